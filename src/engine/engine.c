/*
 * The engine thread and its step. Submitters push requests onto `incoming` under `lock`; the
 * thread moves them into the scheduler, runs a step, and delivers text through each request's
 * own lock. The model, KV cache and scheduler are touched by the engine thread only.
 *
 * Overlap: when the device samples (the step is queued and the host is free until it waits),
 * a step's tokens are appended at once (so EOS and length limits end a request before the
 * next step is planned) but their text -- detokenizing, stop strings, waking the submitter,
 * the costly part with hundreds of sequences -- is delivered while the device runs the next
 * step. A stop string found then ends a request that the running step still computes: that
 * one token is dropped, and the request leaves the scheduler before the step after.
 */
#include "engine/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "engine/scheduler.h"
#include "model/model.h"

struct cllm_engine {
    const struct cllm_model_files *mf;
    struct cllm_engine_config cfg;
    struct cllm_backend *be;
    struct cllm_model *model;
    struct cllm_kv_cache kv;
    struct cllm_scheduler sched;
    int32_t n_ctx, max_blocks_per_seq, n_vocab;

    /* step arrays, [max_batch_tokens] / [max_seqs][max_blocks_per_seq] */
    int32_t *tokens, *pos, *seq, *slot, *outputs, *table;
    float *logits_copy;           /* one row of logits for the sampler to scribble on */
    struct cllm_sample_row *rows; /* [max_seqs] device sampling of each output */
    int32_t *sampled;             /* [max_seqs] the device's tokens (-1: sample on the host) */
    struct cllm_sched_entry *plan_copy; /* [max_seqs] */
    struct pending_token *pending;      /* [max_seqs] tokens whose text is not delivered yet */
    int32_t n_pending;
    bool overlap; /* deliver a step's text during the next step */

    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct cllm_request *incoming_head, *incoming_tail; /* under lock */
    int32_t n_incoming;                                 /* under lock */
    bool stop;                                          /* under lock */
    char lost[192];   /* under lock: why the device can run nothing more ("" while it can) */
    uint64_t next_id; /* under lock */
    struct cllm_engine_stats stats; /* under lock */
};

/* A generated token whose text is still to be delivered. */
struct pending_token {
    struct cllm_request *r; /* a reference of its own */
    int32_t token;
    bool at_limit; /* the request reached its length limit with this token */
};

void cllm_engine_config_default(struct cllm_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->backend = CLLM_BACKEND_CPU;
    c->prefix_cache = true;
}

/* --- per-token output --- */

static bool is_stop_id(const struct cllm_request *r, int32_t token)
{
    for (int32_t i = 0; i < r->params.n_stop_ids; i++)
        if (r->params.stop_ids[i] == token)
            return true;
    return false;
}

/* Decodes the new token, runs stop strings over the text and publishes what is final.
 * Returns the finish reason, or CLLM_FINISH_NONE to go on. */
static enum cllm_finish_reason deliver_token(struct cllm_request *r, int32_t token, bool at_limit,
                                             int32_t n_cached)
{
    bool eos = is_stop_id(r, token);
    struct cllm_buf *text = &r->pending;
    text->len = 0;
    if (!eos)
        cllm_detok_stream_push(&r->detok, token, text);
    if (eos || at_limit)
        cllm_detok_stream_flush(&r->detok, text);
    struct cllm_stop_out so = {0};
    cllm_stop_push(r->stop, text->data ? text->data : "", text->len, &so);
    struct cllm_buf emit = {0};
    cllm_buf_append(&emit, so.text ? so.text : "", so.len);
    if (!so.stopped && (eos || at_limit)) {
        struct cllm_stop_out rest = {0};
        cllm_stop_flush(r->stop, &rest);
        cllm_buf_append(&emit, rest.text ? rest.text : "", rest.len);
    }
    cllm_request_emit(r, emit.data, emit.len, n_cached);
    cllm_buf_free(&emit);
    if (eos || so.stopped)
        return CLLM_FINISH_STOP;
    return at_limit ? CLLM_FINISH_LENGTH : CLLM_FINISH_NONE;
}

/* Ends a request for its submitter. The scheduler may still hold it (drop_finished). */
static void end_request(struct cllm_engine *e, struct cllm_request *r, enum cllm_finish_reason why,
                        const char *error)
{
    r->ended = true;
    cllm_request_finish(r, why, error);
    pthread_mutex_lock(&e->lock);
    e->stats.requests_finished++;
    pthread_mutex_unlock(&e->lock);
}

static void finish(struct cllm_engine *e, struct cllm_request *r, enum cllm_finish_reason why,
                   const char *error)
{
    end_request(e, r, why, error);
    cllm_scheduler_remove(&e->sched, r);
}

/* Publishes the text of the last step's tokens, and the end of the requests they finish. */
static void deliver_pending(struct cllm_engine *e)
{
    for (int32_t i = 0; i < e->n_pending; i++) {
        struct pending_token *pt = &e->pending[i];
        struct cllm_request *r = pt->r;
        if (!r->ended) { /* else cancelled meanwhile: nothing more goes out */
            enum cllm_finish_reason why = deliver_token(r, pt->token, pt->at_limit, r->n_cached);
            if (why != CLLM_FINISH_NONE)
                end_request(e, r, why, NULL);
        }
        cllm_request_release(r);
    }
    e->n_pending = 0;
}

/* --- the step --- */

static void take_incoming(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    struct cllm_request *r = e->incoming_head;
    e->incoming_head = e->incoming_tail = NULL;
    e->n_incoming = 0;
    pthread_mutex_unlock(&e->lock);
    while (r) {
        struct cllm_request *next = r->next;
        r->next = NULL;
        if (cllm_scheduler_add(&e->sched, r) != CLLM_OK)
            cllm_request_finish(r, CLLM_FINISH_ERROR, "out of memory queueing the request");
        cllm_request_release(r); /* the scheduler holds its own reference now */
        r = next;
    }
}

/* Takes the requests that are over out of the scheduler: those cancelled by their submitter
 * (finished here) and those a stop string ended while a step that included them ran. */
static void drop_one(struct cllm_engine *e, struct cllm_request *r)
{
    if (r->ended)
        cllm_scheduler_remove(&e->sched, r);
    else if (cllm_request_cancelled(r))
        finish(e, r, CLLM_FINISH_CANCELLED, NULL);
}

static void drop_finished(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    for (int32_t i = s->n_running - 1; i >= 0; i--)
        drop_one(e, s->running[i]);
    for (int32_t i = s->n_waiting - 1; i >= 0; i--)
        drop_one(e, s->waiting[(s->wait_head + i) % s->wait_cap]);
}

/* Lays the plan out as a model step. The block table is only as wide as the longest
 * sequence needs, rounded up to a power of two (so that recorded decode steps see few
 * widths): a step uploads kilobytes of table, not max_seqs x the whole context. */
static void build_step(struct cllm_engine *e, struct cllm_step *st)
{
    const struct cllm_plan *p = &e->sched.plan;
    int32_t n = 0, n_out = 0, width = 16;
    for (int32_t j = 0; j < p->n_entries; j++)
        while (width < p->entries[j].req->n_blocks)
            width *= 2;
    if (width > e->max_blocks_per_seq)
        width = e->max_blocks_per_seq;
    for (int32_t j = 0; j < p->n_entries; j++) {
        const struct cllm_sched_entry *en = &p->entries[j];
        const struct cllm_request *r = en->req;
        for (int32_t k = 0; k < en->n_new; k++, n++) {
            int32_t pos = en->start + k;
            e->tokens[n] = r->tokens[pos];
            e->pos[n] = pos;
            e->seq[n] = j;
            e->slot[n] = cllm_sched_slot(&e->sched, r, pos);
        }
        if (en->sample)
            e->outputs[n_out++] = n - 1;
        int32_t *row = e->table + (int64_t)j * width;
        memcpy(row, r->blocks, (size_t)r->n_blocks * sizeof *row);
        for (int32_t b = r->n_blocks; b < width; b++)
            row[b] = 0; /* never read: positions stop inside the table */
    }
    *st = (struct cllm_step){n,        e->tokens,    e->pos, e->seq, e->slot,
                             e->table, p->n_entries, width,  n_out,  e->outputs};
}

/* Penalties need the request's token history, which only the host sampler keeps. */
static bool samples_on_device(const struct cllm_sampling_params *p)
{
    return p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f &&
           p->frequency_penalty == 0.0f;
}

/* The device sampler's row for each output of the plan: the draw counter is the index of the
 * token being generated, so a request's draws never depend on what it is batched with. */
static void build_sample_rows(struct cllm_engine *e)
{
    const struct cllm_plan *p = &e->sched.plan;
    int32_t out = 0;
    for (int32_t j = 0; j < p->n_entries; j++) {
        if (!p->entries[j].sample)
            continue;
        const struct cllm_request *r = p->entries[j].req;
        const struct cllm_sampling_params *sp = &r->params.sampling;
        struct cllm_sample_row *row = &e->rows[out++];
        if (!samples_on_device(sp)) {
            *row = (struct cllm_sample_row){.temperature = -1.0f};
            continue;
        }
        *row = (struct cllm_sample_row){sp->temperature, sp->top_k,
                                        sp->top_p,       sp->min_p,
                                        sp->seed,        (uint64_t)(r->n_tokens - r->n_prompt)};
    }
}

/* Ends every request the scheduler holds with an error. */
static void fail_all(struct cllm_engine *e, const char *msg)
{
    struct cllm_scheduler *s = &e->sched;
    while (s->n_running > 0)
        finish(e, s->running[0], CLLM_FINISH_ERROR, msg);
    while (s->n_waiting > 0)
        finish(e, s->waiting[s->wait_head], CLLM_FINISH_ERROR, msg);
}

/* A step that failed ends its requests with the error. If the device does not answer a sync
 * either, the error sticks (a CUDA illegal address, a lost GPU): nothing can run any more, so
 * every request ends, new ones are refused and the health check reports it, for the server
 * to be restarted. */
static void step_failed(struct cllm_engine *e, enum cllm_status rc)
{
    const struct cllm_plan *p = &e->sched.plan;
    char msg[96];
    snprintf(msg, sizeof msg, "the forward pass failed: %s", cllm_status_str(rc));
    cllm_log(CLLM_LOG_ERROR, "%s (%d requests in the step)", msg, (int)p->n_entries);
    for (int32_t j = p->n_entries - 1; j >= 0; j--)
        if (!p->entries[j].req->ended)
            finish(e, p->entries[j].req, CLLM_FINISH_ERROR, msg);
    if (rc != CLLM_ERR_DEVICE || e->be->iface->sync(e->be) == CLLM_OK)
        return;
    char lost[sizeof e->lost];
    snprintf(lost, sizeof lost,
             "the %s device failed (%s) and cannot run requests any more: restart the server",
             e->be->iface->name, cllm_status_str(rc));
    cllm_log(CLLM_LOG_ERROR, "engine: %s", lost);
    pthread_mutex_lock(&e->lock);
    memcpy(e->lost, lost, sizeof lost);
    pthread_mutex_unlock(&e->lock);
    fail_all(e, lost);
}

static void step(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    cllm_scheduler_schedule(s);
    const struct cllm_plan *p = &s->plan;
    if (p->n_entries == 0) {
        deliver_pending(e);
        return;
    }
    struct cllm_step st;
    build_step(e, &st);
    const float *logits = NULL;
    bool device_sampling = cllm_model_samples_on_device(e->model);
    enum cllm_status rc;
    if (device_sampling) {
        build_sample_rows(e);
        rc = cllm_model_launch_sample(e->model, &e->kv, &st, e->rows, e->sampled);
        deliver_pending(e); /* while the device runs the step */
        if (rc == CLLM_OK)
            rc = cllm_model_wait_sample(e->model, e->rows, e->sampled, &logits);
    } else {
        deliver_pending(e); /* (only with overlap forced on: the CPU runs the step below) */
        rc = cllm_model_forward(e->model, &e->kv, &st, &logits);
    }
    if (rc) {
        step_failed(e, rc);
        return;
    }
    cllm_scheduler_update(s);
    int32_t n_prompt_tokens = 0, n_generated = 0;
    /* Ending a request edits the scheduler, so walk a copy of the plan. */
    struct cllm_sched_entry *done = e->plan_copy;
    int32_t n_entries = p->n_entries, out = 0;
    memcpy(done, p->entries, (size_t)n_entries * sizeof done[0]);
    for (int32_t j = 0; j < n_entries; j++) {
        struct cllm_request *r = done[j].req;
        int32_t prompt_part = r->n_prompt - done[j].start;
        if (prompt_part > 0)
            n_prompt_tokens += prompt_part < done[j].n_new ? prompt_part : done[j].n_new;
        if (!done[j].sample)
            continue;
        int32_t i = out++, token = device_sampling ? e->sampled[i] : -1;
        if (r->ended) /* a stop string ended it while this step ran */
            continue;
        if (token < 0) {
            memcpy(e->logits_copy, logits + (int64_t)i * e->n_vocab,
                   (size_t)e->n_vocab * sizeof(float));
            token = cllm_sampler_sample(r->sampler, e->logits_copy);
        }
        if (token < 0 || cllm_request_append(r, token) != CLLM_OK) {
            finish(e, r, CLLM_FINISH_ERROR, "out of memory while sampling");
            continue;
        }
        n_generated++;
        bool at_limit = r->n_tokens >= r->max_total;
        cllm_request_retain(r);
        e->pending[e->n_pending++] = (struct pending_token){r, token, at_limit};
        /* Nothing more to compute: out of the scheduler now, ended when its text goes out. */
        if (at_limit || is_stop_id(r, token))
            cllm_scheduler_remove(s, r);
    }
    if (!e->overlap || (s->n_running == 0 && s->n_waiting == 0))
        deliver_pending(e);
    pthread_mutex_lock(&e->lock);
    e->stats.steps++;
    e->stats.prompt_tokens += (uint64_t)n_prompt_tokens;
    e->stats.generated_tokens += (uint64_t)n_generated;
    pthread_mutex_unlock(&e->lock);
}

static void publish_stats(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->stats.running = e->sched.n_running;
    e->stats.waiting = e->sched.n_waiting + e->n_incoming;
    e->stats.kv_blocks_used = cllm_block_pool_in_use(&e->sched.pool);
    e->stats.preemptions = e->sched.n_preemptions;
    e->stats.prefix_queries = e->sched.pool.prefix_queries;
    e->stats.prefix_hits = e->sched.pool.prefix_hits;
    pthread_mutex_unlock(&e->lock);
}

static void *engine_main(void *arg)
{
    struct cllm_engine *e = arg;
    for (;;) {
        if (e->sched.n_running == 0 && e->sched.n_waiting == 0)
            deliver_pending(e); /* before sleeping: nothing may stay undelivered */
        pthread_mutex_lock(&e->lock);
        while (!e->stop && !e->incoming_head && e->sched.n_running == 0 && e->sched.n_waiting == 0)
            pthread_cond_wait(&e->wake, &e->lock);
        bool stop = e->stop;
        pthread_mutex_unlock(&e->lock);
        take_incoming(e);
        if (stop)
            break;
        if (e->lost[0]) { /* (only this thread writes it) */
            fail_all(e, e->lost);
            continue;
        }
        drop_finished(e);
        step(e);
        publish_stats(e);
    }
    /* Shutting down: everything left is cancelled, so no submitter waits forever. */
    deliver_pending(e);
    drop_finished(e);
    while (e->sched.n_running > 0)
        finish(e, e->sched.running[0], CLLM_FINISH_CANCELLED, "the server is shutting down");
    while (e->sched.n_waiting > 0)
        finish(e, e->sched.waiting[e->sched.wait_head], CLLM_FINISH_CANCELLED,
               "the server is shutting down");
    publish_stats(e);
    return NULL;
}

/* --- setup --- */

/* Room for max_seqs sequences of up to 2048 tokens, capped at 4 GiB, but always at least one
 * full context. */
static int64_t default_kv_bytes(int64_t per_token, int32_t max_seqs, int32_t n_ctx)
{
    int64_t per_seq = n_ctx < 2048 ? n_ctx : 2048;
    int64_t want = per_token * per_seq * max_seqs, cap = (int64_t)4 << 30;
    if (want > cap)
        want = cap;
    return want > per_token * n_ctx ? want : per_token * n_ctx;
}

/* On a device that reports its memory: the KV cache takes what the --gpu-mem-fraction share
 * of the device leaves after the weights, activations and everyone else's use, less a
 * reserve for the BLAS workspace and recorded steps. 0 when the backend reports nothing. */
#define DEVICE_RESERVE_BYTES ((int64_t)512 << 20)
static enum cllm_status device_kv_bytes(struct cllm_engine *e, int64_t *out, char *err,
                                        size_t err_len)
{
    *out = 0;
    const struct cllm_backend_iface *be = e->be->iface;
    size_t free_b = 0, total_b = 0;
    if (!be->mem_info)
        return CLLM_OK;
    enum cllm_status st = be->mem_info(e->be, &free_b, &total_b);
    if (st)
        return cllm_fail(err, err_len, st, "cannot read the device's free memory");
    double frac = e->cfg.gpu_mem_fraction > 0.0 ? e->cfg.gpu_mem_fraction : 0.9;
    int64_t used = (int64_t)total_b - (int64_t)free_b;
    int64_t budget = (int64_t)((double)total_b * frac) - used - DEVICE_RESERVE_BYTES;
    if (budget <= 0)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM,
                         "no device memory left for the KV cache: %.0f of %.0f MiB in use, "
                         "--gpu-mem-fraction %.2f",
                         (double)used / (1 << 20), (double)total_b / (1 << 20), frac);
    *out = budget;
    return CLLM_OK;
}

/* Frees whatever of the engine exists (after the thread has stopped, or before it started). */
static void release(struct cllm_engine *e)
{
    cllm_scheduler_free(&e->sched);
    if (e->model)
        cllm_kv_cache_free(&e->kv, e->model);
    cllm_model_free(e->model);
    cllm_backend_free(e->be);
    free(e->tokens), free(e->pos), free(e->seq), free(e->slot), free(e->outputs), free(e->table);
    free(e->logits_copy);
    free(e->rows);
    free(e->sampled);
    free(e->pending);
    free(e->plan_copy);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->wake);
    free(e);
}

enum cllm_status cllm_engine_new(struct cllm_engine **out, const struct cllm_model_files *mf,
                                 const struct cllm_engine_config *c, char *err, size_t err_len)
{
    *out = NULL;
    struct cllm_engine *e = calloc(1, sizeof *e);
    if (!e)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    e->mf = mf;
    e->cfg = *c;
    struct cllm_engine_config *cfg = &e->cfg;
    if (!cfg->block_size)
        cfg->block_size = 16;
    if (!cfg->max_batch_tokens)
        cfg->max_batch_tokens = 512;
    if (!cfg->max_seqs)
        cfg->max_seqs = 256;
    if (!cfg->max_queue)
        cfg->max_queue = 4096;
    if (cfg->max_seqs > cfg->max_batch_tokens)
        cfg->max_seqs = cfg->max_batch_tokens;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    enum cllm_status st;
    struct cllm_backend_options bo = {cfg->backend, cfg->n_threads, cfg->device};
    if ((st = cllm_backend_new(&e->be, &bo, err, err_len)) ||
        (st = cllm_model_init(&e->model, mf, e->be, cfg->max_batch_tokens, cfg->max_seqs, err,
                              err_len)))
        goto fail;
    int64_t per_token = (int64_t)cllm_model_kv_bytes_per_token(e->model);
    e->n_ctx = cfg->n_ctx ? cfg->n_ctx : mf->hp.n_ctx_train;
    if (e->n_ctx > mf->hp.n_ctx_train)
        e->n_ctx = mf->hp.n_ctx_train;
    int64_t kv_bytes = cfg->kv_bytes;
    if (!kv_bytes && (st = device_kv_bytes(e, &kv_bytes, err, err_len)))
        goto fail;
    if (!kv_bytes)
        kv_bytes = default_kv_bytes(per_token, cfg->max_seqs, e->n_ctx);
    int64_t block_bytes = per_token * cfg->block_size;
    /* The default budget rounds up to whole blocks; an explicit --kv-mem is a ceiling. */
    int64_t n_blocks =
        cfg->kv_bytes ? kv_bytes / block_bytes : (kv_bytes + block_bytes - 1) / block_bytes;
    if (!cfg->kv_bytes && n_blocks < 2)
        n_blocks = 2; /* the smallest cache the scheduler works with */
    if (n_blocks < 2 || n_blocks > INT32_MAX / cfg->block_size) {
        st = cllm_fail(err, err_len, CLLM_ERR_RANGE,
                       "a KV cache of %lld bytes holds %lld blocks of %d tokens; need at least 2",
                       (long long)kv_bytes, (long long)n_blocks, (int)cfg->block_size);
        goto fail;
    }
    /* One sequence must always fit in the whole cache, or preemption could not make room. */
    if ((int64_t)e->n_ctx > n_blocks * cfg->block_size)
        e->n_ctx = (int32_t)(n_blocks * cfg->block_size);
    e->max_blocks_per_seq = (e->n_ctx + cfg->block_size - 1) / cfg->block_size;
    e->n_vocab = mf->hp.n_vocab;
    if ((st = cllm_kv_cache_init(&e->kv, e->model, (int32_t)n_blocks, cfg->block_size, err,
                                 err_len)) ||
        (st = cllm_scheduler_init(&e->sched, (int32_t)n_blocks, cfg->block_size,
                                  cfg->max_batch_tokens, cfg->max_seqs, cfg->prefix_cache))) {
        if (st == CLLM_ERR_NOMEM)
            cllm_fail(err, err_len, st, "out of memory for the KV cache (%lld bytes)",
                      (long long)kv_bytes);
        goto fail;
    }
    size_t T = (size_t)cfg->max_batch_tokens;
    e->tokens = cllm_malloc_array(T, sizeof(int32_t));
    e->pos = cllm_malloc_array(T, sizeof(int32_t));
    e->seq = cllm_malloc_array(T, sizeof(int32_t));
    e->slot = cllm_malloc_array(T, sizeof(int32_t));
    e->outputs = cllm_malloc_array(T, sizeof(int32_t));
    e->table =
        cllm_malloc_array((size_t)cfg->max_seqs * (size_t)e->max_blocks_per_seq, sizeof(int32_t));
    e->logits_copy = cllm_malloc_array((size_t)e->n_vocab, sizeof(float));
    e->plan_copy = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->plan_copy);
    e->rows = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->rows);
    e->sampled = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->sampled);
    e->pending = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->pending);
    if (!e->tokens || !e->pos || !e->seq || !e->slot || !e->outputs || !e->table ||
        !e->logits_copy || !e->plan_copy || !e->rows || !e->sampled || !e->pending) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    e->overlap = cfg->overlap > 0 || (cfg->overlap == 0 && cllm_model_samples_on_device(e->model));
    e->stats.kv_blocks_total = (int32_t)n_blocks;
    e->stats.block_size = cfg->block_size;
    e->stats.n_ctx = e->n_ctx;
    cllm_log(CLLM_LOG_INFO,
             "engine: %s backend, KV cache %d blocks x %d tokens (%.0f MiB, %d tokens), context "
             "%d, %d tokens/step, %d sequences",
             e->be->iface->name, (int)n_blocks, (int)cfg->block_size,
             (double)(n_blocks * cfg->block_size * per_token) / (1 << 20),
             (int)(n_blocks * cfg->block_size), (int)e->n_ctx, (int)cfg->max_batch_tokens,
             (int)cfg->max_seqs);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot start the engine thread");
        goto fail;
    }
    *out = e;
    return CLLM_OK;
fail:
    release(e);
    return st;
}

void cllm_engine_free(struct cllm_engine *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->lock);
    e->stop = true;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->thread, NULL);
    release(e);
}

enum cllm_status cllm_engine_submit(struct cllm_engine *e, const int32_t *prompt, int32_t n_prompt,
                                    const struct cllm_request_params *p, struct cllm_request **out,
                                    char *err, size_t err_len)
{
    *out = NULL;
    char lost[sizeof e->lost];
    pthread_mutex_lock(&e->lock);
    bool full = e->stats.waiting + e->n_incoming >= e->cfg.max_queue;
    uint64_t id = ++e->next_id;
    memcpy(lost, e->lost, sizeof lost);
    pthread_mutex_unlock(&e->lock);
    if (lost[0])
        return cllm_fail(err, err_len, CLLM_ERR_DEVICE, "%s", lost);
    if (full)
        return cllm_fail(err, err_len, CLLM_ERR_BUSY, "the queue is full (%d requests waiting)",
                         (int)e->cfg.max_queue);
    struct cllm_request *r;
    enum cllm_status st = cllm_request_new(&r, id, prompt, n_prompt, p, e->mf->tok, e->n_vocab,
                                           e->n_ctx, err, err_len);
    if (st)
        return st;
    cllm_request_retain(r); /* one for the engine's queue, one for the caller */
    pthread_mutex_lock(&e->lock);
    if (e->stop) {
        pthread_mutex_unlock(&e->lock);
        cllm_request_release(r);
        cllm_request_release(r);
        return cllm_fail(err, err_len, CLLM_ERR_BUSY, "the engine is shutting down");
    }
    if (e->incoming_tail)
        e->incoming_tail->next = r;
    else
        e->incoming_head = r;
    e->incoming_tail = r;
    e->n_incoming++;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
    *out = r;
    return CLLM_OK;
}

bool cllm_engine_lost(struct cllm_engine *e, char *why, size_t why_len)
{
    pthread_mutex_lock(&e->lock);
    bool lost = e->lost[0] != 0;
    if (lost && why_len)
        snprintf(why, why_len, "%s", e->lost);
    pthread_mutex_unlock(&e->lock);
    return lost;
}

bool cllm_engine_queue_full(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    bool full = e->stats.waiting + e->n_incoming >= e->cfg.max_queue;
    pthread_mutex_unlock(&e->lock);
    return full;
}

void cllm_engine_stats(struct cllm_engine *e, struct cllm_engine_stats *s)
{
    pthread_mutex_lock(&e->lock);
    *s = e->stats;
    pthread_mutex_unlock(&e->lock);
}

int32_t cllm_engine_n_ctx(const struct cllm_engine *e)
{
    return e->n_ctx;
}

const char *cllm_engine_backend_name(const struct cllm_engine *e)
{
    return e->be->iface->name;
}
