/*
 * The scheduler and block pool with a fake model: each step's plan is checked against the
 * rules (token budget, sequence limit, blocks covering every scheduled position, no block
 * shared unless it is a published prefix block), then "run" by appending a deterministic next
 * token. Covers chunked prefill, preemption and resume under memory pressure, prefix-cache
 * hits, cancellation, and that every block is returned at the end.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sched_fake.h"
#include "engine/scheduler.h"
#include "test.h"

#define VOCAB SCHED_FAKE_VOCAB

static struct cllm_request *make(uint64_t id, const int32_t *prompt, int32_t n, int32_t max_tokens)
{
    struct cllm_request *r = NULL;
    char err[200];
    CHECKF(sched_fake_request(&r, id, prompt, n, max_tokens, err, sizeof err) == CLLM_OK, "%s",
           err);
    return r;
}

/* Runs steps until every request has finished; returns the number of steps. */
static int run_all(struct cllm_scheduler *s, struct cllm_request **reqs, int n, int max_steps)
{
    int steps = 0, done = 0;
    while (done < n && steps < max_steps) {
        cllm_scheduler_schedule(s);
        CHECK(sched_plan_ok(s));
        if (s->plan.n_entries == 0) {
            CHECK(!"no progress");
            break;
        }
        cllm_scheduler_update(s);
        struct cllm_sched_entry plan[64];
        int32_t np = s->plan.n_entries;
        memcpy(plan, s->plan.entries, (size_t)np * sizeof plan[0]);
        for (int32_t i = 0; i < np; i++) {
            struct cllm_request *r = plan[i].req;
            if (!plan[i].sample)
                continue;
            cllm_request_append(r, sched_fake_next(r));
            if (r->n_tokens >= r->max_total) {
                cllm_request_finish(r, CLLM_FINISH_LENGTH, NULL);
                cllm_scheduler_remove(s, r);
                done++;
            }
        }
        steps++;
    }
    (void)reqs;
    return steps;
}

/* What a request generates alone, for comparison. */
static void expected_tokens(const int32_t *prompt, int32_t n, int32_t max_tokens, int32_t *out)
{
    struct cllm_request *r = make(999, prompt, n, max_tokens);
    for (int32_t i = 0; i < max_tokens; i++) {
        out[i] = sched_fake_next(r);
        cllm_request_append(r, out[i]);
    }
    cllm_request_release(r);
}

static void test_chunked_prefill(void)
{
    struct cllm_scheduler s;
    CHECK(cllm_scheduler_init(&s, 64, 4, 10, 4, false) == CLLM_OK);
    int32_t prompt[25];
    for (int i = 0; i < 25; i++)
        prompt[i] = i + 1;
    struct cllm_request *r = make(1, prompt, 25, 3);
    cllm_scheduler_add(&s, r);
    cllm_scheduler_schedule(&s);
    CHECK(s.plan.n_entries == 1 && s.plan.n_tokens == 10 && !s.plan.entries[0].sample);
    cllm_scheduler_update(&s);
    cllm_scheduler_schedule(&s);
    CHECK(s.plan.n_tokens == 10 && s.plan.entries[0].start == 10);
    cllm_scheduler_update(&s);
    cllm_scheduler_schedule(&s);
    CHECK(s.plan.n_tokens == 5 && s.plan.entries[0].sample);
    cllm_scheduler_update(&s);
    cllm_request_append(r, 7);
    cllm_scheduler_schedule(&s); /* decode: one token */
    CHECK(s.plan.n_tokens == 1 && s.plan.entries[0].start == 25 && s.plan.entries[0].sample);
    cllm_scheduler_remove(&s, r);
    CHECK(cllm_block_pool_in_use(&s.pool) == 0);
    cllm_request_release(r);
    cllm_scheduler_free(&s);
}

static void test_pressure(bool prefix)
{
    /* 12 requests of 20-30 prompt tokens + 40 generated, in a pool of 24 blocks x 4 tokens:
     * at most a few fit at once, so the newest are preempted and recomputed. */
    struct cllm_scheduler s;
    CHECK(cllm_scheduler_init(&s, 24, 4, 16, 8, prefix) == CLLM_OK);
    enum { N = 12, GEN = 40 };
    struct cllm_request *reqs[N];
    int32_t prompts[N][32], lens[N];
    for (int i = 0; i < N; i++) {
        lens[i] = 20 + i % 11;
        for (int j = 0; j < lens[i]; j++)
            prompts[i][j] = j < 8 ? 5 : (i * 31 + j * 7) % VOCAB; /* shared 8-token prefix */
        reqs[i] = make((uint64_t)i, prompts[i], lens[i], GEN);
        cllm_scheduler_add(&s, reqs[i]);
    }
    int steps = run_all(&s, reqs, N, 10000);
    CHECK(steps < 10000);
    printf("pressure (prefix cache %s): %d steps, %llu preemptions, prefix hits %llu/%llu\n",
           prefix ? "on" : "off", steps, (unsigned long long)s.n_preemptions,
           (unsigned long long)s.pool.prefix_hits, (unsigned long long)s.pool.prefix_queries);
    CHECK(s.n_preemptions > 0);
    for (int i = 0; i < N; i++) {
        int32_t want[GEN];
        expected_tokens(prompts[i], lens[i], GEN, want);
        CHECK(reqs[i]->n_tokens == lens[i] + GEN);
        CHECKF(memcmp(reqs[i]->tokens + lens[i], want, sizeof want) == 0,
               "request %d generated other tokens after preemption", i);
        CHECK(reqs[i]->state == CLLM_REQ_DONE);
        cllm_request_release(reqs[i]);
    }
    CHECK(cllm_block_pool_in_use(&s.pool) == 0);
    if (prefix)
        CHECK(s.pool.prefix_hits > 0);
    cllm_scheduler_free(&s);
}

static void test_prefix_hits(void)
{
    struct cllm_scheduler s;
    CHECK(cllm_scheduler_init(&s, 32, 4, 64, 4, true) == CLLM_OK);
    int32_t a[14], b[13];
    for (int i = 0; i < 14; i++)
        a[i] = 100 + i;
    memcpy(b, a, 12 * sizeof *a);
    b[12] = 7;
    struct cllm_request *ra = make(1, a, 14, 2);
    cllm_scheduler_add(&s, ra);
    cllm_scheduler_schedule(&s);
    cllm_scheduler_update(&s); /* publishes a's 3 full blocks */
    struct cllm_request *rb = make(2, b, 13, 2);
    cllm_scheduler_add(&s, rb);
    cllm_request_append(ra, 1);
    cllm_scheduler_schedule(&s);
    /* b shares blocks 0-2 (12 tokens) and computes its last token only */
    CHECK(rb->n_cached == 12);
    CHECK(rb->blocks[0] == ra->blocks[0] && rb->blocks[2] == ra->blocks[2]);
    CHECK(s.pool.refcount[ra->blocks[0]] == 2);
    bool found = false;
    for (int32_t i = 0; i < s.plan.n_entries; i++)
        if (s.plan.entries[i].req == rb)
            found = s.plan.entries[i].start == 12 && s.plan.entries[i].n_new == 1;
    CHECK(found);
    /* a prompt that is exactly the cached blocks still computes its last token */
    struct cllm_request *rc = make(3, a, 12, 2);
    cllm_scheduler_update(&s);
    cllm_scheduler_add(&s, rc);
    cllm_scheduler_schedule(&s);
    CHECK(rc->n_cached == 8);
    cllm_scheduler_remove(&s, ra);
    cllm_scheduler_remove(&s, rb);
    cllm_scheduler_remove(&s, rc);
    CHECK(cllm_block_pool_in_use(&s.pool) == 0);
    CHECK(cllm_block_pool_available(&s.pool) == 32);
    /* cached blocks are evicted, least recently released first, when needed */
    for (int i = 0; i < 32; i++)
        CHECK(cllm_block_pool_alloc(&s.pool) >= 0);
    CHECK(cllm_block_pool_alloc(&s.pool) == -1);
    CHECK(cllm_block_pool_lookup(&s.pool, ra->block_hashes[0]) == -1);
    cllm_request_release(ra);
    cllm_request_release(rb);
    cllm_request_release(rc);
    cllm_scheduler_free(&s);
}

static void test_remove_waiting_and_limits(void)
{
    struct cllm_scheduler s;
    CHECK(cllm_scheduler_init(&s, 8, 4, 100, 2, false) == CLLM_OK);
    int32_t p[6] = {1, 2, 3, 4, 5, 6};
    struct cllm_request *r[4];
    for (int i = 0; i < 4; i++) {
        r[i] = make((uint64_t)i, p, 6, 4);
        cllm_scheduler_add(&s, r[i]);
    }
    cllm_scheduler_schedule(&s);
    CHECK(s.n_running == 2 && s.n_waiting == 2); /* max_seqs */
    cllm_scheduler_remove(&s, r[3]);             /* cancelled while waiting */
    CHECK(s.n_waiting == 1 && r[3]->state == CLLM_REQ_DONE);
    cllm_scheduler_remove(&s, r[0]); /* cancelled while running: blocks back at once */
    CHECK(cllm_block_pool_in_use(&s.pool) == r[1]->n_blocks);
    for (int i = 0; i < 4; i++)
        cllm_request_release(r[i]);
    cllm_scheduler_free(&s); /* releases r[1], r[2] */
    CHECK(cllm_scheduler_init(&s, 0, 4, 10, 2, false) != CLLM_OK);
}

/* Limits lowered and raised between steps (the engine's smaller steps on a device short of
 * memory, and its growing back): the plans keep to the limits of the moment, never past those
 * given at init, and a limit below the requests running is refused. */
static void test_set_limits(void)
{
    struct cllm_scheduler s;
    CHECK(cllm_scheduler_init(&s, 64, 4, 16, 4, false) == CLLM_OK);
    int32_t p[12];
    for (int i = 0; i < 12; i++)
        p[i] = i + 1;
    struct cllm_request *r[4];
    for (int i = 0; i < 4; i++) {
        r[i] = make((uint64_t)i, p, 12, 4);
        cllm_scheduler_add(&s, r[i]);
    }
    CHECK(cllm_scheduler_set_limits(&s, 4, 1) == CLLM_OK);
    cllm_scheduler_schedule(&s);
    CHECK(sched_plan_ok(&s) && s.n_running == 1 && s.plan.n_tokens == 4);
    cllm_scheduler_update(&s);
    CHECK(cllm_scheduler_set_limits(&s, 17, 4) == CLLM_ERR_INVALID_ARG); /* past init's */
    CHECK(cllm_scheduler_set_limits(&s, 16, 5) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_scheduler_set_limits(&s, 0, 4) == CLLM_ERR_INVALID_ARG);
    CHECK(s.max_batch_tokens == 4 && s.max_seqs == 1); /* unchanged */
    CHECK(cllm_scheduler_set_limits(&s, 16, 4) == CLLM_OK);
    cllm_scheduler_schedule(&s); /* the first one's 8 left, then 8 of the second's */
    CHECK(sched_plan_ok(&s) && s.n_running == 2 && s.plan.n_tokens == 16);
    cllm_scheduler_update(&s);
    CHECK(cllm_scheduler_set_limits(&s, 16, 1) == CLLM_ERR_INVALID_ARG); /* 2 running */
    CHECK(cllm_scheduler_set_limits(&s, 16, 2) == CLLM_OK);
    cllm_scheduler_schedule(&s);
    CHECK(sched_plan_ok(&s) && s.n_running == 2 && s.n_waiting == 2);
    for (int i = 0; i < 4; i++)
        cllm_request_release(r[i]);
    cllm_scheduler_free(&s);
}

int main(void)
{
    test_chunked_prefill();
    test_prefix_hits();
    test_pressure(false);
    test_pressure(true);
    test_remove_waiting_and_limits();
    test_set_limits();
    return test_summary();
}
