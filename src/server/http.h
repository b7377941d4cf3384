/*
 * The HTTP layer on libmicrohttpd: one thread per connection (a slow client holds only its own
 * thread), an idle timeout and a connection limit, the routing table, authentication, request
 * bodies accumulated up to max_body, JSON and error replies, and the per-request log line and
 * metrics. Route handlers (routes.h) receive a struct cllm_http_req with the whole body and
 * answer with one of the reply functions below.
 */
#ifndef CLLM_SERVER_HTTP_H
#define CLLM_SERVER_HTTP_H

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/buf.h"
#include "server/job.h"
#include "server/server.h"

struct cllm_http_req;
typedef enum MHD_Result (*cllm_route_fn)(struct cllm_server *s, struct cllm_http_req *hr);

struct cllm_route {
    const char *path;   /* exact match; also the metrics label */
    const char *method; /* "GET" (HEAD is accepted too) or "POST" */
    bool open;          /* answers without the API key */
    bool needs_model;   /* 503 until the model is loaded and warmed up */
    cllm_route_fn handle;
};

/* One HTTP request on a connection, from its headers to the end of its response. */
struct cllm_http_req {
    struct cllm_server *srv;
    struct MHD_Connection *conn;
    const struct cllm_route *route; /* NULL for an unknown path */
    char method[16];                /* sanitised for the log and messages */
    char url[96];                   /* sanitised for the log and messages */
    struct cllm_buf body;           /* the request body, NUL-terminated once complete */
    uint64_t n_read;                /* body bytes received */
    unsigned reject_status; /* non-zero: answered with this error once the body is drained */
    char reject[256];       /* its message */
    bool answered;          /* a response was queued */
    unsigned status;        /* the response's status code */
    double t_start;         /* monotonic seconds at the first header (for a replayed request:
                               when the first serving process received it) */
    double waited;          /* a replayed request: seconds it spent before this process got it */
    int fd;                 /* the connection's socket, to notice a client that went away */
    uint64_t custody_id;    /* non-zero while the keeper holds a copy of it (custody.h) */
    uint64_t progress_id;   /* the number its progress is reported to the keeper under (0:
                               none): its custody_id, or its replay's */
    size_t progress_len;    /* a replay: bytes of progress its body ends with, until split */
    struct cllm_buf progress; /* a replay: the progress to go on from (progress.h) */
    struct cllm_job job;    /* the engine requests behind this HTTP request, if any */
};

/* Starts the daemon on the bound, listening socket s->listen_fd. */
enum cllm_status cllm_http_start(struct cllm_server *s, char *err, size_t err_len);
/* Stops accepting connections (the listening socket is closed); running ones go on. */
void cllm_http_quiesce(struct cllm_server *s);
/* Closes every connection and waits for their threads. */
void cllm_http_stop(struct cllm_server *s);

/* Queues `body` (taken over and freed) as a JSON response. */
enum MHD_Result cllm_http_reply_json(struct cllm_http_req *hr, unsigned status, cJSON *body);
/* Queues {"error": {"message": ..., "type": ...}} with the type that goes with status. */
enum MHD_Result cllm_http_reply_error(struct cllm_http_req *hr, unsigned status, const char *fmt,
                                      ...) __attribute__((format(printf, 3, 4)));
/* Maps an engine/job status to an error reply: BUSY -> 429, RANGE/INVALID_ARG/FORMAT -> 400,
 * anything else -> 500. */
enum MHD_Result cllm_http_reply_status(struct cllm_http_req *hr, enum cllm_status st,
                                       const char *msg);
/* Queues a prepared response (e.g. a stream) with status; resp stays the caller's to destroy. */
enum MHD_Result cllm_http_reply_response(struct cllm_http_req *hr, unsigned status,
                                         struct MHD_Response *resp);

/* True when the peer of fd has closed its end (or the socket failed): nobody will read the
 * answer. Never blocks. */
bool cllm_http_peer_gone(int fd);

/* Submits hr's prepared job and waits for it. True when every prompt finished; otherwise the
 * reply (an error, or dropping the connection of a client that left) is queued, *ret is set
 * and false is returned. `list` names failing prompts as prompt[i] rather than prompt. */
bool cllm_http_run_job(struct cllm_server *s, struct cllm_http_req *hr,
                       const struct cllm_request_params *p, bool list, enum MHD_Result *ret);

/* Parses the body as a JSON object; on failure queues a 400 and returns NULL with *ret set. */
cJSON *cllm_http_parse_object(struct cllm_http_req *hr, enum MHD_Result *ret);

#endif
