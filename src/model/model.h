/*
 * The Qwen2 forward pass over a batch of tokens from any number of sequences (a "step"),
 * written once against backend ops. Weights come from cllm_model_files; the KV cache is a
 * pool of fixed-size blocks that each sequence addresses through its block table.
 */
#ifndef CLLM_MODEL_MODEL_H
#define CLLM_MODEL_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/model_files.h"

struct cllm_model;

/* The KV cache: per layer, [n_blocks * block_size][n_kv_head][head_dim] of the backend's
 * kv_dtype for K and for V. */
struct cllm_kv_cache {
    int32_t n_layer;
    int32_t n_blocks;
    int32_t block_size;
    void **k; /* [n_layer] device pointers */
    void **v;
};

/* One forward step: n_tokens tokens, each with its position, sequence and cache slot. The
 * tokens of one sequence must be at consecutive positions and every earlier position of the
 * sequence must already be in the cache (or in this step). */
struct cllm_step {
    int32_t n_tokens;
    const int32_t *tokens;      /* [n_tokens] */
    const int32_t *pos;         /* [n_tokens] */
    const int32_t *seq;         /* [n_tokens] row of block_table */
    const int32_t *slot;        /* [n_tokens] block * block_size + offset */
    const int32_t *block_table; /* [n_seqs][max_blocks] */
    int32_t n_seqs;
    int32_t max_blocks;
    int32_t n_outputs;          /* tokens whose next-token logits are wanted */
    const int32_t *outputs;     /* [n_outputs] indices into the step's tokens */
};

/* Loads the weights onto be (borrowed; must outlive the model) and sizes activation buffers
 * for steps of up to max_tokens tokens and max_outputs outputs. Checks every tensor first. */
enum cllm_status cllm_model_init(struct cllm_model **out, const struct cllm_model_files *mf,
                                 struct cllm_backend *be, int32_t max_tokens, int32_t max_outputs,
                                 char *err, size_t err_len);
void cllm_model_free(struct cllm_model *m);
const struct cllm_hparams *cllm_model_hparams(const struct cllm_model *m);
struct cllm_backend *cllm_model_backend(const struct cllm_model *m); /* the one it runs on */
int32_t cllm_model_max_tokens(const struct cllm_model *m);

/* Bytes of KV cache one token takes (all layers, K and V). */
uint64_t cllm_model_kv_bytes_per_token(const struct cllm_model *m);
enum cllm_status cllm_kv_cache_init(struct cllm_kv_cache *kv, const struct cllm_model *m,
                                    int32_t n_blocks, int32_t block_size, char *err,
                                    size_t err_len);
void cllm_kv_cache_free(struct cllm_kv_cache *kv, const struct cllm_model *m);

/* Runs the step; on success *logits points at [n_outputs][n_vocab] F32 host logits owned by
 * the model, valid until the next forward. Invalid steps (bad ids, positions, slots, sizes)
 * return CLLM_ERR_INVALID_ARG / CLLM_ERR_RANGE without touching the cache. */
enum cllm_status cllm_model_forward(struct cllm_model *m, struct cllm_kv_cache *kv,
                                    const struct cllm_step *step, const float **logits);

/* True if the backend samples on the device (cllm_model_forward_sample). */
bool cllm_model_samples_on_device(const struct cllm_model *m);

/* Runs the step and draws each output's token on the device as rows[i] says (its penalties
 * over counts, host, read during the call; NULL when no row has any), so the logits stay
 * there: tokens[i] gets output i's token. A row with a negative temperature is the caller's to
 * sample: its tokens[i] is -1 and its logits are row i of *logits (host; the other rows of
 * *logits are not filled). Needs cllm_model_samples_on_device. */
enum cllm_status cllm_model_forward_sample(struct cllm_model *m, struct cllm_kv_cache *kv,
                                           const struct cllm_step *step,
                                           const struct cllm_sample_row *rows,
                                           const struct cllm_token_count *counts, int32_t *tokens,
                                           const float **logits);

/* cllm_model_forward_sample in two halves, so the host can work while the device runs the
 * step: launch queues it and returns; wait (with the same rows and tokens, which must stay
 * valid in between) blocks until tokens and *logits are filled. Nothing else may use the
 * model or its backend in between.
 *
 * Two steps may be in flight (waited for in launch order) when cllm_model_queues_steps, or
 * on a backend without a device sampler, where launch runs the step at once and draws its
 * rows on the host as the device would (argmax, or the processors with a (seed, counter)
 * generator). The second step's tokens may then name outputs of the first, not known on the
 * host yet: -1 - k stands for the first step's output k (and a row's unseen_output k + 1
 * counts that output for its penalties). A step whose rows include the
 * caller's (temperature < 0: logits to download) cannot have a second step behind it.
 * Without a device sampler, launch returns the step's own errors at once. */
enum cllm_status cllm_model_launch_sample(struct cllm_model *m, struct cllm_kv_cache *kv,
                                          const struct cllm_step *step,
                                          const struct cllm_sample_row *rows,
                                          const struct cllm_token_count *counts, int32_t *tokens);
enum cllm_status cllm_model_wait_sample(struct cllm_model *m, const struct cllm_sample_row *rows,
                                        int32_t *tokens, const float **logits);

/* True if the backend queues steps: a second step can be launched, taking tokens from the
 * first one's draw on the device, while the first one runs. */
bool cllm_model_queues_steps(const struct cllm_model *m);

/* Steps still to run op by op, unrecorded, because recording a step's graph found no room
 * on the device (then it is tried again); 0 while steps are recorded as usual. */
int64_t cllm_model_unrecorded_steps(const struct cllm_model *m);

/* After a failed launch or wait: waits for the device, then forgets every launched step
 * (their tokens are never filled). */
void cllm_model_drop_launched(struct cllm_model *m);

#endif
