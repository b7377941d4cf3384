#include "core/backoff.h"

/* The longest wait, in multiples of the first: bounds how long a failure that has passed
 * goes on costing (at the engine's default of 256 steps, 4,096 steps: seconds on a GPU). */
#define BACKOFF_MAX_FACTOR 16

void cllm_backoff_init(struct cllm_backoff *b, int64_t first)
{
    b->first = first < 1                                ? 1
               : first > INT64_MAX / BACKOFF_MAX_FACTOR ? INT64_MAX / BACKOFF_MAX_FACTOR
                                                        : first;
    b->wait = b->first;
    b->tried = false;
}

int64_t cllm_backoff_failed(struct cllm_backoff *b)
{
    /* Only a try's failure doubles: failing again before any try (the engine halving its
     * steps twice in a row) says nothing about how long the shortage lasts. */
    if (b->tried && b->wait < BACKOFF_MAX_FACTOR * b->first)
        b->wait = b->wait * 2 < BACKOFF_MAX_FACTOR * b->first ? b->wait * 2
                                                              : BACKOFF_MAX_FACTOR * b->first;
    b->tried = false;
    return b->wait;
}

void cllm_backoff_tried(struct cllm_backoff *b)
{
    b->tried = true;
}
