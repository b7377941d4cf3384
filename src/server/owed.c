/* The keeper's side of custody.h (owed.h): a table of requests, each held for the serving
 * process (HELD), owed to the next one (OWED), being replayed to it (REPLAYING), or answered,
 * the answer still being copied to the client (FLUSHING). Everything here is non-blocking:
 * the keeper's one thread polls the custody socket, the replays and the clients together. */
#include "server/owed.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/buf.h"
#include "core/log.h"
#include "engine/request.h"
#include "server/custody.h"

#define REPLAY_TRIES 2 /* with the first process, three processes tried it */
#define RETRY_PAUSE_S 0.5
/* A custody stream that ends while its serving process lives on (it stopped giving custody,
 * custody.c) is told from one that ended with the process's death by waiting this long for
 * that death. */
#define END_GRACE_S 1.0
#define READ_CHUNK ((size_t)64 << 10)

enum owed_state { HELD, OWED, REPLAYING, FLUSHING, DONE };

struct owed_req {
    enum owed_state state;
    uint64_t id;          /* the serving process's number for it (HELD) */
    int client;           /* the keeper's copy of the client's connection */
    struct cllm_buf req;  /* the request as bytes (custody.h) */
    struct cllm_buf progress; /* its answers so far, as last reported (progress.h) */
    uint64_t replay_id;       /* REPLAYING: the number its progress is reported under */
    int pump;             /* REPLAYING: the keeper's end of the replay's connection */
    struct cllm_buf wire; /* REPLAYING: the replay's bytes (the request and its progress) */
    size_t sent;          /* REPLAYING: bytes of wire written to pump */
    struct cllm_buf back; /* answer bytes read from pump, not yet written to the client */
    size_t back_off;      /* bytes of back written */
    size_t n_back;        /* answer bytes of this replay so far */
    int tries;            /* replays begun */
    double retry_at;      /* OWED: not replayed before (monotonic s) */
};

enum poll_role { ROLE_SOCK, ROLE_CLIENT, ROLE_PUMP };

struct poll_slot {
    enum poll_role role;
    size_t req;
};

struct cllm_owed {
    struct owed_req *r;
    size_t n, cap;
    int sock;           /* the keeper's end of the custody socket pair, or -1 */
    bool ready;         /* the serving process takes replays */
    bool sock_ended;    /* the custody stream ended (sock closed) */
    double ended_at;    /* when; see END_GRACE_S */
    bool child_running; /* between child_start and child_ended */
    struct cllm_buf in; /* custody bytes received, not yet taken apart */
    int *fds;           /* descriptors received, not yet matched with their TAKE message */
    size_t n_fds, fds_cap;
    struct poll_slot *slots;
    size_t slots_cap;
    uint64_t replays; /* replays begun, for their numbers */
};

struct cllm_owed *cllm_owed_new(void)
{
    struct cllm_owed *o = calloc(1, sizeof *o);
    if (o)
        o->sock = -1;
    return o;
}

static void close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void finish(struct owed_req *q)
{
    close_fd(&q->client);
    close_fd(&q->pump);
    cllm_buf_free(&q->req);
    cllm_buf_free(&q->progress);
    cllm_buf_free(&q->wire);
    cllm_buf_free(&q->back);
    q->state = DONE;
}

/* Drops the DONE entries. */
static void compact(struct cllm_owed *o)
{
    size_t k = 0;
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state != DONE)
            o->r[k++] = o->r[i];
    o->n = k;
}

static void close_sock(struct cllm_owed *o)
{
    close_fd(&o->sock);
    for (size_t i = 0; i < o->n_fds; i++)
        close(o->fds[i]);
    o->n_fds = 0;
    cllm_buf_free(&o->in);
}

void cllm_owed_free(struct cllm_owed *o)
{
    if (!o)
        return;
    size_t lost = 0;
    for (size_t i = 0; i < o->n; i++) {
        lost += o->r[i].state == OWED || o->r[i].state == REPLAYING;
        finish(&o->r[i]);
    }
    if (lost)
        cllm_log(CLLM_LOG_WARN,
                 "keeper: %zu request(s) a dead serving process owed are not "
                 "answered: the keeper stops",
                 lost);
    close_sock(o);
    free(o->r);
    free(o->fds);
    free(o->slots);
    free(o);
}

size_t cllm_owed_count(const struct cllm_owed *o)
{
    size_t k = 0;
    for (size_t i = 0; i < o->n; i++)
        k += o->r[i].state == OWED || o->r[i].state == REPLAYING;
    return k;
}

/* Lets every HELD request go: the serving process no longer says which it answered. */
static void drop_held(struct cllm_owed *o, const char *why)
{
    size_t k = 0;
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state == HELD) {
            finish(&o->r[i]);
            k++;
        }
    cllm_log(CLLM_LOG_WARN,
             "keeper: %s: %zu request(s) of the serving process are no longer "
             "kept for a restart",
             why, k);
}

int cllm_owed_child_start(struct cllm_owed *o)
{
    close_sock(o);
    o->ready = false;
    o->sock_ended = false;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        cllm_log(CLLM_LOG_WARN, "keeper: no custody of requests: %s", strerror(errno));
        return -1;
    }
    const int child = fcntl(sv[1], F_DUPFD, 3); /* handed down across exec */
    close(sv[1]);
    if (child < 0 || fcntl(sv[0], F_SETFL, O_NONBLOCK) != 0) {
        close(sv[0]);
        if (child >= 0)
            close(child);
        return -1;
    }
    o->sock = sv[0];
    o->child_running = true;
    return child;
}

void cllm_owed_child_ready(struct cllm_owed *o)
{
    o->ready = true;
}

static struct owed_req *find_held(struct cllm_owed *o, uint64_t id)
{
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state == HELD && o->r[i].id == id)
            return &o->r[i];
    return NULL;
}

/* The request whose progress is reported as id: one held, or one being replayed. */
static struct owed_req *find_reporting(struct cllm_owed *o, uint64_t id)
{
    if (!(id & CLLM_CUSTODY_REPLAY_BIT))
        return find_held(o, id);
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state == REPLAYING && o->r[i].replay_id == id)
            return &o->r[i];
    return NULL;
}

/* Keeps the progress reported for request id, replacing the last (out of memory: none, its
 * replay starts from its prompts). */
static void keep_progress(struct cllm_owed *o, uint64_t id, const char *bytes, size_t len)
{
    struct owed_req *q = find_reporting(o, id);
    if (!q) /* (answered meanwhile) */
        return;
    q->progress.len = 0;
    if (cllm_buf_append(&q->progress, bytes, len) != CLLM_OK)
        cllm_buf_free(&q->progress);
}

/* Takes apart the complete messages in o->in; false on a message that makes no sense. */
static bool take_messages(struct cllm_owed *o)
{
    struct cllm_custody_msg m;
    size_t off = 0; /* bytes of o->in taken apart */
    while (o->in.len - off >= sizeof m) {
        memcpy(&m, o->in.data + off, sizeof m);
        if ((m.type != CLLM_CUSTODY_TAKE && m.type != CLLM_CUSTODY_RELEASE &&
             m.type != CLLM_CUSTODY_PROGRESS) ||
            m.len > CLLM_CUSTODY_MAX_LEN || (m.type == CLLM_CUSTODY_RELEASE && m.len))
            return false;
        if (o->in.len - off - sizeof m < m.len)
            break; /* the rest is still on its way */
        const char *bytes = o->in.data + off + sizeof m;
        off += sizeof m + m.len;
        if (m.type == CLLM_CUSTODY_RELEASE) {
            struct owed_req *q = find_held(o, m.id);
            if (q)
                finish(q); /* (compacted later: cllm_owed_handle's slots index the table) */
            continue;
        }
        if (m.type == CLLM_CUSTODY_PROGRESS) {
            keep_progress(o, m.id, bytes, m.len);
            continue;
        }
        if (o->n_fds == 0) /* a descriptor comes with the first byte of its message */
            return false;
        const int client = o->fds[0];
        memmove(o->fds, o->fds + 1, --o->n_fds * sizeof *o->fds);
        if (o->n == o->cap) {
            size_t cap = o->cap ? 2 * o->cap : 16;
            struct owed_req *r = realloc(o->r, cap * sizeof *r);
            if (!r) {
                close(client);
                return false;
            }
            o->r = r;
            o->cap = cap;
        }
        struct owed_req *q = &o->r[o->n];
        *q = (struct owed_req){.state = HELD, .id = m.id, .client = client, .pump = -1};
        if (cllm_buf_append(&q->req, bytes, m.len) != CLLM_OK) {
            close(client);
            return false;
        }
        o->n++;
    }
    if (off) { /* keep only the message still on its way */
        memmove(o->in.data, o->in.data + off, o->in.len - off);
        o->in.len -= off;
    }
    return true;
}

static bool keep_fd(struct cllm_owed *o, int fd)
{
    if (o->n_fds == o->fds_cap) {
        size_t cap = o->fds_cap ? 2 * o->fds_cap : 16;
        int *f = realloc(o->fds, cap * sizeof *f);
        if (!f)
            return false;
        o->fds = f;
        o->fds_cap = cap;
    }
    o->fds[o->n_fds++] = fd;
    return true;
}

/* Reads what the serving process sent, as far as there is any; at the end of the stream (or
 * on a message that makes no sense) the socket is closed. */
static void read_sock(struct cllm_owed *o)
{
    bool ok = true, ended = false;
    while (ok && !ended && o->sock >= 0) {
        if (cllm_buf_reserve(&o->in, READ_CHUNK) != CLLM_OK) {
            ok = false;
            break;
        }
        int fds[64];
        size_t n_fds = 0;
        bool lost = false;
        ssize_t n = cllm_custody_recv(o->sock, o->in.data + o->in.len, READ_CHUNK, MSG_DONTWAIT,
                                      fds, 64, &n_fds, &lost);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        for (size_t i = 0; i < n_fds; i++)
            if (!keep_fd(o, fds[i])) {
                close(fds[i]);
                ok = false;
            }
        if (lost || n < 0)
            ok = false;
        else if (n == 0)
            ended = true;
        else
            o->in.len += (size_t)n;
        if (ok)
            ok = take_messages(o);
    }
    if (!ok) {
        cllm_log(CLLM_LOG_WARN, "keeper: the custody stream from the serving process is broken");
        close_sock(o);
        drop_held(o, "custody ended");
        return;
    }
    if (ended) {
        close_sock(o);
        o->sock_ended = true;
        o->ended_at = cllm_now();
    }
}

size_t cllm_owed_max_fds(const struct cllm_owed *o)
{
    return 1 + 2 * o->n;
}

size_t cllm_owed_child_ended(struct cllm_owed *o, bool died)
{
    if (o->sock >= 0)
        read_sock(o); /* the process is gone: its end is closed, so this reads to the end */
    close_sock(o);
    o->ready = false;
    o->child_running = false;
    o->sock_ended = false;
    size_t k = 0;
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state == HELD && !died)
            finish(&o->r[i]); /* a shutdown: nothing more comes */
        else if (o->r[i].state == HELD) {
            o->r[i].state = OWED;
            o->r[i].retry_at = 0;
            k++;
        }
    if (k)
        cllm_log(CLLM_LOG_WARN,
                 "keeper: the serving process owed %zu answer(s): they go to the "
                 "next one",
                 k);
    compact(o);
    return cllm_owed_count(o);
}

/* OWED -> REPLAYING: a new connection to the serving process, the request and its progress
 * to be written. */
static void start_replay(struct cllm_owed *o, struct owed_req *q)
{
    const uint64_t id = ++o->replays | CLLM_CUSTODY_REPLAY_BIT;
    q->wire.len = 0;
    enum cllm_status st = cllm_custody_replay_bytes(&q->wire, q->req.data, q->req.len, id,
                                                    q->progress.data, q->progress.len);
    if (st == CLLM_ERR_FORMAT) { /* (not from cllm_custody_request_bytes: sent as they are) */
        cllm_log(CLLM_LOG_WARN, "keeper: a request owed is replayed without its progress");
        q->wire.len = 0;
        st = cllm_buf_append(&q->wire, q->req.data, q->req.len);
    }
    int sv[2];
    if (st || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) {
        q->retry_at = cllm_now() + RETRY_PAUSE_S;
        return;
    }
    const struct cllm_custody_msg m = {CLLM_CUSTODY_REPLAY, 0, 0};
    st = cllm_custody_send(o->sock, &m, NULL, sv[1]);
    close(sv[1]);
    if (st != CLLM_OK) {
        close(sv[0]);
        q->retry_at = cllm_now() + RETRY_PAUSE_S;
        return;
    }
    q->state = REPLAYING;
    q->replay_id = id;
    q->pump = sv[0];
    q->sent = 0;
    q->n_back = 0;
    q->tries++;
    cllm_log(CLLM_LOG_INFO,
             "keeper: replaying a request the dead serving process owed (try %d, %s)", q->tries,
             q->progress.len ? "with the progress it had" : "from its prompts");
}

static struct poll_slot *slot(struct cllm_owed *o, size_t i)
{
    if (i >= o->slots_cap) {
        size_t cap = o->slots_cap ? 2 * o->slots_cap : 64;
        while (cap <= i)
            cap *= 2;
        struct poll_slot *s = realloc(o->slots, cap * sizeof *s);
        if (!s)
            return NULL;
        o->slots = s;
        o->slots_cap = cap;
    }
    return &o->slots[i];
}

static int ms_until(double t)
{
    double ms = (t - cllm_now()) * 1e3;
    return ms <= 0 ? 0 : ms > 60e3 ? 60000 : (int)ms + 1;
}

size_t cllm_owed_poll_fds(struct cllm_owed *o, struct pollfd *p, size_t cap, int *timeout_ms)
{
    const double now = cllm_now();
    if (o->sock_ended && o->child_running && now - o->ended_at >= END_GRACE_S) {
        o->sock_ended = false;
        drop_held(o, "the serving process stopped giving custody of requests");
    }
    if (o->sock_ended && o->child_running) {
        const int ms = ms_until(o->ended_at + END_GRACE_S);
        if (*timeout_ms < 0 || ms < *timeout_ms)
            *timeout_ms = ms;
    }
    size_t k = 0;
    struct poll_slot *sl;
    if (o->sock >= 0 && k < cap && (sl = slot(o, k))) {
        *sl = (struct poll_slot){ROLE_SOCK, 0};
        p[k++] = (struct pollfd){.fd = o->sock, .events = POLLIN};
    }
    for (size_t i = 0; i < o->n; i++) {
        struct owed_req *q = &o->r[i];
        if (q->state == OWED && o->ready && o->sock >= 0 && now >= q->retry_at)
            start_replay(o, q);
        if (q->state == OWED && q->retry_at > now) {
            const int ms = ms_until(q->retry_at);
            if (*timeout_ms < 0 || ms < *timeout_ms)
                *timeout_ms = ms;
        }
        if (q->state == HELD || q->state == DONE)
            continue;
        short ev = POLLRDHUP; /* a client that leaves is let go */
        if (q->back.len > q->back_off)
            ev |= POLLOUT;
        if (k < cap && (sl = slot(o, k))) {
            *sl = (struct poll_slot){ROLE_CLIENT, i};
            p[k++] = (struct pollfd){.fd = q->client, .events = ev};
        }
        if (q->state == REPLAYING && k < cap && (sl = slot(o, k))) {
            *sl = (struct poll_slot){ROLE_PUMP, i};
            p[k++] = (struct pollfd){.fd = q->pump,
                                     .events = POLLIN | (q->sent < q->wire.len ? POLLOUT : 0)};
        }
    }
    return k;
}

/* The replay's connection ended: an answer came (it is copied on), or none did (tried again,
 * REPLAY_TRIES times in all). */
static void replay_ended(struct owed_req *q)
{
    close_fd(&q->pump);
    cllm_buf_free(&q->wire); /* (a next replay writes it anew, with the progress it has then) */
    if (q->n_back > 0) {
        q->state = FLUSHING;
        return;
    }
    if (q->tries >= REPLAY_TRIES) {
        cllm_log(CLLM_LOG_ERROR,
                 "keeper: a request a dead serving process owed got no answer in "
                 "%d tries: its connection is closed",
                 q->tries);
        finish(q);
        return;
    }
    q->state = OWED;
    q->retry_at = cllm_now() + RETRY_PAUSE_S;
}

static void pump(struct owed_req *q, short revents)
{
    if ((revents & POLLOUT) && q->sent < q->wire.len) {
        ssize_t n = send(q->pump, q->wire.data + q->sent, q->wire.len - q->sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0)
            q->sent += (size_t)n;
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            replay_ended(q);
            return;
        }
    }
    if (!(revents & (POLLIN | POLLHUP | POLLERR)))
        return;
    for (;;) {
        if (cllm_buf_reserve(&q->back, READ_CHUNK) != CLLM_OK) {
            finish(q);
            return;
        }
        ssize_t n = recv(q->pump, q->back.data + q->back.len, READ_CHUNK, MSG_DONTWAIT);
        if (n > 0) {
            q->back.len += (size_t)n;
            q->n_back += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EINTR))
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        replay_ended(q);
        return;
    }
}

/* Copies answer bytes on to the client; closes its connection once a finished answer is all
 * out. */
static void to_client(struct owed_req *q, short revents)
{
    if (revents & (POLLRDHUP | POLLHUP | POLLERR)) {
        cllm_log(CLLM_LOG_INFO, "keeper: the client of a request a dead serving process owed "
                                "went away");
        finish(q);
        return;
    }
    if ((revents & POLLOUT) && q->back.len > q->back_off) {
        ssize_t n = send(q->client, q->back.data + q->back_off, q->back.len - q->back_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0)
            q->back_off += (size_t)n;
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            finish(q);
            return;
        }
        if (q->back_off == q->back.len)
            q->back.len = q->back_off = 0;
    }
    if (q->state == FLUSHING && q->back.len == q->back_off) {
        cllm_log(CLLM_LOG_INFO, "keeper: answered a request a dead serving process owed");
        shutdown(q->client, SHUT_WR);
        finish(q);
    }
}

void cllm_owed_handle(struct cllm_owed *o, const struct pollfd *p, size_t n)
{
    for (size_t k = 0; k < n && k < o->slots_cap; k++) {
        const struct poll_slot *sl = &o->slots[k];
        if (!p[k].revents)
            continue;
        if (sl->role == ROLE_SOCK) {
            read_sock(o); /* may add entries at the end: the slots' indices stay good */
            continue;
        }
        struct owed_req *q = &o->r[sl->req];
        if (q->state == DONE)
            continue;
        if (sl->role == ROLE_PUMP && q->state == REPLAYING)
            pump(q, p[k].revents);
        else if (sl->role == ROLE_CLIENT)
            to_client(q, p[k].revents);
    }
    /* An answer all read whose client had nothing to write to this round: finish it too. */
    for (size_t i = 0; i < o->n; i++)
        if (o->r[i].state == FLUSHING && o->r[i].back.len == o->r[i].back_off)
            to_client(&o->r[i], 0);
    compact(o);
}
