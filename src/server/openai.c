/*
 * The OpenAI-compatible routes: POST /v1/completions (raw text, no template), POST
 * /v1/chat/completions (messages under the chat template), each answered whole or, with
 * "stream": true, as server-sent events (`data: {chunk}\n\n` ... `data: [DONE]\n\n`) sent as
 * soon as the engine has text; and GET /v1/models. A stream is a libmicrohttpd callback
 * response: its reader runs on the connection's own thread and may wait for the engine.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "core/status.h"
#include "server/http.h"
#include "server/routes.h"

/* Seconds without a token after which a stream sends an SSE comment, so neither the idle
 * timeout nor a proxy drops a request that waits in the queue. */
#define KEEPALIVE_S 10.0

enum api_kind { API_COMPLETION, API_CHAT };

static void make_id(struct cllm_server *s, enum api_kind kind, char *id, size_t cap)
{
    uint64_t n = atomic_fetch_add(&s->next_id, 1);
    snprintf(id, cap, "%s-%" PRIx64 "%06" PRIx64, kind == API_CHAT ? "chatcmpl" : "cmpl",
             (uint64_t)time(NULL), n & 0xffffff);
}

static cJSON *usage_json(int64_t n_prompt, int64_t n_completion)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)n_completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(n_prompt + n_completion));
    return u;
}

/* The fields every response and chunk starts with. */
static cJSON *envelope(struct cllm_server *s, const char *id, const char *object, int64_t created)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", s->model_name);
    return o;
}

/* --- streaming --- */

struct stream {
    struct cllm_server *s;
    struct cllm_request *req; /* our own reference */
    struct cllm_engine *engine; /* the engine it runs on */
    struct cllm_request_output out; /* counts include what `carried` says */
    /* To go on on the CPU when the engine stalls (cllm_job_resume): the request's prompt,
     * settings and stop strings (copies: the request's JSON is gone by then), the text sent
     * so far, and the tokens generated before the move. can_resume: the copies were made. */
    struct cllm_ids prompt;
    struct cllm_request_params params;
    char **stops;
    struct cllm_buf said;
    int32_t carried;
    bool can_resume;
    enum api_kind kind;
    char id[64];
    int64_t created;
    int fd;
    bool role_sent, finished, done;
    struct cllm_buf pending; /* SSE bytes not yet handed to libmicrohttpd */
    size_t sent;             /* bytes of pending already handed over */
    double t_last;           /* when bytes last went out */
};

/* Appends one `data: <json>\n\n` event (frees j). */
static void put_event(struct stream *st, cJSON *j)
{
    char *text = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    if (!text)
        return; /* out of memory: the chunk is lost, the stream goes on */
    cllm_buf_append(&st->pending, "data: ", 6);
    cllm_buf_append(&st->pending, text, strlen(text));
    cllm_buf_append(&st->pending, "\n\n", 2);
    cJSON_free(text);
}

/* A chunk with one choice: a text delta, or (text NULL) the end with finish_reason. */
static void put_chunk(struct stream *st, const char *text, size_t len, bool role,
                      const char *finish)
{
    cJSON *o =
        envelope(st->s, st->id, st->kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                 st->created);
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    cJSON *str = NULL;
    if (text && !role) {
        /* The engine never splits a UTF-8 character; len bytes are copied as they are. */
        char *copy = malloc(len + 1);
        if (copy) {
            memcpy(copy, text, len);
            copy[len] = 0;
            str = cJSON_CreateString(copy);
            free(copy);
        }
    }
    if (st->kind == API_CHAT) {
        cJSON *delta = cJSON_AddObjectToObject(c, "delta");
        if (role) {
            cJSON_AddStringToObject(delta, "role", "assistant");
            cJSON_AddStringToObject(delta, "content", "");
        }
        if (str)
            cJSON_AddItemToObject(delta, "content", str);
    } else {
        cJSON_AddItemToObject(c, "text", str ? str : cJSON_CreateString(""));
    }
    cJSON_AddNullToObject(c, "logprobs");
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    if (finish)
        cJSON_AddItemToObject(o, "usage", usage_json(st->out.n_prompt, st->out.n_generated));
    put_event(st, o);
}

static void put_error(struct stream *st, const char *msg)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", "server_error");
    put_event(st, o);
}

/* The server moved to engine `to` from the stream's stalled one (cllm_server_fail_over): the
 * stream goes on there from the text it has sent, with what is left of its tokens and time.
 * False when it cannot: it then ends with that text. */
static bool go_on(struct stream *st, struct cllm_engine *to)
{
    st->engine = to;
    struct cllm_request *r = cllm_job_resume(
        st->s, to, st->req, &st->out, st->can_resume ? &st->prompt : NULL, &st->said, &st->params);
    if (!r)
        return false;
    cllm_request_release(st->req);
    st->req = r;
    st->carried = st->out.n_generated;
    cllm_log(CLLM_LOG_INFO, "a stream goes on on the CPU from the text it had");
    return true;
}

/* As a whole answer would (cllm_job_wait): while the engine is stalled the stream goes on on
 * the CPU if the server can move there (or has), else, and past max_time and its grace, it
 * ends with the text it has. Returns whether it ended. */
static bool give_up(struct stream *st)
{
    struct cllm_engine *current = cllm_server_engine(st->s);
    if (current != st->engine && !go_on(st, current)) /* another handler moved the server */
        return true;
    char why[256];
    const char *stalled = cllm_engine_stalled(st->engine, why, sizeof why) ? why : NULL;
    if (stalled) {
        struct cllm_engine *to = cllm_server_fail_over(st->s, st->engine, why);
        if (to && !go_on(st, to))
            return true;
        if (to)
            stalled = NULL;
    }
    if (!cllm_job_give_up(st->req, &st->out, stalled, cllm_now()))
        return false;
    if (stalled)
        cllm_log(CLLM_LOG_ERROR, "a stream ends with the text so far: %s", stalled);
    return true;
}

/* Produces the next events into pending: waits for the engine in short slices, watching for
 * the client leaving and the server stopping. Returns false to abort the stream. */
static bool produce(struct stream *st)
{
    if (st->kind == API_CHAT && !st->role_sent) {
        st->role_sent = true;
        put_chunk(st, "", 0, true, NULL);
        return true;
    }
    if (st->finished) {
        enum cllm_finish_reason r = st->out.reason;
        if (r == CLLM_FINISH_ERROR || r == CLLM_FINISH_CANCELLED)
            put_error(st, st->out.error[0] ? st->out.error : "the generation was cancelled");
        else
            put_chunk(st, NULL, 0, false, cllm_job_finish_reason(r));
        cllm_buf_append(&st->pending, "data: [DONE]\n\n", 14);
        st->done = true;
        return true;
    }
    for (;;) {
        st->out.text.len = 0;
        const bool done = cllm_request_poll(st->req, 50, &st->out);
        if (st->carried) { /* counts on the CPU start from the text carried over */
            st->out.n_prompt = (int32_t)st->prompt.n;
            st->out.n_generated += st->carried;
        }
        if (st->out.text.len) {
            put_chunk(st, st->out.text.data, st->out.text.len, false, NULL);
            if (st->can_resume && cllm_buf_append(&st->said, st->out.text.data, st->out.text.len))
                st->can_resume = false;
        }
        st->finished = done || give_up(st);
        if (st->pending.len || st->finished)
            return true;
        if (atomic_load(&st->s->stopping) || cllm_http_peer_gone(st->fd)) {
            cllm_request_cancel(st->req);
            return false;
        }
        if (cllm_now() - st->t_last > KEEPALIVE_S) {
            cllm_buf_append(&st->pending, ": keep-alive\n\n", 14);
            return true;
        }
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct stream *st = cls;
    while (st->sent == st->pending.len) {
        st->sent = st->pending.len = 0;
        if (st->done)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (!produce(st))
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = st->pending.len - st->sent;
    if (n > max)
        n = max;
    memcpy(buf, st->pending.data + st->sent, n);
    st->sent += n;
    st->t_last = cllm_now();
    return (ssize_t)n;
}

/* Runs when libmicrohttpd drops the response: at the end, or when a write failed because the
 * client went away; then the engine must stop working for nobody. */
static void stream_free(void *cls)
{
    struct stream *st = cls;
    cllm_request_cancel(st->req);
    cllm_request_release(st->req);
    cllm_buf_free(&st->out.text);
    cllm_buf_free(&st->pending);
    cllm_buf_free(&st->said);
    cllm_ids_free(&st->prompt);
    for (size_t i = 0; st->stops && i < st->params.n_stop; i++)
        free(st->stops[i]);
    free(st->stops);
    free(st);
}

/* The copies a stream needs to go on on another engine (struct stream): false when out of
 * memory (the stream then cannot). */
static bool keep_for_resume(struct stream *st, const struct cllm_ids *prompt,
                            const struct cllm_request_params *p)
{
    st->params = *p;
    st->params.stop = NULL;
    st->params.n_stop = 0;
    if (p->n_stop && !(st->stops = calloc(p->n_stop, sizeof *st->stops)))
        return false;
    for (size_t i = 0; i < p->n_stop; i++) {
        if (!(st->stops[i] = strdup(p->stop[i])))
            return false;
        st->params.n_stop = i + 1; /* what stream_free frees */
    }
    st->params.stop = (const char *const *)st->stops;
    return cllm_ids_append(&st->prompt, prompt->v, prompt->n) == CLLM_OK;
}

static enum MHD_Result start_stream(struct cllm_server *s, struct cllm_http_req *hr,
                                    enum api_kind kind)
{
    struct stream *st = calloc(1, sizeof *st);
    if (!st)
        return cllm_http_reply_error(hr, 500, "out of memory");
    st->s = s;
    st->req = hr->job.reqs[0];
    st->engine = hr->job.engine;
    cllm_request_retain(st->req);
    st->kind = kind;
    make_id(s, kind, st->id, sizeof st->id);
    st->created = (int64_t)time(NULL);
    st->fd = hr->fd;
    st->t_last = cllm_now();
    st->can_resume = keep_for_resume(st, &hr->job.prompts[0], hr->job.params);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                                  stream_read, st, stream_free);
    if (!resp) {
        stream_free(st);
        return cllm_http_reply_error(hr, 500, "out of memory");
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    enum MHD_Result ret = cllm_http_reply_response(hr, 200, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* --- shared request handling --- */

/* Fills hr->job from the body (prompts already validated by the caller's parse). */
typedef enum cllm_status (*fill_fn)(struct cllm_server *s, struct cllm_http_req *hr,
                                    const cJSON *root, int32_t *n, char *err, size_t err_len);

static enum cllm_status fill_completion(struct cllm_server *s, struct cllm_http_req *hr,
                                        const cJSON *root, int32_t *n, char *err, size_t err_len)
{
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    bool list = cJSON_IsArray(prompt);
    if (!prompt || cJSON_IsNull(prompt))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "prompt is required");
    if (!list && !cJSON_IsString(prompt))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "prompt must be a string or a list of strings");
    *n = list ? cJSON_GetArraySize(prompt) : 1;
    if (*n == 0)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "prompt is an empty list");
    const cJSON *it = list ? prompt->child : prompt;
    for (int32_t i = 0; i < *n; i++, it = it->next)
        if (!cJSON_IsString(it))
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "prompt[%d] must be a string",
                             (int)i);
    enum cllm_status st = cllm_job_init(&hr->job, *n);
    if (st)
        return cllm_fail(err, err_len, st, "out of memory");
    it = list ? prompt->child : prompt;
    for (int32_t i = 0; i < *n; i++, it = it->next) {
        char what[32];
        snprintf(what, sizeof what, list ? "prompt[%d]" : "prompt", (int)i);
        if ((st = cllm_job_set_text(s, &hr->job, i, what, it->valuestring, strlen(it->valuestring),
                                    err, err_len)))
            return st;
    }
    return CLLM_OK;
}

/* A message's content: a string, null (empty), or a list of {"type": "text", "text": ...}
 * parts, which are concatenated into *owned. */
static enum cllm_status message_content(const cJSON *c, size_t i, struct cllm_buf *owned,
                                        const char **text, size_t *len, char *err, size_t err_len)
{
    if (!c || cJSON_IsNull(c)) {
        *text = "", *len = 0;
        return CLLM_OK;
    }
    if (cJSON_IsString(c)) {
        *text = c->valuestring, *len = strlen(c->valuestring);
        return CLLM_OK;
    }
    if (!cJSON_IsArray(c))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "messages[%zu].content must be a string or a list of text parts", i);
    const cJSON *part;
    cJSON_ArrayForEach(part, c)
    {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(t))
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "messages[%zu].content: only {\"type\": \"text\", \"text\": ...} "
                             "parts are supported",
                             i);
        if (cllm_buf_append(owned, t->valuestring, strlen(t->valuestring)))
            return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    }
    *text = owned->data ? owned->data : "", *len = owned->len;
    return CLLM_OK;
}

static enum cllm_status fill_chat(struct cllm_server *s, struct cllm_http_req *hr,
                                  const cJSON *root, int32_t *n, char *err, size_t err_len)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!msgs || cJSON_IsNull(msgs))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "messages is required");
    if (!cJSON_IsArray(msgs))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "messages must be a list of {\"role\", \"content\"} objects");
    size_t m = (size_t)cJSON_GetArraySize(msgs);
    if (m == 0)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "messages is an empty list");
    *n = 1;
    enum cllm_status st = cllm_job_init(&hr->job, 1);
    if (st)
        return cllm_fail(err, err_len, st, "out of memory");
    struct cllm_chat_message *cm = calloc(m, sizeof *cm);
    struct cllm_buf *parts = calloc(m, sizeof *parts);
    if (!cm || !parts) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
        goto done;
    }
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, msgs)
    {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        if (!cJSON_IsObject(it) || !cJSON_IsString(role)) {
            st = cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                           "messages[%zu] must be an object with a string role", i);
            goto done;
        }
        cm[i].role = role->valuestring;
        if ((st = message_content(cJSON_GetObjectItemCaseSensitive(it, "content"), i, &parts[i],
                                  &cm[i].content, &cm[i].content_len, err, err_len)))
            goto done;
        i++;
    }
    st = cllm_job_set_chat(s, &hr->job, 0, "messages", cm, m, err, err_len);
done:
    for (size_t k = 0; parts && k < m; k++)
        cllm_buf_free(&parts[k]);
    free(parts);
    free(cm);
    return st;
}

static cJSON *whole_response(struct cllm_server *s, struct cllm_http_req *hr, enum api_kind kind)
{
    char id[64];
    make_id(s, kind, id, sizeof id);
    cJSON *o = envelope(s, id, kind == API_CHAT ? "chat.completion" : "text_completion",
                        (int64_t)time(NULL));
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    int64_t n_prompt = 0, n_completion = 0;
    for (int32_t i = 0; i < hr->job.n; i++) {
        const struct cllm_request_output *out = &hr->job.outs[i];
        const char *text = out->text.data ? out->text.data : "";
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToArray(choices, c);
        cJSON_AddNumberToObject(c, "index", i);
        if (kind == API_CHAT) {
            cJSON *msg = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(msg, "role", "assistant");
            cJSON_AddStringToObject(msg, "content", text);
        } else {
            cJSON_AddStringToObject(c, "text", text);
        }
        cJSON_AddNullToObject(c, "logprobs");
        cJSON_AddStringToObject(c, "finish_reason", cllm_job_finish_reason(out->reason));
        n_prompt += out->n_prompt;
        n_completion += out->n_generated;
    }
    cJSON_AddItemToObject(o, "usage", usage_json(n_prompt, n_completion));
    return o;
}

static enum MHD_Result handle(struct cllm_server *s, struct cllm_http_req *hr, enum api_kind kind,
                              fill_fn fill)
{
    enum MHD_Result ret;
    cJSON *root = cllm_http_parse_object(hr, &ret);
    if (!root)
        return ret;
    char err[512];
    enum cllm_status st;
    struct cllm_job_params jp;
    int32_t n = 0;
    const cJSON *stream = cJSON_GetObjectItemCaseSensitive(root, "stream");
    const cJSON *nch = cJSON_GetObjectItemCaseSensitive(root, "n");
    if (stream && !cJSON_IsNull(stream) && !cJSON_IsBool(stream)) {
        ret = cllm_http_reply_error(hr, 400, "stream must be true or false");
        goto done;
    }
    if (nch && !cJSON_IsNull(nch) && (!cJSON_IsNumber(nch) || nch->valuedouble != 1)) {
        ret = cllm_http_reply_error(hr, 400, "n must be 1 (one choice per prompt)");
        goto done;
    }
    if ((st = cllm_job_params_parse(root, &s->defaults, &jp, err, sizeof err)) ||
        (st = fill(s, hr, root, &n, err, sizeof err))) {
        ret = cllm_http_reply_status(hr, st, err);
        goto done;
    }
    bool streaming = cJSON_IsTrue(stream);
    if (streaming && n != 1) {
        ret = cllm_http_reply_error(hr, 400, "stream needs exactly one prompt, got %d", (int)n);
        goto done;
    }
    if (streaming) {
        if ((st = cllm_job_submit(s, &hr->job, &jp.p, hr->waited, err, sizeof err)))
            ret = cllm_http_reply_status(hr, st, err);
        else
            ret = start_stream(s, hr, kind);
        goto done;
    }
    if (!cllm_http_run_job(s, hr, &jp.p, false, &ret))
        goto done;
    ret = cllm_http_reply_json(hr, 200, whole_response(s, hr, kind));
done:
    cJSON_Delete(root);
    return ret;
}

enum MHD_Result cllm_route_completions(struct cllm_server *s, struct cllm_http_req *hr)
{
    return handle(s, hr, API_COMPLETION, fill_completion);
}

enum MHD_Result cllm_route_chat(struct cllm_server *s, struct cllm_http_req *hr)
{
    return handle(s, hr, API_CHAT, fill_chat);
}

enum MHD_Result cllm_route_models(struct cllm_server *s, struct cllm_http_req *hr)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddItemToArray(data, m);
    cJSON_AddStringToObject(m, "id", s->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->t_created);
    cJSON_AddStringToObject(m, "owned_by", "cllm");
    if (cllm_server_ready(s))
        cJSON_AddNumberToObject(m, "max_model_len", cllm_engine_n_ctx(cllm_server_engine(s)));
    return cllm_http_reply_json(hr, 200, o);
}
