/*
 * A generation request as the engine tracks it. The submitter and the engine thread share it
 * (refcounted); fields are grouped by who writes them:
 *   - set at submit, then read-only: prompt, params, limits;
 *   - engine thread only: token list, scheduling state, block table, sampler, detokenizer;
 *   - under `lock`: the output handed to the submitter (text delta, counts, finish state) and
 *     the cancel flag.
 */
#ifndef CLLM_ENGINE_REQUEST_H
#define CLLM_ENGINE_REQUEST_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/buf.h"
#include "sampling/sampling.h"
#include "sampling/stop.h"
#include "tokenizer/tokenizer.h"

#define CLLM_MAX_STOP_IDS 8

enum cllm_finish_reason {
    CLLM_FINISH_NONE = 0,  /* still running */
    CLLM_FINISH_STOP,      /* an EOS token or a stop string */
    CLLM_FINISH_LENGTH,    /* max_tokens or the context window */
    CLLM_FINISH_CANCELLED, /* cancelled by the submitter (e.g. client gone) */
    CLLM_FINISH_ERROR,     /* the engine failed this request (message in error) */
    CLLM_FINISH_TIME,      /* max_time passed: the text so far (an API says "length") */
};

const char *cllm_finish_reason_str(enum cllm_finish_reason r);

/* What a submitter asks for. */
struct cllm_request_params {
    struct cllm_sampling_params sampling;
    int32_t max_tokens;                    /* >= 1: tokens to generate at most */
    int32_t stop_ids[CLLM_MAX_STOP_IDS];   /* generation ends at any of these tokens */
    int32_t n_stop_ids;
    const char *const *stop;               /* stop strings (copied at submit) */
    size_t n_stop;
    double max_time; /* > 0: seconds after submit at which the request ends with the text so
                        far, waiting or running (within a step); 0: no limit */
    int32_t n_carried; /* the prompt's last n_carried tokens were generated on an engine the
                          request left (a stalled GPU's): the presence and frequency penalties
                          count them as generated; 0: none */
};

enum cllm_request_state {
    CLLM_REQ_WAITING, /* queued or preempted: no KV blocks */
    CLLM_REQ_RUNNING, /* holds blocks; scheduled every step */
    CLLM_REQ_DONE,    /* finished; blocks released */
};

/* The submitter's view of progress, copied out by cllm_request_poll. */
struct cllm_request_output {
    struct cllm_buf text;      /* new text since the last poll (UTF-8, never a split character) */
    int32_t n_prompt;          /* prompt tokens */
    int32_t n_generated;       /* tokens generated so far */
    int32_t n_cached;          /* prompt tokens served from the prefix cache */
    bool finished;
    enum cllm_finish_reason reason;
    char error[160];           /* for CLLM_FINISH_ERROR */
    double t_submit, t_first_token, t_finish; /* monotonic seconds; 0 if not yet */
};

struct cllm_request {
    atomic_int refs;
    uint64_t id;
    struct cllm_request *next; /* intrusive link for the engine's queues */

    /* set at submit */
    struct cllm_request_params params;
    int32_t n_prompt;
    int32_t max_total;          /* n_prompt + max_tokens, capped by the context window */
    double deadline;            /* cllm_now() at which max_time is over; 0: none */

    /* engine thread */
    int32_t *tokens;            /* prompt then generated tokens */
    int32_t n_tokens, cap_tokens;
    int32_t n_unseen;           /* the last n_unseen tokens are drawn by launched steps and not
                                   known on the host yet (placeholders; engine.c, "Run-ahead") */
    int32_t unseen_output;      /* the newest launched step's output that draws the last one */
    int32_t n_computed;         /* tokens whose K/V are in the cache */
    int32_t *blocks;            /* block table */
    int32_t n_blocks, cap_blocks;
    uint64_t *block_hashes;     /* hash of each full block (prefix cache), 0 if not computed */
    int32_t n_hashed;           /* leading blocks whose hash is known and published */
    int32_t n_cached;           /* prompt tokens found in the prefix cache at first admission */
    enum cllm_request_state state;
    bool ended;                 /* finished for the submitter; may still be in the scheduler
                                   until the next step (engine.c, "Overlap") */
    struct cllm_sampler *sampler;
    struct cllm_detok_stream detok;
    struct cllm_stop *stop;
    struct cllm_buf pending;    /* decoded text not yet passed through stop matching */

    /* shared, under lock */
    pthread_mutex_t lock;
    pthread_cond_t changed;
    bool cancel;
    struct cllm_request_output out;
    double *token_times; /* when each generated token was delivered (for latency stats) */
    int32_t n_token_times, cap_token_times;
};

/* A request for prompt[0..n_prompt); copies what it keeps. */
enum cllm_status cllm_request_new(struct cllm_request **out, uint64_t id, const int32_t *prompt,
                                  int32_t n_prompt, const struct cllm_request_params *p,
                                  const struct cllm_tokenizer *tok, int32_t n_vocab,
                                  int32_t n_ctx, char *err, size_t err_len);
void cllm_request_retain(struct cllm_request *r);
/* Drops a reference; the last one frees the request. */
void cllm_request_release(struct cllm_request *r);

/* Appends a token (engine thread). */
enum cllm_status cllm_request_append(struct cllm_request *r, int32_t token);
/* Tokens the host knows: all but the trailing placeholders of launched steps (engine thread). */
static inline int32_t cllm_request_n_known(const struct cllm_request *r)
{
    return r->n_tokens - r->n_unseen;
}
/* Generated tokens the host knows (engine thread). */
int32_t cllm_request_n_generated(const struct cllm_request *r);

/* Asks the engine to stop the request; it finishes with CLLM_FINISH_CANCELLED within a step. */
void cllm_request_cancel(struct cllm_request *r);
bool cllm_request_cancelled(struct cllm_request *r);

/* Waits up to timeout_ms (0: no wait, < 0: forever) for news, then moves the text produced
 * since the last poll into out->text (appended) and copies the counters. Returns true when
 * the request has finished (everything has been delivered). */
bool cllm_request_poll(struct cllm_request *r, int timeout_ms, struct cllm_request_output *out);

/* Engine side: publish text and counters, or the end. */
void cllm_request_emit(struct cllm_request *r, const char *text, size_t len, int32_t n_cached);
void cllm_request_finish(struct cllm_request *r, enum cllm_finish_reason reason, const char *error);

/* Copies up to max delivery times of generated tokens into times; returns how many there are. */
int32_t cllm_request_token_times(struct cllm_request *r, double *times, int32_t max);

double cllm_now(void);

#endif
