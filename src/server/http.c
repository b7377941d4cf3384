/*
 * libmicrohttpd glue: the routing table, the per-request state machine of the access handler
 * (headers -> early rejections -> body -> handler), replies, and the completion callback that
 * ends jobs, logs the request and counts it.
 */
#include "server/http.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.h"
#include "server/custody.h"
#include "server/routes.h"

static const struct cllm_route routes[] = {
    {"/", "GET", true, false, cllm_route_health},
    {"/health", "GET", true, false, cllm_route_health},
    {"/predict", "POST", false, true, cllm_route_predict},
    {"/v1/completions", "POST", false, true, cllm_route_completions},
    {"/v1/chat/completions", "POST", false, true, cllm_route_chat},
    {"/v1/models", "GET", false, false, cllm_route_models},
    {"/metrics", "GET", false, false, cllm_route_metrics},
};

static const struct cllm_route *find_route(const char *url)
{
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(routes[i].path, url))
            return &routes[i];
    return NULL;
}

static bool method_allowed(const struct cllm_route *r, const char *method)
{
    if (!strcmp(r->method, "GET"))
        return !strcmp(method, "GET") || !strcmp(method, "HEAD");
    return !strcmp(method, r->method);
}

/* --- replies --- */

static const char *error_type(unsigned status)
{
    switch (status) {
    case 400:
        return "invalid_request_error";
    case 401:
        return "authentication_error";
    case 404:
        return "not_found_error";
    case 405:
        return "method_not_allowed_error";
    case 413:
        return "request_too_large_error";
    case 429:
        return "rate_limit_error";
    case 503:
        return "service_unavailable_error";
    default:
        return "server_error";
    }
}

enum MHD_Result cllm_http_reply_response(struct cllm_http_req *hr, unsigned status,
                                         struct MHD_Response *resp)
{
    /* Headers every error needs, so no call site can forget them. */
    if (status == 405 && hr->route)
        MHD_add_response_header(resp, "Allow",
                                strcmp(hr->route->method, "GET") ? hr->route->method : "GET, HEAD");
    else if (status == 401)
        MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    else if (status == 429)
        MHD_add_response_header(resp, "Retry-After", "1");
    else if (status == 503)
        MHD_add_response_header(resp, "Retry-After", "5");
    cllm_custody_release(hr->srv, hr); /* before a byte of it can reach the client */
    enum MHD_Result ret = MHD_queue_response(hr->conn, status, resp);
    hr->answered = true;
    hr->status = status;
    return ret;
}

static enum MHD_Result reply_text(struct cllm_http_req *hr, unsigned status, char *text, size_t len,
                                  const char *type)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer_with_free_callback(len, text, free);
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", type);
    enum MHD_Result ret = cllm_http_reply_response(hr, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

enum MHD_Result cllm_http_reply_json(struct cllm_http_req *hr, unsigned status, cJSON *body)
{
    char *text = body ? cJSON_PrintUnformatted(body) : NULL;
    cJSON_Delete(body);
    if (!text) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}";
        struct MHD_Response *resp =
            MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (!resp)
            return MHD_NO;
        MHD_add_response_header(resp, "Content-Type", "application/json");
        enum MHD_Result ret = cllm_http_reply_response(hr, 500, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    return reply_text(hr, status, text, strlen(text), "application/json");
}

enum MHD_Result cllm_http_reply_error(struct cllm_http_req *hr, unsigned status, const char *fmt,
                                      ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    if (e) {
        cJSON_AddStringToObject(e, "message", msg);
        cJSON_AddStringToObject(e, "type", error_type(status));
    }
    return cllm_http_reply_json(hr, status, e ? root : (cJSON_Delete(root), NULL));
}

enum MHD_Result cllm_http_reply_status(struct cllm_http_req *hr, enum cllm_status st,
                                       const char *msg)
{
    unsigned status = 500;
    if (st == CLLM_ERR_BUSY)
        status = 429;
    else if (st == CLLM_ERR_DEVICE) /* the device is lost (engine.h): nothing will run */
        status = 503;
    else if (st == CLLM_ERR_RANGE || st == CLLM_ERR_INVALID_ARG || st == CLLM_ERR_FORMAT)
        status = 400;
    return cllm_http_reply_error(hr, status, "%s", msg);
}

cJSON *cllm_http_parse_object(struct cllm_http_req *hr, enum MHD_Result *ret)
{
    const char *end = NULL;
    const char *text = hr->body.data ? hr->body.data : "";
    cJSON *root = cJSON_ParseWithLengthOpts(text, hr->body.len, &end, false);
    if (!root) {
        if (hr->body.len == 0) {
            *ret = cllm_http_reply_error(hr, 400, "the request body is empty: send a JSON object");
        } else {
            size_t at = end && end >= text ? (size_t)(end - text) : 0;
            *ret = cllm_http_reply_error(hr, 400,
                                         "malformed JSON in the request body (near byte %zu)", at);
        }
        return NULL;
    }
    /* Trailing garbage after the value is malformed too. */
    while (end && (size_t)(end - text) < hr->body.len &&
           (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t'))
        end++;
    if (end && (size_t)(end - text) < hr->body.len) {
        cJSON_Delete(root);
        *ret = cllm_http_reply_error(hr, 400,
                                     "malformed JSON: unexpected data after the value (byte %zu)",
                                     (size_t)(end - text));
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        *ret = cllm_http_reply_error(hr, 400, "the request body must be a JSON object");
        return NULL;
    }
    return root;
}

bool cllm_http_peer_gone(int fd)
{
    if (fd < 0)
        return false;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0)
        return false;
    if (p.revents & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP))
        return true;
    if (p.revents & POLLIN) {
        /* Readable while we owe the answer: either a pipelined request (still there) or EOF. */
        char c;
        ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    return false;
}

/* --- the request state machine --- */

/* Bytes of a rejected body read and dropped before hanging up instead. */
static unsigned long long drain_limit(const struct cllm_server *s)
{
    return 4ULL * s->cfg.max_body + (1 << 20);
}

static bool authorized(const struct cllm_server *s, struct MHD_Connection *conn)
{
    const char *key = s->cfg.api_key;
    if (!key || !key[0])
        return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    /* Compare in time independent of where the strings differ. */
    size_t n = strlen(key), m = strlen(h);
    unsigned char diff = n != m;
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < m ? h[i] : 0);
    return diff == 0;
}

static void sanitize(char *dst, size_t cap, const char *src)
{
    size_t i = 0;
    for (; src && src[i] && i + 1 < cap; i++) {
        unsigned char c = (unsigned char)src[i];
        dst[i] = c < 0x21 || c > 0x7e || c == '"' ? '?' : (char)c;
    }
    dst[i] = 0;
}

static void reject(struct cllm_http_req *hr, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reject(struct cllm_http_req *hr, unsigned status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(hr->reject, sizeof hr->reject, fmt, ap);
    va_end(ap);
    hr->reject_status = status;
}

/* Decisions made from the headers alone. A rejection is answered once the body has been read
 * and dropped: answering first and closing with unread bytes makes the kernel reset the
 * connection, and the client may never see the answer. Only a body declared far beyond the
 * limit is refused at once. */
static enum MHD_Result on_headers(struct cllm_server *s, struct cllm_http_req *hr,
                                  const char *method)
{
    if (!hr->route)
        reject(hr, 404, "no route %s %s", hr->method, hr->url);
    else if (!method_allowed(hr->route, method))
        reject(hr, 405, "%s does not accept %s (use %s)", hr->route->path, hr->method,
               hr->route->method);
    else if (!hr->route->open && !authorized(s, hr->conn))
        reject(hr, 401, "missing or wrong API key: send Authorization: Bearer <key>");
    const char *cl = MHD_lookup_connection_value(hr->conn, MHD_HEADER_KIND, "Content-Length");
    unsigned long long n = 0;
    if (cl) {
        char *end;
        errno = 0;
        n = strtoull(cl, &end, 10);
        if (errno || end == cl)
            n = 0;
    }
    if (!hr->reject_status && n > s->cfg.max_body)
        reject(hr, 413, "the request body has %llu bytes; the limit is %zu", n, s->cfg.max_body);
    if (hr->reject_status && n > drain_limit(s))
        return cllm_http_reply_error(hr, hr->reject_status, "%s", hr->reject);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    (void)version;
    struct cllm_server *s = cls;
    struct cllm_http_req *hr = *con_cls;
    if (!hr) {
        hr = calloc(1, sizeof *hr);
        if (!hr)
            return MHD_NO;
        *con_cls = hr;
        hr->srv = s;
        hr->conn = conn;
        hr->t_start = cllm_now();
        hr->route = find_route(url);
        sanitize(hr->method, sizeof hr->method, method);
        sanitize(hr->url, sizeof hr->url, url);
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        hr->fd = ci ? ci->connect_fd : -1;
        const double received = cllm_custody_received(hr);
        if (received > 0) {
            hr->waited = hr->t_start - received;
            hr->t_start = received;
        }
        cllm_custody_replay_header(hr);
        return on_headers(s, hr, method);
    }
    if (hr->answered) {
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        hr->n_read += n;
        /* Past the limit (a chunked body has no Content-Length): read on, keep nothing, answer
         * 413 once the body is over; past the drain limit, hang up. */
        if (hr->n_read > s->cfg.max_body + hr->progress_len && !hr->reject_status)
            reject(hr, 413, "the request body is larger than %zu bytes", s->cfg.max_body);
        if (hr->reject_status) {
            cllm_buf_free(&hr->body);
            return hr->n_read > drain_limit(s) ? MHD_NO : MHD_YES;
        }
        return cllm_buf_append(&hr->body, upload_data, n) == CLLM_OK ? MHD_YES : MHD_NO;
    }
    if (hr->reject_status)
        return cllm_http_reply_error(hr, hr->reject_status, "%s", hr->reject);
    cllm_custody_split_progress(hr);
    if (hr->route->needs_model && !cllm_server_ready(s))
        return cllm_http_reply_error(hr, 503,
                                     atomic_load(&s->stopping) ? "the server is shutting down"
                                                               : "the model is loading");
    if (hr->route->needs_model) /* a request that may take long to answer */
        cllm_custody_take(s, hr, method);
    return hr->route->handle(s, hr);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)conn;
    struct cllm_server *s = cls;
    struct cllm_http_req *hr = *con_cls;
    if (!hr)
        return;
    *con_cls = NULL;
    cllm_custody_release(s, hr);
    cllm_job_finish(&hr->job, &s->metrics);
    /* 499 (nginx's "client closed request"): the client left before an answer was queued. */
    unsigned status = hr->answered ? hr->status : 499;
    double dt = cllm_now() - hr->t_start;
    cllm_metrics_count_request(&s->metrics, hr->route ? hr->route->path : "other", status, dt);
    cllm_log(CLLM_LOG_INFO, "%s %s %u prompt_tokens=%lld completion_tokens=%lld %.3f s%s",
             hr->method, hr->url, status, (long long)hr->job.n_prompt_tokens,
             (long long)hr->job.n_completion_tokens, dt,
             toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" : " (connection closed early)");
    cllm_buf_free(&hr->body);
    cllm_buf_free(&hr->progress);
    free(hr);
}

/* libmicrohttpd's complaints that a socket takes no TCP options: a keeper's replay comes on
 * a local socket (custody.h), where they fail every time and harm nothing. */
static bool about_tcp_options(const char *line)
{
    static const char *const known[] = {
        "Setting TCP_NODELAY option",
        "Setting TCP_CORK option",
        "Failed to push the data from buffers to the network",
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strncmp(line, known[i], strlen(known[i])))
            return true;
    return false;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = 0;
    cllm_log(about_tcp_options(line) ? CLLM_LOG_DEBUG : CLLM_LOG_WARN, "http: %s", line);
}

enum cllm_status cllm_http_start(struct cllm_server *s, char *err, size_t err_len)
{
    /* One thread per connection: a handler may block for a whole generation, and a client
     * that sends half a request stalls only its own thread until the idle timeout. poll()
     * instead of select() so descriptors above FD_SETSIZE work. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER,
                                 mhd_log, s, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)s->listen_fd,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)s->cfg.timeout_s,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned int)s->cfg.max_connections,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_END);
    if (!s->daemon) {
        snprintf(err, err_len, "cannot start the HTTP daemon (libmicrohttpd)");
        return CLLM_ERR_IO;
    }
    return CLLM_OK;
}

void cllm_http_quiesce(struct cllm_server *s)
{
    if (!s->daemon || s->listen_fd < 0)
        return;
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET)
        close(fd);
    s->listen_fd = -1;
}

void cllm_http_stop(struct cllm_server *s)
{
    if (s->daemon)
        MHD_stop_daemon(s->daemon);
    s->daemon = NULL;
}

/* Sets j to go on from what a dead serving process had generated for it (custody.h). */
static void go_on(struct cllm_server *s, struct cllm_job *j, const struct cllm_buf *progress)
{
    if (!cllm_job_go_on(j, progress->data, progress->len)) {
        cllm_log(CLLM_LOG_WARN, "custody: a replay's progress does not fit its request: it starts "
                                "again from its prompts");
        return;
    }
    int32_t complete = 0;
    int64_t tokens = 0;
    for (int32_t i = 0; i < j->n; i++) {
        complete += j->outs[i].finished;
        tokens += j->carried[i];
    }
    atomic_fetch_add(&s->metrics.replayed_tokens, (uint_fast64_t)tokens);
    cllm_log(CLLM_LOG_INFO,
             "custody: a replayed request goes on from the %lld tokens a dead process had "
             "generated (%d of its %d answers complete)",
             (long long)tokens, (int)complete, (int)j->n);
}

bool cllm_http_run_job(struct cllm_server *s, struct cllm_http_req *hr,
                       const struct cllm_request_params *p, bool list, enum MHD_Result *ret)
{
    char err[512];
    if (hr->progress.len) /* a replay of a request a dead process had begun */
        go_on(s, &hr->job, &hr->progress);
    if (hr->progress_id) {
        hr->job.report = cllm_custody_report;
        hr->job.report_ctx = hr;
    }
    enum cllm_status st = cllm_job_submit(s, &hr->job, p, hr->waited, err, sizeof err);
    if (st) {
        *ret = cllm_http_reply_status(hr, st, err);
        return false;
    }
    switch (cllm_job_wait(s, &hr->job, hr->fd)) {
    case CLLM_JOB_CLIENT_GONE:
        *ret = MHD_NO;
        return false;
    case CLLM_JOB_STOPPING:
        *ret = cllm_http_reply_error(hr, 503, "the server is shutting down");
        return false;
    case CLLM_JOB_DONE:
        break;
    }
    int32_t bad = cllm_job_failed(&hr->job);
    if (bad < 0)
        return true;
    const char *why = hr->job.outs[bad].error;
    char what[32];
    snprintf(what, sizeof what, list ? "prompt[%d]" : "prompt", (int)bad);
    *ret = cllm_http_reply_error(hr, 500, "%s: generation failed: %s", what,
                                 why[0] ? why : "cancelled");
    return false;
}
