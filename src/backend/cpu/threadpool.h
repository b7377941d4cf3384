/*
 * A persistent pool of worker threads for the CPU backend. cllm_threadpool_run calls
 * fn(ctx, ith, nth) on every thread (the caller is thread 0) and returns when all are done.
 * Workers spin briefly before sleeping: a decode step dispatches hundreds of small ops, and a
 * condition-variable wake-up per op would cost more than the ops themselves.
 */
#ifndef CLLM_BACKEND_CPU_THREADPOOL_H
#define CLLM_BACKEND_CPU_THREADPOOL_H

#include <sched.h>
#include <stdint.h>
#include <stdio.h>

#include "cllm.h"

struct cllm_threadpool;

typedef void (*cllm_task_fn)(void *ctx, int ith, int nth);

/* A pool of n_threads threads in all (n_threads - 1 workers plus the caller); n_threads >= 1. */
enum cllm_status cllm_threadpool_new(struct cllm_threadpool **out, int n_threads);
void cllm_threadpool_free(struct cllm_threadpool *tp);
int cllm_threadpool_n_threads(const struct cllm_threadpool *tp);

/* Runs fn on all threads and waits. Not reentrant: one caller thread at a time. tp may be NULL,
 * which runs fn(ctx, 0, 1) on the caller. */
void cllm_threadpool_run(struct cllm_threadpool *tp, cllm_task_fn fn, void *ctx);

/* Rows [*start, *end) of n rows for thread ith of nth, in contiguous near-equal chunks. */
static inline void cllm_split_rows(int64_t n, int ith, int nth, int64_t *start, int64_t *end)
{
    int64_t per = (n + nth - 1) / nth;
    *start = per * ith < n ? per * ith : n;
    *end = *start + per < n ? *start + per : n;
}

/* The default thread count, at least 1: the physical cores this process may run on (its CPU
 * affinity's distinct cores in /proc/cpuinfo), at most the whole cores of its cgroup's CPU
 * quota (a container's --cpus). */
int cllm_cpu_physical_cores(void);

/* Distinct (physical id, core id) pairs in a /proc/cpuinfo text among the processors in allowed
 * (NULL: all); 0 if it lists no core ids. */
int cllm_cpuinfo_cores(FILE *cpuinfo, const cpu_set_t *allowed);

#endif
