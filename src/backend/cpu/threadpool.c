/*
 * Dispatch is a generation counter: run() publishes (fn, ctx), bumps `generation`, does its own
 * share, then waits for `pending` to reach zero. Workers spin on `generation` for a while, then
 * sleep on a condition variable until it changes.
 */
#include "backend/cpu/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/limits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_ITERS 20000 /* ~0.1-1 ms of spinning before a worker sleeps */

struct worker {
    struct cllm_threadpool *tp;
    pthread_t thread;
    int ith;
};

struct cllm_threadpool {
    int n_threads;
    struct worker *workers; /* [n_threads - 1] */
    cllm_task_fn fn;
    void *ctx;
    atomic_uint generation;   /* bumped once per run */
    atomic_int pending;       /* workers still running the current task */
    atomic_bool stop;
    atomic_int sleepers;      /* workers waiting on `wake` */
    pthread_mutex_t lock;
    pthread_cond_t wake;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct cllm_threadpool *tp = w->tp;
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&tp->generation, memory_order_acquire)) == seen &&
               !atomic_load(&tp->stop)) {
            if (++spins < SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&tp->lock);
            atomic_fetch_add(&tp->sleepers, 1);
            while (atomic_load(&tp->generation) == seen && !atomic_load(&tp->stop))
                pthread_cond_wait(&tp->wake, &tp->lock);
            atomic_fetch_sub(&tp->sleepers, 1);
            pthread_mutex_unlock(&tp->lock);
        }
        if (atomic_load(&tp->stop))
            return NULL;
        seen = gen;
        tp->fn(tp->ctx, w->ith, tp->n_threads);
        atomic_fetch_sub_explicit(&tp->pending, 1, memory_order_release);
    }
}

enum cllm_status cllm_threadpool_new(struct cllm_threadpool **out, int n_threads)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return CLLM_ERR_INVALID_ARG;
    struct cllm_threadpool *tp = calloc(1, sizeof *tp);
    if (!tp)
        return CLLM_ERR_NOMEM;
    tp->n_threads = n_threads;
    pthread_mutex_init(&tp->lock, NULL);
    pthread_cond_init(&tp->wake, NULL);
    tp->workers = calloc((size_t)n_threads, sizeof *tp->workers);
    if (!tp->workers) {
        free(tp);
        return CLLM_ERR_NOMEM;
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker *w = &tp->workers[i - 1];
        w->tp = tp;
        w->ith = i;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            tp->n_threads = i; /* free() joins the ones that started */
            cllm_threadpool_free(tp);
            return CLLM_ERR_NOMEM;
        }
    }
    *out = tp;
    return CLLM_OK;
}

void cllm_threadpool_free(struct cllm_threadpool *tp)
{
    if (!tp)
        return;
    pthread_mutex_lock(&tp->lock);
    atomic_store(&tp->stop, true);
    pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->lock);
    for (int i = 1; i < tp->n_threads; i++)
        pthread_join(tp->workers[i - 1].thread, NULL);
    pthread_cond_destroy(&tp->wake);
    pthread_mutex_destroy(&tp->lock);
    free(tp->workers);
    free(tp);
}

int cllm_threadpool_n_threads(const struct cllm_threadpool *tp)
{
    return tp ? tp->n_threads : 1;
}

void cllm_threadpool_run(struct cllm_threadpool *tp, cllm_task_fn fn, void *ctx)
{
    if (!tp || tp->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    tp->fn = fn;
    tp->ctx = ctx;
    atomic_store_explicit(&tp->pending, tp->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&tp->generation, 1); /* seq_cst: pairs with the sleepers check (Dekker) */
    if (atomic_load(&tp->sleepers) > 0) {
        pthread_mutex_lock(&tp->lock);
        pthread_cond_broadcast(&tp->wake);
        pthread_mutex_unlock(&tp->lock);
    }
    fn(ctx, 0, tp->n_threads);
    while (atomic_load_explicit(&tp->pending, memory_order_acquire) > 0)
        cpu_relax();
}

int cllm_cpuinfo_cores(FILE *cpuinfo, const cpu_set_t *allowed)
{
    /* Count distinct (physical id, core id) pairs of the allowed processors. */
    char line[256];
    int processor = -1, phys = 0, seen[4096][2], n_seen = 0;
    while (fgets(line, sizeof line, cpuinfo)) {
        int v;
        if (sscanf(line, "processor : %d", &v) == 1) {
            processor = v;
            phys = 0;
        } else if (sscanf(line, "physical id : %d", &v) == 1) {
            phys = v;
        } else if (sscanf(line, "core id : %d", &v) == 1) {
            if (allowed && (processor < 0 || processor >= CPU_SETSIZE ||
                            !CPU_ISSET((size_t)processor, allowed)))
                continue;
            bool dup = false;
            for (int i = 0; i < n_seen; i++)
                dup |= seen[i][0] == phys && seen[i][1] == v;
            if (!dup && n_seen < 4096) {
                seen[n_seen][0] = phys;
                seen[n_seen][1] = v;
                n_seen++;
            }
        }
    }
    return n_seen;
}

int cllm_cpu_physical_cores(void)
{
    cpu_set_t allowed;
    const bool have_mask = sched_getaffinity(0, sizeof allowed, &allowed) == 0;
    int cores = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        cores = cllm_cpuinfo_cores(f, have_mask ? &allowed : NULL);
        fclose(f);
    }
    /* No core ids listed (some VMs and architectures): one core per usable CPU. */
    if (cores <= 0)
        cores = have_mask ? CPU_COUNT(&allowed) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    /* A container's CPU quota (docker --cpus): more threads than it allows would be throttled
     * in turns, and an op waits for its slowest thread. */
    const int quota = cllm_cpu_quota_cores();
    if (quota > 0 && quota < cores)
        cores = quota;
    return cores > 0 ? cores : 1;
}
