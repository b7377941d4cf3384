/*
 * The step scheduler (vLLM v1's policy): each step hands out a token budget. Running requests
 * come first, in arrival order, each taking what it still needs to compute (one token when
 * decoding, a chunk of its prompt when prefilling); then waiting requests are admitted while
 * budget, sequence slots and KV blocks last. There are no separate prefill and decode phases:
 * a request just has n_computed tokens catching up with n_tokens.
 *
 * When a running request needs a block and none is left, the newest running request is
 * preempted: its blocks are released (full ones stay in the prefix cache) and it goes back to
 * the front of the queue to be recomputed later. Nothing is ever dropped for lack of memory.
 */
#ifndef CLLM_ENGINE_SCHEDULER_H
#define CLLM_ENGINE_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/block_pool.h"
#include "engine/request.h"

struct cllm_sched_entry {
    struct cllm_request *req;
    int32_t start;  /* first token of the request computed in this step (= n_computed) */
    int32_t n_new;  /* tokens computed in this step */
    bool sample;    /* this step reaches the last known token: sample the next one */
};

struct cllm_plan {
    struct cllm_sched_entry *entries; /* [max_seqs] */
    int32_t n_entries;
    int32_t n_tokens;  /* sum of n_new */
    int32_t n_samples; /* entries with sample set */
};

struct cllm_scheduler {
    struct cllm_block_pool pool;
    int32_t max_batch_tokens; /* token budget per step */
    int32_t max_seqs;         /* running requests at most */
    int32_t cap_tokens, cap_seqs; /* the limits given at init: the most they can be set to */
    bool prefix_cache;
    struct cllm_request **running; /* [max_seqs], in admission order */
    int32_t n_running;
    struct cllm_request **waiting; /* ring buffer of queued / preempted requests */
    int32_t wait_head, n_waiting, wait_cap;
    uint64_t n_preemptions;
    struct cllm_plan plan;
};

enum cllm_status cllm_scheduler_init(struct cllm_scheduler *s, int32_t n_blocks,
                                     int32_t block_size, int32_t max_batch_tokens,
                                     int32_t max_seqs, bool prefix_cache);
/* Releases every request still held (their blocks go back to the pool). */
void cllm_scheduler_free(struct cllm_scheduler *s);
/* The limits of the steps planned from now on: each from 1 to the one given at init (which
 * sized the scheduler's arrays), and max_seqs not below the requests running now.
 * CLLM_ERR_INVALID_ARG, changing nothing, otherwise. */
enum cllm_status cllm_scheduler_set_limits(struct cllm_scheduler *s, int32_t max_batch_tokens,
                                           int32_t max_seqs);

/* Queues a request (the scheduler takes a reference). */
enum cllm_status cllm_scheduler_add(struct cllm_scheduler *s, struct cllm_request *r);
/* Drops a request wherever it is (running or waiting), releasing its blocks and the
 * scheduler's reference. */
void cllm_scheduler_remove(struct cllm_scheduler *s, struct cllm_request *r);

/* Plans the next step into s->plan (empty when there is nothing to do). */
void cllm_scheduler_schedule(struct cllm_scheduler *s);
/* Once the planned step is launched: advances n_computed and publishes newly full blocks to
 * the prefix cache. A block is published only when all its tokens are known (a launched
 * step's token is not until the host has seen it: request.h, n_unseen). */
void cllm_scheduler_update(struct cllm_scheduler *s);
/* Publishes r's full blocks whose tokens have become known since. */
void cllm_scheduler_publish(struct cllm_scheduler *s, struct cllm_request *r);

/* KV slot of position pos of a running request. */
static inline int32_t cllm_sched_slot(const struct cllm_scheduler *s, const struct cllm_request *r,
                                      int32_t pos)
{
    int32_t bs = s->pool.block_size;
    return r->blocks[pos / bs] * bs + pos % bs;
}

#endif
