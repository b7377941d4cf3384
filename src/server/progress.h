/*
 * A job's progress as bytes: what each of its prompts has generated so far, so that a serving
 * process taking over a request a dead one owed (custody.h) goes on from there instead of
 * starting again from the prompt. The bytes travel serving process -> keeper -> next serving
 * process on one machine, between copies of one binary, so they are in host byte order; they
 * are still checked whole before use, as anything read from a socket must be.
 *
 * Layout: "CLPR", u32 n, then n entries of
 *   u8 finished (0 or 1), u8 reason (enum cllm_finish_reason: STOP, LENGTH or TIME when
 *   finished, NONE otherwise), u16 0, i32 n_generated, u32 len, len bytes of text.
 */
#ifndef CLLM_SERVER_PROGRESS_H
#define CLLM_SERVER_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/buf.h"
#include "core/status.h"
#include "engine/request.h"

/* Progress larger than this is not reported (a replay then starts from the prompts). */
#define CLLM_PROGRESS_MAX_LEN ((size_t)64 << 20)
/* The most tokens an entry may count (max_tokens' own bound). */
#define CLLM_PROGRESS_MAX_TOKENS (1 << 24)

/* One prompt's progress, as decoded. */
struct cllm_progress_entry {
    bool finished;                  /* the answer is complete: text is all of it */
    enum cllm_finish_reason reason; /* when finished: STOP, LENGTH or TIME */
    int32_t n_generated;            /* tokens generated so far (text may lack the newest few's:
                                       held back for stop strings or a split character) */
    const char *text;               /* into the decoded bytes; not NUL-terminated */
    size_t len;
};

/* Appends the progress of outs[0..n) (each the answers so far, as cllm_request_poll gives
 * them) to out. An answer that ended in failure (ERROR, CANCELLED) counts as unfinished: a
 * replay makes it again. CLLM_ERR_RANGE past CLLM_PROGRESS_MAX_LEN. */
enum cllm_status cllm_progress_encode(struct cllm_buf *out, const struct cllm_request_output *outs,
                                      int32_t n);

/* Decodes bytes[0..len) into entries[0..n) for a job of n prompts. CLLM_ERR_FORMAT unless the
 * bytes are exactly n well-formed entries (the wrong count, a length past the end, bytes left
 * over, an unknown reason, a count out of [0, CLLM_PROGRESS_MAX_TOKENS], text without a
 * token). */
enum cllm_status cllm_progress_decode(const void *bytes, size_t len, int32_t n,
                                      struct cllm_progress_entry *entries);

#endif
