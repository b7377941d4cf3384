/* Request lifetime, the token list, and the hand-off of output to the submitter. */
#include "engine/request.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h"
#include "core/status.h"

double cllm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *cllm_finish_reason_str(enum cllm_finish_reason r)
{
    switch (r) {
    case CLLM_FINISH_NONE: return "none";
    case CLLM_FINISH_STOP: return "stop";
    case CLLM_FINISH_LENGTH: return "length";
    case CLLM_FINISH_CANCELLED: return "cancelled";
    case CLLM_FINISH_ERROR: return "error";
    case CLLM_FINISH_TIME: return "time";
    }
    return "?";
}

enum cllm_status cllm_request_new(struct cllm_request **out, uint64_t id, const int32_t *prompt,
                                  int32_t n_prompt, const struct cllm_request_params *p,
                                  const struct cllm_tokenizer *tok, int32_t n_vocab,
                                  int32_t n_ctx, char *err, size_t err_len)
{
    *out = NULL;
    if (n_prompt < 1)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "the prompt is empty");
    if (n_prompt >= n_ctx)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "the prompt has %d tokens; the context window is %d tokens (prompt + at "
                         "least one generated token)",
                         (int)n_prompt, (int)n_ctx);
    if (p->max_tokens < 1)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "max_tokens must be >= 1, got %d",
                         (int)p->max_tokens);
    if (p->n_stop_ids < 0 || p->n_stop_ids > CLLM_MAX_STOP_IDS)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "at most %d stop token ids",
                         CLLM_MAX_STOP_IDS);
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= n_vocab)
            return cllm_fail(err, err_len, CLLM_ERR_RANGE, "prompt token %d is not in [0, %d)",
                             (int)prompt[i], (int)n_vocab);
    if (p->n_carried < 0 || p->n_carried > n_prompt)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "n_carried must be in [0, %d] (the prompt's length), got %d",
                         (int)n_prompt, (int)p->n_carried);
    if (!(p->max_time >= 0 && p->max_time <= 1e9)) /* (NaN fails too) */
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "max_time must be a number of seconds in [0, 1e9], got %g", p->max_time);
    enum cllm_status st = cllm_sampling_params_check(&p->sampling, err, err_len);
    if (st)
        return st;
    struct cllm_request *r = calloc(1, sizeof *r);
    if (!r)
        return CLLM_ERR_NOMEM;
    atomic_init(&r->refs, 1);
    r->id = id;
    r->params = *p;
    r->params.stop = NULL;
    r->params.n_stop = 0;
    r->n_prompt = n_prompt;
    int64_t total = (int64_t)n_prompt + p->max_tokens;
    r->max_total = total > n_ctx ? n_ctx : (int32_t)total;
    r->cap_tokens = n_prompt + 16;
    r->tokens = cllm_malloc_array((size_t)r->cap_tokens, sizeof *r->tokens);
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->changed, NULL);
    if (!r->tokens)
        goto nomem;
    memcpy(r->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    r->n_tokens = n_prompt;
    if (cllm_sampler_new(&r->sampler, &p->sampling, n_vocab, prompt, (size_t)n_prompt) ||
        cllm_stop_new(&r->stop, p->stop, NULL, p->n_stop))
        goto nomem;
    for (int32_t i = n_prompt - p->n_carried; i < n_prompt; i++)
        if (cllm_sampler_accept(r->sampler, prompt[i]))
            goto nomem;
    cllm_detok_stream_init(&r->detok, tok, true);
    r->out.n_prompt = n_prompt;
    r->out.t_submit = cllm_now();
    r->deadline = p->max_time > 0 ? r->out.t_submit + p->max_time : 0;
    *out = r;
    return CLLM_OK;
nomem:
    cllm_request_release(r);
    return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
}

void cllm_request_retain(struct cllm_request *r)
{
    atomic_fetch_add(&r->refs, 1);
}

void cllm_request_release(struct cllm_request *r)
{
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    free(r->tokens);
    free(r->blocks);
    free(r->block_hashes);
    cllm_sampler_free(r->sampler);
    cllm_stop_free(r->stop);
    cllm_buf_free(&r->pending);
    cllm_buf_free(&r->out.text);
    free(r->token_times);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->changed);
    free(r);
}

enum cllm_status cllm_request_append(struct cllm_request *r, int32_t token)
{
    if (r->n_tokens == r->cap_tokens) {
        int32_t cap = r->cap_tokens * 2;
        int32_t *t = cllm_realloc_array(r->tokens, (size_t)cap, sizeof *t);
        if (!t)
            return CLLM_ERR_NOMEM;
        r->tokens = t;
        r->cap_tokens = cap;
    }
    r->tokens[r->n_tokens++] = token;
    return CLLM_OK;
}

int32_t cllm_request_n_generated(const struct cllm_request *r)
{
    return cllm_request_n_known(r) - r->n_prompt;
}

void cllm_request_cancel(struct cllm_request *r)
{
    pthread_mutex_lock(&r->lock);
    r->cancel = true;
    pthread_mutex_unlock(&r->lock);
}

bool cllm_request_cancelled(struct cllm_request *r)
{
    pthread_mutex_lock(&r->lock);
    bool c = r->cancel;
    pthread_mutex_unlock(&r->lock);
    return c;
}

bool cllm_request_poll(struct cllm_request *r, int timeout_ms, struct cllm_request_output *out)
{
    pthread_mutex_lock(&r->lock);
    if (timeout_ms != 0 && !r->out.finished && r->out.text.len == 0) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&r->changed, &r->lock);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += timeout_ms / 1000;
            ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&r->changed, &r->lock, &ts);
        }
    }
    if (r->out.text.len)
        cllm_buf_append(&out->text, r->out.text.data, r->out.text.len);
    r->out.text.len = 0;
    struct cllm_buf keep = out->text;
    *out = r->out;
    out->text = keep;
    bool done = r->out.finished;
    pthread_mutex_unlock(&r->lock);
    return done;
}

void cllm_request_emit(struct cllm_request *r, const char *text, size_t len, int32_t n_cached)
{
    pthread_mutex_lock(&r->lock);
    if (len)
        cllm_buf_append(&r->out.text, text, len);
    int32_t generated = cllm_request_n_generated(r);
    double now = cllm_now();
    if (generated > r->out.n_generated) {
        if (r->n_token_times == r->cap_token_times) {
            int32_t cap = r->cap_token_times ? r->cap_token_times * 2 : 64;
            double *t = cllm_realloc_array(r->token_times, (size_t)cap, sizeof *t);
            if (t) {
                r->token_times = t;
                r->cap_token_times = cap;
            }
        }
        if (r->n_token_times < r->cap_token_times)
            r->token_times[r->n_token_times++] = now;
    }
    r->out.n_generated = generated;
    r->out.n_cached = n_cached;
    if (generated > 0 && r->out.t_first_token == 0)
        r->out.t_first_token = now;
    pthread_cond_broadcast(&r->changed);
    pthread_mutex_unlock(&r->lock);
}

void cllm_request_finish(struct cllm_request *r, enum cllm_finish_reason reason, const char *error)
{
    pthread_mutex_lock(&r->lock);
    if (!r->out.finished) {
        r->out.finished = true;
        r->out.reason = reason;
        r->out.n_generated = cllm_request_n_generated(r);
        r->out.t_finish = cllm_now();
        if (error)
            snprintf(r->out.error, sizeof r->out.error, "%s", error);
    }
    pthread_cond_broadcast(&r->changed);
    pthread_mutex_unlock(&r->lock);
}

int32_t cllm_request_token_times(struct cllm_request *r, double *times, int32_t max)
{
    pthread_mutex_lock(&r->lock);
    int32_t n = r->n_token_times;
    if (times && max > 0)
        memcpy(times, r->token_times, (size_t)(n < max ? n : max) * sizeof *times);
    pthread_mutex_unlock(&r->lock);
    return n;
}
