/*
 * The engine's calls for other threads (HTTP handlers, /health, /metrics): submitting a
 * request, and reading the engine's state -- stalls, losses, fallbacks, a degraded device,
 * the counters -- under its lock.
 */
#include "engine/engine_internal.h"

#include <stdio.h>
#include <string.h>

#include "core/status.h"

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
    /* (the GPU's GEMMs on CUDA cores: only while the engine is on that GPU) */
    const bool on_cores = e->cfg.gemm_on_cores && strcmp(e->backend_name, "cpu") != 0;
    pthread_mutex_unlock(&e->lock);
    const bool smaller = tokens < e->cfg.max_batch_tokens || seqs < e->cfg.max_seqs;
    if (!smaller && unrecorded <= 0 && !on_cores)
        return false;
    if (why_len) {
        int n = 0;
        why[0] = 0;
        if (on_cores)
            n = snprintf(why, why_len,
                         "the GPU passed its device check only with every GEMM on CUDA cores, "
                         "which run them so (prefill is slower)");
        if (smaller && n >= 0 && (size_t)n < why_len)
            n += snprintf(why + n, why_len - (size_t)n,
                          "%sthe device ran short of memory: a step's limits are %d tokens, %d "
                          "sequences (configured: %d, %d) until they grow back",
                          n ? "; " : "", (int)tokens, (int)seqs, (int)e->cfg.max_batch_tokens,
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

bool cllm_engine_gemm_on_cores(const struct cllm_engine *e)
{
    return e->cfg.gemm_on_cores; /* set before the engine's thread starts, never after */
}

const char *cllm_engine_backend_name(struct cllm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    const char *name = e->backend_name;
    pthread_mutex_unlock(&e->lock);
    return name;
}
