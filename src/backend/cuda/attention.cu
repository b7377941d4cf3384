/*
 * Paged causal attention over a BF16 KV cache, for prefill and decode alike.
 *
 * One block per (token, KV head, split): its warps are the query heads that share the KV
 * head (grouped-query attention), so each K/V tile is read from memory once for the whole
 * group. Keys are taken 32 at a time into shared memory; lane j of each warp scores key j,
 * then an online-softmax rescale folds the tile into the warp's running sum, each lane
 * holding head_dim / 32 output dimensions.
 *
 * Long contexts are split over up to MAX_SPLITS blocks per (token, head), which a second
 * kernel combines. How a token's keys are split depends only on that token's own length,
 * never on the rest of the batch, and the combine runs in a fixed order: a sequence gets
 * the same bits whether it runs alone or with 255 others (batch invariance).
 *
 * Costs: one pass over the token's K/V per KV head. For prefill each token re-reads its
 * prefix (from L2 for a few thousand tokens); a tensor-core (mma) prefill kernel that shares
 * K/V tiles across query tokens is the next step for long prompts.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/kernels.h"

#define TILE 32       /* keys per shared-memory tile: one per lane */
#define MAX_GROUP 16  /* query heads per KV head (warps per block) */
#define MAX_SPLITS 16 /* blocks one (token, head) is split over at most */
#define SPLIT_MIN 256 /* keys per split at least */

/* Keys per split for a token that attends to len keys: a function of len alone. */
static __host__ __device__ int32_t split_len_for(int32_t len)
{
    int32_t per = (len + MAX_SPLITS - 1) / MAX_SPLITS;
    per = (per + TILE - 1) / TILE * TILE;
    return per < SPLIT_MIN ? SPLIT_MIN : per;
}

static __device__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* D = head_dim / 32 dimensions per lane. */
template <int D>
static __global__ void __launch_bounds__(32 * MAX_GROUP)
    attention_kernel(struct cllm_cuda_batch b, const float *q, int32_t ldq,
                     const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache, int32_t n_head,
                     int32_t n_kv, float scale, __nv_bfloat16 *out, float *part_acc, float *part_ml)
{
    cllm_pdl_wait();
    constexpr int HD = 32 * D;
    /* K rows padded by one 4-byte word: lane j reads row j, and an odd row stride in words
     * puts the 32 lanes on 32 different banks. */
    __shared__ __align__(16) __nv_bfloat16 ks[TILE][HD + 2];
    __shared__ __align__(16) __nv_bfloat16 vs[TILE][HD];
    __shared__ __align__(16) float qs[MAX_GROUP][HD];

    const int32_t t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t group = n_head / n_kv, h = kvh * group + warp;
    const int32_t len = b.pos[t] + 1, split_len = split_len_for(len);
    const int32_t n_splits = (len + split_len - 1) / split_len;
    if (split >= n_splits)
        return; /* the whole block: no barrier has been reached yet */
    const int32_t start = split * split_len;
    const int32_t end = min(len, start + split_len);

    const float *qrow = q + (int64_t)t * ldq + (int64_t)h * HD;
    for (int d = lane; d < HD; d += 32)
        qs[warp][d] = qrow[d];

    const int32_t *table = b.block_table + (int64_t)b.seq[t] * b.max_blocks;
    const int64_t kv_stride = (int64_t)n_kv * HD; /* elements between consecutive slots */
    float m = -INFINITY, l = 0.0f, acc[D];
#pragma unroll
    for (int i = 0; i < D; i++)
        acc[i] = 0.0f;

    for (int32_t p0 = start; p0 < end; p0 += TILE) {
        __syncthreads();               /* the previous tile is consumed (and qs is visible) */
        constexpr int CHUNKS = HD / 8; /* 16-byte chunks per row */
        for (int c = threadIdx.x; c < TILE * CHUNKS; c += blockDim.x) {
            int j = c / CHUNKS, e = (c % CHUNKS) * 8;
            int32_t p = p0 + j;
            uint4 kk = make_uint4(0, 0, 0, 0), vv = kk;
            if (p < end) {
                int64_t slot = (int64_t)table[p / b.block_size] * b.block_size + p % b.block_size;
                int64_t at = slot * kv_stride + (int64_t)kvh * HD + e;
                kk = *(const uint4 *)(k_cache + at);
                vv = *(const uint4 *)(v_cache + at);
            }
            *(uint4 *)&vs[j][e] = vv;
            uint32_t *kd = (uint32_t *)&ks[j][e]; /* padded rows are only 4-byte aligned */
            kd[0] = kk.x, kd[1] = kk.y, kd[2] = kk.z, kd[3] = kk.w;
        }
        __syncthreads();

        float score = -INFINITY;
        if (p0 + lane < end) {
            const __nv_bfloat162 *kr = (const __nv_bfloat162 *)&ks[lane][0];
            const float2 *qv = (const float2 *)&qs[warp][0];
            float dot = 0.0f;
#pragma unroll 8
            for (int d2 = 0; d2 < HD / 2; d2++) {
                float2 kf = __bfloat1622float2(kr[d2]);
                float2 qf = qv[d2];
                dot = fmaf(qf.x, kf.x, dot);
                dot = fmaf(qf.y, kf.y, dot);
            }
            score = dot * scale;
        }
        float m_new = fmaxf(m, warp_max(score)); /* finite: key p0 is always valid */
        float corr = expf(m - m_new);
        float w = p0 + lane < end ? expf(score - m_new) : 0.0f;
        l = l * corr + warp_sum(w);
#pragma unroll
        for (int i = 0; i < D; i++)
            acc[i] *= corr;
        int32_t n_keys = min(TILE, end - p0);
        for (int j = 0; j < n_keys; j++) {
            float wj = __shfl_sync(0xffffffffu, w, j);
            const __nv_bfloat16 *vr = &vs[j][lane * D];
#pragma unroll
            for (int i = 0; i < D; i++)
                acc[i] = fmaf(wj, __bfloat162float(vr[i]), acc[i]);
        }
        m = m_new;
    }

    int64_t th = (int64_t)t * n_head + h;
    if (n_splits == 1) {
        float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < D; i++)
            out[th * HD + lane * D + i] = __float2bfloat16_rn(acc[i] * inv);
        return;
    }
    float *pa = part_acc + (th * MAX_SPLITS + split) * HD;
#pragma unroll
    for (int i = 0; i < D; i++)
        pa[lane * D + i] = acc[i];
    if (lane == 0) {
        part_ml[(th * MAX_SPLITS + split) * 2] = m;
        part_ml[(th * MAX_SPLITS + split) * 2 + 1] = l;
    }
}

/* One block per (token, head), one thread per dimension: merges the token's splits in order. */
static __global__ void combine_kernel(struct cllm_cuda_batch b, int32_t n_head, int32_t hd,
                                      const float *part_acc, const float *part_ml,
                                      __nv_bfloat16 *out)
{
    cllm_pdl_wait();
    const int32_t t = blockIdx.x, h = blockIdx.y;
    const int32_t len = b.pos[t] + 1, split_len = split_len_for(len);
    const int32_t n_splits = (len + split_len - 1) / split_len;
    if (n_splits == 1)
        return; /* written by attention_kernel */
    int64_t th = (int64_t)t * n_head + h;
    const float *ml = part_ml + th * MAX_SPLITS * 2;
    float mx = -INFINITY;
    for (int32_t s = 0; s < n_splits; s++)
        mx = fmaxf(mx, ml[2 * s]);
    for (int32_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int32_t s = 0; s < n_splits; s++) {
            float w = expf(ml[2 * s] - mx);
            num = fmaf(w, part_acc[(th * MAX_SPLITS + s) * hd + d], num);
            den = fmaf(w, ml[2 * s + 1], den);
        }
        out[th * hd + d] = __float2bfloat16_rn(num / den);
    }
}

size_t cllm_cuda_attention_scratch(int32_t n_tokens, int32_t n_head, int32_t head_dim)
{
    return (size_t)n_tokens * (size_t)n_head * MAX_SPLITS * ((size_t)head_dim + 2) * sizeof(float);
}

int cllm_cuda_attention_supported(int32_t n_head, int32_t n_kv, int32_t head_dim)
{
    return n_kv > 0 && n_head % n_kv == 0 && n_head / n_kv <= MAX_GROUP &&
           (head_dim == 64 || head_dim == 128);
}

cudaError_t cllm_cuda_attention(const struct cllm_cuda_batch *b, const float *q, int32_t ldq,
                                const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                                int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                                void *scratch, __nv_bfloat16 *out, cudaStream_t stream)
{
    if (b->n_tokens <= 0)
        return cudaSuccess;
    if (!cllm_cuda_attention_supported(n_head, n_kv, head_dim) || b->max_len < 1)
        return cudaErrorInvalidValue;
    int32_t splits = (b->max_len + SPLIT_MIN - 1) / SPLIT_MIN;
    splits = splits < MAX_SPLITS ? splits : MAX_SPLITS;
    float *part_acc = (float *)scratch;
    float *part_ml = part_acc + (size_t)b->n_tokens * n_head * MAX_SPLITS * head_dim;
    dim3 grid((unsigned)b->n_tokens, (unsigned)n_kv, (unsigned)splits);
    unsigned threads = 32u * (unsigned)(n_head / n_kv);
    if (head_dim == 64)
        cllm_launch(attention_kernel<2>, grid, threads, 0, stream, *b, q, ldq, k_cache, v_cache,
                    n_head, n_kv, scale, out, part_acc, part_ml);
    else
        cllm_launch(attention_kernel<4>, grid, threads, 0, stream, *b, q, ldq, k_cache, v_cache,
                    n_head, n_kv, scale, out, part_acc, part_ml);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess || splits == 1)
        return e;
    return cllm_launch(combine_kernel, dim3((unsigned)b->n_tokens, (unsigned)n_head),
                       (unsigned)head_dim, 0, stream, *b, n_head, head_dim, part_acc, part_ml, out);
}
