/*
 * When to try again after a failure that may pass: a device short of memory because another
 * process holds it, say. The first failure waits `first` turns (steps); each failure of a
 * try made after such a wait doubles the wait, up to 16 times `first`, so a failure that
 * stays costs a try at most that rarely while one that passes is tried again soon. The
 * engine (smaller steps growing back) and the model (graph recordings paused) share it.
 */
#ifndef CLLM_CORE_BACKOFF_H
#define CLLM_CORE_BACKOFF_H

#include <stdbool.h>
#include <stdint.h>

struct cllm_backoff {
    int64_t first; /* the wait after a first failure (>= 1) */
    int64_t wait;  /* the wait after the next failure */
    bool tried;    /* a try was made since the last failure: the next failure is its */
};

/* first < 1 counts as 1 (and one past INT64_MAX / 16 as that). */
void cllm_backoff_init(struct cllm_backoff *b, int64_t first);
/* A failure: returns how many turns to wait before trying again. */
int64_t cllm_backoff_failed(struct cllm_backoff *b);
/* The wait after a failure is over and it is tried again. */
void cllm_backoff_tried(struct cllm_backoff *b);

#endif
