/* Jobs: request fields to request params, prompts to checked token ids, submit and collect. */
#include "server/job.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "server/http.h"
#include "server/progress.h"
#include "server/server.h"

/* --- request fields --- */

/* The field, or NULL when absent or null (clients often send null for "unset"). */
static const cJSON *field(const cJSON *obj, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* 2^53: beyond it a JSON number no longer holds every integer exactly. */
#define MAX_EXACT_INT 9007199254740992.0

static enum cllm_status get_int(const cJSON *obj, const char *name, double lo, double hi,
                                int64_t *out, bool *set, char *err, size_t err_len)
{
    const cJSON *v = field(obj, name);
    if (!v)
        return CLLM_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "%s must be an integer", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s must be in [%.0f, %.0f], got %.0f", name,
                         lo, hi, v->valuedouble);
    *out = (int64_t)v->valuedouble;
    if (set)
        *set = true;
    return CLLM_OK;
}

static enum cllm_status get_float(const cJSON *obj, const char *name, float *out, char *err,
                                  size_t err_len)
{
    const cJSON *v = field(obj, name);
    if (!v)
        return CLLM_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || fabs(v->valuedouble) > 1e30)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "%s must be a number", name);
    *out = (float)v->valuedouble;
    return CLLM_OK;
}

static enum cllm_status get_stops(const cJSON *obj, struct cllm_job_params *out, char *err,
                                  size_t err_len)
{
    const cJSON *v = field(obj, "stop");
    if (!v)
        return CLLM_OK;
    size_t n = 0;
    if (cJSON_IsString(v)) {
        out->stops[n++] = v->valuestring;
    } else if (cJSON_IsArray(v)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, v)
        {
            if (!cJSON_IsString(it))
                return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                                 "stop must be a string or a list of strings");
            if (n == CLLM_JOB_MAX_STOPS)
                return cllm_fail(err, err_len, CLLM_ERR_RANGE, "stop: at most %d strings",
                                 CLLM_JOB_MAX_STOPS);
            out->stops[n++] = it->valuestring;
        }
    } else {
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "stop must be a string or a list of strings");
    }
    for (size_t i = 0; i < n; i++)
        if (!out->stops[i][0])
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "stop strings must not be empty");
    /* Request stops replace the server's, as in OpenAI's API. */
    out->p.stop = out->stops;
    out->p.n_stop = n;
    return CLLM_OK;
}

enum cllm_status cllm_job_params_parse(const cJSON *obj, const struct cllm_request_params *defaults,
                                       struct cllm_job_params *out, char *err, size_t err_len)
{
    memset(out, 0, sizeof *out);
    out->p = *defaults;
    struct cllm_sampling_params *sp = &out->p.sampling;
    int64_t v = 0;
    bool set = false;
    enum cllm_status st;
    if ((st = get_int(obj, "max_completion_tokens", 1, 1 << 24, &v, &set, err, err_len)) ||
        (st = get_int(obj, "max_tokens", 1, 1 << 24, &v, &set, err, err_len)))
        return st;
    if (set)
        out->p.max_tokens = (int32_t)v;
    set = false;
    if ((st = get_int(obj, "top_k", -1, 1 << 30, &v, &set, err, err_len)))
        return st;
    if (set)
        sp->top_k = v < 0 ? 0 : (int32_t)v; /* -1 means "off", as in vLLM */
    set = false;
    if ((st = get_int(obj, "seed", 0, MAX_EXACT_INT, &v, &set, err, err_len)))
        return st;
    if (set)
        sp->seed = (uint64_t)v;
    if ((st = get_float(obj, "temperature", &sp->temperature, err, err_len)) ||
        (st = get_float(obj, "top_p", &sp->top_p, err, err_len)) ||
        (st = get_float(obj, "min_p", &sp->min_p, err, err_len)) ||
        (st = get_float(obj, "repetition_penalty", &sp->repetition_penalty, err, err_len)) ||
        (st = get_float(obj, "presence_penalty", &sp->presence_penalty, err, err_len)) ||
        (st = get_float(obj, "frequency_penalty", &sp->frequency_penalty, err, err_len)) ||
        (st = get_stops(obj, out, err, err_len)))
        return st;
    const cJSON *max_time = field(obj, "max_time");
    if (max_time) {
        if (!cJSON_IsNumber(max_time) || !(max_time->valuedouble > 0) ||
            max_time->valuedouble > 1e9)
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "max_time must be a number of seconds in (0, 1e9]");
        out->p.max_time = max_time->valuedouble;
    }
    return cllm_sampling_params_check(sp, err, err_len);
}

/* --- prompts --- */

enum cllm_status cllm_job_init(struct cllm_job *j, int32_t n)
{
    memset(j, 0, sizeof *j);
    if (n < 1)
        return CLLM_ERR_INVALID_ARG;
    j->prompts = cllm_calloc_array((size_t)n, sizeof *j->prompts);
    j->reqs = cllm_calloc_array((size_t)n, sizeof *j->reqs);
    j->outs = cllm_calloc_array((size_t)n, sizeof *j->outs);
    if (!j->prompts || !j->reqs || !j->outs) {
        free(j->prompts), free(j->reqs), free(j->outs);
        memset(j, 0, sizeof *j);
        return CLLM_ERR_NOMEM;
    }
    j->n = n;
    return CLLM_OK;
}

enum cllm_status cllm_job_set_text(struct cllm_server *s, struct cllm_job *j, int32_t i,
                                   const char *what, const char *text, size_t len, char *err,
                                   size_t err_len)
{
    struct cllm_ids *ids = &j->prompts[i];
    ids->n = 0;
    if (len == 0)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "%s is empty", what);
    if (cllm_tokenize(s->mf->tok, text, len, ids) != CLLM_OK)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory tokenizing %s", what);
    int32_t n_ctx = cllm_engine_n_ctx(cllm_server_engine(s));
    if (ids->n == 0)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "%s has no tokens", what);
    if (ids->n >= (size_t)n_ctx)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "%s has %zu tokens; the context window is %d tokens (prompt + at least "
                         "one generated token)",
                         what, ids->n, (int)n_ctx);
    return CLLM_OK;
}

enum cllm_status cllm_job_set_chat(struct cllm_server *s, struct cllm_job *j, int32_t i,
                                   const char *what, const struct cllm_chat_message *msgs, size_t n,
                                   char *err, size_t err_len)
{
    if (!s->tmpl) {
        if (n == 1 && !strcmp(msgs[0].role, "user"))
            return cllm_job_set_text(s, j, i, what, msgs[0].content, msgs[0].content_len, err,
                                     err_len);
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "the model has no chat template: send one user message or use "
                         "/v1/completions");
    }
    struct cllm_buf text = {0};
    char why[256] = "";
    enum cllm_status st = cllm_chat_template_render(s->tmpl, msgs, n, true, &text, why, sizeof why);
    if (st)
        cllm_fail(err, err_len, st, "%s: %s", what, why);
    else
        st = cllm_job_set_text(s, j, i, what, text.data, text.len, err, err_len);
    cllm_buf_free(&text);
    return st;
}

/* --- running --- */

/* Shortest max_time a replayed request gets: it ends at its first step. */
#define MIN_MAX_TIME_S 1e-3

/* Submits prompt and the text generated for it so far (n_generated tokens, re-tokenized:
 * where the text is cut, the tokens may be split otherwise than they were drawn) to e, with p
 * but what is left of its max_tokens, the penalties counting that text's tokens as generated
 * (n_carried). CLLM_ERR_RANGE when no token is left. */
static enum cllm_status submit_from(struct cllm_server *s, struct cllm_engine *e,
                                    const struct cllm_ids *prompt, const struct cllm_buf *text,
                                    int32_t n_generated, struct cllm_request_params p,
                                    struct cllm_request **r, char *err, size_t err_len)
{
    const int32_t left = p.max_tokens - n_generated;
    if (left <= 0)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "no tokens left");
    struct cllm_ids ids = {0};
    enum cllm_status st = cllm_ids_append(&ids, prompt->v, prompt->n);
    if (!st && text->len)
        st = cllm_tokenize(s->mf->tok, text->data, text->len, &ids);
    p.max_tokens = left;
    p.n_carried = (int32_t)(ids.n - prompt->n);
    if (st)
        cllm_fail(err, err_len, st, "out of memory");
    else
        st = cllm_engine_submit(e, ids.v, (int32_t)ids.n, &p, r, err, err_len);
    cllm_ids_free(&ids);
    return st;
}

/* Ends prompt i's answer, never submitted here, with the text it has (from a dead serving
 * process: cllm_job_go_on) and the n_generated tokens that made it. */
static void end_unsubmitted(struct cllm_job *j, int32_t i, enum cllm_finish_reason reason,
                            int32_t n_generated)
{
    struct cllm_request_output *o = &j->outs[i];
    o->finished = true;
    o->reason = reason;
    o->n_prompt = (int32_t)j->prompts[i].n;
    o->n_generated = n_generated;
    o->t_finish = cllm_now();
}

bool cllm_job_go_on(struct cllm_job *j, const void *progress, size_t len)
{
    struct cllm_progress_entry *from = cllm_calloc_array((size_t)j->n, sizeof *from);
    int32_t *carried = cllm_calloc_array((size_t)j->n, sizeof *carried);
    bool ok = from && carried && !j->carried &&
              cllm_progress_decode(progress, len, j->n, from) == CLLM_OK;
    for (int32_t i = 0; ok && i < j->n; i++)
        ok = cllm_buf_append(&j->outs[i].text, from[i].text, from[i].len) == CLLM_OK;
    if (!ok) {
        for (int32_t i = 0; i < j->n; i++)
            cllm_buf_free(&j->outs[i].text);
        free(carried);
        free(from);
        return false;
    }
    for (int32_t i = 0; i < j->n; i++) {
        carried[i] = from[i].n_generated;
        if (from[i].finished)
            end_unsubmitted(j, i, from[i].reason, from[i].n_generated);
    }
    j->carried = carried;
    free(from);
    return true;
}

/* Submits prompt i of j, going on from the text it has when it had begun (cllm_job_go_on):
 * one that cannot (no tokens left, or too long for the engine) ends with that text. */
static enum cllm_status submit_one(struct cllm_server *s, struct cllm_engine *e, struct cllm_job *j,
                                   int32_t i, const struct cllm_request_params *p, char *err,
                                   size_t err_len)
{
    const struct cllm_ids *ids = &j->prompts[i];
    const int32_t carried = j->carried ? j->carried[i] : 0;
    if (carried == 0)
        return cllm_engine_submit(e, ids->v, (int32_t)ids->n, p, &j->reqs[i], err, err_len);
    enum cllm_status st =
        submit_from(s, e, ids, &j->outs[i].text, carried, *p, &j->reqs[i], err, err_len);
    if (st == CLLM_OK || st == CLLM_ERR_BUSY || st == CLLM_ERR_NOMEM)
        return st;
    if (p->max_tokens > carried)
        cllm_log(CLLM_LOG_WARN, "a replayed answer cannot go on (%s): it ends with its text so far",
                 err);
    end_unsubmitted(j, i, CLLM_FINISH_LENGTH, carried);
    return CLLM_OK;
}

enum cllm_status cllm_job_submit(struct cllm_server *s, struct cllm_job *j,
                                 const struct cllm_request_params *p, double waited, char *err,
                                 size_t err_len)
{
    struct cllm_engine *e = cllm_server_engine_live(s);
    j->engine = e;
    j->params = p;
    struct cllm_request_params left; /* (the engine copies what it needs at submit) */
    if (waited > 0 && p->max_time > 0) {
        left = *p;
        left.max_time =
            p->max_time - waited > MIN_MAX_TIME_S ? p->max_time - waited : MIN_MAX_TIME_S;
        p = &left;
    }
    if (cllm_engine_queue_full(e))
        return cllm_fail(err, err_len, CLLM_ERR_BUSY, "the queue is full: try again later");
    j->next_report = cllm_now() + CLLM_JOB_REPORT_S;
    for (int32_t i = 0; i < j->n; i++) {
        if (j->outs[i].finished) /* complete before a crash (cllm_job_go_on) */
            continue;
        enum cllm_status st = submit_one(s, e, j, i, p, err, err_len);
        if (st) {
            for (int32_t k = 0; k < i; k++) {
                if (!j->reqs[k])
                    continue;
                cllm_request_cancel(j->reqs[k]);
                cllm_request_release(j->reqs[k]);
                j->reqs[k] = NULL;
            }
            return st;
        }
    }
    return CLLM_OK;
}

static void cancel_all(struct cllm_job *j)
{
    for (int32_t i = 0; i < j->n; i++)
        if (j->reqs[i])
            cllm_request_cancel(j->reqs[i]);
}

/* A request this long past its max_time without an answer is given up on here: the engine
 * ends it at its next step, which a stalled device may never reach. */
#define MAX_TIME_GRACE_S 5.0

bool cllm_job_give_up(struct cllm_request *r, struct cllm_request_output *o, const char *stalled,
                      double now)
{
    const double deadline = r->deadline; /* set at submit, read-only since */
    const bool late = deadline > 0 && now >= deadline + MAX_TIME_GRACE_S;
    if (o->finished || (!late && !stalled))
        return false;
    if (late)
        cllm_log(CLLM_LOG_ERROR,
                 "request %llu: no answer %.0f s after its max_time (a stalled device?): it "
                 "ends with the text so far",
                 (unsigned long long)r->id, MAX_TIME_GRACE_S);
    cllm_request_cancel(r);
    o->finished = true;
    o->reason = CLLM_FINISH_TIME;
    o->t_finish = now;
    return true;
}

/* Polls request i into outs[i] (see cllm_request_poll), counting in what it generated on an
 * engine it left. */
static bool poll_one(struct cllm_job *j, int32_t i, int timeout_ms)
{
    struct cllm_request_output *o = &j->outs[i];
    bool done = cllm_request_poll(j->reqs[i], timeout_ms, o);
    if (j->carried && j->carried[i]) {
        o->n_prompt = (int32_t)j->prompts[i].n;
        o->n_generated += j->carried[i];
    }
    return done;
}

struct cllm_request *cllm_job_resume(struct cllm_server *s, struct cllm_engine *to,
                                     struct cllm_request *old, struct cllm_request_output *o,
                                     const struct cllm_ids *prompt, const struct cllm_buf *text,
                                     const struct cllm_request_params *params)
{
    const double now = cllm_now(), deadline = old->deadline; /* read-only since submit */
    const int32_t left = params->max_tokens - o->n_generated;
    struct cllm_request *r = NULL;
    enum cllm_status st = CLLM_ERR_RANGE;
    if (prompt && left > 0 && (deadline <= 0 || now < deadline)) {
        struct cllm_request_params p = *params;
        p.max_time = deadline > 0 ? deadline - now : 0;
        char err[256];
        st = submit_from(s, to, prompt, text, o->n_generated, p, &r, err, sizeof err);
        if (st)
            cllm_log(CLLM_LOG_ERROR,
                     "request %llu cannot go on on the CPU (%s): it ends with the text so far",
                     (unsigned long long)old->id, err);
    }
    cllm_request_cancel(old); /* a stuck engine that answers again drops it */
    if (st) {
        o->finished = true;
        o->reason = left > 0 ? CLLM_FINISH_TIME : CLLM_FINISH_LENGTH;
        o->t_finish = now;
        return NULL;
    }
    return r;
}

/* The server moved to engine `to` (cllm_server_fail_over) from the stalled j->engine: every
 * unfinished request goes on there (cllm_job_wait); one that cannot, or has no tokens or time
 * left, ends with the text it has. The old requests are cancelled: a stuck engine that
 * answers again drops them. */
static void carry_over(struct cllm_server *s, struct cllm_job *j, int32_t next,
                       struct cllm_engine *to)
{
    j->engine = to;
    if (!j->carried)
        j->carried = cllm_calloc_array((size_t)j->n, sizeof *j->carried);
    int32_t moved = 0;
    for (int32_t i = next; i < j->n; i++) {
        struct cllm_request_output *o = &j->outs[i];
        struct cllm_request *old = j->reqs[i];
        if (o->finished || poll_one(j, i, 0)) /* (it may have ended since the last poll) */
            continue;
        struct cllm_request *r =
            cllm_job_resume(s, to, old, o, j->carried ? &j->prompts[i] : NULL, &o->text, j->params);
        if (!r)
            continue;
        cllm_request_release(old);
        j->reqs[i] = r;
        j->carried[i] = o->n_generated;
        moved++;
    }
    if (moved)
        cllm_log(CLLM_LOG_INFO, "%d requests go on on the CPU from the text they had", (int)moved);
}

/* Requests past their max_time and its grace end with the text polled so far (the engine
 * cancels them when it can). While their engine is stalled, they go on on the CPU if the
 * server can move there, else they all end so. */
static void give_up_late(struct cllm_server *s, struct cllm_job *j, int32_t next)
{
    struct cllm_engine *current = cllm_server_engine(s);
    if (current != j->engine) /* another handler moved the server */
        carry_over(s, j, next, current);
    char why[256];
    const char *stalled = cllm_engine_stalled(j->engine, why, sizeof why) ? why : NULL;
    if (stalled) {
        struct cllm_engine *to = cllm_server_fail_over(s, j->engine, why);
        if (to) {
            carry_over(s, j, next, to);
            stalled = NULL;
        }
    }
    const double now = cllm_now();
    int32_t n_stalled = 0;
    for (int32_t i = next; i < j->n; i++)
        if (j->reqs[i] && cllm_job_give_up(j->reqs[i], &j->outs[i], stalled, now) && stalled)
            n_stalled++;
    if (n_stalled)
        cllm_log(CLLM_LOG_ERROR, "%d requests end with the text so far: %s", (int)n_stalled,
                 stalled);
}

/* What a report would show: the tokens generated and the answers complete (both only grow,
 * so their sum changes with either). */
static int64_t progress_mark(const struct cllm_job *j)
{
    int64_t m = 0;
    for (int32_t i = 0; i < j->n; i++)
        m += (int64_t)j->outs[i].n_generated + j->outs[i].finished;
    return m;
}

static void maybe_report(struct cllm_job *j)
{
    const double now = cllm_now();
    if (!j->report || now < j->next_report)
        return;
    j->next_report = now + CLLM_JOB_REPORT_S;
    const int64_t mark = progress_mark(j);
    if (mark != j->reported) {
        j->report(j->report_ctx, j);
        j->reported = mark;
    }
}

enum cllm_job_end cllm_job_wait(struct cllm_server *s, struct cllm_job *j, int fd)
{
    int32_t next = 0; /* requests before next have finished */
    for (;;) {
        give_up_late(s, j, next);
        while (next < j->n && j->outs[next].finished)
            next++;
        if (next == j->n)
            return CLLM_JOB_DONE;
        /* Sleep on one unfinished request; then sweep the others so their text does not pile
         * up in the engine's buffers. */
        poll_one(j, next, 50);
        for (int32_t i = next + 1; i < j->n; i++)
            if (!j->outs[i].finished)
                poll_one(j, i, 0);
        maybe_report(j);
        if (atomic_load(&s->stopping)) {
            cancel_all(j);
            return CLLM_JOB_STOPPING;
        }
        if (fd >= 0 && cllm_http_peer_gone(fd)) {
            cancel_all(j);
            return CLLM_JOB_CLIENT_GONE;
        }
    }
}

int32_t cllm_job_failed(const struct cllm_job *j)
{
    for (int32_t i = 0; i < j->n; i++)
        if (j->outs[i].reason == CLLM_FINISH_ERROR || j->outs[i].reason == CLLM_FINISH_CANCELLED)
            return i;
    return -1;
}

const char *cllm_job_finish_reason(enum cllm_finish_reason r)
{
    /* APIs know "stop" and "length": a request cut by max_time was cut short, as by
     * max_tokens */
    return r == CLLM_FINISH_TIME ? "length" : cllm_finish_reason_str(r);
}

void cllm_job_finish(struct cllm_job *j, struct cllm_metrics *m)
{
    for (int32_t i = 0; i < j->n; i++) {
        struct cllm_request *r = j->reqs[i];
        if (r) {
            struct cllm_request_output *o = &j->outs[i];
            /* Whoever ends the job no longer wants what is left (client gone, stream done). */
            cllm_request_cancel(r);
            poll_one(j, i, 0);
            double ttft = o->t_first_token > 0 ? o->t_first_token - o->t_submit : -1;
            double itl = o->n_generated > 1 && o->t_finish > 0
                             ? (o->t_finish - o->t_first_token) / (o->n_generated - 1)
                             : -1;
            if (m)
                cllm_metrics_observe_generation(m, ttft, itl);
            j->n_prompt_tokens += o->n_prompt;
            j->n_completion_tokens += o->n_generated;
            cllm_request_release(r);
        } else { /* complete before a crash (cllm_job_go_on), or never submitted (zeros) */
            j->n_prompt_tokens += j->outs[i].n_prompt;
            j->n_completion_tokens += j->outs[i].n_generated;
        }
        cllm_ids_free(&j->prompts[i]);
        cllm_buf_free(&j->outs[i].text);
    }
    free(j->prompts);
    free(j->reqs);
    free(j->outs);
    free(j->carried);
    int64_t np = j->n_prompt_tokens, nc = j->n_completion_tokens;
    memset(j, 0, sizeof *j);
    j->n_prompt_tokens = np;
    j->n_completion_tokens = nc;
}
