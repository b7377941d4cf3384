/*
 * Custody of requests (src/server/custody.h, owed.h) without a server: the request rebuilt as
 * bytes, and the keeper's table driven through real socket pairs playing the serving process
 * and the clients -- a release lets the connection go, a death makes what was held owed, a
 * replay writes the request and copies the answer back, a replay with no answer is tried
 * twice, a client that leaves is let go, a broken custody stream drops what it held, and so
 * does a serving process that exits by itself.
 */
#include <errno.h>
#include <stdlib.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/buf.h"
#include "engine/request.h"
#include "server/custody.h"
#include "server/owed.h"
#include "test.h"

static void test_request_bytes(void)
{
    const struct cllm_custody_header h[] = {
        {"Host", "127.0.0.1:8000"},
        {"Content-Type", "application/json"},
        {"content-length", "999"},
        {"Transfer-Encoding", "chunked"},
        {"Connection", "keep-alive"},
        {"Expect", "100-continue"},
        {"Authorization", "Bearer k"},
        {"X-Evil", "a\r\nInjected: 1"},
        {"Bad:Name", "v"},
        {"", "empty name"},
        {"x-cllm-received", "1.0"}, /* a client's own is dropped */
    };
    struct cllm_buf b = {0};
    CHECK(cllm_custody_request_bytes(&b, "POST", "/predict", h, sizeof h / sizeof h[0], 12.5,
                                     "{\"a\":1}", 7) == CLLM_OK);
    const char want[] = "POST /predict HTTP/1.1\r\n"
                        "Host: 127.0.0.1:8000\r\n"
                        "Content-Type: application/json\r\n"
                        "Authorization: Bearer k\r\n"
                        "X-Cllm-Received: 12.500000\r\n"
                        "Content-Length: 7\r\n"
                        "Connection: close\r\n"
                        "\r\n"
                        "{\"a\":1}";
    CHECKF(b.len == sizeof want - 1 && !memcmp(b.data, want, b.len), "%.*s", (int)b.len, b.data);

    /* The keeper's replay of it: the progress after the body, counted in its length. */
    struct cllm_buf r = {0};
    CHECK(cllm_custody_replay_bytes(&r, b.data, b.len, CLLM_CUSTODY_REPLAY_BIT | 5, "PRG", 3) ==
          CLLM_OK);
    const char want_replay[] = "POST /predict HTTP/1.1\r\n"
                               "Host: 127.0.0.1:8000\r\n"
                               "Content-Type: application/json\r\n"
                               "Authorization: Bearer k\r\n"
                               "X-Cllm-Received: 12.500000\r\n"
                               "Content-Length: 10\r\n"
                               "Connection: close\r\n"
                               "X-Cllm-Progress: 9223372036854775813 3\r\n"
                               "\r\n"
                               "{\"a\":1}PRG";
    CHECKF(r.len == sizeof want_replay - 1 && !memcmp(r.data, want_replay, r.len), "%.*s",
           (int)r.len, r.data);
    r.len = 0;
    CHECK(cllm_custody_replay_bytes(&r, b.data, b.len, CLLM_CUSTODY_REPLAY_BIT, NULL, 0) ==
              CLLM_OK &&
          strstr(r.data, "Content-Length: 7\r\n") &&
          strstr(r.data, "X-Cllm-Progress: 9223372036854775808 0\r\n\r\n{\"a\":1}"));
    /* bytes that are not a request made so are refused, not rewritten */
    const char *const not_ours[] = {
        "REQ1",
        "POST / HTTP/1.1\r\nHost: x\r\n\r\nbody",               /* no length */
        "POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nbody",     /* the wrong length */
        "POST / HTTP/1.1\r\nContent-Length: x\r\n\r\nbody",     /* no number */
        "POST / HTTP/1.1\r\nContent-Length: 4 \r\n\r\nbody",    /* more after it */
        "POST / HTTP/1.1\r\n\r\nContent-Length: 4\r\n\r\nbody", /* in the body */
    };
    for (size_t i = 0; i < sizeof not_ours / sizeof not_ours[0]; i++) {
        r.len = 0;
        CHECKF(cllm_custody_replay_bytes(&r, not_ours[i], strlen(not_ours[i]), 1, "P", 1) ==
                   CLLM_ERR_FORMAT,
               "%zu", i);
    }
    cllm_buf_free(&r);
    cllm_buf_free(&b);
    CHECK(cllm_custody_request_bytes(&b, "POST", "/a b", NULL, 0, 1, "", 0) != CLLM_OK);
    CHECK(cllm_custody_request_bytes(&b, "PO\nST", "/a", NULL, 0, 1, "", 0) != CLLM_OK);
    cllm_buf_free(&b);
}

/* Runs the keeper's side for ms milliseconds, as its poll loop does. */
static void spin(struct cllm_owed *o, int ms)
{
    const double until = cllm_now() + ms / 1e3;
    struct pollfd p[64];
    while (cllm_now() < until) {
        int timeout = 5;
        size_t n = cllm_owed_poll_fds(o, p, 64, &timeout);
        poll(p, n, timeout < 5 ? timeout : 5);
        cllm_owed_handle(o, p, n);
    }
}

/* A client connection: c[0] the client's end, c[1] the server's. */
static void client_pair(int c[2])
{
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, c) == 0);
}

static void take(int sock, uint64_t id, const char *req, int fd)
{
    const struct cllm_custody_msg m = {CLLM_CUSTODY_TAKE, (uint32_t)strlen(req), id};
    CHECK(cllm_custody_send(sock, &m, req, fd) == CLLM_OK);
}

static void release(int sock, uint64_t id)
{
    const struct cllm_custody_msg m = {CLLM_CUSTODY_RELEASE, 0, id};
    CHECK(cllm_custody_send(sock, &m, NULL, -1) == CLLM_OK);
}

/* What is readable on fd within ms, the keeper o running meanwhile: the bytes
 * (NUL-terminated into buf), and *eof when the other end is closed by all that hold it. */
static size_t read_for(struct cllm_owed *o, int fd, char *buf, size_t cap, int ms, bool *eof)
{
    size_t got = 0;
    *eof = false;
    const double until = cllm_now() + ms / 1e3;
    while (got + 1 < cap && cllm_now() < until) {
        if (o)
            spin(o, 5);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, o ? 0 : 10) <= 0)
            continue;
        ssize_t n = recv(fd, buf + got, cap - 1 - got, MSG_DONTWAIT);
        if (n == 0) {
            *eof = true;
            break;
        }
        if (n > 0)
            got += (size_t)n;
    }
    buf[got] = 0;
    return got;
}

static void progress(int sock, uint64_t id, const char *bytes)
{
    const struct cllm_custody_msg m = {CLLM_CUSTODY_PROGRESS, (uint32_t)strlen(bytes), id};
    CHECK(cllm_custody_send(sock, &m, bytes, -1) == CLLM_OK);
}

/* The replay the keeper sends to the serving process: its connection, or -1. */
static int receive_replay(int child, struct cllm_owed *o)
{
    for (int i = 0; i < 200; i++) {
        spin(o, 5);
        struct cllm_custody_msg m;
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {&m, sizeof m};
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = ctl.space,
                            .msg_controllen = sizeof ctl.space};
        ssize_t n = recvmsg(child, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EAGAIN)
            continue;
        struct cmsghdr *c = n == (ssize_t)sizeof m ? CMSG_FIRSTHDR(&mh) : NULL;
        CHECK(c && m.type == CLLM_CUSTODY_REPLAY && m.len == 0);
        if (!c)
            return -1;
        int fd;
        memcpy(&fd, CMSG_DATA(c), sizeof fd);
        return fd;
    }
    return -1;
}

static void test_keeper_side(void)
{
    struct cllm_owed *o = cllm_owed_new();
    int child = cllm_owed_child_start(o);
    CHECK(child >= 3);
    int c1[2], c2[2], c3[2], c4[2];
    client_pair(c1);
    client_pair(c2);
    client_pair(c3);
    client_pair(c4);
    take(child, 1, "REQ1", c1[1]);
    take(child, 2, "REQ2", c2[1]);
    take(child, 3, "REQ3", c3[1]);
    take(child, 4, "REQ4", c4[1]);
    release(child, 1);
    spin(o, 50);
    CHECK(cllm_owed_count(o) == 0); /* held, not owed: their process lives */

    /* Released: the keeper let its copy go, so the server's close reaches the client. */
    char buf[256];
    bool eof;
    close(c1[1]);
    read_for(o, c1[0], buf, sizeof buf, 200, &eof);
    CHECK(eof);
    /* Held: the server's close does not end the connection; the keeper's copy keeps it. */
    close(c2[1]);
    close(c3[1]);
    close(c4[1]);
    read_for(o, c2[0], buf, sizeof buf, 50, &eof);
    CHECK(!eof);

    /* The serving process dies: what it held is owed to the next. */
    close(child);
    CHECK(cllm_owed_child_ended(o, true) == 3);
    close(c4[0]); /* a client that leaves while its request waits is let go */
    spin(o, 50);
    CHECK(cllm_owed_count(o) == 2);

    child = cllm_owed_child_start(o);
    spin(o, 50);
    char x; /* nothing is replayed before the new process is ready */
    CHECK(recv(child, &x, 1, MSG_DONTWAIT) < 0 && errno == EAGAIN);
    cllm_owed_child_ready(o);
    int r2 = receive_replay(child, o), r3 = receive_replay(child, o);
    CHECK(r2 >= 0 && r3 >= 0);
    /* Each replay's connection carries its request; which one comes first is the table's. */
    read_for(o, r2, buf, sizeof buf, 200, &eof);
    const bool first_is_2 = !strcmp(buf, "REQ2");
    CHECKF(first_is_2 || !strcmp(buf, "REQ3"), "%s", buf);
    int answer = first_is_2 ? r2 : r3, silent = first_is_2 ? r3 : r2;
    int answered_client = first_is_2 ? c2[0] : c3[0], other_client = first_is_2 ? c3[0] : c2[0];
    CHECK(send(answer, "ANSWER", 6, MSG_NOSIGNAL) == 6);
    close(answer);
    read_for(o, answered_client, buf, sizeof buf, 500, &eof);
    CHECKF(!strcmp(buf, "ANSWER") && eof, "%s eof %d", buf, eof);
    CHECK(cllm_owed_count(o) == 1);

    /* A replay that ends with no answer is tried once more: twice in all. */
    close(silent);
    for (int tries = 2; tries <= 2; tries++) {
        int r = receive_replay(child, o); /* after the 0.5 s pause */
        CHECKF(r >= 0, "try %d", tries);
        read_for(o, r, buf, sizeof buf, 100, &eof);
        CHECK(!strcmp(buf, first_is_2 ? "REQ3" : "REQ2"));
        close(r);
    }
    spin(o, 100);
    CHECK(cllm_owed_count(o) == 0);
    read_for(o, other_client, buf, sizeof buf, 200, &eof);
    CHECK(buf[0] == 0 && eof);
    close(c1[0]);
    close(c2[0]);
    close(c3[0]);

    /* A custody stream that makes no sense: what it held is let go at once. */
    int c5[2];
    client_pair(c5);
    take(child, 5, "REQ5", c5[1]);
    const struct cllm_custody_msg junk = {0x4a554e4b, 0, 0};
    CHECK(cllm_custody_send(child, &junk, NULL, -1) == CLLM_OK);
    spin(o, 50);
    close(c5[1]);
    read_for(o, c5[0], buf, sizeof buf, 200, &eof);
    CHECK(eof);
    close(c5[0]);
    close(child);
    CHECK(cllm_owed_child_ended(o, true) == 0);

    /* A stream that ends while its process lives on (it stopped giving custody): after a
     * grace of a second, what it held is let go; not when the process died meanwhile. */
    child = cllm_owed_child_start(o);
    int c6[2];
    client_pair(c6);
    take(child, 6, "REQ6", c6[1]);
    close(child);
    spin(o, 1300);
    close(c6[1]);
    read_for(o, c6[0], buf, sizeof buf, 200, &eof);
    CHECK(eof);
    close(c6[0]);
    CHECK(cllm_owed_child_ended(o, true) == 0);

    /* A serving process that exits by itself (a shutdown): what it held is let go. */
    child = cllm_owed_child_start(o);
    int c8[2];
    client_pair(c8);
    take(child, 8, "REQ8", c8[1]);
    spin(o, 50);
    close(child);
    close(c8[1]);
    CHECK(cllm_owed_child_ended(o, false) == 0);
    read_for(o, c8[0], buf, sizeof buf, 200, &eof);
    CHECK(eof);
    close(c8[0]);

    /* Freed with a request still held: its connection is closed. */
    child = cllm_owed_child_start(o);
    int c7[2];
    client_pair(c7);
    take(child, 7, "REQ7", c7[1]);
    spin(o, 50);
    close(c7[1]);
    cllm_owed_free(o);
    read_for(NULL, c7[0], buf, sizeof buf, 200, &eof);
    CHECK(eof);
    close(c7[0]);
    close(child);
}

struct big_take {
    int sock;
    const char *req;
    int fd;
    enum cllm_status sent; /* checked on the main thread: the test's counters are not atomic */
    atomic_bool done;
};

static void *send_big_take(void *arg)
{
    struct big_take *t = arg;
    const struct cllm_custody_msg m = {CLLM_CUSTODY_TAKE, (uint32_t)strlen(t->req), 1};
    t->sent = cllm_custody_send(t->sock, &m, t->req, t->fd);
    atomic_store(&t->done, true);
    return NULL;
}

/* A request and an answer far larger than one read: taken apart across reads, written and
 * copied back whole. */
static void test_large(void)
{
    enum { REQ = 300 << 10, ANS = 200 << 10 };
    char *req = malloc(REQ + 1), *ans = malloc(ANS), *got = malloc(REQ + 1);
    for (int i = 0; i < REQ; i++)
        req[i] = (char)('a' + i % 26);
    req[REQ] = 0;
    for (int i = 0; i < ANS; i++)
        ans[i] = (char)('0' + i % 10);
    struct cllm_owed *o = cllm_owed_new();
    int child = cllm_owed_child_start(o), c[2];
    client_pair(c);
    /* Sent from a thread while the keeper reads: a socket buffer holds less than this, so
     * the keeper gets it in parts. */
    struct big_take t = {child, req, c[1], CLLM_ERR_IO, false};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, send_big_take, &t) == 0);
    while (!atomic_load(&t.done))
        spin(o, 1);
    pthread_join(th, NULL);
    CHECK(t.sent == CLLM_OK);
    spin(o, 20);
    close(c[1]);
    close(child);
    CHECK(cllm_owed_child_ended(o, true) == 1);
    child = cllm_owed_child_start(o);
    cllm_owed_child_ready(o);
    int r = receive_replay(child, o);
    CHECK(r >= 0);
    bool eof;
    size_t n = read_for(o, r, got, REQ + 1, 3000, &eof);
    CHECKF(n == REQ && !memcmp(got, req, REQ), "%zu of %d bytes", n, REQ);
    for (size_t off = 0; off < ANS;) { /* the answer, while the keeper copies it on */
        ssize_t k = send(r, ans + off, ANS - off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0)
            off += (size_t)k;
        spin(o, 1); /* (what the client's socket cannot hold waits in the keeper) */
    }
    close(r);
    n = read_for(o, c[0], got, REQ + 1, 3000, &eof);
    CHECKF(n == ANS && !memcmp(got, ans, ANS) && eof, "%zu of %d bytes, eof %d", n, ANS, eof);
    close(c[0]);
    close(child);
    cllm_owed_free(o);
    free(req);
    free(ans);
    free(got);
}

/* The progress a serving process reports for a request it holds goes with the request's
 * replay; the replay's own progress, reported under the number it came with, goes with the
 * next replay when the next process dies too. */
static void test_progress_replay(void)
{
    struct cllm_owed *o = cllm_owed_new();
    int child = cllm_owed_child_start(o);
    int c[2];
    client_pair(c);
    struct cllm_buf req = {0};
    CHECK(cllm_custody_request_bytes(&req, "POST", "/predict", NULL, 0, 1.5, "{}", 2) == CLLM_OK);
    take(child, 7, req.data, c[1]);
    close(c[1]);
    progress(child, 7, "first");
    progress(child, 7, "second");    /* replaces the first */
    progress(child, 99, "nobody's"); /* (answered meanwhile): nothing to keep */
    spin(o, 50);
    close(child);
    CHECK(cllm_owed_child_ended(o, true) == 1);

    char buf[512];
    bool eof;
    struct cllm_buf want = {0};
    for (int round = 1; round <= 2; round++) {
        child = cllm_owed_child_start(o);
        cllm_owed_child_ready(o);
        int r = receive_replay(child, o);
        CHECK(r >= 0);
        read_for(o, r, buf, sizeof buf, 300, &eof);
        const uint64_t id = CLLM_CUSTODY_REPLAY_BIT | (uint64_t)round;
        want.len = 0;
        CHECK(cllm_custody_replay_bytes(&want, req.data, req.len, id,
                                        round == 1 ? "second" : "third",
                                        round == 1 ? 6 : 5) == CLLM_OK);
        CHECKF(!strcmp(buf, want.data), "replay %d: %s", round, buf);
        if (round == 1) {
            /* the replay reports under its number; then its process dies too */
            progress(child, id, "third");
            progress(child, 7, "stale"); /* no longer held */
            spin(o, 50);
            close(r);
            close(child);
            spin(o, 50);
            CHECK(cllm_owed_child_ended(o, true) == 1);
        } else {
            CHECK(send(r, "ANSWER", 6, MSG_NOSIGNAL) == 6);
            close(r);
        }
    }
    read_for(o, c[0], buf, sizeof buf, 500, &eof);
    CHECKF(!strcmp(buf, "ANSWER") && eof, "%s eof %d", buf, eof);
    CHECK(cllm_owed_count(o) == 0);
    close(c[0]);
    close(child);
    cllm_owed_free(o);
    cllm_buf_free(&want);
    cllm_buf_free(&req);
}

int main(void)
{
    test_request_bytes();
    test_keeper_side();
    test_progress_replay();
    test_large();
    return test_summary();
}
