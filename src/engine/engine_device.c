/*
 * The device the engine runs on: loading the backend and model (a GPU's logits checked against
 * the CPU's first), sizing the KV cache, and what the engine does when a step fails there --
 * under --device auto it moves every request to the CPU; out of memory, it goes on in smaller
 * steps that grow back later; else the step's requests end with the error, and a device that
 * no longer answers is recorded as lost.
 */
#include "engine/engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/limits.h"
#include "core/log.h"
#include "core/status.h"
#include "engine/device_check.h"

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
double cllm_engine_stall_limit(const struct cllm_engine *e)
{
    if (e->cfg.stall_timeout != 0)
        return e->cfg.stall_timeout > 0 ? e->cfg.stall_timeout : 0;
    return on_gpu(e) ? GPU_STALL_TIMEOUT_S : 0;
}

static enum cllm_status init_model_on(struct cllm_engine *e, enum cllm_backend_kind kind, char *err,
                                      size_t err_len)
{
    const struct cllm_engine_config *cfg = &e->cfg;
    /* The CPU's weights copied within a quarter of the RAM (beside the KV cache's eighth: the
     * rest stays for the page cache and the host); CLLM_CPU_MAPPED_WEIGHTS=1: none, matrices
     * read from the mapped files, for comparison or to save the memory */
    const char *mapped = getenv("CLLM_CPU_MAPPED_WEIGHTS");
    const uint64_t ram = cllm_memory_limit();
    const uint64_t copy_budget = mapped && mapped[0] == '1' ? 0 : ram ? ram / 4 : UINT64_MAX;
    struct cllm_backend_options bo = {kind,        cfg->n_threads,    cfg->device, cfg->cpu_weights,
                                      copy_budget, cfg->gemm_on_cores};
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
int64_t cllm_engine_cache_blocks(const struct cllm_engine *e, int64_t kv_bytes)
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
void cllm_engine_set_step_modes(struct cllm_engine *e)
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

/* On a device that reports its memory: the KV cache takes what the --gpu-mem-fraction share
 * of the device leaves after the weights, activations and everyone else's use, less a
 * reserve for the BLAS workspace and recorded steps. 0 when the backend reports nothing. */
#define DEVICE_RESERVE_BYTES ((int64_t)512 << 20)
enum cllm_status cllm_engine_device_kv_bytes(struct cllm_engine *e, int64_t *out, char *err,
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

/* The device check (device_check.h) of the engine's model, on the GPU it was made on. */
static enum cllm_status check_device(struct cllm_engine *e, char *why, size_t why_len)
{
    struct cllm_agreement r;
    return cllm_device_check(e->model, e->be->iface->name, e->cfg.max_seqs, e->mf, e->cfg.n_threads,
                             &r, why, why_len);
}

/* Drops the model and its backend (before the engine's thread starts). */
static void drop_model(struct cllm_engine *e)
{
    cllm_model_free(e->model);
    cllm_backend_free(e->be);
    e->model = NULL;
    e->be = NULL;
}

/* The backend and the model on it. A GPU's logits are checked against the CPU's first
 * (device_check.h). Under CLLM_BACKEND_AUTO a GPU that fails is tried once more with every
 * GEMM on CUDA cores: the GEMMs are where a wrong device most likely goes wrong (a vendor BLAS
 * that passed the backend's small start-up probe, as MUSA's muBLAS would have to, never run by
 * this project), and a GPU without its fast GEMM still beats the CPU by far; a GPU that fails
 * that too gives way to the CPU (an answer late beats a wrong one). Asked for by name, a GPU
 * that fails is an error. */
enum cllm_status cllm_engine_load_model(struct cllm_engine *e, char *err, size_t err_len)
{
    struct cllm_engine_config *cfg = &e->cfg;
    enum cllm_status st = init_model_on(e, cfg->backend, err, err_len);
    if (st || cfg->no_device_check || !on_gpu(e))
        return st;
    const char *name = e->be->iface->name;
    char why[512] = "";
    st = check_device(e, why, sizeof why);
    if (st == CLLM_ERR_DEVICE && cfg->backend == CLLM_BACKEND_AUTO && !cfg->gemm_on_cores) {
        cllm_log(CLLM_LOG_ERROR, "%s: trying the GPU again with every GEMM on CUDA cores", why);
        drop_model(e);
        cfg->gemm_on_cores = true;
        st = init_model_on(e, cfg->backend, why, sizeof why);
        if (st == CLLM_OK && !on_gpu(e))
            st = cllm_fail(why, sizeof why, CLLM_ERR_DEVICE, "the GPU did not start again");
        if (st == CLLM_OK) {
            name = e->be->iface->name;
            st = check_device(e, why, sizeof why);
        }
        if (st == CLLM_OK)
            cllm_log(CLLM_LOG_WARN,
                     "device check: %s passes with every GEMM on CUDA cores: "
                     "serving from it so (prefill is slower)",
                     name);
        else if (st != CLLM_ERR_DEVICE) /* the GPU of the first try is not there now */
            st = CLLM_ERR_DEVICE;
    }
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
    drop_model(e);
    cfg->gemm_on_cores = false;
    return init_model_on(e, CLLM_BACKEND_CPU, err, err_len);
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
            cllm_engine_end_request(e, keep[i], CLLM_FINISH_ERROR, why);
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
        n_blocks = cllm_engine_cache_blocks(e, cfg->kv_bytes);
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
    cllm_engine_set_step_modes(e);
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
    /* as large as configured, for the steps to grow back to (cllm_engine_grow_steps_back) */
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
void cllm_engine_grow_steps_back(struct cllm_engine *e)
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

static void fail_entries(struct cllm_engine *e, const struct cllm_sched_entry *en, int32_t n,
                         const char *msg)
{
    for (int32_t j = n - 1; j >= 0; j--)
        if (!en[j].req->ended)
            cllm_engine_finish(e, en[j].req, CLLM_FINISH_ERROR, msg);
}

/* A launch or a wait failed. Under --device auto, after a device error on a GPU, the engine
 * goes on on the CPU with every request (move_to_cpu). Otherwise the requests of every
 * launched step and of the plan (if `plan`) end with the error; and if the device does not
 * answer a sync either, the error sticks (a CUDA illegal address, a lost GPU): nothing can
 * run any more, so every request ends, new ones are refused and the health check reports
 * it, for the server to be restarted. */
void cllm_engine_step_failed(struct cllm_engine *e, enum cllm_status rc, bool plan)
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
        cllm_engine_fail_all(e, lost);
}
