/*
 * Launchers of the CUDA kernels (kernels.cu, attention.cu), called by backend_cuda_ops.cu. Each
 * queues its work on `stream` and returns the launch error; none synchronises, allocates or
 * copies to the host, so every one of them can be recorded into a CUDA graph.
 *
 * Types: "act" buffers are __nv_bfloat16, the residual stream and projections F32, the KV
 * cache __nv_bfloat16 [slots][n_kv][head_dim] (see backend.h).
 */
#ifndef CLLM_BACKEND_CUDA_KERNELS_H
#define CLLM_BACKEND_CUDA_KERNELS_H

#include "backend/cuda/vendor.h"

#include <stdint.h>

#include "backend/cuda/warp.h"

/* Largest head_dim / 2 the RoPE kernel takes its frequencies for (by value). */
#define CLLM_CUDA_MAX_HALF_DIM 128

struct cllm_cuda_rope_freqs {
    float inv_freq[CLLM_CUDA_MAX_HALF_DIM]; /* computed on the host exactly as cpu/ref.c does */
};

/* Two BF16 as one 32-bit MMA operand register, lo in the low half (the PTX fragment order). */
static __device__ __forceinline__ unsigned cllm_cuda_pack_bf16x2(__nv_bfloat16 lo, __nv_bfloat16 hi)
{
    return (unsigned)__bfloat16_as_ushort(lo) | (unsigned)__bfloat16_as_ushort(hi) << 16;
}

/* RoPE's cos and sin at position pos for frequency inv_freq, as cpu/ref.c rounds them (the
 * angle in F32, its sine and cosine in double), and the rotation of one rotate-half pair
 * (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) without FMA contraction: shared by the RoPE kernel
 * and the QKV GEMM's epilogue, so both give the same bits. */
static __device__ __forceinline__ void cllm_cuda_rope_cos_sin(int32_t pos, float inv_freq, float *c,
                                                              float *s)
{
    const float angle = __fmul_rn((float)pos, inv_freq);
    double sd, cd;
    sincos((double)angle, &sd, &cd);
    *c = (float)cd;
    *s = (float)sd;
}

static __device__ __forceinline__ void cllm_cuda_rope_rotate(float x1, float x2, float c, float s,
                                                             float *y1, float *y2)
{
    *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

/* The end of a launch whose blocks share out a tile's work: each block, its part written,
 * counts itself on *count; true in the last of the tile's `blocks` to do so, which then sees
 * every block's part and has reset the count for the next launch (atomically: a plain store
 * would race with the others' atomicAdd in CUDA's memory model; the emulator's race check
 * reports it). Every thread of the block calls it. `last` is the caller's __shared__ flag: the
 * emulator gives a block its own copy of a __shared__ variable only in the .cu files it
 * rewrites (tests/emu/prep.py), not in this header. */
static __device__ __forceinline__ bool cllm_cuda_last_block(int32_t *count, int32_t blocks,
                                                            bool *last)
{
    __threadfence(); /* this block's part is visible before it is counted */
    __syncthreads();
    if (threadIdx.x == 0) {
        *last = atomicAdd(count, 1) == blocks - 1;
        if (*last)
            atomicExch(count, 0);
    }
    __syncthreads();
    if (!*last)
        return false;
    __threadfence(); /* the parts counted before this block's are seen after it */
    return true;
}

/* What cllm_cuda_qkv_rope_store does after the QKV projection, as the GEMM's epilogue takes
 * it (gemm.h): rows of [q heads | k heads | v heads], n_head + 2 n_kv heads of head_dim. */
struct cllm_cuda_rope_store {
    const int32_t *pos, *slot; /* per token (device); slot < 0: a padding row */
    const float *bias;         /* stacked [q | k | v] bias, or NULL */
    int32_t n_head, n_kv, head_dim;
    __nv_bfloat16 *k_cache, *v_cache;
    struct cllm_cuda_rope_freqs freqs;
};

/* Where the tokens of a step sit (device arrays), as in struct cllm_attn_batch. */
struct cllm_cuda_batch {
    int32_t n_tokens;
    const int32_t *pos, *seq, *slot, *block_table;
    int32_t max_blocks, block_size, max_len;
};

cudaError_t cllm_cuda_embed(const __nv_bfloat16 *table, int64_t n_rows, int32_t dim,
                            const int32_t *tokens, int32_t n, float *out, cudaStream_t stream);

/* The RMSNorm's arithmetic, shared by the rmsnorm kernel and the GEMMs that normalize their
 * own input (gemm.h, cllm_cuda_norm_in), so that both give the same bits: the sum of squares
 * as CLLM_CUDA_NORM_THREADS partial sums (cllm_cuda_norm_partial), summed by one warp
 * (cllm_cuda_norm_sum), whatever the width of the block that computes them. */
#define CLLM_CUDA_NORM_THREADS 256
/* The value normalized at d: the residual stream plus what is added to it, or the stream. */
static __device__ __forceinline__ float cllm_cuda_norm_value(const float *res, const float *add,
                                                             int32_t d)
{
    return add ? __fadd_rn(res[d], add[d]) : res[d];
}
/* cllm_cuda_norm_value at d .. d + 3 (16-byte aligned). */
static __device__ __forceinline__ float4 cllm_cuda_norm_value4(const float *res, const float *add,
                                                               int64_t d)
{
    float4 v = *(const float4 *)(res + d);
    if (add) {
        const float4 a = *(const float4 *)(add + d);
        v.x = __fadd_rn(v.x, a.x), v.y = __fadd_rn(v.y, a.y);
        v.z = __fadd_rn(v.z, a.z), v.w = __fadd_rn(v.w, a.w);
    }
    return v;
}
/* Partial sum t (< CLLM_CUDA_NORM_THREADS): v * v over d = t, t + 256, ... in order (FMA). */
static __device__ __forceinline__ float cllm_cuda_norm_partial(const float *res, const float *add,
                                                               int32_t t, int32_t dim)
{
    float sum = 0.0f;
#pragma unroll 4
    for (int32_t d = t; d < dim; d += CLLM_CUDA_NORM_THREADS) {
        const float v = cllm_cuda_norm_value(res, add, d);
        sum = __fmaf_rn(v, v, sum);
    }
    return sum;
}
/* Partial sums t .. t + 3 (t a multiple of 4; dim too, rows 16-byte aligned) at once, each the
 * chain cllm_cuda_norm_partial computes, from 16-byte loads: a quarter of the threads, a
 * quarter of the loads. */
static __device__ __forceinline__ float4 cllm_cuda_norm_partial4(const float *res, const float *add,
                                                                 int32_t t, int32_t dim)
{
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int32_t d = t; d < dim; d += CLLM_CUDA_NORM_THREADS) {
        const float4 v = cllm_cuda_norm_value4(res, add, d);
        sum.x = __fmaf_rn(v.x, v.x, sum.x), sum.y = __fmaf_rn(v.y, v.y, sum.y);
        sum.z = __fmaf_rn(v.z, v.z, sum.z), sum.w = __fmaf_rn(v.w, v.w, sum.w);
    }
    return sum;
}
/* The sum of partial[0 .. CLLM_CUDA_NORM_THREADS) (shared memory), called by all 32 lanes of
 * one warp, each of which gets it: an xor butterfly over each 32 of them, then one over those
 * 8 sums (with zeros). */
static __device__ __forceinline__ float cllm_cuda_norm_sum(const float *partial)
{
    const int lane = threadIdx.x % 32;
    float mine = 0.0f;
    for (int w = 0; w < CLLM_CUDA_NORM_THREADS / 32; w++) {
        float v = partial[w * 32 + lane];
        for (int o = 16; o > 0; o >>= 1)
            v += cllm_shfl_xor(v, o);
        if (lane == w)
            mine = v;
    }
    for (int o = 16; o > 0; o >>= 1)
        mine += cllm_shfl_xor(mine, o);
    return mine;
}
static __device__ __forceinline__ float cllm_cuda_norm_scale(float sum, int32_t dim, float eps)
{
    return 1.0f / sqrtf(sum / (float)dim + eps);
}
static __device__ __forceinline__ __nv_bfloat16 cllm_cuda_norm_out(float w, float v, float scale)
{
    return __float2bfloat16_rn(__fmul_rn(w, __fmul_rn(v, scale)));
}

/* res (if non-NULL) += x; out = bf16(rmsnorm(res or x) * w). */
cudaError_t cllm_cuda_rmsnorm(float *res, const float *x, const float *w, float eps, int32_t n,
                              int32_t dim, __nv_bfloat16 *out, cudaStream_t stream);

/* y[t][0..N) += bias, rows of stride ldy. */
cudaError_t cllm_cuda_add_bias(float *y, int32_t ldy, const float *bias, int32_t n, int32_t N,
                               cudaStream_t stream);

/* y[t][0..N) = float(src[t][0..N)) (+ bias if non-NULL); rows of stride ld_src and ldy. */
cudaError_t cllm_cuda_widen_bias(const __nv_bfloat16 *src, int32_t ld_src, float *y, int32_t ldy,
                                 const float *bias, int32_t n, int32_t N, cudaStream_t stream);

cudaError_t cllm_cuda_qkv_rope_store(const struct cllm_cuda_batch *b,
                                     const struct cllm_cuda_rope_freqs *freqs, float *qkv,
                                     int32_t ld, const float *bias, int32_t n_head, int32_t n_kv,
                                     int32_t head_dim, __nv_bfloat16 *k_cache,
                                     __nv_bfloat16 *v_cache, cudaStream_t stream);

/* silu(g) * u rounded to BF16, in cpu/ref.c's order (g / (1 + exp(-g)) * u, no FMA): shared
 * by the silu_mul kernel and the gate/up GEMM's SiLU epilogue, so both give the same bits. */
static __device__ __forceinline__ __nv_bfloat16 cllm_cuda_silu_mul_one(float g, float u)
{
    return __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
}

cudaError_t cllm_cuda_silu_mul(const float *gate_up, int32_t n, int32_t dim, __nv_bfloat16 *out,
                               cudaStream_t stream);

cudaError_t cllm_cuda_gather_rows(const float *x, const int32_t *idx, int32_t n_idx, int32_t dim,
                                  float *out, cudaStream_t stream);

/* tokens[i] = drawn[-1 - tokens[i]] where tokens[i] < 0 (0 for an index past n_drawn): a step
 * takes the tokens the previous step drew on the device before the host has seen them. */
cudaError_t cllm_cuda_resolve_tokens(int32_t *tokens, int32_t n, const int32_t *drawn,
                                     int32_t n_drawn, cudaStream_t stream);

/* Scratch bytes cllm_cuda_attention needs for n_tokens tokens. */
size_t cllm_cuda_attention_scratch(int32_t n_tokens, int32_t n_head, int32_t head_dim);

/* Is (n_head, n_kv, head_dim) a shape the attention kernel handles (simt: attention_simt)? */
int cllm_cuda_attention_supported(int32_t n_head, int32_t n_kv, int32_t head_dim, bool simt);

/* Causal paged attention (attention.cu's formula). simt picks the CUDA-core kernel instead of
 * the tensor-core one (forced where there is no MMA): different rounding, so one per process. */
cudaError_t cllm_cuda_attention(const struct cllm_cuda_batch *b, const float *q, int32_t ldq,
                                const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                                int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                                bool simt, void *scratch, __nv_bfloat16 *out, cudaStream_t stream);

#endif
