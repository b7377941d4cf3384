/*
 * The keeper's side of custody.h: the requests its serving process holds, and those a dead one
 * owed, replayed to the next serving process once it is ready. A replay is a new local
 * connection (a socket pair) to the serving process: the keeper writes the request into it,
 * with the progress last reported for it (custody.h), and copies what comes back to the
 * client's connection, which it then closes. A replay that ends
 * before a byte of an answer came back (the serving process died again, or could not take it)
 * is tried once more: a request that kills every process it reaches is given up after three.
 * A client that goes away meanwhile is let go.
 */
#ifndef CLLM_SERVER_OWED_H
#define CLLM_SERVER_OWED_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>

struct cllm_owed;

struct cllm_owed *cllm_owed_new(void);
/* Closes every connection still held: their clients get no answer. */
void cllm_owed_free(struct cllm_owed *o);

/* A serving process is about to start: returns the end of a new custody socket pair to hand it
 * (>= 3, not close-on-exec: the caller closes it once the process started), or -1. */
int cllm_owed_child_start(struct cllm_owed *o);
/* The serving process is ready: owed requests are replayed to it from now on. */
void cllm_owed_child_ready(struct cllm_owed *o);
/* The serving process ended: reads what it said before its end. When it died (and another is
 * to start), every request it still held is owed to the next; otherwise they are let go.
 * Returns how many requests are owed now. */
size_t cllm_owed_child_ended(struct cllm_owed *o, bool died);
/* Requests owed to a next serving process, or being replayed. */
size_t cllm_owed_count(const struct cllm_owed *o);
/* The most descriptors cllm_owed_poll_fds may write now. */
size_t cllm_owed_max_fds(const struct cllm_owed *o);

/* The descriptors to poll, written to p (at most cap; returns how many), and *timeout_ms
 * lowered to when a retry is due. Then cllm_owed_handle with the same p after poll(). */
size_t cllm_owed_poll_fds(struct cllm_owed *o, struct pollfd *p, size_t cap, int *timeout_ms);
void cllm_owed_handle(struct cllm_owed *o, const struct pollfd *p, size_t n);

#endif
