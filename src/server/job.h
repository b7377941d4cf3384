/*
 * A job: the engine requests behind one HTTP request (one per prompt), from the request's
 * sampling fields to the collected answers. Every prompt is tokenized and checked against the
 * context window before anything is submitted, so a bad prompt in a list rejects the whole
 * list; then all prompts are submitted at once so the engine batches them.
 */
#ifndef CLLM_SERVER_JOB_H
#define CLLM_SERVER_JOB_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/buf.h"
#include "engine/request.h"
#include "server/metrics.h"
#include "tokenizer/chat_template.h"

struct cllm_server;

#define CLLM_JOB_MAX_STOPS 16

/* A request's generation settings. p.stop points into stops (and the strings into the parsed
 * JSON document), so the struct must not be copied and the document must outlive submit. */
struct cllm_job_params {
    struct cllm_request_params p;
    const char *stops[CLLM_JOB_MAX_STOPS];
};

struct cllm_job {
    int32_t n;                        /* prompts */
    struct cllm_ids *prompts;         /* [n] token ids */
    struct cllm_request **reqs;       /* [n]; NULL until submitted */
    struct cllm_request_output *outs; /* [n] answers as collected so far */
    struct cllm_engine *engine;       /* the engine reqs run on (set at submit) */
    const struct cllm_request_params *params; /* as submitted; must outlive the wait */
    int32_t *carried; /* [n] tokens each request generated before it went on from its text
                         so far: on a stalled engine before the CPU, or in a dead serving
                         process (cllm_job_go_on) (NULL: none did); outs count them in */
    /* Called by cllm_job_wait about once a CLLM_JOB_REPORT_S while the answers grow (NULL:
     * never): custody.h's progress, for a serving process that may have to go on from it. */
    void (*report)(void *ctx, const struct cllm_job *j);
    void *report_ctx;
    double next_report;               /* monotonic seconds */
    int64_t reported;                 /* what the last report showed (see job.c, progress_mark) */
    int64_t n_prompt_tokens;          /* totals, known after cllm_job_finish */
    int64_t n_completion_tokens;
};

enum cllm_job_end {
    CLLM_JOB_DONE,        /* every request finished (see cllm_job_error) */
    CLLM_JOB_CLIENT_GONE, /* the client closed its connection: the requests were cancelled */
    CLLM_JOB_STOPPING,    /* the server is shutting down: the requests were cancelled */
};

/* Reads the optional fields max_tokens (or max_completion_tokens), temperature, top_p, top_k,
 * min_p, repetition_penalty, presence_penalty, frequency_penalty, seed and stop (a string or
 * a list of strings) of obj over defaults. null counts as absent; unknown fields are ignored.
 * A wrong type or value -> CLLM_ERR_INVALID_ARG / CLLM_ERR_RANGE with err naming the field. */
enum cllm_status cllm_job_params_parse(const cJSON *obj, const struct cllm_request_params *defaults,
                                       struct cllm_job_params *out, char *err, size_t err_len);

/* A job for n >= 1 prompts (zeroed j on failure). */
enum cllm_status cllm_job_init(struct cllm_job *j, int32_t n);

/* Sets prompt i to the tokens of text as is (no template). what names the prompt in errors
 * ("prompt", "prompt[3]"). Empty -> CLLM_ERR_INVALID_ARG; beyond the context window ->
 * CLLM_ERR_RANGE naming the window. */
enum cllm_status cllm_job_set_text(struct cllm_server *s, struct cllm_job *j, int32_t i,
                                   const char *what, const char *text, size_t len, char *err,
                                   size_t err_len);
/* Sets prompt i to msgs[0..n) rendered with the model's chat template (opening the assistant
 * turn). Without a template: an error, unless the conversation is one user message, which is
 * then used as is. */
enum cllm_status cllm_job_set_chat(struct cllm_server *s, struct cllm_job *j, int32_t i,
                                   const char *what, const struct cllm_chat_message *msgs, size_t n,
                                   char *err, size_t err_len);

/* Seconds between two reports of a job's progress (cllm_job.report). */
#define CLLM_JOB_REPORT_S 1.0

/* Sets the job (its prompts set, not submitted yet) to go on from progress (progress.h: the
 * bytes a dead serving process reported for this request): a prompt whose answer was complete
 * is not submitted again, its answer is the text it had; one that had begun goes on from the
 * text it had (as after a stall, cllm_job_wait), the tokens it had counted in. False, the job
 * untouched, when the bytes are not progress of this job's n prompts. */
bool cllm_job_go_on(struct cllm_job *j, const void *progress, size_t len);

/* Submits every prompt with p, but those cllm_job_go_on found complete; one it set to go on
 * from its text gets what is left of max_tokens, and ends with that text when nothing is left
 * or the engine refuses it for its length. All or nothing: when one is refused
 * (CLLM_ERR_BUSY: the queue is full), those already queued are cancelled and released. waited:
 * seconds the request spent before this process got it (a replay, custody.h), which its max_time
 * counts too (one already past it ends at its first step). */
enum cllm_status cllm_job_submit(struct cllm_server *s, struct cllm_job *j,
                                 const struct cllm_request_params *p, double waited, char *err,
                                 size_t err_len);

/* Waits until every request has finished, collecting the text into outs[i].text. Returns early,
 * cancelling the requests, when the peer of fd (-1: none) goes away or the server stops. When
 * the engine stalls (cllm_engine_stalled) and the server can move to the CPU
 * (cllm_server_fail_over), each unfinished request goes on there: its prompt and the text it
 * has so far, re-tokenized, become the new prompt, with what is left of its max_tokens and
 * max_time. Greedy answers come out as they would have (the tokens may be split differently
 * where the text is cut; the presence and frequency penalties go on counting the tokens of
 * the text before the move, cllm_request_params.n_carried); a sampled one draws anew from
 * there. Otherwise the requests end with the text they have. */
enum cllm_job_end cllm_job_wait(struct cllm_server *s, struct cllm_job *j, int fd);

/* Request `old`, whose output so far is o, again on engine `to` after its own stalled
 * (cllm_job_wait, streams): prompt and the text it has so far, re-tokenized, become the new
 * prompt, with params but what is left of its max_tokens and max_time, the penalties counting
 * that text's tokens (n_carried). old is cancelled. Returns the new request, or NULL when
 * prompt is NULL (the caller could not keep it), nothing is left or it cannot be submitted
 * (logged): o then ends with the text it has, as by max_time or max_tokens. */
struct cllm_request *cllm_job_resume(struct cllm_server *s, struct cllm_engine *to,
                                     struct cllm_request *old, struct cllm_request_output *o,
                                     const struct cllm_ids *prompt, const struct cllm_buf *text,
                                     const struct cllm_request_params *params);

/* Whether a handler stops waiting for r, whose output so far is o: r is 5 s past its max_time
 * (the engine ends it at its next step, which a stalled device may never reach), or stalled
 * says why the engine is stuck (cllm_engine_stalled; NULL: it is not). Then o ends as if by
 * max_time, with the text polled so far, and r is cancelled. */
bool cllm_job_give_up(struct cllm_request *r, struct cllm_request_output *o, const char *stalled,
                      double now);

/* The first request that failed in the engine (CLLM_FINISH_ERROR or CANCELLED), as an index,
 * or -1 if all finished normally. */
int32_t cllm_job_failed(const struct cllm_job *j);

/* "stop", "length", ... as OpenAI spells them. */
const char *cllm_job_finish_reason(enum cllm_finish_reason r);

/* Ends the job: cancels what still runs, records the final counts (into m unless NULL) and
 * the totals, releases the requests and frees j. Safe on a zeroed job. */
void cllm_job_finish(struct cllm_job *j, struct cllm_metrics *m);

#endif
