/*
 * The scalar reference of every backend op except matmul (whose reference kernels are in
 * dot_ref.c): straightforward single-threaded loops in F32 that follow transformers' Qwen2
 * code step by step. Backends are tested against these. The CPU backend calls the
 * elementwise and per-row ones directly from its threads (they are already memory-bound);
 * attention and SiLU (whose exp is not) go through its kernel family's (attend.h).
 */
#ifndef CLLM_BACKEND_CPU_REF_H
#define CLLM_BACKEND_CPU_REF_H

#include <stdint.h>

#include "backend/backend.h"

/* One row: out = x * rsqrt(mean(x^2) + eps) * w. */
void cllm_ref_rmsnorm_row(const float *x, const float *w, float eps, int32_t dim, float *out);
/* w as F32: the norm weights of GGUF and F32 folders are F32; BF16/F16 are widened first. */
void cllm_ref_silu_mul(const float *gate, const float *up, int64_t n, float *out);
/* cos/sin of the rotary angles of position pos, for i < head_dim/2, computed as transformers
 * does in F32: inv_freq = 1 / theta^(2i/d) (F32), angle = F32(pos) * inv_freq (F32). */
void cllm_ref_rope_cos_sin(const struct cllm_rope *rope, int32_t pos, float *cos_out,
                           float *sin_out);
/* Rotates one head vector in place with the cos/sin of its position. */
void cllm_ref_rope_apply(float *x, const float *cos, const float *sin, int32_t head_dim);
/* Naive two-pass softmax attention for one token and one head over positions 0..pos. */
void cllm_ref_attention_head(const struct cllm_attn_batch *b, int32_t t, int32_t h,
                             const float *q, const float *k_cache, const float *v_cache,
                             int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                             float *out);
/* The whole attention op, single-threaded. */
void cllm_ref_attention(const struct cllm_attn_batch *b, const float *q, const float *k_cache,
                        const float *v_cache, int32_t n_head, int32_t n_kv, int32_t head_dim,
                        float scale, float *out);

#endif
