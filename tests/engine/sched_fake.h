/*
 * A fake model for scheduler tests (test_scheduler.c, tests/fuzz/fuzz_sched.c): the next token
 * depends only on the sequence so far, so a request's output must be the same whatever the
 * batch, preemption or prefix cache did. And the rules every plan must keep.
 */
#ifndef CLLM_TESTS_SCHED_FAKE_H
#define CLLM_TESTS_SCHED_FAKE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "engine/scheduler.h"

#define SCHED_FAKE_VOCAB 1000

/* A greedy request for the fake model's vocabulary that generates max_tokens tokens. */
static inline enum cllm_status sched_fake_request(struct cllm_request **out, uint64_t id,
                                                  const int32_t *prompt, int32_t n,
                                                  int32_t max_tokens, char *err, size_t err_len)
{
    struct cllm_request_params p;
    memset(&p, 0, sizeof p);
    cllm_sampling_params_default(&p.sampling);
    p.max_tokens = max_tokens;
    return cllm_request_new(out, id, prompt, n, &p, NULL, SCHED_FAKE_VOCAB, 4096, err, err_len);
}

static inline int32_t sched_fake_next(const struct cllm_request *r)
{
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < r->n_tokens; i++)
        h = (h ^ (uint32_t)r->tokens[i]) * 16777619u;
    return (int32_t)(h % SCHED_FAKE_VOCAB);
}

/* The plan keeps the budget and sequence limit, computes each request from where it stopped
 * over blocks it holds, and writes no block that another request shares. */
static inline bool sched_plan_ok(const struct cllm_scheduler *s)
{
    const struct cllm_plan *p = &s->plan;
    int32_t bs = s->pool.block_size, total = 0;
    if (p->n_entries > s->max_seqs)
        return false;
    for (int32_t i = 0; i < p->n_entries; i++) {
        const struct cllm_sched_entry *e = &p->entries[i];
        const struct cllm_request *r = e->req;
        total += e->n_new;
        if (e->n_new < 1 || e->start != r->n_computed || e->start + e->n_new > r->n_tokens)
            return false;
        if ((e->start + e->n_new + bs - 1) / bs > r->n_blocks)
            return false;
        for (int32_t b = 0; b < r->n_blocks; b++) {
            int32_t id = r->blocks[b];
            if (id < 0 || id >= s->pool.n_blocks || s->pool.refcount[id] < 1)
                return false;
            /* A block written in this step must not be shared. */
            bool written = (b + 1) * bs > e->start;
            if (written && s->pool.refcount[id] != 1)
                return false;
        }
    }
    return total == p->n_tokens && total <= s->max_batch_tokens;
}

#endif
