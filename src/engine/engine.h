/*
 * The engine: one thread that owns the model, the KV cache and the scheduler, and runs
 * step() in a loop: schedule -> build the step -> forward -> sample -> update requests.
 * Any thread may submit requests and poll their output (request.h); the engine never sees
 * JSON or HTTP. Continuous batching: requests join and leave at every step.
 */
#ifndef CLLM_ENGINE_ENGINE_H
#define CLLM_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "engine/request.h"
#include "model/model_files.h"

struct cllm_engine_config {
    enum cllm_backend_kind backend;
    int32_t device;           /* GPU ordinal */
    double gpu_mem_fraction;  /* GPU: share of device memory to use in all; 0 = 0.9 */
    int32_t n_threads;        /* CPU threads; 0 = physical cores */
    enum cllm_cpu_weights cpu_weights; /* float matrices on the CPU (also after a GPU fails):
                                          as stored, or quantized (backend.h) */
    int32_t n_ctx;            /* max tokens per sequence (prompt + generated); 0 = model's */
    int64_t kv_bytes;         /* KV cache budget in bytes; 0 = GPU: what gpu_mem_fraction leaves;
                                 CPU: enough for max_seqs x 2048 tokens, capped at 4 GiB or an
                                 eighth of the process's memory limit, whichever is more */
    int32_t block_size;       /* tokens per KV block; 0 = 16 */
    int32_t max_batch_tokens; /* token budget per step; 0 = 512 */
    int32_t max_seqs;         /* sequences per step; 0 = 256 */
    int32_t max_queue;        /* waiting requests accepted at most; 0 = 4096 */
    bool prefix_cache;        /* share full blocks between requests with equal prefixes */
    int32_t overlap;          /* deliver a step's text while the next step runs (engine.c):
                                 0 = when the device samples, 1 = always (tests), -1 = never */
    int32_t run_ahead;        /* launch step N+1 before step N's tokens are seen (engine.c):
                                 0 = when the backend queues steps (GPU), 1 = always (tests:
                                 the CPU draws as a device would), -1 = never */
    bool no_device_check;     /* skip comparing a GPU's logits with the CPU's at start
                                 (device_check.h); a GPU that fails it is tried once more with
                                 every GEMM on CUDA cores (gemm_on_cores) and then not used
                                 under CLLM_BACKEND_AUTO; asked for by name, it is an error */
    bool gemm_on_cores;       /* GPU: every GEMM on CUDA cores (backend.h): set by the engine
                                 when the device check passes only so, and by the server when
                                 its GPU probe's child found that (probe.h) */
    double stall_timeout;     /* seconds one turn of the engine (a step, with run-ahead the
                                 wait for one) may take before the engine counts as stalled
                                 (cllm_engine_stalled); 0 = 30 on a GPU, never on the CPU
                                 (whose steps are the host's own work, seconds each on a big
                                 batch); < 0 = never. Never once the engine moved from a GPU
                                 to the CPU (there is nowhere else to go). */
    int32_t grow_back_steps;  /* after a step found no room on the device and the engine went
                                 on in smaller steps: steps that go through before it tries
                                 twice the size again, up to max_batch_tokens and max_seqs;
                                 doubled by each try that finds no room either, up to 16
                                 times. 0 = 256 */
};

void cllm_engine_config_default(struct cllm_engine_config *c);

/* Counters for /metrics and the logs (a consistent snapshot). */
struct cllm_engine_stats {
    int32_t running, waiting;
    int32_t kv_blocks_total, kv_blocks_used;
    int32_t block_size;
    int32_t n_ctx;
    uint64_t steps, prompt_tokens, generated_tokens, preemptions;
    uint64_t prefix_queries, prefix_hits; /* in blocks */
    uint64_t requests_finished;
    int32_t step_tokens, step_seqs; /* the most tokens and sequences a step takes now: less
                                       than configured while the device is short of memory */
    int64_t unrecorded_steps;       /* steps still to run without a recorded graph, whose recording
                                       found no room on the device (cllm_model_unrecorded_steps) */
    double turn_seconds; /* how long the engine's current turn has run (0: idle) */
    bool stalled;        /* turn_seconds is past the stall timeout (cllm_engine_stalled) */
};

struct cllm_engine;

/* Loads the model onto the backend and starts the engine thread. mf is borrowed and must
 * outlive the engine. */
enum cllm_status cllm_engine_new(struct cllm_engine **out, const struct cllm_model_files *mf,
                                 const struct cllm_engine_config *c, char *err, size_t err_len);
/* Cancels everything still queued or running, stops the thread, frees the engine. */
void cllm_engine_free(struct cllm_engine *e);

/* Queues a request for prompt token ids. On success *out holds a reference the caller must
 * release (cllm_request_release). Errors, with err filled: CLLM_ERR_INVALID_ARG (empty
 * prompt), CLLM_ERR_RANGE (prompt beyond the context window, a bad parameter), CLLM_ERR_BUSY
 * (max_queue requests are waiting already), CLLM_ERR_NOMEM. */
enum cllm_status cllm_engine_submit(struct cllm_engine *e, const int32_t *prompt, int32_t n_prompt,
                                    const struct cllm_request_params *p, struct cllm_request **out,
                                    char *err, size_t err_len);

/* True if one more request would exceed max_queue. */
bool cllm_engine_queue_full(struct cllm_engine *e);

void cllm_engine_stats(struct cllm_engine *e, struct cllm_engine_stats *s);
/* True once the device has failed for good (a step failed and the device no longer answers)
 * and the engine could not move to the CPU (it does under CLLM_BACKEND_AUTO): every request
 * since ends with an error and submits fail with CLLM_ERR_DEVICE; why gets the reason. The
 * server reports itself unhealthy then. */
bool cllm_engine_lost(struct cllm_engine *e, char *why, size_t why_len);
/* True while the engine's current turn has run longer than its stall timeout (engine config):
 * a device that stops answering without an error keeps the engine thread waiting in one sync,
 * where nothing else can end it. Unlike a loss this may clear: if the device answers again the
 * engine goes on. While it lasts, submits fail with CLLM_ERR_DEVICE, and the server moves to
 * the CPU (cllm_server_fail_over) or reports itself unhealthy, its handlers no longer waiting
 * (server/job.h); why gets the reason. */
bool cllm_engine_stalled(struct cllm_engine *e, char *why, size_t why_len);
/* True when the engine runs on the CPU though it was to use a GPU (--device auto): the GPU
 * failed its device check at start, or a step on it failed; why gets which. */
bool cllm_engine_fallback(struct cllm_engine *e, char *why, size_t why_len);
/* True while the engine runs below its configured speed: for want of device memory, steps
 * smaller than configured (a step found no room; they grow back, engine config
 * grow_back_steps), or steps run without their recorded graphs (a recording found no room);
 * or on a GPU that passed its device check only with every GEMM on CUDA cores (config
 * gemm_on_cores); why gets which, with the numbers. Answers are the same; the server stays
 * healthy and says so (/health "degraded"). */
bool cllm_engine_degraded(struct cllm_engine *e, char *why, size_t why_len);
int32_t cllm_engine_n_ctx(const struct cllm_engine *e);
/* The most sequences one step takes (the config's max_seqs after its defaults and limits). */
int32_t cllm_engine_max_seqs(const struct cllm_engine *e);
/* The backend it runs on: a static string ("cpu", "cuda"); under --device auto it turns to
 * "cpu" if the GPU is lost (engine_device.c, move_to_cpu). */
const char *cllm_engine_backend_name(struct cllm_engine *e);
/* Whether its GPU runs every GEMM on CUDA cores (engine config gemm_on_cores: asked for, or the
 * device check passed only so). Fixed once the engine is made. */
bool cllm_engine_gemm_on_cores(const struct cllm_engine *e);

#endif
