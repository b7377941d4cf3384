/* The serving process's side of custody.h: the request rebuilt as bytes, the messages to the
 * keeper, and the thread that serves the connections the keeper replays. */
#include "server/custody.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "core/log.h"
#include "engine/request.h"
#include "server/http.h"
#include "server/progress.h"

/* --- the request as bytes --- */

static bool hop_by_hop(const char *name)
{
    static const char *const dropped[] = {
        "Connection",
        "Keep-Alive",
        "Content-Length",
        "Transfer-Encoding",
        "Expect",
        "TE",
        "Upgrade",
        "Proxy-Connection",
        CLLM_CUSTODY_RECEIVED,        /* ours is added */
        CLLM_CUSTODY_PROGRESS_HEADER, /* only a keeper's replay has one */
    };
    for (size_t i = 0; i < sizeof dropped / sizeof dropped[0]; i++)
        if (!strcasecmp(name, dropped[i]))
            return true;
    return false;
}

static bool clean(const char *s)
{
    return s && !strpbrk(s, "\r\n");
}

enum cllm_status cllm_custody_request_bytes(struct cllm_buf *out, const char *method,
                                            const char *path,
                                            const struct cllm_custody_header *headers,
                                            size_t n_headers, double received, const char *body,
                                            size_t len)
{
    if (!clean(method) || !clean(path) || strchr(method, ' ') || strchr(path, ' '))
        return CLLM_ERR_INVALID_ARG;
    enum cllm_status st = cllm_buf_appendf(out, "%s %s HTTP/1.1\r\n", method, path);
    for (size_t i = 0; i < n_headers && !st; i++) {
        const struct cllm_custody_header *h = &headers[i];
        if (clean(h->name) && h->name[0] && !strchr(h->name, ':') && clean(h->value) &&
            !hop_by_hop(h->name))
            st = cllm_buf_appendf(out, "%s: %s\r\n", h->name, h->value);
    }
    if (!st)
        st = cllm_buf_appendf(out, "%s: %.6f\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                              CLLM_CUSTODY_RECEIVED, received, len);
    if (!st && len)
        st = cllm_buf_append(out, body, len);
    return st;
}

static const char *find(const char *hay, size_t n, const char *needle)
{
    return memmem(hay, n, needle, strlen(needle));
}

enum cllm_status cllm_custody_replay_bytes(struct cllm_buf *out, const char *req, size_t len,
                                           uint64_t id, const void *progress, size_t n)
{
    /* The head is ours (cllm_custody_request_bytes): no CR or LF inside a line, one
     * Content-Length, the body right after the blank line. */
    static const char length_line[] = "\r\nContent-Length: ";
    const char *end = find(req, len, "\r\n\r\n");
    const char *cl = end ? find(req, (size_t)(end - req), length_line) : NULL;
    if (!cl)
        return CLLM_ERR_FORMAT;
    const char *num = cl + strlen(length_line);
    char *after;
    errno = 0;
    const unsigned long long body = strtoull(num, &after, 10);
    const char *body_at = end + 4;
    if (errno || after == num || after[0] != '\r' || after[1] != '\n' ||
        body != (unsigned long long)(req + len - body_at))
        return CLLM_ERR_FORMAT;
    enum cllm_status st = cllm_buf_append(out, req, (size_t)(cl - req));
    if (!st)
        st = cllm_buf_appendf(out, "%s%llu", length_line, body + n);
    if (!st)
        st = cllm_buf_append(out, after, (size_t)(end - after));
    if (!st)
        st = cllm_buf_appendf(out, "\r\n%s: %llu %zu\r\n\r\n", CLLM_CUSTODY_PROGRESS_HEADER,
                              (unsigned long long)id, n);
    if (!st)
        st = cllm_buf_append(out, body_at, (size_t)body);
    if (!st && n)
        st = cllm_buf_append(out, progress, n);
    return st;
}

/* --- messages --- */

enum cllm_status cllm_custody_send(int sock, const struct cllm_custody_msg *m, const void *bytes,
                                   int fd)
{
    struct iovec iov[2] = {{(void *)m, sizeof *m}, {(void *)bytes, bytes ? m->len : 0}};
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    if (fd >= 0) {
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof ctl.space;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    size_t left = iov[0].iov_len + iov[1].iov_len;
    while (left > 0) {
        ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return CLLM_ERR_IO;
        left -= (size_t)n;
        mh.msg_control = NULL; /* the descriptor went with the first part */
        mh.msg_controllen = 0;
        while (n > 0 && mh.msg_iovlen > 0) { /* skip what was sent */
            size_t k = (size_t)n < mh.msg_iov->iov_len ? (size_t)n : mh.msg_iov->iov_len;
            mh.msg_iov->iov_base = (char *)mh.msg_iov->iov_base + k;
            mh.msg_iov->iov_len -= k;
            n -= (ssize_t)k;
            if (mh.msg_iov->iov_len == 0) {
                mh.msg_iov++;
                mh.msg_iovlen--;
            }
        }
    }
    return CLLM_OK;
}

/* --- the serving process --- */

int cllm_custody_child_fd(void)
{
    const char *s = getenv(CLLM_KEEPER_ENV_CUSTODY);
    if (!s)
        return -1;
    char *end;
    errno = 0;
    long fd = strtol(s, &end, 10);
    unsetenv(CLLM_KEEPER_ENV_CUSTODY);
    if (errno || end == s || *end || fd <= 2 || fd > 1 << 30)
        return -1;
    int type = 0;
    socklen_t tl = sizeof type;
    if (getsockopt((int)fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM)
        return -1;
    fcntl((int)fd, F_SETFD, FD_CLOEXEC); /* a GPU probe started from here must not hold it */
    /* A keeper that stops reading must not stall a request for long: its take then fails,
     * and custody ends for this process (the request is served without it). */
    struct timeval tv = {2, 0};
    setsockopt((int)fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return (int)fd;
}

/* Gives up custody for the rest of this process's life (a message that failed part-way would
 * leave the stream unreadable): the keeper sees the end of the stream and lets every copy go.
 * Called with custody_lock held. */
static void custody_broken(struct cllm_server *s, const char *what)
{
    if (atomic_exchange(&s->custody_broken, true))
        return;
    cllm_log(CLLM_LOG_WARN,
             "custody: %s (%s): requests are no longer kept for a restart if this process dies",
             what, strerror(errno));
    shutdown(s->custody_fd, SHUT_WR);
}

struct header_list {
    struct cllm_custody_header *h;
    size_t n, cap;
    bool failed;
};

static enum MHD_Result collect_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                      const char *value)
{
    (void)kind;
    struct header_list *l = cls;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        struct cllm_custody_header *h = realloc(l->h, cap * sizeof *h);
        if (!h) {
            l->failed = true;
            return MHD_NO;
        }
        l->h = h;
        l->cap = cap;
    }
    l->h[l->n++] = (struct cllm_custody_header){key, value ? value : ""};
    return MHD_YES;
}

/* True for a connection the keeper replayed: one end of a local socket pair. */
static bool from_keeper(int fd)
{
    int domain = 0;
    socklen_t dl = sizeof domain;
    return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) == 0 && domain == AF_UNIX;
}

void cllm_custody_take(struct cllm_server *s, struct cllm_http_req *hr, const char *method)
{
    if (s->custody_fd < 0 || atomic_load(&s->custody_broken) || hr->fd < 0 || from_keeper(hr->fd))
        return;
    struct header_list l = {0};
    MHD_get_connection_values(hr->conn, MHD_HEADER_KIND, collect_header, &l);
    struct cllm_buf req = {0};
    enum cllm_status st =
        l.failed ? CLLM_ERR_NOMEM
                 : cllm_custody_request_bytes(&req, method, hr->route->path, l.h, l.n, hr->t_start,
                                              hr->body.data, hr->body.len);
    free(l.h);
    if (st || req.len > CLLM_CUSTODY_MAX_LEN) {
        cllm_log(CLLM_LOG_WARN, "custody: cannot keep %s %s for a restart: %s", hr->method, hr->url,
                 cllm_status_str(st ? st : CLLM_ERR_RANGE));
        cllm_buf_free(&req);
        return;
    }
    pthread_mutex_lock(&s->custody_lock);
    const uint64_t id = ++s->custody_next_id;
    const struct cllm_custody_msg m = {CLLM_CUSTODY_TAKE, (uint32_t)req.len, id};
    if (!atomic_load(&s->custody_broken)) {
        if (cllm_custody_send(s->custody_fd, &m, req.data, hr->fd) == CLLM_OK)
            hr->custody_id = hr->progress_id = id;
        else
            custody_broken(s, "cannot hand a request to the keeper");
    }
    pthread_mutex_unlock(&s->custody_lock);
    cllm_buf_free(&req);
}

double cllm_custody_received(struct cllm_http_req *hr)
{
    const char *v = MHD_lookup_connection_value(hr->conn, MHD_HEADER_KIND, CLLM_CUSTODY_RECEIVED);
    if (!v || hr->fd < 0 || !from_keeper(hr->fd))
        return 0;
    char *end;
    errno = 0;
    const double t = strtod(v, &end);
    /* (a time to come, or none, is no word of a keeper's) */
    return errno || end == v || *end || !(t > 0) || t > cllm_now() ? 0 : t;
}

void cllm_custody_replay_header(struct cllm_http_req *hr)
{
    const char *v =
        MHD_lookup_connection_value(hr->conn, MHD_HEADER_KIND, CLLM_CUSTODY_PROGRESS_HEADER);
    if (!v || hr->fd < 0 || !from_keeper(hr->fd))
        return;
    unsigned long long id = 0, n = 0;
    int used = 0;
    if (sscanf(v, "%llu %llu%n", &id, &n, &used) != 2 || v[used] ||
        !(id & CLLM_CUSTODY_REPLAY_BIT) || n > CLLM_PROGRESS_MAX_LEN) {
        cllm_log(CLLM_LOG_WARN, "custody: a replay with a bad %s header: it starts again",
                 CLLM_CUSTODY_PROGRESS_HEADER);
        return;
    }
    hr->progress_id = id;
    hr->progress_len = (size_t)n;
}

void cllm_custody_split_progress(struct cllm_http_req *hr)
{
    const size_t n = hr->progress_len;
    if (!n)
        return;
    hr->progress_len = 0;
    if (hr->body.len < n) {
        cllm_log(CLLM_LOG_WARN, "custody: a replay shorter than its progress: it starts again");
        return;
    }
    hr->body.len -= n;
    if (cllm_buf_append(&hr->progress, hr->body.data + hr->body.len, n) != CLLM_OK)
        cllm_buf_free(&hr->progress); /* (it goes on from the prompts) */
    hr->body.data[hr->body.len] = '\0';
}

void cllm_custody_report(void *ctx, const struct cllm_job *j)
{
    struct cllm_http_req *hr = ctx;
    struct cllm_server *s = hr->srv;
    if (!hr->progress_id || s->custody_fd < 0 || atomic_load(&s->custody_broken))
        return;
    struct cllm_buf bytes = {0};
    if (cllm_progress_encode(&bytes, j->outs, j->n) == CLLM_OK) {
        const struct cllm_custody_msg m = {CLLM_CUSTODY_PROGRESS, (uint32_t)bytes.len,
                                           hr->progress_id};
        pthread_mutex_lock(&s->custody_lock);
        if (!atomic_load(&s->custody_broken) &&
            cllm_custody_send(s->custody_fd, &m, bytes.data, -1) != CLLM_OK)
            custody_broken(s, "cannot report a request's progress to the keeper");
        pthread_mutex_unlock(&s->custody_lock);
    }
    cllm_buf_free(&bytes);
}

void cllm_custody_release(struct cllm_server *s, struct cllm_http_req *hr)
{
    if (!hr->custody_id)
        return;
    const struct cllm_custody_msg m = {CLLM_CUSTODY_RELEASE, 0, hr->custody_id};
    hr->custody_id = 0;
    pthread_mutex_lock(&s->custody_lock);
    if (!atomic_load(&s->custody_broken) &&
        cllm_custody_send(s->custody_fd, &m, NULL, -1) != CLLM_OK)
        custody_broken(s, "cannot tell the keeper a request was answered");
    pthread_mutex_unlock(&s->custody_lock);
}

ssize_t cllm_custody_recv(int sock, void *buf, size_t len, int flags, int *fds, size_t max_fds,
                          size_t *n_fds, bool *lost)
{
    struct iovec iov = {buf, len};
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(64 * sizeof(int))];
    } ctl;
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = ctl.space,
                        .msg_controllen = sizeof ctl.space};
    ssize_t n;
    while ((n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR)
        ;
    if (n > 0 && (mh.msg_flags & MSG_CTRUNC))
        *lost = true;
    for (struct cmsghdr *c = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int d;
            memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
            if (*n_fds < max_fds) {
                fds[(*n_fds)++] = d;
            } else {
                close(d);
                *lost = true;
            }
        }
    }
    return n;
}

/* Receives one REPLAY message: the descriptor that came with it, -1 when the keeper closed its
 * end or the stream is broken. Messages from a keeper carry no bytes and one descriptor. */
static int receive_replay(int sock)
{
    struct cllm_custody_msg m;
    size_t got = 0, n_fds = 0;
    int fds[1];
    bool lost = false;
    while (got < sizeof m) {
        ssize_t n =
            cllm_custody_recv(sock, (char *)&m + got, sizeof m - got, 0, fds, 1, &n_fds, &lost);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    if (got == sizeof m && m.type == CLLM_CUSTODY_REPLAY && m.len == 0 && n_fds == 1 && !lost)
        return fds[0];
    if (n_fds)
        close(fds[0]);
    if (got > 0)
        cllm_log(CLLM_LOG_WARN, "custody: a message from the keeper that is no replay: "
                                "no more replays are taken");
    return -1;
}

static void *replay_main(void *arg)
{
    struct cllm_server *s = arg;
    for (int fd; (fd = receive_replay(s->custody_fd)) >= 0;) {
        if (atomic_load(&s->stopping)) {
            close(fd); /* the keeper sees no answer and keeps it for the next process */
            continue;
        }
        struct sockaddr_un sun = {.sun_family = AF_UNIX};
        /* MHD closes fd itself when it fails */
        if (MHD_add_connection(s->daemon, fd, (const struct sockaddr *)&sun, sizeof sun) ==
            MHD_YES) {
            atomic_fetch_add(&s->metrics.replayed, 1);
            cllm_log(CLLM_LOG_INFO, "custody: serving a request a dead process owed");
        } else
            cllm_log(CLLM_LOG_WARN, "custody: cannot take a request a dead process owed: %s",
                     strerror(errno));
    }
    return NULL;
}

enum cllm_status cllm_custody_start(struct cllm_server *s)
{
    if (s->custody_fd < 0)
        return CLLM_OK;
    if (pthread_create(&s->custody_thread, NULL, replay_main, s) != 0)
        return CLLM_ERR_NOMEM;
    s->custody_started = true;
    return CLLM_OK;
}

void cllm_custody_stop(struct cllm_server *s)
{
    if (!s->custody_started)
        return;
    shutdown(s->custody_fd, SHUT_RD); /* wakes the thread: it reads the end of the stream */
    pthread_join(s->custody_thread, NULL);
    s->custody_started = false;
}
