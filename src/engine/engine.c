/*
 * The engine thread and its step. Submitters push requests onto `incoming` under `lock`; the
 * thread moves them into the scheduler, runs a step, and delivers text through each request's
 * own lock. The model, KV cache and scheduler are touched by the engine thread only.
 *
 * Run-ahead: when the backend queues steps (a GPU), step N+1 is planned, laid out and launched
 * while step N still runs, so the device never waits for the host between steps. A request
 * sampled in step N gets a placeholder token at launch (request.h, n_unseen); step N+1 takes
 * that token from step N's draw on the device (cllm_model_launch_sample's references), and the
 * host writes it in when it waits for step N. A request whose step-N token ends it (EOS) has
 * been computed once more by step N+1: that token is dropped with its placeholder. Length
 * limits are known before the draw, so a request at its limit is never run ahead.
 *
 * Overlap: a step's tokens are written in (so EOS and length limits end a request before the
 * next step is planned) but their text -- detokenizing, stop strings, waking the submitter,
 * the costly part with hundreds of sequences -- is delivered while the device runs the next
 * step. A stop string found then ends a request that launched steps still compute: their
 * tokens are dropped, and the request leaves the scheduler before the next plan.
 */
#include "engine/engine_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/threadpool.h"
#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"

void cllm_engine_config_default(struct cllm_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->backend = CLLM_BACKEND_AUTO;
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

/* Runs the decoded text in r->pending through the stop strings and publishes what is final;
 * at the end (last) also what the stop matcher held back. True if a stop string matched. */
static bool emit_text(struct cllm_request *r, bool last, int32_t n_cached)
{
    const struct cllm_buf *text = &r->pending;
    struct cllm_stop_out so = {0};
    cllm_stop_push(r->stop, text->data ? text->data : "", text->len, &so);
    struct cllm_buf emit = {0};
    cllm_buf_append(&emit, so.text ? so.text : "", so.len);
    if (!so.stopped && last) {
        struct cllm_stop_out rest = {0};
        cllm_stop_flush(r->stop, &rest);
        cllm_buf_append(&emit, rest.text ? rest.text : "", rest.len);
    }
    cllm_request_emit(r, emit.data, emit.len, n_cached);
    cllm_buf_free(&emit);
    return so.stopped;
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
    bool stopped = emit_text(r, eos || at_limit, n_cached);
    if (eos || stopped)
        return CLLM_FINISH_STOP;
    return at_limit ? CLLM_FINISH_LENGTH : CLLM_FINISH_NONE;
}

/* Ends a request for its submitter. The scheduler may still hold it (drop_finished). */
void cllm_engine_end_request(struct cllm_engine *e, struct cllm_request *r,
                             enum cllm_finish_reason why, const char *error)
{
    r->ended = true;
    /* counted first: whoever sees the request finished sees it counted */
    pthread_mutex_lock(&e->lock);
    e->stats.requests_finished++;
    pthread_mutex_unlock(&e->lock);
    cllm_request_finish(r, why, error);
}

void cllm_engine_finish(struct cllm_engine *e, struct cllm_request *r, enum cllm_finish_reason why,
                        const char *error)
{
    cllm_engine_end_request(e, r, why, error);
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
                cllm_engine_end_request(e, r, why, NULL);
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

/* Ends a request whose max_time is over with the text it has: first that of its tokens whose
 * delivery waits (overlap: deliver_pending skips them once it has ended), then what the
 * detokenizer and the stop matcher still hold back, as at max_tokens. Tokens of a step in
 * flight for it are dropped when they arrive. */
static void finish_in_time(struct cllm_engine *e, struct cllm_request *r)
{
    for (int32_t i = 0; i < e->n_pending; i++) {
        const struct pending_token *pt = &e->pending[i];
        if (pt->r != r)
            continue;
        enum cllm_finish_reason why = deliver_token(r, pt->token, pt->at_limit, r->n_cached);
        if (why != CLLM_FINISH_NONE) {
            cllm_engine_finish(e, r, why, NULL);
            return;
        }
    }
    r->pending.len = 0;
    cllm_detok_stream_flush(&r->detok, &r->pending);
    bool stopped = emit_text(r, true, r->n_cached);
    cllm_log(CLLM_LOG_WARN,
             "request %llu: max_time %.3g s over after %d generated tokens: it ends with the "
             "text so far",
             (unsigned long long)r->id, r->params.max_time, (int)cllm_request_n_generated(r));
    cllm_engine_finish(e, r, stopped ? CLLM_FINISH_STOP : CLLM_FINISH_TIME, NULL);
}

/* Takes the requests that are over out of the scheduler: those cancelled by their submitter
 * or past their max_time (finished here) and those a stop string ended while a step that
 * included them ran. */
static void drop_one(struct cllm_engine *e, struct cllm_request *r, double now)
{
    if (r->ended)
        cllm_scheduler_remove(&e->sched, r);
    else if (cllm_request_cancelled(r))
        cllm_engine_finish(e, r, CLLM_FINISH_CANCELLED, NULL);
    else if (r->deadline > 0 && now >= r->deadline)
        finish_in_time(e, r);
}

static void drop_finished(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    const double now = cllm_now();
    for (int32_t i = s->n_running - 1; i >= 0; i--)
        drop_one(e, s->running[i], now);
    for (int32_t i = s->n_waiting - 1; i >= 0; i--)
        drop_one(e, s->waiting[(s->wait_head + i) % s->wait_cap], now);
}

/* Lays the plan out as a model step. The block table is only as wide as the longest
 * sequence needs, rounded up to a power of two (so that recorded decode steps see few
 * widths): a step uploads kilobytes of table, not max_seqs x the whole context. A token not
 * known yet (the placeholder of a request the step in flight draws for) is a reference to
 * that step's output. */
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
        int32_t known = cllm_request_n_known(r);
        for (int32_t k = 0; k < en->n_new; k++, n++) {
            int32_t pos = en->start + k;
            e->tokens[n] = pos < known ? r->tokens[pos] : -1 - r->unseen_output;
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

/* Room for n token counts in e->counts. */
static bool reserve_counts(struct cllm_engine *e, size_t n)
{
    if (n <= e->counts_cap)
        return true;
    const size_t cap = cllm_grow_cap(e->counts_cap, n, 4096);
    struct cllm_token_count *grown = cllm_realloc_array(e->counts, cap, sizeof *grown);
    if (!grown)
        return false;
    e->counts = grown;
    e->counts_cap = cap;
    return true;
}

/* The draw of each output of the plan: the counter is the index of the token being
 * generated, so a request's draws never depend on what it is batched with. A request with
 * penalties hands the device its sampler's seen tokens (e->counts), and the token its
 * launched step draws, not known here yet (unseen_output); its rows go to the host's sampler
 * instead when there is no room for them, or CLLM_HOST_PENALTIES=1 asks. Returns whether
 * some output is the host's to sample. */
static bool build_sample_rows(struct cllm_engine *e, const struct cllm_plan *p,
                              struct cllm_sample_row *rows)
{
    int32_t out = 0;
    size_t n_counts = 0;
    bool host = false;
    for (int32_t j = 0; j < p->n_entries; j++) {
        if (!p->entries[j].sample)
            continue;
        const struct cllm_request *r = p->entries[j].req;
        const struct cllm_sampling_params *sp = &r->params.sampling;
        struct cllm_sample_row *row = &rows[out++];
        *row = (struct cllm_sample_row){.temperature = sp->temperature,
                                        .top_k = sp->top_k,
                                        .top_p = sp->top_p,
                                        .min_p = sp->min_p,
                                        .seed = sp->seed,
                                        .counter = (uint64_t)(r->n_tokens - r->n_prompt)};
        if (!cllm_sampling_penalized(sp))
            continue;
        size_t n_seen;
        const struct cllm_token_count *seen = cllm_sampler_seen(r->sampler, &n_seen);
        if (!e->draws || e->host_penalties || !reserve_counts(e, n_counts + n_seen)) {
            *row = (struct cllm_sample_row){.temperature = -1.0f};
            host = true;
            continue;
        }
        if (n_seen)
            memcpy(e->counts + n_counts, seen, n_seen * sizeof *seen);
        row->repetition_penalty = sp->repetition_penalty;
        row->presence_penalty = sp->presence_penalty;
        row->frequency_penalty = sp->frequency_penalty;
        row->counts_at = (int32_t)n_counts;
        row->n_counts = (int32_t)n_seen;
        row->unseen_output = r->n_unseen > 0 ? r->unseen_output + 1 : 0;
        n_counts += n_seen;
    }
    return host;
}

/* Ends every request the scheduler holds with an error. */
void cllm_engine_fail_all(struct cllm_engine *e, const char *msg)
{
    struct cllm_scheduler *s = &e->sched;
    while (s->n_running > 0)
        cllm_engine_finish(e, s->running[0], CLLM_FINISH_ERROR, msg);
    while (s->n_waiting > 0)
        cllm_engine_finish(e, s->waiting[s->wait_head], CLLM_FINISH_ERROR, msg);
}

/* Plans the next step and launches it. Then each request it samples gets a placeholder for
 * its token; one that reaches its length limit with it leaves the scheduler at once (ended
 * when its text goes out). Returns false when there was nothing to launch or it failed. */
static bool launch_next(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    cllm_scheduler_schedule(s);
    const struct cllm_plan *p = &s->plan;
    if (p->n_entries == 0)
        return false;
    struct launched *f = flight_at(e, e->n_flights);
    struct cllm_step st;
    build_step(e, &st);
    f->caller_rows = build_sample_rows(e, p, f->rows);
    f->logits = NULL;
    enum cllm_status rc =
        e->draws ? cllm_model_launch_sample(e->model, &e->kv, &st, f->rows, e->counts, f->sampled)
                 : cllm_model_forward(e->model, &e->kv, &st, &f->logits);
    if (rc) {
        cllm_engine_step_failed(e, rc, true);
        return false;
    }
    memcpy(f->entries, p->entries, (size_t)p->n_entries * sizeof f->entries[0]);
    f->n_entries = p->n_entries;
    e->n_flights++;
    cllm_scheduler_update(s);
    for (int32_t j = 0, out = 0; j < f->n_entries; j++) {
        struct cllm_request *r = f->entries[j].req;
        cllm_request_retain(r);
        f->tok_index[j] = -1;
        if (!f->entries[j].sample)
            continue;
        int32_t i = out++;
        if (cllm_request_append(r, -1) != CLLM_OK) {
            cllm_engine_finish(e, r, CLLM_FINISH_ERROR, "out of memory while sampling");
            continue;
        }
        f->tok_index[j] = r->n_tokens - 1;
        r->n_unseen++;
        r->unseen_output = i;
        if (r->n_tokens >= r->max_total)
            cllm_scheduler_remove(s, r);
    }
    return true;
}

/* Whether the backend lends its host threads (host_threads and host_run, both or neither). */
static bool lends_threads(const struct cllm_backend *be)
{
    return be->iface->host_run && be->iface->host_threads;
}

/* Whether output token idx of a finished step is still wanted by r: not when r has ended (a
 * stop string, a cancel) or dropped it (an earlier token of it was EOS). */
static bool token_wanted(const struct cllm_request *r, int32_t idx)
{
    return !r->ended && idx >= 0 && idx < r->n_tokens;
}

struct host_draw_job {
    const float *logits;
    int32_t n_vocab;
    float *copies; /* [nth][n_vocab] */
    const struct host_draw *draws;
    int32_t n;
    atomic_int next;
};

static void host_draw_task(void *ctx, int ith, int nth)
{
    struct host_draw_job *j = ctx;
    float *row = j->copies + (size_t)ith * (size_t)j->n_vocab;
    (void)nth;
    for (;;) {
        const int k = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (k >= j->n)
            return;
        const struct host_draw *d = &j->draws[k];
        memcpy(row, j->logits + (int64_t)d->row * j->n_vocab, (size_t)j->n_vocab * sizeof(float));
        *d->token = cllm_sampler_sample(d->sampler, row);
    }
}

/* Draws n tokens on several host threads: the backend's when it lends them (the CPU's pool,
 * idle between steps), else the engine's own pool (a GPU's rows come here only when asked:
 * CLLM_HOST_PENALTIES=1, or out of memory for their penalties). A draw with Qwen's defaults
 * (top-k 20, top-p 0.8, repetition penalty 1.1) over 151,936 logits takes ~0.5 ms, so 192
 * sequences cost 100 ms a step on the engine thread alone. Which thread draws a token changes
 * nothing: every request has its own sampler and random stream. Without a row per thread (out
 * of memory) the engine thread draws all. */
static void draw_on_host(struct cllm_engine *e, const float *logits, const struct host_draw *draws,
                         int32_t n)
{
    const struct cllm_backend_iface *bi = e->be->iface;
    const bool lent = lends_threads(e->be);
    int32_t nth = n < 2                ? 1
                  : lent               ? bi->host_threads(e->be)
                  : e->draw_pool       ? cllm_threadpool_n_threads(e->draw_pool)
                                       : 1;
    if (nth > e->n_copies) {
        float *grown = realloc(e->logits_copies, (size_t)nth * (size_t)e->n_vocab * sizeof(float));
        if (grown) {
            e->logits_copies = grown;
            e->n_copies = nth;
        } else {
            nth = 1;
        }
    }
    struct host_draw_job j = {.logits = logits,
                              .n_vocab = e->n_vocab,
                              .copies = e->logits_copies,
                              .draws = draws,
                              .n = n};
    atomic_init(&j.next, 0);
    if (nth > 1 && lent)
        bi->host_run(e->be, host_draw_task, &j);
    else
        cllm_threadpool_run(nth > 1 ? e->draw_pool : NULL, host_draw_task, &j);
}

/* Waits for the oldest launched step and writes its tokens in; their text goes out later
 * (deliver_pending). */
static void finish_oldest(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    struct launched *f = flight_at(e, 0);
    const float *logits = f->logits;
    enum cllm_status rc =
        e->draws ? cllm_model_wait_sample(e->model, f->rows, f->sampled, &logits) : CLLM_OK;
    if (rc) {
        cllm_engine_step_failed(e, rc, false);
        return;
    }
    /* The host's draws first, all together; the loop below takes their tokens in order. */
    int32_t n_draws = 0;
    for (int32_t j = 0, out = 0; j < f->n_entries; j++) {
        const struct cllm_sched_entry *en = &f->entries[j];
        if (!en->sample)
            continue;
        const int32_t i = out++, idx = f->tok_index[j];
        if (token_wanted(en->req, idx) && (!e->draws || f->sampled[i] < 0))
            e->host_draws[n_draws++] = (struct host_draw){en->req->sampler, i, &f->sampled[i]};
    }
    if (n_draws)
        draw_on_host(e, logits, e->host_draws, n_draws);
    int32_t n_prompt_tokens = 0, n_generated = 0;
    for (int32_t j = 0, out = 0; j < f->n_entries; j++) {
        const struct cllm_sched_entry *en = &f->entries[j];
        struct cllm_request *r = en->req;
        int32_t prompt_part = r->n_prompt - en->start;
        if (prompt_part > 0)
            n_prompt_tokens += prompt_part < en->n_new ? prompt_part : en->n_new;
        if (!en->sample)
            continue;
        int32_t i = out++, idx = f->tok_index[j];
        if (!token_wanted(r, idx))
            continue;
        const int32_t token = f->sampled[i];
        /* a device draw counts for the penalties of the request's next rows (a host draw
         * recorded it already) */
        const bool drawn_by_model = e->draws && f->rows[i].temperature >= 0.0f;
        if (token < 0 || (drawn_by_model && cllm_sampler_accept(r->sampler, token) != CLLM_OK)) {
            cllm_engine_finish(e, r, CLLM_FINISH_ERROR, "out of memory while sampling");
            continue;
        }
        r->tokens[idx] = token;
        r->n_unseen--;
        cllm_scheduler_publish(s, r);
        n_generated++;
        bool at_limit = idx + 1 >= r->max_total;
        cllm_request_retain(r);
        e->pending[e->n_pending++] = (struct pending_token){r, token, at_limit};
        if (is_stop_id(r, token)) {
            /* Nothing more to compute: what later steps drew for it goes. */
            cllm_scheduler_remove(s, r);
            r->n_tokens = idx + 1;
            r->n_unseen = 0;
        }
    }
    pop_flight(e);
    pthread_mutex_lock(&e->lock);
    e->stats.steps++;
    e->stats.prompt_tokens += (uint64_t)n_prompt_tokens;
    e->stats.generated_tokens += (uint64_t)n_generated;
    pthread_mutex_unlock(&e->lock);
    cllm_engine_grow_steps_back(e);
}

/* One turn of the engine: launch the next step (while the last one runs, with run-ahead),
 * deliver the text of the tokens seen so far, then wait for the oldest step. */
static void step(struct cllm_engine *e)
{
    bool may_launch =
        e->n_flights == 0 || (e->run_ahead && e->n_flights == 1 && !flight_at(e, 0)->caller_rows);
    bool launched = may_launch && launch_next(e);
    if (e->overlap || e->n_flights == 0)
        deliver_pending(e); /* while the device runs (a CPU ran its step already) */
    if (e->n_flights == 0)
        return;
    if (e->run_ahead && launched && e->n_flights == 1)
        return; /* the next turn launches the step after this one before waiting for it */
    finish_oldest(e);
    struct cllm_scheduler *s = &e->sched;
    if (!e->overlap || (s->n_running == 0 && s->n_waiting == 0 && e->n_flights == 0))
        deliver_pending(e);
}

static void publish_stats(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->stats.running = e->sched.n_running;
    e->stats.waiting = e->sched.n_waiting + e->n_incoming;
    e->stats.kv_blocks_used = cllm_block_pool_in_use(&e->sched.pool);
    e->stats.preemptions = e->sched.n_preemptions;
    e->stats.step_tokens = e->sched.max_batch_tokens;
    e->stats.step_seqs = e->sched.max_seqs;
    e->stats.unrecorded_steps = cllm_model_unrecorded_steps(e->model);
    e->stats.prefix_queries = e->sched.pool.prefix_queries;
    e->stats.prefix_hits = e->sched.pool.prefix_hits;
    pthread_mutex_unlock(&e->lock);
}

static void *engine_main(void *arg)
{
    struct cllm_engine *e = arg;
    for (;;) {
        bool idle = e->sched.n_running == 0 && e->sched.n_waiting == 0 && e->n_flights == 0;
        if (idle)
            deliver_pending(e); /* before sleeping: nothing may stay undelivered */
        pthread_mutex_lock(&e->lock);
        e->turn_started = 0; /* waiting for work is no stall */
        while (!e->stop && !e->incoming_head && idle)
            pthread_cond_wait(&e->wake, &e->lock);
        bool stop = e->stop;
        e->turn_started = cllm_now();
        pthread_mutex_unlock(&e->lock);
        take_incoming(e);
        if (stop)
            break;
        if (e->lost[0]) { /* (only this thread writes it) */
            cllm_engine_fail_all(e, e->lost);
            continue;
        }
        drop_finished(e);
        step(e);
        publish_stats(e);
    }
    /* Shutting down: everything left is cancelled, so no submitter waits forever. */
    while (e->n_flights > 0)
        finish_oldest(e);
    deliver_pending(e);
    drop_finished(e);
    while (e->sched.n_running > 0)
        cllm_engine_finish(e, e->sched.running[0], CLLM_FINISH_CANCELLED,
                           "the server is shutting down");
    while (e->sched.n_waiting > 0)
        cllm_engine_finish(e, e->sched.waiting[e->sched.wait_head], CLLM_FINISH_CANCELLED,
                           "the server is shutting down");
    publish_stats(e);
    return NULL;
}

/* --- setup --- */

/* Frees whatever of the engine exists (after the thread has stopped, or before it started). */
static void release(struct cllm_engine *e)
{
    cllm_scheduler_free(&e->sched);
    if (e->model)
        cllm_kv_cache_free(&e->kv, e->model);
    cllm_model_free(e->model);
    cllm_backend_free(e->be);
    free(e->tokens), free(e->pos), free(e->seq), free(e->slot), free(e->outputs), free(e->table);
    free(e->logits_copies);
    free(e->counts);
    free(e->host_draws);
    cllm_threadpool_free(e->draw_pool);
    for (int i = 0; i < 2; i++) {
        struct launched *f = &e->flights[i];
        free(f->entries), free(f->tok_index), free(f->rows), free(f->sampled);
    }
    free(e->pending);
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
    if (cfg->grow_back_steps <= 0)
        cfg->grow_back_steps = 256;
    cllm_backoff_init(&e->grow, cfg->grow_back_steps);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    enum cllm_status st;
    if ((st = cllm_engine_load_model(e, err, err_len)))
        goto fail;
    int64_t per_token = (int64_t)cllm_model_kv_bytes_per_token(e->model);
    e->n_ctx = cfg->n_ctx ? cfg->n_ctx : mf->hp.n_ctx_train;
    if (e->n_ctx > mf->hp.n_ctx_train)
        e->n_ctx = mf->hp.n_ctx_train;
    int64_t kv_bytes = cfg->kv_bytes;
    if (!kv_bytes && (st = cllm_engine_device_kv_bytes(e, &kv_bytes, err, err_len)))
        goto fail;
    int64_t n_blocks = cllm_engine_cache_blocks(e, kv_bytes);
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
    e->logits_copies = cllm_malloc_array((size_t)e->n_vocab, sizeof(float));
    e->n_copies = 1;
    e->host_draws = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->host_draws);
    /* pending: one step's tokens at most (delivered before the next step's are seen) */
    e->pending = cllm_malloc_array((size_t)cfg->max_seqs, sizeof *e->pending);
    bool flights_ok = true;
    for (int i = 0; i < 2; i++) {
        struct launched *f = &e->flights[i];
        size_t S = (size_t)cfg->max_seqs;
        f->entries = cllm_malloc_array(S, sizeof *f->entries);
        f->tok_index = cllm_malloc_array(S, sizeof *f->tok_index);
        f->rows = cllm_malloc_array(S, sizeof *f->rows);
        f->sampled = cllm_malloc_array(S, sizeof *f->sampled);
        flights_ok &= f->entries && f->tok_index && f->rows && f->sampled;
    }
    if (!e->tokens || !e->pos || !e->seq || !e->slot || !e->outputs || !e->table ||
        !e->logits_copies || !e->host_draws || !e->pending || !flights_ok) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    cllm_engine_set_step_modes(e);
    if (cfg->max_seqs > 1 && !lends_threads(e->be)) {
        /* a GPU lends no host threads; without its own the engine draws alone (slower) */
        int32_t n = cfg->n_threads > 0 ? cfg->n_threads : cllm_cpu_physical_cores();
        if (n > 1 && cllm_threadpool_new(&e->draw_pool, n) != CLLM_OK)
            cllm_log(CLLM_LOG_WARN, "engine: no threads for host draws; the engine draws alone");
    }
    e->backend_name = e->be->iface->name;
    e->stall_s = cllm_engine_stall_limit(e);
    e->stats.kv_blocks_total = (int32_t)n_blocks;
    e->stats.block_size = cfg->block_size;
    e->stats.n_ctx = e->n_ctx;
    e->stats.step_tokens = cfg->max_batch_tokens;
    e->stats.step_seqs = cfg->max_seqs;
    cllm_log(CLLM_LOG_INFO,
             "engine: %s backend, KV cache %d blocks x %d tokens (%.0f MiB, %d tokens), context "
             "%d, %d tokens/step, %d sequences, run-ahead %s",
             e->be->iface->name, (int)n_blocks, (int)cfg->block_size,
             (double)(n_blocks * cfg->block_size * per_token) / (1 << 20),
             (int)(n_blocks * cfg->block_size), (int)e->n_ctx, (int)cfg->max_batch_tokens,
             (int)cfg->max_seqs, e->run_ahead ? "on" : "off");
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
