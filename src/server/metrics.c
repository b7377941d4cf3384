/* Prometheus counters and histograms of the server, and their text exposition. */
#include "server/metrics.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static const double ttft_bounds[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
static const double itl_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                    0.1,   0.25,   0.5,   1,    2.5};
static const double duration_bounds[] = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                         10,   30,  60,   120, 300, 600};

static void hist_init(struct cllm_histogram *h, const double *bounds, int n)
{
    memset(h, 0, sizeof *h);
    h->bounds = bounds;
    h->n_bounds = n;
}

static void hist_observe(struct cllm_histogram *h, double v)
{
    for (int i = 0; i < h->n_bounds; i++)
        if (v <= h->bounds[i])
            h->counts[i]++;
    h->count++;
    h->sum += v;
}

void cllm_metrics_init(struct cllm_metrics *m)
{
    memset(m, 0, sizeof *m);
    atomic_init(&m->replayed, 0);
    atomic_init(&m->replayed_tokens, 0);
    pthread_mutex_init(&m->lock, NULL);
#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))
    _Static_assert(N(ttft_bounds) <= CLLM_METRICS_MAX_BUCKETS, "ttft buckets");
    _Static_assert(N(itl_bounds) <= CLLM_METRICS_MAX_BUCKETS, "itl buckets");
    _Static_assert(N(duration_bounds) <= CLLM_METRICS_MAX_BUCKETS, "duration buckets");
    hist_init(&m->ttft, ttft_bounds, N(ttft_bounds));
    hist_init(&m->itl, itl_bounds, N(itl_bounds));
    hist_init(&m->duration, duration_bounds, N(duration_bounds));
#undef N
}

void cllm_metrics_free(struct cllm_metrics *m)
{
    pthread_mutex_destroy(&m->lock);
}

void cllm_metrics_count_request(struct cllm_metrics *m, const char *route, unsigned status,
                                double seconds)
{
    pthread_mutex_lock(&m->lock);
    int i = 0;
    while (i < m->n_requests &&
           (m->requests[i].status != status || strcmp(m->requests[i].route, route) != 0))
        i++;
    if (i == m->n_requests && i < CLLM_METRICS_MAX_SERIES) {
        m->requests[i].route = route;
        m->requests[i].status = status;
        m->requests[i].n = 0;
        m->n_requests++;
    }
    /* Routes x statuses are few and fixed; a full table only loses exotic combinations. */
    if (i < m->n_requests)
        m->requests[i].n++;
    hist_observe(&m->duration, seconds);
    pthread_mutex_unlock(&m->lock);
}

void cllm_metrics_observe_generation(struct cllm_metrics *m, double ttft, double itl)
{
    pthread_mutex_lock(&m->lock);
    if (ttft >= 0)
        hist_observe(&m->ttft, ttft);
    if (itl >= 0)
        hist_observe(&m->itl, itl);
    pthread_mutex_unlock(&m->lock);
}

/* The exposition under construction; one failed append marks it failed. */
struct text {
    struct cllm_buf b;
    bool failed;
};

static void put(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct text *t, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof line || cllm_buf_append(&t->b, line, (size_t)n) != CLLM_OK)
        t->failed = true;
}

static void head(struct text *t, const char *name, const char *type, const char *help)
{
    put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void hist_render(struct text *b, const char *name, const char *help,
                        const struct cllm_histogram *h)
{
    head(b, name, "histogram", help);
    for (int i = 0; i < h->n_bounds; i++)
        put(b, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)h->counts[i]);
    put(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name,
        (unsigned long long)h->count, name, h->sum, name, (unsigned long long)h->count);
}

enum cllm_status cllm_metrics_render(struct cllm_metrics *m, const struct cllm_engine_stats *es,
                                     struct cllm_buf *out)
{
    struct cllm_engine_stats zero = {0};
    if (!es)
        es = &zero;
    struct text t = {0};
    pthread_mutex_lock(&m->lock);
    head(&t, "cllm_requests_total", "counter", "HTTP requests by route and status code.");
    for (int i = 0; i < m->n_requests; i++)
        put(&t, "cllm_requests_total{route=\"%s\",status=\"%u\"} %llu\n", m->requests[i].route,
            m->requests[i].status, (unsigned long long)m->requests[i].n);
    hist_render(&t, "cllm_time_to_first_token_seconds",
                "Seconds from queueing a prompt to its first generated token.", &m->ttft);
    hist_render(&t, "cllm_inter_token_latency_seconds",
                "Mean seconds between generated tokens, one observation per prompt.", &m->itl);
    hist_render(&t, "cllm_request_duration_seconds", "Seconds to answer an HTTP request.",
                &m->duration);
    pthread_mutex_unlock(&m->lock);

    head(&t, "cllm_prompt_tokens_total", "counter",
         "Prompt tokens computed (prefill; prefix-cache hits excluded, recomputation included).");
    put(&t, "cllm_prompt_tokens_total %llu\n", (unsigned long long)es->prompt_tokens);
    head(&t, "cllm_generation_tokens_total", "counter", "Tokens generated.");
    put(&t, "cllm_generation_tokens_total %llu\n", (unsigned long long)es->generated_tokens);
    head(&t, "cllm_requests_running", "gauge", "Sequences holding KV cache blocks.");
    put(&t, "cllm_requests_running %d\n", (int)es->running);
    head(&t, "cllm_requests_waiting", "gauge", "Sequences queued for the engine.");
    put(&t, "cllm_requests_waiting %d\n", (int)es->waiting);
    head(&t, "cllm_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use.");
    put(&t, "cllm_kv_cache_usage_ratio %.6f\n",
        es->kv_blocks_total > 0 ? (double)es->kv_blocks_used / (double)es->kv_blocks_total : 0.0);
    head(&t, "cllm_prefix_cache_queries_total", "counter",
         "KV blocks looked up in the prefix cache.");
    put(&t, "cllm_prefix_cache_queries_total %llu\n", (unsigned long long)es->prefix_queries);
    head(&t, "cllm_prefix_cache_hits_total", "counter", "KV blocks found in the prefix cache.");
    put(&t, "cllm_prefix_cache_hits_total %llu\n", (unsigned long long)es->prefix_hits);
    head(&t, "cllm_preemptions_total", "counter", "Sequences preempted to free KV blocks.");
    put(&t, "cllm_preemptions_total %llu\n", (unsigned long long)es->preemptions);
    head(&t, "cllm_step_tokens_limit", "gauge",
         "Most tokens a step takes now: below --batch-tokens while the device is short of memory.");
    put(&t, "cllm_step_tokens_limit %d\n", (int)es->step_tokens);
    head(&t, "cllm_step_sequences_limit", "gauge",
         "Most sequences a step takes now: below --max-seqs while the device is short of memory.");
    put(&t, "cllm_step_sequences_limit %d\n", (int)es->step_seqs);
    head(&t, "cllm_unrecorded_steps", "gauge",
         "Steps still to run without a recorded graph: recording one found no room on the device.");
    put(&t, "cllm_unrecorded_steps %lld\n", (long long)es->unrecorded_steps);
    head(&t, "cllm_engine_turn_seconds", "gauge",
         "Seconds the engine has been in its current step (0 while it waits for work).");
    put(&t, "cllm_engine_turn_seconds %.3f\n", es->turn_seconds);
    head(&t, "cllm_engine_stalled", "gauge",
         "1 while the current step has run past the stall timeout (the device does not answer).");
    put(&t, "cllm_engine_stalled %d\n", es->stalled ? 1 : 0);
    head(&t, "cllm_server_restarts_total", "counter",
         "Serving processes that died of a signal before this one (restarted by the keeper).");
    put(&t, "cllm_server_restarts_total %d\n", m->restarts);
    head(&t, "cllm_server_replayed_requests_total", "counter",
         "Requests a dead serving process owed that the keeper replayed to this one.");
    put(&t, "cllm_server_replayed_requests_total %llu\n",
        (unsigned long long)atomic_load(&m->replayed));
    head(&t, "cllm_server_replayed_tokens_total", "counter",
         "Tokens a dead serving process had generated that its replays went on from.");
    put(&t, "cllm_server_replayed_tokens_total %llu\n",
        (unsigned long long)atomic_load(&m->replayed_tokens));
    enum cllm_status st = t.failed ? CLLM_ERR_NOMEM : cllm_buf_append(out, t.b.data, t.b.len);
    cllm_buf_free(&t.b);
    return st;
}
