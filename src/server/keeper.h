/*
 * The keeper: `cllm serve` runs the server in a child process and stays as its parent, so
 * that a serving process that dies (a GPU driver or runtime that crashes or aborts the
 * process, the kernel's OOM killer) does not take the service down with it. The keeper binds
 * the address and hands the listening socket to the child; when the child dies of a signal,
 * the keeper starts another on the same socket (connections that arrive meanwhile wait in its
 * backlog): under --device auto, after the first death of one that served from a GPU, on the
 * GPU again (a crash may not come back: an OOM kill, a fault of the moment; the GPU probe
 * runs again first, and the requests go on from their progress, so one that does come back
 * costs a restart), after any later one on the CPU. The requests the dead process
 * owed answers to are answered by the next one (custody.h, owed.h), unless their answer had
 * begun to be sent (a stream); every later one is served. A child that exits by itself (a shutdown,
 * a model that cannot load) ends the keeper with its exit status: that is no crash, and a restart
 * would fail the same way. SIGINT and SIGTERM go on to the child, which shuts down as usual.
 */
#ifndef CLLM_SERVER_KEEPER_H
#define CLLM_SERVER_KEEPER_H

#include <stdbool.h>
#include <stddef.h>

/* What a keeper tells the serving process it starts, through its environment. */
#define CLLM_KEEPER_ENV_FD "CLLM_KEEPER_LISTEN_FD"      /* the listening socket's descriptor */
#define CLLM_KEEPER_ENV_READY "CLLM_KEEPER_READY_FD"    /* a pipe to write a byte to when ready */
#define CLLM_KEEPER_ENV_PID "CLLM_KEEPER_PID"           /* the keeper's pid */
#define CLLM_KEEPER_ENV_RESTARTS "CLLM_KEEPER_RESTARTS" /* serving processes that died before */
#define CLLM_KEEPER_ENV_FALLBACK "CLLM_KEEPER_FALLBACK" /* why it runs on the CPU, if it does */

/* What a serving process writes to its ready pipe, a byte each time: it is ready on the CPU,
 * or on a GPU; it moved from the GPU to the CPU (a stall, a lost device). */
#define CLLM_KEEPER_READY_CPU 'r'
#define CLLM_KEEPER_READY_GPU 'g'
#define CLLM_KEEPER_MOVED_TO_CPU 'c'

struct cllm_keeper_config {
    const char *exe; /* this binary */
    int argc;        /* the serve command's arguments as given, argv[0] = "serve" */
    char **argv;
    const char *host; /* where to listen */
    int port;
    bool restart_on_cpu; /* the server was to use a GPU if any (--device auto): after a
                            serving process on a GPU died, the next is started on the GPU once
                            more (the probe first), after any other death on the CPU */
};

/* Binds, then runs serving processes until one exits by itself, or SIGINT/SIGTERM stops it;
 * returns the exit status for `cllm serve`. A serving process that dies before it was ready
 * five times in a row is not started again: the keeper exits (1). One that dies after it was
 * ready is always restarted, after a pause that grows (to 30 s) while they die within a
 * minute of their start. */
int cllm_keeper_run(const struct cllm_keeper_config *c);

/* What a serving process learns from its keeper. */
struct cllm_keeper_child {
    int listen_fd;      /* the listening socket to serve on (-1: the keeper's word was no fd) */
    int ready_fd;       /* write CLLM_KEEPER_READY_* here once ready to serve (-1: none) */
    int custody_fd;     /* the custody socket (custody.h), or -1 */
    int restarts;       /* serving processes that died before this one */
    char fallback[256]; /* why this one runs on the CPU though a GPU was to be used, or "" */
};

/* In a serving process a keeper started: reads (and clears) what the keeper said into *k and
 * returns true (this process then gets SIGTERM if the keeper dies); false when this process
 * has no keeper. */
bool cllm_keeper_child(struct cllm_keeper_child *k);

#endif
