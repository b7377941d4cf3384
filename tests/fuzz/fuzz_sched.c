/*
 * Fuzz target: the scheduler, block pool and prefix cache (engine/scheduler.c) under any
 * interleaving of arrivals, cancellations and steps, with the fake model of
 * tests/engine/sched_fake.h (the next token depends only on the sequence so far). An input
 * is a configuration -- KV blocks, block size, token budget, sequence limit, prefix cache on
 * or off -- then operations: add a request (prompt over a 6-token alphabet, so prefixes are
 * shared; at most what the pool can hold, as the engine guarantees), cancel one, run a step,
 * set the limits (as the engine's smaller steps and growing back do: refused past init's or
 * below the requests running). Properties: every plan keeps the rules and the limits of the
 * moment (sched_plan_ok); while requests remain, a step makes progress; every request that was not
 * cancelled generates exactly what it generates alone (preemption, recomputation and prefix hits
 * change nothing), a cancelled one a prefix of it; at the end every block is back in the pool.
 */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>

#include "core/status.h"
#include "engine/sched_fake.h"
#include "engine/scheduler.h"

const int fuzz_full_stage = 1;

#define MAX_REQS 32
#define MAX_PROMPT 24
#define MAX_GEN 12

struct tracked {
    struct cllm_request *r;
    int32_t n_prompt;
    int32_t want[MAX_PROMPT + MAX_GEN]; /* prompt + what it generates alone */
    bool cancelled, finished;
};

static struct cllm_request *make(uint64_t id, const int32_t *prompt, int32_t n, int32_t gen)
{
    struct cllm_request *r = NULL;
    char err[200];
    FUZZ_ASSERT(sched_fake_request(&r, id, prompt, n, gen, err, sizeof err) == CLLM_OK,
                "request: %s", err);
    return r;
}

/* One step: plan, check, launch, append the fake model's tokens, finish what is complete.
 * Returns the number of requests that finished. */
static int step(struct cllm_scheduler *s, struct tracked *t, int n)
{
    cllm_scheduler_schedule(s);
    FUZZ_ASSERT(sched_plan_ok(s), "a plan breaks the rules");
    cllm_scheduler_update(s);
    struct cllm_request *finished[MAX_REQS];
    int done = 0;
    for (int32_t i = 0; i < s->plan.n_entries; i++) {
        const struct cllm_sched_entry *e = &s->plan.entries[i];
        if (!e->sample)
            continue;
        struct cllm_request *r = e->req;
        cllm_request_append(r, sched_fake_next(r));
        if (r->n_tokens >= r->max_total) {
            for (int k = 0; k < n; k++)
                if (t[k].r == r)
                    t[k].finished = true;
            cllm_request_finish(r, CLLM_FINISH_LENGTH, NULL);
            finished[done++] = r;
        }
    }
    /* removed after the loop: removing compacts the running list the plan points into */
    for (int i = 0; i < done; i++)
        cllm_scheduler_remove(s, finished[i]);
    return done;
}

static void check_tokens(const struct tracked *t, int32_t n)
{
    FUZZ_ASSERT(n <= t->n_prompt + MAX_GEN &&
                    memcmp(t->r->tokens, t->want, (size_t)n * sizeof *t->want) == 0,
                "request %llu generated other tokens than alone",
                (unsigned long long)t->r->id);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 5)
        return 0;
    const int32_t n_blocks = 2 + data[0] % 40, block_size = 1 << (data[1] % 4),
                  budget = 1 + data[2] % 64, max_seqs = 1 + data[3] % 8;
    struct cllm_scheduler s;
    FUZZ_ASSERT(cllm_scheduler_init(&s, n_blocks, block_size, budget, max_seqs, data[4] & 1) ==
                    CLLM_OK,
                "init");
    struct tracked t[MAX_REQS];
    int n = 0, live = 0;
    size_t at = 5;
    while (at < size) {
        const uint8_t op = data[at++] % 5;
        if (op <= 1 && n < MAX_REQS) { /* add */
            const int32_t np = 1 + (at < size ? data[at++] : 0) % MAX_PROMPT;
            const int32_t gen = 1 + (at < size ? data[at++] : 0) % MAX_GEN;
            int32_t prompt[MAX_PROMPT];
            for (int32_t i = 0; i < np; i++)
                prompt[i] = at < size ? data[at++] % 6 : 0;
            if (np + gen > n_blocks * block_size)
                continue; /* the engine never admits a request the pool cannot hold */
            struct tracked *x = &t[n];
            memset(x, 0, sizeof *x);
            x->n_prompt = np;
            struct cllm_request *alone = make(1000 + (uint64_t)n, prompt, np, gen);
            for (int32_t i = 0; i < gen; i++)
                cllm_request_append(alone, sched_fake_next(alone));
            memcpy(x->want, alone->tokens, (size_t)(np + gen) * sizeof *x->want);
            cllm_request_release(alone);
            x->r = make((uint64_t)n, prompt, np, gen);
            FUZZ_ASSERT(cllm_scheduler_add(&s, x->r) == CLLM_OK, "add");
            n++;
            live++;
        } else if (op == 2 && n > 0) { /* cancel */
            struct tracked *x = &t[(at < size ? data[at++] : 0) % n];
            if (!x->cancelled && !x->finished) {
                cllm_scheduler_remove(&s, x->r);
                x->cancelled = true;
                live--;
            }
        } else if (op == 3) {
            live -= step(&s, t, n);
        } else if (op == 4) {
            const int32_t tokens = 1 + (at < size ? data[at++] : 0) % (budget + 1),
                          seqs = 1 + (at < size ? data[at++] : 0) % (max_seqs + 1);
            const int32_t was_tokens = s.max_batch_tokens, was_seqs = s.max_seqs;
            const bool fits = tokens <= budget && seqs <= max_seqs && seqs >= s.n_running;
            const enum cllm_status st = cllm_scheduler_set_limits(&s, tokens, seqs);
            FUZZ_ASSERT(fits ? st == CLLM_OK && s.max_batch_tokens == tokens && s.max_seqs == seqs
                             : st == CLLM_ERR_INVALID_ARG && s.max_batch_tokens == was_tokens &&
                                   s.max_seqs == was_seqs,
                        "limits %d tokens, %d sequences (of %d, %d; %d running): %s", (int)tokens,
                        (int)seqs, (int)budget, (int)max_seqs, (int)s.n_running,
                        cllm_status_str(st));
        }
    }
    for (int steps = 0; live > 0; steps++) {
        FUZZ_ASSERT(steps < 10000, "%d requests never finish", live);
        const int done = step(&s, t, n);
        FUZZ_ASSERT(s.plan.n_entries > 0, "no progress with %d requests left", live);
        live -= done;
    }
    for (int k = 0; k < n; k++) {
        FUZZ_ASSERT(t[k].r->state == CLLM_REQ_DONE, "request %d is not done", k);
        if (!t[k].cancelled)
            FUZZ_ASSERT(t[k].r->n_tokens == t[k].r->max_total, "request %d is short", k);
        check_tokens(&t[k], t[k].r->n_tokens);
        cllm_request_release(t[k].r);
    }
    FUZZ_ASSERT(cllm_block_pool_in_use(&s.pool) == 0, "%d blocks still in use",
                (int)cllm_block_pool_in_use(&s.pool));
    cllm_scheduler_free(&s);
    fuzz_stage = 1;
    return 0;
}
