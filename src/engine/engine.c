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
#include "engine/engine.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/threadpool.h"
#include "core/alloc.h"
#include "core/backoff.h"
#include "core/log.h"
#include "core/limits.h"
#include "core/status.h"
#include "engine/device_check.h"
#include "engine/scheduler.h"
#include "model/model.h"

/* A token to draw on the host: the sampler of its request, its row of the step's logits, and
 * where the token goes (a negative value if the draw failed). */
struct host_draw {
    struct cllm_sampler *sampler;
    int32_t row;
    int32_t *token;
};

/* A step launched and not yet waited for. Each request of its plan is retained: it may leave
 * the scheduler (EOS, cancel) while the step runs. */
struct launched {
    struct cllm_sched_entry *entries; /* [max_seqs] the plan */
    int32_t *tok_index; /* [max_seqs] per entry: where its token goes in req->tokens, or -1 */
    int32_t n_entries;
    struct cllm_sample_row *rows; /* [max_seqs] how each output is drawn */
    int32_t *sampled;             /* [max_seqs] the drawn tokens (-1: sample on the host) */
    bool caller_rows;             /* some outputs are sampled on the host */
    const float *logits;          /* without draws: the step's logits (host) */
};

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
    float *logits_copies;       /* [n_copies][n_vocab]: a row per host thread for samplers */
    int32_t n_copies;
    struct host_draw *host_draws; /* [max_seqs] a step's tokens to draw on the host */
    struct cllm_threadpool *draw_pool; /* host threads for draws on a backend that lends none */
    struct launched flights[2]; /* launched steps, oldest first: flights[(head + i) % 2] */
    int32_t n_flights, flight_head;
    struct pending_token *pending; /* [max_seqs] tokens whose text is not delivered yet */
    int32_t n_pending;
    struct cllm_token_count *counts; /* [counts_cap] the penalties' memory of a step's rows */
    size_t counts_cap;
    bool draws;     /* steps go through cllm_model_launch_sample (tokens drawn by the model) */
    bool host_penalties; /* CLLM_HOST_PENALTIES=1: rows with penalties are drawn on the host */
    bool run_ahead; /* launch a step while the one before it runs */
    bool overlap;   /* deliver a step's text during the next step */
    /* Smaller steps after the device ran short of memory (smaller_steps), and growing back
     * (grow_steps_back): at step grow_at (0: at full size) steps double, after grow.wait
     * steps at each size; a size grown back to that is short again doubles the wait. */
    uint64_t grow_at;
    struct cllm_backoff grow;

    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct cllm_request *incoming_head, *incoming_tail; /* under lock */
    int32_t n_incoming;                                 /* under lock */
    bool stop;                                          /* under lock */
    char lost[192]; /* under lock: why the device can run nothing more ("" while it can) */
    const char *backend_name;       /* under lock: the backend's name (a static string) */
    double stall_s;                 /* under lock: a turn longer than this is a stall; 0: none */
    char fallback[256];  /* under lock: why it runs on the CPU though a GPU was to be used ("") */
    double turn_started; /* under lock: cllm_now() when the current turn began; 0
                            while the engine waits for work */
    uint64_t next_id;               /* under lock */
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
static void end_request(struct cllm_engine *e, struct cllm_request *r, enum cllm_finish_reason why,
                        const char *error)
{
    r->ended = true;
    /* counted first: whoever sees the request finished sees it counted */
    pthread_mutex_lock(&e->lock);
    e->stats.requests_finished++;
    pthread_mutex_unlock(&e->lock);
    cllm_request_finish(r, why, error);
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
            finish(e, r, why, NULL);
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
    finish(e, r, stopped ? CLLM_FINISH_STOP : CLLM_FINISH_TIME, NULL);
}

/* Takes the requests that are over out of the scheduler: those cancelled by their submitter
 * or past their max_time (finished here) and those a stop string ended while a step that
 * included them ran. */
static void drop_one(struct cllm_engine *e, struct cllm_request *r, double now)
{
    if (r->ended)
        cllm_scheduler_remove(&e->sched, r);
    else if (cllm_request_cancelled(r))
        finish(e, r, CLLM_FINISH_CANCELLED, NULL);
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
static void fail_all(struct cllm_engine *e, const char *msg)
{
    struct cllm_scheduler *s = &e->sched;
    while (s->n_running > 0)
        finish(e, s->running[0], CLLM_FINISH_ERROR, msg);
    while (s->n_waiting > 0)
        finish(e, s->waiting[s->wait_head], CLLM_FINISH_ERROR, msg);
}

static struct launched *flight_at(struct cllm_engine *e, int32_t i)
{
    return &e->flights[(e->flight_head + i) % 2];
}

static void fail_entries(struct cllm_engine *e, const struct cllm_sched_entry *en, int32_t n,
                         const char *msg)
{
    for (int32_t j = n - 1; j >= 0; j--)
        if (!en[j].req->ended)
            finish(e, en[j].req, CLLM_FINISH_ERROR, msg);
}

/* Lets go of the oldest launched step's requests. */
static void pop_flight(struct cllm_engine *e)
{
    struct launched *f = flight_at(e, 0);
    for (int32_t j = 0; j < f->n_entries; j++)
        cllm_request_release(f->entries[j].req);
    f->n_entries = 0;
    e->flight_head = (e->flight_head + 1) % 2;
    e->n_flights--;
}

/* Room for max_seqs sequences of up to 2048 tokens, capped at 4 GiB, but always at least one
 * full context. */
static int64_t default_kv_bytes(int64_t per_token, int32_t max_seqs, int32_t n_ctx)
{
    int64_t per_seq = n_ctx < 2048 ? n_ctx : 2048;
    /* 4 GiB, or an eighth of the memory this process may use where that is more: on the
     * evaluation's 100 GB machine the 1.5B's 192 answers fit without preemption. */
    const uint64_t eighth = cllm_memory_limit() / 8;
    int64_t want = per_token * per_seq * max_seqs, cap = (int64_t)4 << 30;
    if (eighth > (uint64_t)cap && eighth < (uint64_t)INT64_MAX)
        cap = (int64_t)eighth;
    if (want > cap)
        want = cap;
    return want > per_token * n_ctx ? want : per_token * n_ctx;
}

/* True when the model runs on a GPU: what the device check checks and what a failure moves
 * away from (any backend but the CPU's). */
static bool on_gpu(const struct cllm_engine *e)
{
    return strcmp(e->be->iface->name, "cpu") != 0;
}

/* The stall timeout on a GPU unless one is set: its steps take milliseconds (a few more when a
 * batch size is first recorded; ~1 s when a failed step moves the engine to the CPU inside a
 * turn); 30 s in one is a device that no longer answers. Not less: what the server does then
 * (moving to the CPU) costs every request its speed. */
#define GPU_STALL_TIMEOUT_S 30.0

/* How long one turn may run on the current backend before the engine counts as stalled (0:
 * any time). */
static double stall_limit(const struct cllm_engine *e)
{
    if (e->cfg.stall_timeout != 0)
        return e->cfg.stall_timeout > 0 ? e->cfg.stall_timeout : 0;
    return on_gpu(e) ? GPU_STALL_TIMEOUT_S : 0;
}

static enum cllm_status init_model_on(struct cllm_engine *e, enum cllm_backend_kind kind, char *err,
                                      size_t err_len)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    struct cllm_backend_options bo = {kind, cfg->n_threads, cfg->device, cfg->cpu_weights};
    enum cllm_status st = cllm_backend_new(&e->be, &bo, err, err_len);
    if (!st)
        st = cllm_model_init(&e->model, e->mf, e->be, cfg->max_batch_tokens, cfg->max_seqs, err,
                             err_len);
    if (!st && cfg->cpu_weights == CLLM_CPU_WEIGHTS_Q6_K && !on_gpu(e))
        cllm_log(CLLM_LOG_INFO, "cpu: --cpu-weights q6_k: float weight matrices whose rows are "
                                "whole 256-element blocks were quantized to Q6_K at load");
    return st;
}

/* Blocks of KV cache that kv_bytes buy on the current model (0: the CPU's default budget);
 * the callers see to the minimums. */
static int64_t cache_blocks(const struct cllm_engine *e, int64_t kv_bytes)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    int64_t per_token = (int64_t)cllm_model_kv_bytes_per_token(e->model);
    if (!kv_bytes)
        kv_bytes = default_kv_bytes(per_token, cfg->max_seqs, e->n_ctx);
    int64_t block_bytes = per_token * cfg->block_size;
    /* The default budget rounds up to whole blocks; an explicit --kv-mem is a ceiling. */
    return cfg->kv_bytes ? kv_bytes / block_bytes : (kv_bytes + block_bytes - 1) / block_bytes;
}

/* How steps are run on the current model: see cllm_engine_config and the top of the file. */
static void set_step_modes(struct cllm_engine *e)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    e->draws = cllm_model_samples_on_device(e->model) || cfg->run_ahead > 0;
    /* CLLM_NO_RUN_AHEAD=1 turns the default off, for comparison */
    const char *no_ahead = getenv("CLLM_NO_RUN_AHEAD");
    bool ahead_default = cllm_model_queues_steps(e->model) && !(no_ahead && !strcmp(no_ahead, "1"));
    e->run_ahead = e->draws && (cfg->run_ahead > 0 || (cfg->run_ahead == 0 && ahead_default));
    const char *host_penalties = getenv("CLLM_HOST_PENALTIES"); /* for comparison */
    e->host_penalties = host_penalties && !strcmp(host_penalties, "1");
    e->overlap = cfg->overlap > 0 || (cfg->overlap == 0 && cllm_model_samples_on_device(e->model));
}

/* r once more among the requests to carry over, unless it is there already or over: ended,
 * or out of the scheduler with all its tokens known (an EOS waiting to be delivered; one at
 * its length limit whose last token a launched step was to draw is carried over). */
static void keep_request(struct cllm_request **keep, int32_t *n, struct cllm_request *r)
{
    if (r->ended || (r->state == CLLM_REQ_DONE && r->n_unseen == 0))
        return;
    for (int32_t i = 0; i < *n; i++)
        if (keep[i] == r)
            return;
    keep[(*n)++] = r;
}

/* Room for every request the engine holds (take_requests). */
static struct cllm_request **requests_room(struct cllm_engine *e)
{
    const struct cllm_scheduler *s = &e->sched;
    int32_t cap = s->n_running + s->n_waiting;
    for (int32_t i = 0; i < e->n_flights; i++)
        cap += flight_at(e, i)->n_entries;
    return cllm_malloc_array((size_t)cap + 1, sizeof(struct cllm_request *));
}

/* Every request that is not over into keep (requests_room), in the order they came: running
 * (including the failed plan's), those only a launched step still held (at their length
 * limit), waiting; each retained, with the tokens that launched steps drew and nobody saw
 * dropped. The launched steps are forgotten. Then the scheduler can be freed and a new one
 * given them back (swap_scheduler), each as if preempted: its known tokens kept, its cache
 * recomputed. Returns how many. */
static int32_t take_requests(struct cllm_engine *e, struct cllm_request **keep)
{
    struct cllm_scheduler *s = &e->sched;
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_running; i++)
        keep_request(keep, &n, s->running[i]);
    for (int32_t f = 0; f < e->n_flights; f++)
        for (int32_t j = 0; j < flight_at(e, f)->n_entries; j++)
            keep_request(keep, &n, flight_at(e, f)->entries[j].req);
    for (int32_t i = 0; i < s->n_waiting; i++)
        keep_request(keep, &n, s->waiting[(s->wait_head + i) % s->wait_cap]);
    for (int32_t i = 0; i < n; i++) {
        cllm_request_retain(keep[i]);
        keep[i]->n_tokens -= keep[i]->n_unseen;
        keep[i]->n_unseen = 0;
        keep[i]->unseen_output = 0;
    }
    while (e->n_flights > 0)
        pop_flight(e);
    return n;
}

/* Every request the engine holds (take_requests, into keep from requests_room, which is
 * freed) moved onto scheduler ns, which replaces the engine's: in order, each as if
 * preempted. One that ns cannot take ends with `why`. Returns how many were moved. */
static int32_t swap_scheduler(struct cllm_engine *e, struct cllm_scheduler *ns,
                              struct cllm_request **keep, const char *why)
{
    struct cllm_scheduler *s = &e->sched;
    const int32_t n = take_requests(e, keep);
    ns->n_preemptions = s->n_preemptions + (uint64_t)s->n_running;
    cllm_scheduler_free(s); /* every request's blocks go back, its n_computed to 0 */
    *s = *ns;
    for (int32_t i = 0; i < n; i++) {
        if (cllm_scheduler_add(s, keep[i]) != CLLM_OK)
            end_request(e, keep[i], CLLM_FINISH_ERROR, why);
        cllm_request_release(keep[i]);
    }
    free(keep);
    return n;
}

/* Under --device auto a GPU that failed (lost, or a step that fails on it) is not the end of
 * the requests it held: the engine loads the model on the CPU and goes on with every request
 * (take_requests). Slower, but no answer is lost. Returns false, having changed nothing, if
 * the CPU model or its cache cannot be made. */
static bool move_to_cpu(struct cllm_engine *e, enum cllm_status rc)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    struct cllm_backend *old_be = e->be;
    struct cllm_model *old_model = e->model;
    struct cllm_request **keep = requests_room(e);
    struct cllm_kv_cache kv = {0};
    struct cllm_scheduler ns;
    char err[256] = "";
    e->be = NULL;
    e->model = NULL;
    enum cllm_status st = keep ? init_model_on(e, CLLM_BACKEND_CPU, err, sizeof err)
                               : cllm_fail(err, sizeof err, CLLM_ERR_NOMEM, "out of memory");
    int64_t n_blocks = 0;
    if (!st) {
        n_blocks = cache_blocks(e, cfg->kv_bytes);
        int64_t need = (e->n_ctx + cfg->block_size - 1) / cfg->block_size;
        if (n_blocks < need)
            n_blocks = need; /* one sequence must always fit */
        st = cllm_kv_cache_init(&kv, e->model, (int32_t)n_blocks, cfg->block_size, err, sizeof err);
    }
    if (!st &&
        (st = cllm_scheduler_init(&ns, (int32_t)n_blocks, cfg->block_size, cfg->max_batch_tokens,
                                  cfg->max_seqs, cfg->prefix_cache))) {
        cllm_kv_cache_free(&kv, e->model);
        cllm_fail(err, sizeof err, st, "out of memory for the scheduler");
    }
    if (st) {
        cllm_log(CLLM_LOG_ERROR, "engine: cannot move to the CPU: %s", err);
        cllm_model_free(e->model);
        cllm_backend_free(e->be);
        e->be = old_be;
        e->model = old_model;
        free(keep);
        return false;
    }
    const int32_t n = swap_scheduler(e, &ns, keep, "out of memory moving to the CPU");
    cllm_kv_cache_free(&e->kv, old_model);
    cllm_model_free(old_model);
    cllm_log(CLLM_LOG_ERROR,
             "engine: a step failed on the %s device (%s): its %d requests go on on the CPU "
             "(recomputed from their tokens so far), and so does everything from now on",
             old_be->iface->name, cllm_status_str(rc), (int)n);
    char fallback[sizeof e->fallback];
    snprintf(fallback, sizeof fallback, "a step failed on the %s device (%s)", old_be->iface->name,
             cllm_status_str(rc));
    cllm_backend_free(old_be);
    e->kv = kv;
    set_step_modes(e);
    e->grow_at = 0; /* a new device: steps as large as configured */
    cllm_backoff_init(&e->grow, cfg->grow_back_steps);
    pthread_mutex_lock(&e->lock);
    e->backend_name = e->be->iface->name;
    e->stall_s = 0; /* the CPU that took over is not timed: there is nowhere else to go */
    e->stats.kv_blocks_total = (int32_t)n_blocks;
    memcpy(e->fallback, fallback, sizeof fallback);
    pthread_mutex_unlock(&e->lock);
    return true;
}

/* A step that found no room on the device (CLLM_ERR_NOMEM: a buffer the size of the step that
 * could not grow, the device's memory taken by the KV cache or by another process) is not
 * the end of its requests: the engine goes on with steps of half as many tokens and
 * sequences, whose buffers are smaller, and every request recomputed (take_requests); again
 * if need be, down to one token a step. Returns false, having changed nothing, at one token a
 * step already or if the new scheduler cannot be made. */
static bool smaller_steps(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched, ns;
    if (s->max_batch_tokens <= 1)
        return false;
    const int32_t tokens = s->max_batch_tokens / 2, seqs = s->max_seqs > 1 ? s->max_seqs / 2 : 1;
    struct cllm_request **keep = requests_room(e);
    /* as large as configured, for the steps to grow back to (grow_steps_back) */
    if (!keep || cllm_scheduler_init(&ns, s->pool.n_blocks, s->pool.block_size, s->cap_tokens,
                                     s->cap_seqs, s->prefix_cache)) {
        free(keep);
        return false;
    }
    (void)cllm_scheduler_set_limits(&ns, tokens, seqs < tokens ? seqs : tokens); /* none runs */
    const int32_t n = swap_scheduler(e, &ns, keep, "out of memory");
    /* A size it had grown back to was short again: it waits twice as long before the next
     * try, up to 16 times the configured wait, so a device that stays short costs a
     * recomputation of what it holds at most every 16 x grow_back_steps steps. */
    e->grow_at = e->stats.steps + (uint64_t)cllm_backoff_failed(&e->grow);
    cllm_log(
        CLLM_LOG_WARN,
        "engine: a step found no room on the %s device: the %d requests held go on (recomputed "
        "from their tokens so far) in steps of at most %d tokens and %d sequences (twice that "
        "again after %lld steps)",
        e->be->iface->name, (int)n, (int)s->max_batch_tokens, (int)s->max_seqs,
        (long long)e->grow.wait);
    return true;
}

/* Steps made smaller for want of device memory (smaller_steps) grow back: twice as large, up
 * to the configured size, once grow.wait steps have gone through at the smaller size, for the
 * memory that was short may have come back (another process's). Nothing is recomputed: the
 * scheduler just plans larger steps from the next on. */
static void grow_steps_back(struct cllm_engine *e)
{
    struct cllm_scheduler *s = &e->sched;
    if (!e->grow_at || e->stats.steps < e->grow_at)
        return;
    int32_t tokens = 2 * s->max_batch_tokens, seqs = 2 * s->max_seqs;
    if (tokens > s->cap_tokens)
        tokens = s->cap_tokens;
    if (seqs > s->cap_seqs)
        seqs = s->cap_seqs;
    if (seqs > tokens)
        seqs = tokens;
    if (cllm_scheduler_set_limits(s, tokens, seqs) != CLLM_OK)
        return; /* cannot be: no larger than the caps, no fewer sequences than running */
    cllm_backoff_tried(&e->grow);
    const bool full = tokens == s->cap_tokens && seqs == s->cap_seqs;
    e->grow_at = full ? 0 : e->stats.steps + (uint64_t)e->grow.wait;
    cllm_log(CLLM_LOG_WARN, "engine: steps grow back to at most %d tokens and %d sequences%s",
             (int)tokens, (int)seqs, full ? ", as configured" : "");
}

/* A launch or a wait failed. Under --device auto, after a device error on a GPU, the engine
 * goes on on the CPU with every request (move_to_cpu). Otherwise the requests of every
 * launched step and of the plan (if `plan`) end with the error; and if the device does not
 * answer a sync either, the error sticks (a CUDA illegal address, a lost GPU): nothing can
 * run any more, so every request ends, new ones are refused and the health check reports
 * it, for the server to be restarted. */
static void step_failed(struct cllm_engine *e, enum cllm_status rc, bool plan)
{
    const struct cllm_plan *p = &e->sched.plan;
    char msg[96];
    snprintf(msg, sizeof msg, "the forward pass failed: %s", cllm_status_str(rc));
    cllm_log(CLLM_LOG_ERROR, "%s (%d requests in the step)", msg,
             (int)(plan ? p->n_entries : flight_at(e, 0)->n_entries));
    if (e->draws)
        cllm_model_drop_launched(e->model);
    bool sticks = rc == CLLM_ERR_DEVICE && e->be->iface->sync(e->be) != CLLM_OK;
    /* Under --device auto a GPU that fails a step -- lost, or a kernel that fails on this
     * batch -- is not given the next one: its requests go on on the CPU. */
    if (rc == CLLM_ERR_DEVICE && e->cfg.backend == CLLM_BACKEND_AUTO && on_gpu(e) &&
        move_to_cpu(e, rc))
        return;
    if (rc == CLLM_ERR_NOMEM && smaller_steps(e))
        return;
    /* The loss is recorded before any request ends with it: a client that gets the error and
     * asks /health at once must see the device lost, not "ok". */
    char lost[sizeof e->lost];
    if (sticks) {
        snprintf(lost, sizeof lost,
                 "the %s device failed (%s) and cannot run requests any more: restart the server",
                 e->be->iface->name, cllm_status_str(rc));
        cllm_log(CLLM_LOG_ERROR, "engine: %s", lost);
        pthread_mutex_lock(&e->lock);
        memcpy(e->lost, lost, sizeof lost);
        pthread_mutex_unlock(&e->lock);
    }
    if (plan)
        fail_entries(e, p->entries, p->n_entries, msg);
    while (e->n_flights > 0) {
        fail_entries(e, flight_at(e, 0)->entries, flight_at(e, 0)->n_entries, msg);
        pop_flight(e);
    }
    if (sticks)
        fail_all(e, lost);
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
        step_failed(e, rc, true);
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
            finish(e, r, CLLM_FINISH_ERROR, "out of memory while sampling");
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
        step_failed(e, rc, false);
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
            finish(e, r, CLLM_FINISH_ERROR, "out of memory while sampling");
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
    grow_steps_back(e);
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
            fail_all(e, e->lost);
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
        finish(e, e->sched.running[0], CLLM_FINISH_CANCELLED, "the server is shutting down");
    while (e->sched.n_waiting > 0)
        finish(e, e->sched.waiting[e->sched.wait_head], CLLM_FINISH_CANCELLED,
               "the server is shutting down");
    publish_stats(e);
    return NULL;
}

/* --- setup --- */

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

/* The backend and the model on it. A GPU's logits are checked against the CPU's first
 * (device_check.h): under CLLM_BACKEND_AUTO a GPU that fails gives way to the CPU (an answer
 * late beats a wrong one); asked for by name, it is an error. */
static enum cllm_status load_model(struct cllm_engine *e, char *err, size_t err_len)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    enum cllm_status st = init_model_on(e, cfg->backend, err, err_len);
    if (st || cfg->no_device_check || !on_gpu(e))
        return st;
    const char *name = e->be->iface->name;
    struct cllm_agreement r;
    char why[512] = "";
    st = cllm_device_check(e->model, name, cfg->max_seqs, e->mf, cfg->n_threads, &r, why,
                           sizeof why);
    if (st == CLLM_OK)
        return CLLM_OK;
    if (st != CLLM_ERR_DEVICE) {
        cllm_log(CLLM_LOG_WARN, "device check could not run (%s): serving from %s unchecked", why,
                 name);
        return CLLM_OK;
    }
    if (cfg->backend != CLLM_BACKEND_AUTO)
        return cllm_fail(err, err_len, st, "%s (--no-device-check serves from it anyway)", why);
    cllm_log(CLLM_LOG_ERROR, "%s: running on the CPU instead", why);
    snprintf(e->fallback, sizeof e->fallback, "%s", why); /* (before the thread starts) */
    cllm_model_free(e->model);
    cllm_backend_free(e->be);
    e->model = NULL;
    e->be = NULL;
    return init_model_on(e, CLLM_BACKEND_CPU, err, err_len);
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
    if ((st = load_model(e, err, err_len)))
        goto fail;
    int64_t per_token = (int64_t)cllm_model_kv_bytes_per_token(e->model);
    e->n_ctx = cfg->n_ctx ? cfg->n_ctx : mf->hp.n_ctx_train;
    if (e->n_ctx > mf->hp.n_ctx_train)
        e->n_ctx = mf->hp.n_ctx_train;
    int64_t kv_bytes = cfg->kv_bytes;
    if (!kv_bytes && (st = device_kv_bytes(e, &kv_bytes, err, err_len)))
        goto fail;
    int64_t n_blocks = cache_blocks(e, kv_bytes);
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
    set_step_modes(e);
    if (cfg->max_seqs > 1 && !lends_threads(e->be)) {
        /* a GPU lends no host threads; without its own the engine draws alone (slower) */
        int32_t n = cfg->n_threads > 0 ? cfg->n_threads : cllm_cpu_physical_cores();
        if (n > 1 && cllm_threadpool_new(&e->draw_pool, n) != CLLM_OK)
            cllm_log(CLLM_LOG_WARN, "engine: no threads for host draws; the engine draws alone");
    }
    e->backend_name = e->be->iface->name;
    e->stall_s = stall_limit(e);
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

/* Under lock: the seconds the current turn has run if that is past the stall timeout, else 0. */
static double stalled_for(const struct cllm_engine *e, double now)
{
    const double busy = e->turn_started > 0 ? now - e->turn_started : 0;
    return e->stall_s > 0 && busy > e->stall_s ? busy : 0;
}

/* Under lock: why the engine counts as stalled, for logs and clients. */
static void describe_stall(const struct cllm_engine *e, double busy, char *why, size_t why_len)
{
    snprintf(why, why_len,
             "the engine has waited %.1f s for one step on the %s device (stall timeout %g s): "
             "the device does not answer",
             busy, e->backend_name, e->stall_s);
}

enum cllm_status cllm_engine_submit(struct cllm_engine *e, const int32_t *prompt, int32_t n_prompt,
                                    const struct cllm_request_params *p, struct cllm_request **out,
                                    char *err, size_t err_len)
{
    *out = NULL;
    char lost[256];
    pthread_mutex_lock(&e->lock);
    bool full = e->stats.waiting + e->n_incoming >= e->cfg.max_queue;
    uint64_t id = ++e->next_id;
    _Static_assert(sizeof lost >= sizeof e->lost, "room for the loss");
    memcpy(lost, e->lost, sizeof e->lost);
    const double stalled = lost[0] ? 0 : stalled_for(e, cllm_now());
    if (stalled > 0) /* a request queued now would wait as long as the device does */
        describe_stall(e, stalled, lost, sizeof lost);
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

bool cllm_engine_stalled(struct cllm_engine *e, char *why, size_t why_len)
{
    pthread_mutex_lock(&e->lock);
    const double busy = stalled_for(e, cllm_now());
    if (busy > 0 && why_len)
        describe_stall(e, busy, why, why_len);
    pthread_mutex_unlock(&e->lock);
    return busy > 0;
}

/* Whether the reason `field` (one of e's strings under lock) is set; why gets a copy. */
static bool read_reason(struct cllm_engine *e, const char *field, char *why, size_t why_len)
{
    pthread_mutex_lock(&e->lock);
    const bool set = field[0] != 0;
    if (set && why_len)
        snprintf(why, why_len, "%s", field);
    pthread_mutex_unlock(&e->lock);
    return set;
}

bool cllm_engine_fallback(struct cllm_engine *e, char *why, size_t why_len)
{
    return read_reason(e, e->fallback, why, why_len);
}

bool cllm_engine_degraded(struct cllm_engine *e, char *why, size_t why_len)
{
    pthread_mutex_lock(&e->lock);
    const int32_t tokens = e->stats.step_tokens, seqs = e->stats.step_seqs;
    const int64_t unrecorded = e->stats.unrecorded_steps;
    pthread_mutex_unlock(&e->lock);
    const bool smaller = tokens < e->cfg.max_batch_tokens || seqs < e->cfg.max_seqs;
    if (!smaller && unrecorded <= 0)
        return false;
    if (why_len) {
        int n = 0;
        if (smaller)
            n = snprintf(why, why_len,
                         "the device ran short of memory: a step's limits are %d tokens, %d "
                         "sequences (configured: %d, %d) until they grow back",
                         (int)tokens, (int)seqs, (int)e->cfg.max_batch_tokens,
                         (int)e->cfg.max_seqs);
        if (unrecorded > 0 && n >= 0 && (size_t)n < why_len)
            snprintf(why + n, why_len - (size_t)n,
                     "%sno room on the device to record a step's graph: the next %lld steps run "
                     "op by op",
                     n ? "; " : "", (long long)unrecorded);
    }
    return true;
}

bool cllm_engine_lost(struct cllm_engine *e, char *why, size_t why_len)
{
    return read_reason(e, e->lost, why, why_len);
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
    const double now = cllm_now();
    s->turn_seconds = e->turn_started > 0 ? now - e->turn_started : 0;
    s->stalled = stalled_for(e, now) > 0;
    pthread_mutex_unlock(&e->lock);
}

int32_t cllm_engine_n_ctx(const struct cllm_engine *e)
{
    return e->n_ctx;
}

int32_t cllm_engine_max_seqs(const struct cllm_engine *e)
{
    return e->cfg.max_seqs;
}

const char *cllm_engine_backend_name(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    const char *name = e->backend_name;
    pthread_mutex_unlock(&e->lock);
    return name;
}
