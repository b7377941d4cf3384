/*
 * Custody of the requests a serving process owes answers to, so that one that dies (keeper.h)
 * does not take them with it. Before a generation route runs, the serving process sends its
 * keeper a copy of the connection's socket (SCM_RIGHTS) and the request, rebuilt as bytes;
 * when the answer is queued, or the request ends without one, it tells the keeper to let go.
 * Holding a copy of the socket keeps the client's connection open after the process died; the
 * keeper then sends each request it still holds to the next serving process once that one is
 * ready (owed.h), as a new connection whose answer it copies back to the client. A request
 * whose answer had begun to be sent (a stream, or a response being written when the process
 * died) is not sent again: its connection closes, as before.
 *
 * Progress: while a whole answer is generated, the serving process reports its text so far
 * to the keeper about once a second (progress.h); a replay carries the last report, and the
 * next process goes on from it (cllm_job_go_on) rather than from the prompt. A replayed
 * request reports its own progress under the number its replay gave it, so a second death
 * loses no more than the first.
 *
 * The messages on the socket pair between the two (a stream socket; each message a header and
 * `len` bytes):
 *   TAKE     serving process -> keeper, with the connection's socket; the bytes: the request
 *   RELEASE  serving process -> keeper; the keeper closes its copy
 *   PROGRESS serving process -> keeper; the bytes: the answers so far (progress.h) of the
 *            request taken as id, or replayed as id; they replace the last
 *   REPLAY   keeper -> serving process, with one end of a socket pair: serve it as a connection
 */
#ifndef CLLM_SERVER_CUSTODY_H
#define CLLM_SERVER_CUSTODY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/buf.h"
#include "core/status.h"

#define CLLM_KEEPER_ENV_CUSTODY "CLLM_KEEPER_CUSTODY_FD" /* the serving process's end */

enum cllm_custody_type {
    CLLM_CUSTODY_TAKE = 0x54414b45,     /* "TAKE" */
    CLLM_CUSTODY_RELEASE = 0x52454c53,  /* "RELS" */
    CLLM_CUSTODY_REPLAY = 0x52504c59,   /* "RPLY" */
    CLLM_CUSTODY_PROGRESS = 0x50524f47, /* "PROG" */
};

/* The keeper numbers replays with this bit set, so their progress never takes the number of a
 * request a serving process holds. */
#define CLLM_CUSTODY_REPLAY_BIT ((uint64_t)1 << 63)

struct cllm_custody_msg {
    uint32_t type; /* enum cllm_custody_type */
    uint32_t len;  /* bytes that follow */
    uint64_t id;   /* the request's number in the serving process */
};

/* A request larger than this is not taken into custody (the body limit is far below). */
#define CLLM_CUSTODY_MAX_LEN ((uint32_t)1 << 30)

/* One header of a request, as received. */
struct cllm_custody_header {
    const char *name;
    const char *value;
};

/* The header a replayed request carries: when the first serving process received it
 * (CLOCK_MONOTONIC seconds, which every process on the machine shares), so that its max_time
 * and its duration count from then. Taken only on a connection from the keeper. */
#define CLLM_CUSTODY_RECEIVED "X-Cllm-Received"

/* The header a replay carries: "ID N": the number to report the replay's progress under,
 * and the length of the progress to go on from, which follows the body (counted in its
 * Content-Length; N may be 0). Taken only on a connection from the keeper. */
#define CLLM_CUSTODY_PROGRESS_HEADER "X-Cllm-Progress"

/* Writes the request as HTTP/1.1 bytes into out (appended): the request line, the headers
 * except those about the connection and the body's framing (Connection, Keep-Alive,
 * Content-Length, Transfer-Encoding, Expect, TE, Upgrade, Proxy-Connection) and any
 * X-Cllm-Received or X-Cllm-Progress, then "X-Cllm-Received: received", "Content-Length: len"
 * and "Connection: close" (the keeper passes one answer back, then closes), then the body.
 * Headers whose name or value hold CR or LF are left out. */
enum cllm_status cllm_custody_request_bytes(struct cllm_buf *out, const char *method,
                                            const char *path,
                                            const struct cllm_custody_header *headers,
                                            size_t n_headers, double received, const char *body,
                                            size_t len);

/* The keeper's replay of req (bytes cllm_custody_request_bytes wrote) into out (appended):
 * req with "X-Cllm-Progress: id n" added and progress[0..n) after its body, its
 * Content-Length grown by n. CLLM_ERR_FORMAT when req is not such bytes. */
enum cllm_status cllm_custody_replay_bytes(struct cllm_buf *out, const char *req, size_t len,
                                           uint64_t id, const void *progress, size_t n);

/* Sends one message (with fd attached when fd >= 0) on sock, whole: a stream socket may take
 * it in parts. MSG_NOSIGNAL; a send that times out (SO_SNDTIMEO) part-way fails. */
enum cllm_status cllm_custody_send(int sock, const struct cllm_custody_msg *m, const void *bytes,
                                   int fd);

/* One recvmsg on sock (flags as recvmsg's, MSG_CMSG_CLOEXEC added): up to len bytes into buf,
 * and the descriptors that came with them appended to fds (at most max_fds in all; *n_fds
 * counts them; any beyond are closed and *lost set). Returns recvmsg's result. */
ssize_t cllm_custody_recv(int sock, void *buf, size_t len, int flags, int *fds, size_t max_fds,
                          size_t *n_fds, bool *lost);

struct cllm_server;
struct cllm_http_req;
struct cllm_job;

/* In a serving process a keeper started: the end of the custody socket pair it was given
 * (made close-on-exec), or -1 (no keeper, or an invalid word from it). */
int cllm_custody_child_fd(void);

/* Starts taking replayed connections from the keeper (after the HTTP daemon started); the
 * server's cfg.custody_fd < 0: nothing to do. */
enum cllm_status cllm_custody_start(struct cllm_server *s);
/* Stops taking them (before the HTTP daemon stops); the socket stays open for releases. */
void cllm_custody_stop(struct cllm_server *s);

/* Gives the keeper a copy of hr's connection and its request, before the route handler
 * runs. Does nothing without a keeper, for a connection the keeper replayed (it holds the
 * other end already), or after the socket failed once. */
void cllm_custody_take(struct cllm_server *s, struct cllm_http_req *hr, const char *method);
/* For a request the keeper replayed: when the first serving process received it (monotonic
 * seconds, its X-Cllm-Received); 0 for any other. */
double cllm_custody_received(struct cllm_http_req *hr);

/* For a request the keeper replayed, from its X-Cllm-Progress: sets hr->progress_id and
 * hr->progress_len (the bytes of progress the body ends with, cllm_custody_split_progress).
 * Nothing for any other request. */
void cllm_custody_replay_header(struct cllm_http_req *hr);
/* Once hr's body is complete: moves the progress it ends with into hr->progress. */
void cllm_custody_split_progress(struct cllm_http_req *hr);

/* Reports the answers so far of job j, the job of the request hr (a struct cllm_http_req),
 * to the keeper (cllm_job.report): a replay then goes on from them. */
void cllm_custody_report(void *hr, const struct cllm_job *j);

/* Tells the keeper to let hr's connection go (an answer is queued, or the request ended):
 * a request it holds is only ever answered once. Safe to call twice. */
void cllm_custody_release(struct cllm_server *s, struct cllm_http_req *hr);

#endif
