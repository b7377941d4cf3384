/* Budget-driven scheduling with chunked prefill, prefix-cache admission and preemption. */
#include "engine/scheduler.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

enum cllm_status cllm_scheduler_init(struct cllm_scheduler *s, int32_t n_blocks,
                                     int32_t block_size, int32_t max_batch_tokens,
                                     int32_t max_seqs, bool prefix_cache)
{
    memset(s, 0, sizeof *s);
    if (max_batch_tokens < 1 || max_seqs < 1)
        return CLLM_ERR_INVALID_ARG;
    enum cllm_status st = cllm_block_pool_init(&s->pool, n_blocks, block_size);
    if (st)
        return st;
    s->max_batch_tokens = s->cap_tokens = max_batch_tokens;
    s->max_seqs = s->cap_seqs = max_seqs;
    s->prefix_cache = prefix_cache;
    s->wait_cap = 64;
    s->running = cllm_calloc_array((size_t)max_seqs, sizeof *s->running);
    s->waiting = cllm_calloc_array((size_t)s->wait_cap, sizeof *s->waiting);
    s->plan.entries = cllm_calloc_array((size_t)max_seqs, sizeof *s->plan.entries);
    if (!s->running || !s->waiting || !s->plan.entries) {
        cllm_scheduler_free(s);
        return CLLM_ERR_NOMEM;
    }
    return CLLM_OK;
}

enum cllm_status cllm_scheduler_set_limits(struct cllm_scheduler *s, int32_t max_batch_tokens,
                                           int32_t max_seqs)
{
    if (max_batch_tokens < 1 || max_batch_tokens > s->cap_tokens || max_seqs < 1 ||
        max_seqs > s->cap_seqs || max_seqs < s->n_running)
        return CLLM_ERR_INVALID_ARG;
    s->max_batch_tokens = max_batch_tokens;
    s->max_seqs = max_seqs;
    return CLLM_OK;
}

static void release_blocks(struct cllm_scheduler *s, struct cllm_request *r)
{
    for (int32_t i = 0; i < r->n_blocks; i++)
        cllm_block_pool_release(&s->pool, r->blocks[i]);
    r->n_blocks = 0;
    r->n_hashed = 0;
    r->n_computed = 0;
}

void cllm_scheduler_free(struct cllm_scheduler *s)
{
    while (s->n_running > 0)
        cllm_scheduler_remove(s, s->running[s->n_running - 1]);
    while (s->n_waiting > 0)
        cllm_scheduler_remove(s, s->waiting[s->wait_head]);
    free(s->running);
    free(s->waiting);
    free(s->plan.entries);
    cllm_block_pool_free(&s->pool);
    memset(s, 0, sizeof *s);
}

static struct cllm_request **wait_at(struct cllm_scheduler *s, int32_t i)
{
    return &s->waiting[(s->wait_head + i) % s->wait_cap];
}

static enum cllm_status wait_grow(struct cllm_scheduler *s)
{
    int32_t cap = s->wait_cap * 2;
    struct cllm_request **w = cllm_malloc_array((size_t)cap, sizeof *w);
    if (!w)
        return CLLM_ERR_NOMEM;
    for (int32_t i = 0; i < s->n_waiting; i++)
        w[i] = *wait_at(s, i);
    free(s->waiting);
    s->waiting = w;
    s->wait_cap = cap;
    s->wait_head = 0;
    return CLLM_OK;
}

enum cllm_status cllm_scheduler_add(struct cllm_scheduler *s, struct cllm_request *r)
{
    if (s->n_waiting == s->wait_cap && wait_grow(s))
        return CLLM_ERR_NOMEM;
    cllm_request_retain(r);
    r->state = CLLM_REQ_WAITING;
    *wait_at(s, s->n_waiting++) = r;
    return CLLM_OK;
}

/* Puts a preempted request back at the head of the queue: it keeps its place in line. Space
 * is guaranteed: a running request left the running array to come here. */
static void wait_push_front(struct cllm_scheduler *s, struct cllm_request *r)
{
    if (s->n_waiting == s->wait_cap && wait_grow(s)) {
        /* Out of memory growing the queue: cannot happen once the queue has grown to hold
         * max_seqs entries; failing here would lose the request, so keep it running. */
        return;
    }
    s->wait_head = (s->wait_head + s->wait_cap - 1) % s->wait_cap;
    s->waiting[s->wait_head] = r;
    s->n_waiting++;
    r->state = CLLM_REQ_WAITING;
}

void cllm_scheduler_remove(struct cllm_scheduler *s, struct cllm_request *r)
{
    for (int32_t i = 0; i < s->n_running; i++) {
        if (s->running[i] != r)
            continue;
        memmove(s->running + i, s->running + i + 1, (size_t)(s->n_running - i - 1) * sizeof r);
        s->n_running--;
        goto found;
    }
    for (int32_t i = 0; i < s->n_waiting; i++) {
        if (*wait_at(s, i) != r)
            continue;
        for (int32_t j = i; j + 1 < s->n_waiting; j++)
            *wait_at(s, j) = *wait_at(s, j + 1);
        s->n_waiting--;
        goto found;
    }
    return;
found:
    release_blocks(s, r);
    r->state = CLLM_REQ_DONE;
    cllm_request_release(r);
}

/* Grows r's block table to cover n tokens; false (nothing allocated) if the pool is short. */
static bool ensure_blocks(struct cllm_scheduler *s, struct cllm_request *r, int32_t n)
{
    int32_t bs = s->pool.block_size, need = (n + bs - 1) / bs;
    if (need <= r->n_blocks)
        return true;
    if (need - r->n_blocks > cllm_block_pool_available(&s->pool))
        return false;
    if (need > r->cap_blocks) {
        int32_t cap = need + 8;
        int32_t *b = cllm_realloc_array(r->blocks, (size_t)cap, sizeof *b);
        uint64_t *h = b ? cllm_realloc_array(r->block_hashes, (size_t)cap, sizeof *h) : NULL;
        if (b)
            r->blocks = b;
        if (!h)
            return false;
        r->block_hashes = h;
        r->cap_blocks = cap;
    }
    while (r->n_blocks < need)
        r->blocks[r->n_blocks++] = cllm_block_pool_alloc(&s->pool);
    return true;
}

/* Moves the newest running request back to the queue, freeing its blocks. */
static struct cllm_request *preempt_newest(struct cllm_scheduler *s)
{
    struct cllm_request *v = s->running[--s->n_running];
    release_blocks(s, v);
    wait_push_front(s, v);
    s->n_preemptions++;
    return v;
}

/* Takes cached blocks for the leading full blocks of a new request's tokens. At least one
 * token is always left to compute: its logits are what the request is waiting for. */
static void admit_prefix(struct cllm_scheduler *s, struct cllm_request *r)
{
    int32_t bs = s->pool.block_size;
    if (!s->prefix_cache || r->n_blocks != 0)
        return;
    uint64_t parent = 0;
    for (int32_t b = 0; (b + 1) * bs < r->n_tokens; b++) {
        if (b >= r->cap_blocks) {
            int32_t cap = r->cap_blocks * 2 + 8;
            int32_t *nb = cllm_realloc_array(r->blocks, (size_t)cap, sizeof *nb);
            uint64_t *nh = nb ? cllm_realloc_array(r->block_hashes, (size_t)cap, sizeof *nh) : NULL;
            if (nb)
                r->blocks = nb;
            if (!nh)
                return;
            r->block_hashes = nh;
            r->cap_blocks = cap;
        }
        uint64_t h = cllm_block_hash(parent, r->tokens + (int64_t)b * bs, bs);
        int32_t id = cllm_block_pool_lookup(&s->pool, h);
        if (id < 0)
            return;
        r->blocks[r->n_blocks++] = id;
        r->block_hashes[b] = h;
        r->n_hashed = b + 1;
        r->n_computed = (b + 1) * bs;
        if (r->n_tokens == r->n_prompt) /* not a resumed preemption */
            r->n_cached = r->n_computed;
        parent = h;
    }
}

static void plan_add(struct cllm_scheduler *s, struct cllm_request *r, int32_t n_new)
{
    struct cllm_sched_entry *e = &s->plan.entries[s->plan.n_entries++];
    e->req = r;
    e->start = r->n_computed;
    e->n_new = n_new;
    e->sample = r->n_computed + n_new == r->n_tokens;
    s->plan.n_tokens += n_new;
    s->plan.n_samples += e->sample;
}

void cllm_scheduler_schedule(struct cllm_scheduler *s)
{
    s->plan.n_entries = s->plan.n_tokens = s->plan.n_samples = 0;
    int32_t budget = s->max_batch_tokens, bs = s->pool.block_size;

    for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
        struct cllm_request *r = s->running[i];
        int32_t want = r->n_tokens - r->n_computed;
        int32_t n_new = want < budget ? want : budget;
        if (n_new <= 0)
            continue;
        bool preempted_self = false;
        while (!ensure_blocks(s, r, r->n_computed + n_new)) {
            if (preempt_newest(s) == r) {
                preempted_self = true;
                break;
            }
        }
        if (preempted_self)
            break; /* r was the newest: everything after it is gone too */
        plan_add(s, r, n_new);
        budget -= n_new;
    }

    while (budget > 0 && s->n_waiting > 0 && s->n_running < s->max_seqs) {
        struct cllm_request *r = *wait_at(s, 0);
        admit_prefix(s, r);
        int32_t want = r->n_tokens - r->n_computed;
        int32_t n_new = want < budget ? want : budget;
        /* Shrink the chunk to the blocks that are free: a long prompt can start anyway. */
        int32_t room = (r->n_blocks + cllm_block_pool_available(&s->pool)) * bs - r->n_computed;
        if (n_new > room)
            n_new = room;
        if (n_new <= 0 || !ensure_blocks(s, r, r->n_computed + n_new)) {
            release_blocks(s, r); /* give back prefix hits; try again next step */
            break;
        }
        s->wait_head = (s->wait_head + 1) % s->wait_cap;
        s->n_waiting--;
        r->state = CLLM_REQ_RUNNING;
        s->running[s->n_running++] = r;
        plan_add(s, r, n_new);
        budget -= n_new;
    }
}

void cllm_scheduler_publish(struct cllm_scheduler *s, struct cllm_request *r)
{
    int32_t bs = s->pool.block_size, known = cllm_request_n_known(r);
    int32_t end = r->n_computed < known ? r->n_computed : known;
    if (!s->prefix_cache || r->state != CLLM_REQ_RUNNING)
        return;
    while ((r->n_hashed + 1) * bs <= end) {
        int32_t b = r->n_hashed;
        uint64_t parent = b ? r->block_hashes[b - 1] : 0;
        r->block_hashes[b] = cllm_block_hash(parent, r->tokens + (int64_t)b * bs, bs);
        cllm_block_pool_publish(&s->pool, r->blocks[b], r->block_hashes[b]);
        r->n_hashed++;
    }
}

void cllm_scheduler_update(struct cllm_scheduler *s)
{
    for (int32_t i = 0; i < s->plan.n_entries; i++) {
        struct cllm_sched_entry *e = &s->plan.entries[i];
        e->req->n_computed = e->start + e->n_new;
        cllm_scheduler_publish(s, e->req);
    }
}
