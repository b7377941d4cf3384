/*
 * The elementwise and per-row kernels of the CUDA backend. Each mirrors its scalar twin in
 * cpu/ref.c operation for operation (F32 arithmetic in the same order, no contraction into
 * FMA where the CPU has none), so the only differences from the CPU backend are the BF16
 * roundings of what the backend stores as BF16 (act buffers, the KV cache) and the order of
 * the sums inside reductions.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/kernels.h"
#include "backend/cuda/warp.h"

#define BLOCK 256

static unsigned grid_for(int64_t n)
{
    int64_t g = (n + BLOCK - 1) / BLOCK;
    return (unsigned)(g < 65535 * 16 ? g : 65535 * 16); /* grid-stride loops cover the rest */
}

/* --- embed --- */

static __global__ void embed_kernel(const __nv_bfloat16 *table, int32_t dim, const int32_t *tokens,
                                    float *out)
{
    cllm_pdl_wait();
    const __nv_bfloat16 *row = table + (int64_t)tokens[blockIdx.x] * dim;
    float *o = out + (int64_t)blockIdx.x * dim;
    for (int32_t d = threadIdx.x; d < dim; d += blockDim.x)
        o[d] = __bfloat162float(row[d]);
}

cudaError_t cllm_cuda_embed(const __nv_bfloat16 *table, int64_t n_rows, int32_t dim,
                            const int32_t *tokens, int32_t n, float *out, cudaStream_t stream)
{
    (void)n_rows; /* ids are checked on the host before a step is queued */
    if (n <= 0)
        return cudaSuccess;
    return cllm_launch(embed_kernel, n, BLOCK, 0, stream, table, dim, tokens, out);
}

/* --- rmsnorm, add_rmsnorm --- */

/* A block of CLLM_CUDA_NORM_THREADS threads per row; its sums are kernels.h's, which the GEMMs
 * that normalize their own input compute too. */
static __global__ void __launch_bounds__(CLLM_CUDA_NORM_THREADS)
    rmsnorm_kernel(float *res, const float *x, const float *w, float eps, int32_t dim,
                   __nv_bfloat16 *out)
{
    cllm_pdl_wait();
    __shared__ __align__(16) float partial[CLLM_CUDA_NORM_THREADS];
    __shared__ float total;
    int64_t base = (int64_t)blockIdx.x * dim;
    const float *xr = x + base;
    float *rr = res ? res + base : NULL;
    const float *src = rr ? rr : xr, *add = rr ? xr : NULL; /* stream + what is added to it */
    if (dim % 4) /* (the model's widths are multiples of 8: the other path) */
        partial[threadIdx.x] = cllm_cuda_norm_partial(src, add, (int32_t)threadIdx.x, dim);
    else if (threadIdx.x < CLLM_CUDA_NORM_THREADS / 4) /* the GEMMs' way: the same sums */
        *(float4 *)&partial[threadIdx.x * 4] =
            cllm_cuda_norm_partial4(src, add, (int32_t)threadIdx.x * 4, dim);
    __syncthreads();
    if (threadIdx.x < 32) {
        const float sum = cllm_cuda_norm_sum(partial);
        if (threadIdx.x == 0)
            total = sum;
    }
    __syncthreads();
    const float scale = cllm_cuda_norm_scale(total, dim, eps);
    __nv_bfloat16 *o = out + base;
    for (int32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        const float v = cllm_cuda_norm_value(src, add, d); /* d is this thread's alone */
        if (rr)
            rr[d] = v;
        o[d] = cllm_cuda_norm_out(w[d], v, scale);
    }
}

cudaError_t cllm_cuda_rmsnorm(float *res, const float *x, const float *w, float eps, int32_t n,
                              int32_t dim, __nv_bfloat16 *out, cudaStream_t stream)
{
    if (n <= 0)
        return cudaSuccess;
    return cllm_launch(rmsnorm_kernel, n, CLLM_CUDA_NORM_THREADS, 0, stream, res, x, w, eps, dim,
                       out);
}

/* --- bias --- */

static __global__ void add_bias_kernel(float *y, int32_t ldy, const float *bias, int64_t total,
                                       int32_t N)
{
    cllm_pdl_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / N;
        int32_t c = (int32_t)(i % N);
        y[t * ldy + c] = __fadd_rn(y[t * ldy + c], bias[c]);
    }
}

cudaError_t cllm_cuda_add_bias(float *y, int32_t ldy, const float *bias, int32_t n, int32_t N,
                               cudaStream_t stream)
{
    int64_t total = (int64_t)n * N;
    if (total <= 0)
        return cudaSuccess;
    return cllm_launch(add_bias_kernel, grid_for(total), BLOCK, 0, stream, y, ldy, bias, total, N);
}

/* y[t][c] = float(src[t][c]) (+ bias[c]): a GEMM the BLAS could only write in BF16. */
static __global__ void widen_bias_kernel(const __nv_bfloat16 *src, int32_t ld_src, float *y,
                                         int32_t ldy, const float *bias, int64_t total, int32_t N)
{
    cllm_pdl_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / N;
        int32_t c = (int32_t)(i % N);
        float v = __bfloat162float(src[t * ld_src + c]);
        y[t * ldy + c] = bias ? __fadd_rn(v, bias[c]) : v;
    }
}

cudaError_t cllm_cuda_widen_bias(const __nv_bfloat16 *src, int32_t ld_src, float *y, int32_t ldy,
                                 const float *bias, int32_t n, int32_t N, cudaStream_t stream)
{
    int64_t total = (int64_t)n * N;
    if (total <= 0)
        return cudaSuccess;
    return cllm_launch(widen_bias_kernel, grid_for(total), BLOCK, 0, stream, src, ld_src, y, ldy,
                       bias, total, N);
}

/* --- bias + RoPE + KV store --- */

/* One block per token: cos/sin of the token's position once, in double from the F32 angle as
 * cpu/ref.c has them, then every q and k head rotated and k, v written to the token's slot. */
static __global__ void qkv_rope_store_kernel(struct cllm_cuda_batch b,
                                             struct cllm_cuda_rope_freqs freqs, float *qkv,
                                             int32_t ld, const float *bias, int32_t n_head,
                                             int32_t n_kv, int32_t hd, __nv_bfloat16 *k_cache,
                                             __nv_bfloat16 *v_cache)
{
    cllm_pdl_wait();
    __shared__ float cos_s[CLLM_CUDA_MAX_HALF_DIM], sin_s[CLLM_CUDA_MAX_HALF_DIM];
    int32_t t = blockIdx.x, half = hd / 2, pos = b.pos[t], slot = b.slot[t];
    for (int32_t i = threadIdx.x; i < half; i += blockDim.x)
        cllm_cuda_rope_cos_sin(pos, freqs.inv_freq[i], &cos_s[i], &sin_s[i]);
    __syncthreads();
    float *row = qkv + (int64_t)t * ld;
    int32_t n_rot = (n_head + n_kv) * half, kv = n_kv * hd;
    for (int32_t idx = threadIdx.x; idx < n_rot; idx += blockDim.x) {
        int32_t h = idx / half, i = idx % half, j = h * hd + i;
        float x1 = row[j], x2 = row[j + half];
        if (bias) {
            x1 = __fadd_rn(x1, bias[j]);
            x2 = __fadd_rn(x2, bias[j + half]);
        }
        float y1, y2;
        cllm_cuda_rope_rotate(x1, x2, cos_s[i], sin_s[i], &y1, &y2);
        row[j] = y1;
        row[j + half] = y2;
        if (h >= n_head && slot >= 0) {
            __nv_bfloat16 *k = k_cache + (int64_t)slot * kv + (int64_t)(h - n_head) * hd;
            k[i] = __float2bfloat16_rn(y1);
            k[i + half] = __float2bfloat16_rn(y2);
        }
    }
    if (slot < 0)
        return; /* a padding row */
    const float *v = row + (int64_t)(n_head + n_kv) * hd;
    const float *bv = bias ? bias + (int64_t)(n_head + n_kv) * hd : NULL;
    __nv_bfloat16 *vc = v_cache + (int64_t)slot * kv;
    for (int32_t i = threadIdx.x; i < kv; i += blockDim.x)
        vc[i] = __float2bfloat16_rn(bv ? __fadd_rn(v[i], bv[i]) : v[i]);
}

cudaError_t cllm_cuda_qkv_rope_store(const struct cllm_cuda_batch *b,
                                     const struct cllm_cuda_rope_freqs *freqs, float *qkv,
                                     int32_t ld, const float *bias, int32_t n_head, int32_t n_kv,
                                     int32_t head_dim, __nv_bfloat16 *k_cache,
                                     __nv_bfloat16 *v_cache, cudaStream_t stream)
{
    if (b->n_tokens <= 0)
        return cudaSuccess;
    if (head_dim % 2 || head_dim / 2 > CLLM_CUDA_MAX_HALF_DIM)
        return cudaErrorInvalidValue;
    return cllm_launch(qkv_rope_store_kernel, b->n_tokens, BLOCK, 0, stream, *b, *freqs, qkv, ld,
                       bias, n_head, n_kv, head_dim, k_cache, v_cache);
}

/* --- silu_mul, gather --- */

static __global__ void silu_mul_kernel(const float *gate_up, int64_t total, int32_t dim,
                                       __nv_bfloat16 *out)
{
    cllm_pdl_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / dim;
        int32_t c = (int32_t)(i % dim);
        out[i] = cllm_cuda_silu_mul_one(gate_up[t * 2 * dim + c], gate_up[t * 2 * dim + dim + c]);
    }
}

cudaError_t cllm_cuda_silu_mul(const float *gate_up, int32_t n, int32_t dim, __nv_bfloat16 *out,
                               cudaStream_t stream)
{
    int64_t total = (int64_t)n * dim;
    if (total <= 0)
        return cudaSuccess;
    return cllm_launch(silu_mul_kernel, grid_for(total), BLOCK, 0, stream, gate_up, total, dim,
                       out);
}

static __global__ void gather_rows_kernel(const float *x, const int32_t *idx, int32_t dim,
                                          float *out)
{
    cllm_pdl_wait();
    const float *src = x + (int64_t)idx[blockIdx.x] * dim;
    float *dst = out + (int64_t)blockIdx.x * dim;
    for (int32_t d = threadIdx.x; d < dim; d += blockDim.x)
        dst[d] = src[d];
}

cudaError_t cllm_cuda_gather_rows(const float *x, const int32_t *idx, int32_t n_idx, int32_t dim,
                                  float *out, cudaStream_t stream)
{
    if (n_idx <= 0)
        return cudaSuccess;
    return cllm_launch(gather_rows_kernel, n_idx, BLOCK, 0, stream, x, idx, dim, out);
}

static __global__ void resolve_tokens_kernel(int32_t *tokens, int32_t n, const int32_t *drawn,
                                             int32_t n_drawn)
{
    cllm_pdl_wait();
    const int32_t i = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n || tokens[i] >= 0)
        return;
    const int32_t k = -1 - tokens[i];
    tokens[i] = k < n_drawn ? drawn[k] : 0;
}

cudaError_t cllm_cuda_resolve_tokens(int32_t *tokens, int32_t n, const int32_t *drawn,
                                     int32_t n_drawn, cudaStream_t stream)
{
    if (n <= 0)
        return cudaSuccess;
    return cllm_launch(resolve_tokens_kernel, grid_for(n), BLOCK, 0, stream, tokens, n, drawn,
                       n_drawn);
}
