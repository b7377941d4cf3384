/*
 * Sampling on the device: each row of a batch of logits becomes one token, drawn as its
 * struct cllm_sample_row says (temperature, top-k, top-p, min-p, in transformers' order) with
 * the host sampler's semantics (sampling/sampling.c; the penalties are cllm_cuda_penalize,
 * run first). Greedy rows give exactly the host's argmax; sampled rows draw from
 * the same distribution as the host, with a counter-based generator: the token depends only
 * on the logits row, the row's parameters and (seed, counter), never on the batch around it.
 *
 * The CUDA types come from backend/cuda/vendor.h (CUDA C++) or <cuda_runtime_api.h> (C):
 * include one of them first.
 */
#ifndef CLLM_BACKEND_CUDA_SAMPLE_H
#define CLLM_BACKEND_CUDA_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest n_vocab cllm_cuda_sample takes. */
#define CLLM_CUDA_SAMPLE_MAX_VOCAB (1 << 30)

/* Scratch bytes cllm_cuda_sample needs for n rows of n_vocab (0: it needs none, and scratch
 * may be NULL). */
size_t cllm_cuda_sample_scratch_bytes(int32_t n, int32_t n_vocab);

/* tokens_dev[i] = the token drawn from logits row i (F32, [n][n_vocab], device) as rows_dev[i]
 * (device copy) says. Asynchronous on stream; returns the launch error, if any
 * (cudaErrorInvalidValue for n < 0 or n_vocab outside [1, CLLM_CUDA_SAMPLE_MAX_VOCAB]). Never
 * synchronises or allocates, so it can be recorded into a CUDA graph. Every token written is
 * in [0, n_vocab), whatever the logits and parameters hold. */
cudaError_t cllm_cuda_sample(const float *logits, int32_t n, int32_t n_vocab,
                             const struct cllm_sample_row *rows_dev, int32_t *tokens_dev,
                             void *scratch, size_t scratch_bytes, cudaStream_t stream);

/* The penalties of each row i of logits (F32, [n][n_vocab], device; in place), as rows_dev[i]
 * says: its entries of counts_dev, and when its unseen_output is k + 1 > 0, prev_dev[k] too
 * (the previous draw's tokens; the caller checks k against that draw's rows). The arithmetic
 * is cllm_penalize's (sampling.h), bit for bit. Rows without penalties are left alone.
 * Asynchronous on stream; never synchronises or allocates. */
cudaError_t cllm_cuda_penalize(float *logits, int32_t n, int32_t n_vocab,
                               const struct cllm_sample_row *rows_dev,
                               const struct cllm_token_count *counts_dev, const int32_t *prev_dev,
                               cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
