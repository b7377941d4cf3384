/*
 * The server's listening socket: bound by the server itself, or by its keeper (keeper.h),
 * which hands it to each serving process it starts, so the address stays taken (and
 * connections wait in its backlog) while a crashed one is replaced.
 */
#ifndef CLLM_SERVER_LISTEN_H
#define CLLM_SERVER_LISTEN_H

#include <stddef.h>

#include "core/status.h"

/* Binds host:port (port 0: any free port) and listens; *fd gets a non-blocking,
 * close-on-exec socket. */
enum cllm_status cllm_listen_open(const char *host, int port, int *fd, char *err, size_t err_len);

/* Takes a listening socket another process bound (the keeper's): checks that fd is one, makes
 * it non-blocking and close-on-exec (a GPU probe started from here must not hold it). */
enum cllm_status cllm_listen_adopt(int fd, char *err, size_t err_len);

/* The port fd listens on, or -1. */
int cllm_listen_port(int fd);

#endif
