/*
 * Stop strings over streamed text. A matcher fed the output chunk by chunk says which bytes are
 * safe to emit and where the first stop string ends the output: text before it is emitted, the
 * stop string and everything after are not. Bytes that may still begin a stop string are held
 * back until decided, as is an incomplete UTF-8 sequence at the end of a chunk, so emitted text
 * never splits a character. Only that undecided tail is kept, never the whole output.
 */
#ifndef CLLM_SAMPLING_STOP_H
#define CLLM_SAMPLING_STOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"

struct cllm_stop;

/* What one push or flush releases. */
struct cllm_stop_out {
    const char *text; /* bytes safe to emit now; valid until the next call on the matcher */
    size_t len;       /* number of those bytes (may be 0) */
    bool stopped;     /* a stop string was found: text ends right before it; later pushes
                         release nothing */
    int32_t which;    /* index (in the list given to new) of the stop string found, else -1 */
};

/*
 * A matcher for n stop strings: stops[i] has lens[i] bytes, or strlen(stops[i]) when lens is
 * NULL. The strings are copied. Empty strings are ignored (they would match everywhere); with
 * none left, text passes straight through. When several stop strings occur, the one that ends
 * first in the stream wins; among those ending at the same byte, the longest (the earliest
 * start), then the lowest index. So the result never depends on how the text was chunked.
 */
enum cllm_status cllm_stop_new(struct cllm_stop **out, const char *const *stops, const size_t *lens,
                               size_t n);
void cllm_stop_free(struct cllm_stop *m);

/* Feeds chunk[0..n) and fills *out with the bytes now safe to emit. CLLM_ERR_NOMEM if the
 * tail buffer could not grow (the chunk is then not consumed). */
enum cllm_status cllm_stop_push(struct cllm_stop *m, const char *chunk, size_t n,
                                struct cllm_stop_out *out);

/* At the end of the stream: releases everything held back (nothing after a stop). The matcher
 * then starts afresh, as if for a new stream. */
void cllm_stop_flush(struct cllm_stop *m, struct cllm_stop_out *out);

#endif
