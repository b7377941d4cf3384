/*
 * The server's Prometheus metrics: request counters by route and status and latency
 * histograms, kept under one mutex because every connection thread updates them. The engine's
 * own numbers (token counters, running, waiting, KV usage, prefix cache, preemptions) are read
 * from cllm_engine_stats when /metrics is scraped, so they move while a generation runs.
 */
#ifndef CLLM_SERVER_METRICS_H
#define CLLM_SERVER_METRICS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/buf.h"
#include "engine/engine.h"

#define CLLM_METRICS_MAX_BUCKETS 16
#define CLLM_METRICS_MAX_SERIES 128

/* A cumulative histogram as Prometheus defines it: counts[i] holds observations <= bounds[i];
 * the +Inf bucket is `count`. */
struct cllm_histogram {
    const double *bounds; /* ascending upper bounds, borrowed (static tables) */
    int n_bounds;
    uint64_t counts[CLLM_METRICS_MAX_BUCKETS];
    uint64_t count;
    double sum;
};

struct cllm_metrics {
    pthread_mutex_t lock;
    struct {
        const char *route; /* a static route name */
        unsigned status;
        uint64_t n;
    } requests[CLLM_METRICS_MAX_SERIES];
    int n_requests;
    struct cllm_histogram ttft;     /* seconds from submit to the first token */
    struct cllm_histogram itl;      /* mean seconds between tokens of one engine request */
    struct cllm_histogram duration; /* seconds from the first byte of a request to its end */
    int restarts; /* serving processes that died before this one (keeper.h); set at start */
    atomic_uint_fast64_t replayed; /* requests a dead process owed, taken by this one */
    atomic_uint_fast64_t replayed_tokens; /* tokens of theirs it went on from (custody.h) */
};

void cllm_metrics_init(struct cllm_metrics *m);
void cllm_metrics_free(struct cllm_metrics *m);

/* One HTTP request finished with status after `seconds`. route must be a static string. */
void cllm_metrics_count_request(struct cllm_metrics *m, const char *route, unsigned status,
                                double seconds);
/* One engine request ended: its time to first token and mean inter-token latency in seconds
 * (< 0 when unknown, e.g. nothing was generated). */
void cllm_metrics_observe_generation(struct cllm_metrics *m, double ttft, double itl);

/* Appends the Prometheus text exposition (format 0.0.4) to out. es may be NULL while the model
 * is loading; the engine gauges then read 0. */
enum cllm_status cllm_metrics_render(struct cllm_metrics *m, const struct cllm_engine_stats *es,
                                     struct cllm_buf *out);

#endif
