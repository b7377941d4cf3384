/*
 * Inside the engine (not its interface, which is engine.h): the engine's state, shared by its
 * files -- engine.c (the thread, its steps, start and stop), engine_device.c (the backend and
 * model it runs on, and what it does when the device fails or runs short of memory) and
 * engine_api.c (what other threads call: submit, and the state they read under the lock).
 */
#ifndef CLLM_ENGINE_ENGINE_INTERNAL_H
#define CLLM_ENGINE_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/backoff.h"
#include "core/token_count.h"
#include "engine/engine.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "model/model.h"

struct cllm_threadpool;
struct cllm_sampler;

/* A token to draw on the host: the sampler of its request, its row of the step's logits, and
 * where the token goes (a negative value if the draw failed). */
struct host_draw {
    struct cllm_sampler *sampler;
    int32_t row;
    int32_t *token;
};

/* A step launched and not yet waited for. Each request of its plan is retained: it may leave
 * the scheduler (EOS, cancel) while the step runs. */
struct launched {
    struct cllm_sched_entry *entries; /* [max_seqs] the plan */
    int32_t *tok_index; /* [max_seqs] per entry: where its token goes in req->tokens, or -1 */
    int32_t n_entries;
    struct cllm_sample_row *rows; /* [max_seqs] how each output is drawn */
    int32_t *sampled;             /* [max_seqs] the drawn tokens (-1: sample on the host) */
    bool caller_rows;             /* some outputs are sampled on the host */
    const float *logits;          /* without draws: the step's logits (host) */
};

struct cllm_engine {
    const struct cllm_model_files *mf;
    struct cllm_engine_config cfg;
    struct cllm_backend *be;
    struct cllm_model *model;
    struct cllm_kv_cache kv;
    struct cllm_scheduler sched;
    int32_t n_ctx, max_blocks_per_seq, n_vocab;

    /* step arrays, [max_batch_tokens] / [max_seqs][max_blocks_per_seq] */
    int32_t *tokens, *pos, *seq, *slot, *outputs, *table;
    float *logits_copies; /* [n_copies][n_vocab]: a row per host thread for samplers */
    int32_t n_copies;
    struct host_draw *host_draws;      /* [max_seqs] a step's tokens to draw on the host */
    struct cllm_threadpool *draw_pool; /* host threads for draws on a backend that lends none */
    struct launched flights[2];        /* launched steps, oldest first: flights[(head + i) % 2] */
    int32_t n_flights, flight_head;
    struct pending_token *pending; /* [max_seqs] tokens whose text is not delivered yet */
    int32_t n_pending;
    struct cllm_token_count *counts; /* [counts_cap] the penalties' memory of a step's rows */
    size_t counts_cap;
    bool draws;          /* steps go through cllm_model_launch_sample (tokens drawn by the model) */
    bool host_penalties; /* CLLM_HOST_PENALTIES=1: rows with penalties are drawn on the host */
    bool run_ahead;      /* launch a step while the one before it runs */
    bool overlap;        /* deliver a step's text during the next step */
    /* Smaller steps after the device ran short of memory (smaller_steps), and growing back
     * (cllm_engine_grow_steps_back): at step grow_at (0: at full size) steps double, after
     * grow.wait steps at each size; a size grown back to that is short again doubles the wait. */
    uint64_t grow_at;
    struct cllm_backoff grow;

    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct cllm_request *incoming_head, *incoming_tail; /* under lock */
    int32_t n_incoming;                                 /* under lock */
    bool stop;                                          /* under lock */
    char lost[192]; /* under lock: why the device can run nothing more ("" while it can) */
    const char *backend_name; /* under lock: the backend's name (a static string) */
    double stall_s;           /* under lock: a turn longer than this is a stall; 0: none */
    char fallback[256];  /* under lock: why it runs on the CPU though a GPU was to be used ("") */
    double turn_started; /* under lock: cllm_now() when the current turn began; 0
                            while the engine waits for work */
    uint64_t next_id;    /* under lock */
    struct cllm_engine_stats stats; /* under lock */
};

/* A generated token whose text is still to be delivered. */
struct pending_token {
    struct cllm_request *r; /* a reference of its own */
    int32_t token;
    bool at_limit; /* the request reached its length limit with this token */
};

/* The i-th launched step, oldest first. */
static inline struct launched *flight_at(struct cllm_engine *e, int32_t i)
{
    return &e->flights[(e->flight_head + i) % 2];
}

/* Lets go of the oldest launched step's requests. */
static inline void pop_flight(struct cllm_engine *e)
{
    struct launched *f = flight_at(e, 0);
    for (int32_t j = 0; j < f->n_entries; j++)
        cllm_request_release(f->entries[j].req);
    f->n_entries = 0;
    e->flight_head = (e->flight_head + 1) % 2;
    e->n_flights--;
}

/* engine.c: ends a request for its submitter (the scheduler may still hold it); the same and
 * out of the scheduler; every request the scheduler holds ended with an error. */
void cllm_engine_end_request(struct cllm_engine *e, struct cllm_request *r,
                             enum cllm_finish_reason why, const char *error);
void cllm_engine_finish(struct cllm_engine *e, struct cllm_request *r, enum cllm_finish_reason why,
                        const char *error);
void cllm_engine_fail_all(struct cllm_engine *e, const char *msg);

/* engine_device.c: the backend and model (a GPU checked against the CPU first), the KV cache
 * they leave room for, how steps run on them, the stall timeout; a failed launch or wait
 * (moves to the CPU, smaller steps, or the requests end), and smaller steps growing back. */
enum cllm_status cllm_engine_load_model(struct cllm_engine *e, char *err, size_t err_len);
enum cllm_status cllm_engine_device_kv_bytes(struct cllm_engine *e, int64_t *out, char *err,
                                             size_t err_len);
int64_t cllm_engine_cache_blocks(const struct cllm_engine *e, int64_t kv_bytes);
void cllm_engine_set_step_modes(struct cllm_engine *e);
double cllm_engine_stall_limit(const struct cllm_engine *e);
void cllm_engine_step_failed(struct cllm_engine *e, enum cllm_status rc, bool plan);
void cllm_engine_grow_steps_back(struct cllm_engine *e);

#endif
