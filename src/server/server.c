/*
 * Server lifetime: bind and listen first (so the health check can answer 503 at once), load
 * the model, build the engine and run one tiny generation in a loader thread, then flip to
 * ready. The calling thread waits for SIGINT/SIGTERM and shuts down in order: stop accepting,
 * let the handlers cancel their requests and return, join every thread, free the engine.
 * Also the two routes about the server itself: health and metrics.
 */
#include "server/server.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/status.h"
#include "server/custody.h"
#include "server/keeper.h"
#include "server/http.h"
#include "server/listen.h"
#include "server/probe.h"
#include "server/routes.h"

struct cllm_engine *cllm_server_engine(struct cllm_server *s)
{
    return atomic_load(&s->engine);
}

/* Tells the keeper, if any, where this process serves from (keeper.h, CLLM_KEEPER_READY_*). */
static void tell_keeper(struct cllm_server *s, char what)
{
    if (s->cfg.ready_fd > 0 && write(s->cfg.ready_fd, &what, 1) != 1)
        cllm_log(CLLM_LOG_WARN, "cannot tell the keeper where the server serves from: %s",
                 strerror(errno));
}

struct cllm_engine *cllm_server_fail_over(struct cllm_server *s, struct cllm_engine *from,
                                          const char *why)
{
    pthread_mutex_lock(&s->failover_lock);
    struct cllm_engine *cur = cllm_server_engine(s);
    if (cur == from && !s->fail_over_tried && s->cfg.engine.backend == CLLM_BACKEND_AUTO &&
        strcmp(cllm_engine_backend_name(from), "cpu") != 0 && !atomic_load(&s->stopping)) {
        s->fail_over_tried = true; /* a CPU engine that cannot start is not retried every poll */
        cllm_log(CLLM_LOG_ERROR, "%s: starting an engine on the CPU", why);
        struct cllm_engine_config c = s->cfg.engine;
        c.backend = CLLM_BACKEND_CPU;
        c.stall_timeout = -1; /* nowhere else to go: a slow CPU step is no stall */
        struct cllm_engine *next = NULL;
        char err[512] = "";
        const double t0 = cllm_now();
        if (cllm_engine_new(&next, s->mf, &c, err, sizeof err) == CLLM_OK) {
            s->abandoned = from;
            snprintf(s->fallback, sizeof s->fallback, "%s", why);
            atomic_store(&s->engine, next);
            cur = next;
            tell_keeper(s, CLLM_KEEPER_MOVED_TO_CPU); /* (a crash from now on is the CPU's) */
            cllm_log(CLLM_LOG_ERROR,
                     "serving from the CPU from now on (started in %.1f s): the requests in "
                     "flight go on there from the text they have",
                     cllm_now() - t0);
        } else {
            cllm_log(CLLM_LOG_ERROR, "cannot start an engine on the CPU: %s", err);
        }
    }
    pthread_mutex_unlock(&s->failover_lock);
    return cur != from ? cur : NULL;
}

struct cllm_engine *cllm_server_engine_live(struct cllm_server *s)
{
    struct cllm_engine *e = cllm_server_engine(s);
    char why[256];
    if (cllm_engine_stalled(e, why, sizeof why)) {
        struct cllm_engine *to = cllm_server_fail_over(s, e, why);
        if (to)
            return to;
    }
    return e;
}

bool cllm_server_ready(const struct cllm_server *s)
{
    return atomic_load(&s->state) == CLLM_SERVER_READY && !atomic_load(&s->stopping);
}

/* --- routes about the server itself --- */

enum MHD_Result cllm_route_health(struct cllm_server *s, struct cllm_http_req *hr)
{
    cJSON *o = cJSON_CreateObject();
    int state = atomic_load(&s->state);
    if (state != CLLM_SERVER_READY) {
        cJSON_AddStringToObject(o, "status", state == CLLM_SERVER_FAILED ? "error" : "loading");
        if (state == CLLM_SERVER_FAILED)
            cJSON_AddStringToObject(o, "error", s->load_error);
        return cllm_http_reply_json(hr, 503, o);
    }
    /* A lost device stays lost; a stalled one may answer again (then this says ok again). */
    char why[512];
    struct cllm_engine *e = cllm_server_engine_live(s);
    if (cllm_engine_lost(e, why, sizeof why) || cllm_engine_stalled(e, why, sizeof why)) {
        cJSON_AddStringToObject(o, "status", "error");
        cJSON_AddStringToObject(o, "error", why);
        return cllm_http_reply_json(hr, 503, o);
    }
    cJSON_AddStringToObject(o, "status", "ok");
    cJSON_AddStringToObject(o, "model", s->model_name);
    cJSON_AddStringToObject(o, "backend", cllm_engine_backend_name(e));
    /* why it is not on the GPU, when it should be: for whoever sees only HTTP */
    pthread_mutex_lock(&s->failover_lock);
    snprintf(why, sizeof why, "%s", s->fallback);
    pthread_mutex_unlock(&s->failover_lock);
    if (why[0] || cllm_engine_fallback(e, why, sizeof why))
        cJSON_AddStringToObject(o, "fallback", why);
    /* slower than configured (device memory short, GEMMs on CUDA cores): answers as usual, so
     * still ok */
    if (cllm_engine_degraded(e, why, sizeof why))
        cJSON_AddStringToObject(o, "degraded", why);
    if (s->cfg.restarts > 0)
        cJSON_AddNumberToObject(o, "restarts", s->cfg.restarts);
    cJSON_AddNumberToObject(o, "context", cllm_engine_n_ctx(e));
    cJSON_AddStringToObject(o, "chat_template",
                            s->tmpl ? cllm_chat_template_name(s->tmpl) : "none");
    cJSON_AddNumberToObject(o, "load_seconds", s->load_seconds);
    cJSON_AddStringToObject(o, "version", CLLM_VERSION);
    return cllm_http_reply_json(hr, 200, o);
}

enum MHD_Result cllm_route_metrics(struct cllm_server *s, struct cllm_http_req *hr)
{
    struct cllm_engine_stats es;
    bool ready = atomic_load(&s->state) == CLLM_SERVER_READY;
    if (ready)
        cllm_engine_stats(cllm_server_engine(s), &es);
    struct cllm_buf b = {0};
    if (cllm_metrics_render(&s->metrics, ready ? &es : NULL, &b) != CLLM_OK) {
        cllm_buf_free(&b);
        return cllm_http_reply_error(hr, 500, "out of memory rendering the metrics");
    }
    struct MHD_Response *resp =
        MHD_create_response_from_buffer_with_free_callback(b.len, b.data, free);
    if (!resp) {
        cllm_buf_free(&b);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result ret = cllm_http_reply_response(hr, 200, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* --- loading --- */

static void *load_fail(struct cllm_server *s, const char *what, const char *err)
{
    snprintf(s->load_error, sizeof s->load_error, "%s%s", what, err);
    atomic_store(&s->state, CLLM_SERVER_FAILED);
    return NULL;
}

/* One tiny generation through the whole path (tokenizer, engine, forward, sampler), so the
 * first real request does not pay for page faults and lazy set-up. */
static enum cllm_status warm_up(struct cllm_server *s, char *err, size_t err_len)
{
    struct cllm_job j;
    enum cllm_status st = cllm_job_init(&j, 1);
    if (st)
        return cllm_fail(err, err_len, st, "out of memory");
    struct cllm_request_params p = s->defaults;
    p.max_tokens = 2;
    p.stop = NULL;
    p.n_stop = 0;
    if (!(st = cllm_job_set_text(s, &j, 0, "the warm-up prompt", "Hello", 5, err, err_len)) &&
        !(st = cllm_job_submit(s, &j, &p, 0, err, err_len))) {
        if (cllm_job_wait(s, &j, -1) == CLLM_JOB_DONE && cllm_job_failed(&j) >= 0)
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE, "%s", j.outs[0].error);
    }
    cllm_job_finish(&j, NULL);
    return st;
}

/* Under --device auto, where a GPU may be found: a GPU that crashed, hung or failed its check
 * in a child process (probe.h) is not tried again: the engine starts on the CPU (a slow server
 * beats none). Without a GPU the engine's own --device auto finds none again. */
static void choose_device(struct cllm_server *s)
{
    struct cllm_engine_config *c = &s->cfg.engine;
    if (!s->cfg.probe_exe || c->backend != CLLM_BACKEND_AUTO || !cllm_backend_gpu_possible())
        return;
    char why[512] = "";
    enum cllm_probe_result r =
        cllm_probe_device(s->cfg.probe_exe, s->cfg.model_path, c, s->cfg.probe_timeout_s,
                          &s->stopping, why, sizeof why);
    if (r == CLLM_PROBE_GPU || r == CLLM_PROBE_GPU_ON_CORES) {
        /* the child ran the device check on the same files and device: not twice; the GEMMs
         * run the way that passed it */
        cllm_log(r == CLLM_PROBE_GPU ? CLLM_LOG_INFO : CLLM_LOG_WARN, "probe: %s", why);
        c->no_device_check = true;
        c->gemm_on_cores = r == CLLM_PROBE_GPU_ON_CORES;
        return;
    }
    if (r == CLLM_PROBE_NO_GPU) {
        cllm_log(CLLM_LOG_INFO, "probe: %s", why);
        return;
    }
    cllm_log(CLLM_LOG_ERROR, "probe: %s: running on the CPU", why);
    c->backend = CLLM_BACKEND_CPU;
    pthread_mutex_lock(&s->failover_lock);
    snprintf(s->fallback, sizeof s->fallback, "%s", why);
    pthread_mutex_unlock(&s->failover_lock);
}

static void *loader_main(void *arg)
{
    struct cllm_server *s = arg;
    char err[512] = "";
    double t0 = cllm_now();
    if (cllm_model_files_open(&s->mf, s->cfg.model_path, err, sizeof err) != CLLM_OK)
        return load_fail(s, "", err);
    if (s->mf->chat_template) {
        if (cllm_chat_template_init(&s->tmpl, s->mf->chat_template, err, sizeof err) != CLLM_OK)
            return load_fail(s, "", err);
    } else {
        cllm_log(CLLM_LOG_WARN, "%s has no chat template: /predict sends prompts as they are",
                 s->cfg.model_path);
    }
    if (s->cfg.request_defaults) {
        s->cfg.request_defaults(s->cfg.request_defaults_ctx, s->mf, &s->defaults);
    } else {
        memset(&s->defaults, 0, sizeof s->defaults);
        cllm_sampling_params_default(&s->defaults.sampling);
        s->defaults.max_tokens = 512;
        for (int i = 0; i < s->mf->gen.n_eos && i < CLLM_MAX_STOP_IDS; i++)
            s->defaults.stop_ids[s->defaults.n_stop_ids++] = s->mf->gen.eos_ids[i];
    }
    if (atomic_load(&s->stopping))
        return NULL;
    choose_device(s);
    if (atomic_load(&s->stopping))
        return NULL;
    struct cllm_engine *e = NULL;
    if (cllm_engine_new(&e, s->mf, &s->cfg.engine, err, sizeof err) != CLLM_OK)
        return load_fail(s, "", err);
    atomic_store(&s->engine, e);
    if (warm_up(s, err, sizeof err) != CLLM_OK)
        return load_fail(s, "warm-up failed: ", err);
    s->load_seconds = cllm_now() - t0;
    if (atomic_load(&s->stopping))
        return NULL;
    atomic_store(&s->state, CLLM_SERVER_READY);
    /* the keeper: a death from now on is no failed start */
    tell_keeper(s, strcmp(cllm_engine_backend_name(e), "cpu") ? CLLM_KEEPER_READY_GPU
                                                              : CLLM_KEEPER_READY_CPU);
    cllm_log(CLLM_LOG_INFO, "model %s ready: loaded and warmed up in %.2f s (%.2f s after start)",
             s->model_name, s->load_seconds, cllm_now() - s->t_start);
    return NULL;
}

/* --- start and stop --- */

/* The model's name for clients: the file or folder name, without ".gguf". */
static void set_model_name(struct cllm_server *s)
{
    const char *p = s->cfg.model_path ? s->cfg.model_path : "model";
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && p[b - 1] != '/')
        b--;
    size_t len = n - b;
    if (len > 5 && !strncmp(p + n - 5, ".gguf", 5))
        len -= 5;
    if (len >= sizeof s->model_name)
        len = sizeof s->model_name - 1;
    memcpy(s->model_name, p + b, len);
    s->model_name[len] = 0;
}

/* Seconds a shutdown waits for the loader thread, which looks at `stopping` between its
 * stages: one blocked in a read (a model on a stuck mount, a FIFO) or in a device call (a GPU
 * that hangs as it starts) would otherwise keep the process from ever exiting. */
#define LOADER_STOP_S 10

static bool join_loader(struct cllm_server *s)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += LOADER_STOP_S;
    return pthread_timedjoin_np(s->loader, NULL, &until) == 0;
}

enum cllm_status cllm_server_run(const struct cllm_server_config *c, char *err, size_t err_len)
{
    struct cllm_server *s = calloc(1, sizeof *s);
    if (!s)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    s->cfg = *c;
    if (!s->cfg.host || !s->cfg.host[0])
        s->cfg.host = "0.0.0.0";
    if (!s->cfg.max_body)
        s->cfg.max_body = CLLM_SERVER_DEFAULT_MAX_BODY;
    if (!s->cfg.max_connections)
        s->cfg.max_connections = CLLM_SERVER_DEFAULT_MAX_CONNECTIONS;
    if (!s->cfg.timeout_s)
        s->cfg.timeout_s = CLLM_SERVER_DEFAULT_TIMEOUT_S;
    s->t_start = cllm_now();
    s->t_created = (int64_t)time(NULL);
    s->listen_fd = -1;
    atomic_init(&s->state, CLLM_SERVER_LOADING);
    atomic_init(&s->stopping, false);
    atomic_init(&s->next_id, 1);
    atomic_init(&s->engine, NULL);
    set_model_name(s);
    cllm_metrics_init(&s->metrics);
    s->metrics.restarts = s->cfg.restarts;
    pthread_mutex_init(&s->failover_lock, NULL);
    s->custody_fd = s->cfg.custody_fd > 0 ? s->cfg.custody_fd : -1;
    pthread_mutex_init(&s->custody_lock, NULL);
    atomic_init(&s->custody_broken, false);
    if (s->cfg.fallback)
        snprintf(s->fallback, sizeof s->fallback, "%s", s->cfg.fallback);

    /* Signals are taken synchronously by this thread; every thread started from here on
     * inherits the mask. Writes to a closed socket must fail with EPIPE, not kill us. */
    sigset_t sigs, old_mask;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, &old_mask);
    struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
    sigaction(SIGPIPE, &ign, &old_pipe);

    bool loader_started = false;
    enum cllm_status st = s->cfg.listen_fd != 0 ? cllm_listen_adopt(s->cfg.listen_fd, err, err_len)
                                                : cllm_listen_open(s->cfg.host, s->cfg.port,
                                                                   &s->listen_fd, err, err_len);
    if (st)
        goto out;
    if (s->cfg.listen_fd != 0)
        s->listen_fd = s->cfg.listen_fd;
    /* With --port 0 the kernel picked one; report that. */
    const int port = cllm_listen_port(s->listen_fd);
    if (port >= 0)
        s->cfg.port = port;
    if ((st = cllm_http_start(s, err, err_len))) {
        close(s->listen_fd);
        goto out;
    }
    cllm_log(CLLM_LOG_INFO, "listening on http://%s:%d (model %s loading)", s->cfg.host,
             s->cfg.port, s->cfg.model_path);
    if (cllm_custody_start(s) != CLLM_OK)
        cllm_log(CLLM_LOG_WARN, "custody: cannot start the thread that takes replayed requests");
    if (pthread_create(&s->loader, NULL, loader_main, s) != 0) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot start the loader thread");
        goto stop;
    }
    loader_started = true;
    for (;;) {
        struct timespec tick = {0, 200 * 1000 * 1000};
        int sig = sigtimedwait(&sigs, NULL, &tick);
        if (sig == SIGINT || sig == SIGTERM) {
            cllm_log(CLLM_LOG_INFO, "%s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
            break;
        }
        if (atomic_load(&s->state) == CLLM_SERVER_FAILED) {
            st = cllm_fail(err, err_len, CLLM_ERR_IO, "%s", s->load_error);
            break;
        }
    }
stop:
    atomic_store(&s->stopping, true);
    cllm_http_quiesce(s);
    cllm_custody_stop(s);
    cllm_http_stop(s); /* handlers see `stopping`, cancel their requests and return */
    if (loader_started && !join_loader(s)) {
        /* It may be using anything here: the process's exit ends it, nothing is freed. */
        cllm_log(CLLM_LOG_WARN,
                 "the model's loading did not stop within %d s (stuck in a read or a device "
                 "call?): exiting without it",
                 LOADER_STOP_S);
        sigaction(SIGPIPE, &old_pipe, NULL);
        pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
        return st;
    }
    cllm_engine_free(cllm_server_engine(s));
    /* A replaced engine whose device answers again stops like any; one still stuck in the
     * device would never be joined: it is left to the process's exit, with the model files
     * it may still read. */
    const bool left_behind = s->abandoned && cllm_engine_stalled(s->abandoned, NULL, 0);
    if (left_behind) {
        cllm_log(CLLM_LOG_WARN, "the stalled GPU engine is left behind: its thread is stuck");
    } else {
        cllm_engine_free(s->abandoned);
        cllm_model_files_free(s->mf);
    }
    cllm_chat_template_free(s->tmpl);
out:
    if (s->custody_fd >= 0)
        close(s->custody_fd);
    if (s->cfg.ready_fd > 0)
        close(s->cfg.ready_fd);
    cllm_metrics_free(&s->metrics);
    pthread_mutex_destroy(&s->failover_lock);
    pthread_mutex_destroy(&s->custody_lock);
    sigaction(SIGPIPE, &old_pipe, NULL);
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    free(s);
    return st;
}
