/*
 * The HTTP server as a whole: it listens at once, loads the model and warms the engine up in a
 * background thread (answering 503 {"status":"loading"} meanwhile), serves until SIGINT or
 * SIGTERM, then stops accepting, cancels the work in flight and frees everything. The server
 * owns all JSON and HTTP; it reaches the model only through the engine and the tokenizer.
 * struct cllm_server is the state the route handlers (http.h, routes.h) share.
 */
#ifndef CLLM_SERVER_SERVER_H
#define CLLM_SERVER_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "model/model_files.h"
#include "server/metrics.h"
#include "tokenizer/chat_template.h"

#define CLLM_SERVER_DEFAULT_PORT 8000
#define CLLM_SERVER_DEFAULT_MAX_BODY ((size_t)8 << 20)
#define CLLM_SERVER_DEFAULT_MAX_CONNECTIONS 512
#define CLLM_SERVER_DEFAULT_TIMEOUT_S 60

struct cllm_server_config {
    const char *model_path;   /* GGUF file or HF folder */
    const char *host;         /* address to bind; NULL = "0.0.0.0" */
    int port;                 /* 0..65535 (0 = any free port) */
    const char *api_key;      /* NULL or "": no authentication */
    size_t max_body;          /* request body bytes at most; 0 = the default */
    unsigned max_connections; /* simultaneous connections; 0 = the default */
    unsigned timeout_s;       /* idle seconds before a connection is dropped; 0 = the default */
    /* --device auto: the GPU is first tried by this executable's `probe-device` in a child
     * process (probe.h), for up to probe_timeout_s seconds; NULL: not tried that way. */
    const char *probe_exe;
    double probe_timeout_s;
    /* Set by a keeper (keeper.h) in the serving process it starts: listen_fd != 0, the
     * listening socket to serve on (-1: the keeper handed none over, an error) (host and port are
     * then only for the log); ready_fd > 0, where to tell the keeper it is ready, and on
     * which device (keeper.h, CLLM_KEEPER_READY_*); restarts, how many
     * serving processes died before this one; fallback (or NULL), why this one runs on the CPU
     * though a GPU was to be used (/health says it); custody_fd >= 0, the socket to give the
     * keeper custody of requests on (custody.h; -1 or 0: none). */
    int listen_fd;
    int ready_fd;
    int custody_fd;
    int restarts;
    const char *fallback;
    struct cllm_engine_config engine;
    /* Fills the request defaults once the model is open (generation_config + server flags).
     * Strings it points p->stop at must outlive cllm_server_run. */
    void (*request_defaults)(void *ctx, const struct cllm_model_files *mf,
                             struct cllm_request_params *p);
    void *request_defaults_ctx;
};

enum cllm_server_state {
    CLLM_SERVER_LOADING,
    CLLM_SERVER_READY,
    CLLM_SERVER_FAILED,
};

struct cllm_server {
    struct cllm_server_config cfg;
    char model_name[128]; /* what /v1/models and responses call the model */
    double t_start;       /* monotonic seconds at cllm_server_run */
    int64_t t_created;    /* Unix seconds at cllm_server_run (the model's "created") */
    atomic_int state;     /* enum cllm_server_state; the fields below are set before READY */
    atomic_bool stopping; /* a signal came: handlers cancel their work and return */
    atomic_uint_fast64_t next_id;

    /* set by the loader thread before state becomes READY, read-only afterwards */
    struct cllm_model_files *mf;
    struct cllm_chat_template *tmpl; /* NULL if the model has no chat template */
    /* Read it with cllm_server_engine: it changes once at most afterwards, when a stalled GPU
     * engine is replaced by one on the CPU (cllm_server_fail_over). */
    _Atomic(struct cllm_engine *) engine;
    struct cllm_request_params defaults;
    double load_seconds;
    char load_error[512]; /* for CLLM_SERVER_FAILED */

    pthread_mutex_t failover_lock;
    struct cllm_engine *abandoned; /* under failover_lock: the stalled engine replaced */
    bool fail_over_tried;          /* under failover_lock: a move was tried (once at most) */
    char fallback[256]; /* under failover_lock: why the server runs on the CPU though a GPU was
                           to be used, when the server chose so (the GPU probe, a stall) */

    /* custody.h: the keeper's socket (-1: none) and what goes with it */
    int custody_fd;
    pthread_mutex_t custody_lock; /* one message at a time on custody_fd */
    uint64_t custody_next_id;     /* under custody_lock */
    atomic_bool custody_broken;   /* a message failed: no more custody */
    pthread_t custody_thread;     /* takes replayed connections */
    bool custody_started;

    struct cllm_metrics metrics;
    struct MHD_Daemon *daemon;
    int listen_fd;
    pthread_t loader;
};

/* The engine requests go to now. */
struct cllm_engine *cllm_server_engine(struct cllm_server *s);

/* Called by a handler that found engine `from` stalled (cllm_engine_stalled): under
 * --device auto, on a GPU, the first caller starts an engine on the CPU and makes it the
 * server's, leaving the stuck one to its thread (which owns its requests and cannot be
 * joined). Returns the engine to go on with (the new one, or the one another handler made),
 * or NULL when there is none: not --device auto, already on the CPU, or the CPU engine could
 * not start. */
struct cllm_engine *cllm_server_fail_over(struct cllm_server *s, struct cllm_engine *from,
                                          const char *why);

/* The engine, after moving to the CPU first if it is stalled and the server can
 * (cllm_server_fail_over): for new requests and the health check, so that a stall with no
 * request left waiting (their clients gone) does not keep the server unhealthy. */
struct cllm_engine *cllm_server_engine_live(struct cllm_server *s);

/* Runs the server until SIGINT/SIGTERM (CLLM_OK) or until it cannot go on: the address cannot
 * be bound or the model fails to load (an error, err filled). Blocks SIGINT/SIGTERM in the
 * calling thread (and so in every thread it starts) and ignores SIGPIPE while it runs. */
enum cllm_status cllm_server_run(const struct cllm_server_config *c, char *err, size_t err_len);

/* True once the model is loaded and warmed up (and not shutting down). */
bool cllm_server_ready(const struct cllm_server *s);

#endif
