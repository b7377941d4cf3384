/*
 * Batch-invariant BF16 GEMM on tensor cores: the formula both kernels compute is in gemm.h.
 *
 * Operand order. An m16n8k16 MMA sums over 16 K positions, and which K index a lane's
 * register holds is ours to choose as long as A (W rows) and B (tokens) agree. Lane
 * (g = lane / 4, q = lane % 4) loads 8 consecutive BF16 (16 bytes) at k = chunk start + 8q from
 * W rows g and g + 8 and from token g; the chunk's first MMA takes elements 0..3 of those
 * loads and its second 4..7. So operands go from one 16-byte load (global or shared memory)
 * straight into the MMA with no shuffles, and W streams at full vector width.
 *
 * This file: the skinny kernel (decode steps), the GEMMs' entry points, and which kernel a
 * step takes; the tiled kernel is in gemm_tiled.cu, the choice of a way to run each step
 * (tuned at start-up) in gemm_plan.cu, what they share in gemm_internal.h.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_internal.h"
#include "backend/cuda/gemm_simt.h"
#include "backend/cuda/kernels.h"

#include <math.h>

#define MAX_SLICES 16
#define MIN_SLICE_CHUNKS 4
/* Skinny warps that keep enough loads in flight to saturate HBM (~4 KB each, ~8 MB in all:
 * bandwidth x latency on an H100/H200 is about 6 MB). */
#define TARGET_WARPS 2048

int32_t cllm_cuda_gemm_slices(int32_t N, int32_t K)
{
    int64_t tiles = ((int64_t)N + 15) / 16, chunks = ((int64_t)K + CHUNK - 1) / CHUNK;
    int64_t s = tiles > 0 ? (TARGET_WARPS + tiles - 1) / tiles : 1;
    if (s > MAX_SLICES)
        s = MAX_SLICES;
    if (s > chunks / MIN_SLICE_CHUNKS)
        s = chunks / MIN_SLICE_CHUNKS;
    return s < 1 ? 1 : (int32_t)s;
}

#ifdef CLLM_HAVE_MMA

int cllm_cuda_gemm_supported(const void *w, const void *x, int32_t K)
{
    return cllm_cuda_gemm_simt_supported(w, x, K); /* the same operands: rows of 16-byte vectors */
}

/* 8 BF16 of row at k, zeros past K or for a missing row (the K tail and the edge tiles). */
static __device__ __forceinline__ uint4 load_vec(const __nv_bfloat16 *row, int32_t k, int32_t K)
{
    if (!row || k >= K)
        return make_uint4(0, 0, 0, 0);
    return __ldg((const uint4 *)(row + k));
}
/* What the skinny kernel does with its finished sums: y = sum (+ bias), its 16 rows
 * consecutive... */
struct plain_epilogue {
    const float *bias; /* or NULL */
};

/* ... or (cllm_cuda_rope_store: the QKV projection) bias, RoPE and the KV cache. Then a q or
 * k block takes 8 rotate-half pairs of one head, rows i and i + head_dim / 2 as MMA rows g and
 * g + 8, so each lane holds both halves of its pairs; v rows stay 16 consecutive ones. Which W
 * row lands on which MMA row does not change what is summed for it. */
static __device__ __forceinline__ void block_rows(const plain_epilogue &, int32_t bx, int g,
                                                  int32_t *lo, int32_t *hi)
{
    *lo = bx * 16 + g;
    *hi = *lo + 8;
}

static __device__ __forceinline__ void block_rows(const cllm_cuda_rope_store &r, int32_t bx, int g,
                                                  int32_t *lo, int32_t *hi)
{
    const int32_t half = r.head_dim / 2, per_head = half / 8;
    const int32_t rope_blocks = (r.n_head + r.n_kv) * per_head;
    if (bx < rope_blocks) {
        *lo = bx / per_head * r.head_dim + bx % per_head * 8 + g;
        *hi = *lo + half;
    } else {
        *lo = (r.n_head + r.n_kv) * r.head_dim + (bx - rope_blocks) * 16 + g;
        *hi = *lo + 8;
    }
}

/* ... or (cllm_cuda_gemm_gate_up_silu: the stacked [gate | up] weight) bf16(silu(g) * u),
 * written as BF16 [n][F]: a block takes gate rows f..f+7 as MMA rows g and their up rows
 * F + f.. as rows g + 8, so each lane holds both factors of its outputs. */
struct silu_epilogue {
    int32_t F;          /* outputs per token; the weight has 2F rows */
    __nv_bfloat16 *out; /* [n][ldo] */
    int32_t ldo;
};

static __device__ __forceinline__ void block_rows(const silu_epilogue &ep, int32_t bx, int g,
                                                  int32_t *lo, int32_t *hi)
{
    const int32_t f = bx * 8 + g;
    *lo = f < ep.F ? f : 2 * ep.F; /* 2F: past the weight's rows, so zeros */
    *hi = f < ep.F ? ep.F + f : 2 * ep.F;
}

/* Element e of lane l of token tile j, summed over the slices in order. */
template <int NT>
static __device__ __forceinline__ float slice_sum(const float (*part)[NT][4][32], int32_t S, int j,
                                                  int e, int l)
{
    float v = part[0][j][e][l];
    for (int32_t s = 1; s < S; s++)
        v += part[s][j][e][l];
    return v;
}

template <int NT>
static __device__ void finish(const plain_epilogue &ep, const float (*part)[NT][4][32], int32_t S,
                              int32_t N, int32_t n, float *y, int32_t ldy)
{
    for (int i = threadIdx.x; i < NT * 4 * 32; i += blockDim.x) {
        const int j = i / 128, e = i / 32 % 4, l = i % 32;
        int32_t lo, hi;
        block_rows(ep, (int32_t)blockIdx.x, l / 4, &lo, &hi);
        const int32_t row = e >= 2 ? hi : lo, tok = j * 8 + acc_tok(l, e);
        const float v = slice_sum<NT>(part, S, j, e, l);
        if (row < N && tok < n)
            y[(int64_t)tok * ldy + row] = ep.bias ? v + ep.bias[row] : v;
    }
}

/* Exactly the silu_mul kernel's arithmetic on the gate and up sums it would read back. */
template <int NT>
static __device__ void finish(const silu_epilogue &ep, const float (*part)[NT][4][32], int32_t S,
                              int32_t N, int32_t n, float *y, int32_t ldy)
{
    (void)N, (void)y, (void)ldy;
    for (int i = threadIdx.x; i < NT * 2 * 32; i += blockDim.x) {
        const int j = i / 64, e = i / 32 % 2, l = i % 32; /* elements e and e + 2: gate, up */
        const int32_t tok = j * 8 + acc_tok(l, e), f = (int32_t)blockIdx.x * 8 + l / 4;
        if (tok >= n || f >= ep.F)
            continue;
        ep.out[(int64_t)tok * ep.ldo + f] = cllm_cuda_silu_mul_one(
            slice_sum<NT>(part, S, j, e, l), slice_sum<NT>(part, S, j, e + 2, l));
    }
}

/* Exactly cllm_cuda_qkv_rope_store's arithmetic on the rows it would read back. */
template <int NT>
static __device__ void finish(const cllm_cuda_rope_store &r, const float (*part)[NT][4][32],
                              int32_t S, int32_t N, int32_t n, float *y, int32_t ldy)
{
    (void)N;
    const int32_t hd = r.head_dim, half = hd / 2, kv = r.n_kv * hd;
    const int32_t qk_rows = (r.n_head + r.n_kv) * hd;
    for (int i = threadIdx.x; i < NT * 2 * 32; i += blockDim.x) {
        const int j = i / 64, e = i / 32 % 2, l = i % 32; /* elements e and e + 2: rows lo, hi */
        const int32_t tok = j * 8 + acc_tok(l, e);
        if (tok >= n)
            continue;
        int32_t lo, hi;
        block_rows(r, (int32_t)blockIdx.x, l / 4, &lo, &hi);
        const float v1 = slice_sum<NT>(part, S, j, e, l), v2 = slice_sum<NT>(part, S, j, e + 2, l);
        const int32_t slot = r.slot[tok];
        float *row = y + (int64_t)tok * ldy;
        if (lo < qk_rows) {
            const float x1 = r.bias ? __fadd_rn(v1, r.bias[lo]) : v1;
            const float x2 = r.bias ? __fadd_rn(v2, r.bias[hi]) : v2;
            const int32_t h = lo / hd, f = lo % hd;
            float c, s, y1, y2;
            cllm_cuda_rope_cos_sin(r.pos[tok], r.freqs.inv_freq[f], &c, &s);
            cllm_cuda_rope_rotate(x1, x2, c, s, &y1, &y2);
            row[lo] = y1;
            row[hi] = y2;
            if (h >= r.n_head && slot >= 0) {
                __nv_bfloat16 *k = r.k_cache + (int64_t)slot * kv + (int64_t)(h - r.n_head) * hd;
                k[f] = __float2bfloat16_rn(y1);
                k[f + half] = __float2bfloat16_rn(y2);
            }
        } else {
            row[lo] = v1; /* v stays as projected; the cache gets it with its bias */
            row[hi] = v2;
            if (slot >= 0) {
                __nv_bfloat16 *vc = r.v_cache + (int64_t)slot * kv;
                vc[lo - qk_rows] = __float2bfloat16_rn(r.bias ? __fadd_rn(v1, r.bias[lo]) : v1);
                vc[hi - qk_rows] = __float2bfloat16_rn(r.bias ? __fadd_rn(v2, r.bias[hi]) : v2);
            }
        }
    }
}

/* The lane's W vectors (rows lo and hi) of chunks c .. c + UNROLL - 1, zeros from c1 on. */
template <int UNROLL>
static __device__ __forceinline__ void
load_w_chunks(uint4 (&vl)[UNROLL], uint4 (&vh)[UNROLL], const __nv_bfloat16 *w_lo,
              const __nv_bfloat16 *w_hi, int32_t c, int32_t c1, int q, int32_t K)
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const bool in = c + u < c1;
        const int32_t k = (c + u) * CHUNK + q * 8;
        vl[u] = load_vec(in ? w_lo : NULL, k, K);
        vh[u] = load_vec(in ? w_hi : NULL, k, K);
    }
}

/* Decode steps (n <= 8 NT tokens): block = 16 rows of W, warp s = slice s. Each warp streams
 * its part of the 16 rows once and applies it to every token; the slices meet in shared memory
 * and are summed in slice order, and EP says what becomes of the sums.
 *
 * The first chunks of W are loaded BEFORE cllm_pdl_wait(): weights are never written by a
 * kernel, so they may be read while the kernel before (a norm, the attention) still runs.
 * With programmatic dependent launch that hides the small kernels between the GEMMs behind
 * the weight stream; for many decode shapes (a slice of <= UNROLL chunks) it is all of the
 * block's weights. Nothing else is touched before the wait (tests/tools/test_pdl_discipline.py). */
/* The norm of cllm_cuda_norm_in (gemm.h) for a block's n <= CLLM_CUDA_GEMM_NORM_MAX rows, into
 * xs [n][K] BF16 (shared memory); block (0, 0) also writes res_out. The rmsnorm kernel's sums
 * (kernels.h): its CLLM_CUDA_NORM_THREADS partial sums, computed by this block's threads,
 * summed by warp 0 -- so the rows get the kernel's bits whatever this block's width. Loads of
 * 16 bytes, so that a block of 2 warps (gate/up) needs few rounds of L2 latency. */
static __device__ void norm_rows(const cllm_cuda_norm_in &nin, int32_t n, int32_t K,
                                 __nv_bfloat16 *xs, float *partial, float *scale)
{
    for (int32_t j = 0; j < n; j++) {
        const float *res = nin.res + (int64_t)j * K;
        const float *add = nin.add ? nin.add + (int64_t)j * K : NULL;
        /* four partial sums a thread (K % 8 == 0): one round of loads for blocks of 64+ */
        for (int t = threadIdx.x * 4; t < CLLM_CUDA_NORM_THREADS; t += blockDim.x * 4)
            *(float4 *)&partial[t] = cllm_cuda_norm_partial4(res, add, t, K);
        __syncthreads();
        if (threadIdx.x < 32) {
            const float sum = cllm_cuda_norm_sum(partial);
            if (threadIdx.x == 0)
                scale[j] = cllm_cuda_norm_scale(sum, K, nin.eps);
        }
        __syncthreads(); /* scale[j] is seen; partial may be written again */
    }
    /* the rows, 4 elements a thread at a time (16-byte loads; K % 8 == 0) */
    const bool keep = nin.add && nin.res_out && blockIdx.x == 0 && blockIdx.y == 0;
#pragma unroll 4
    for (int64_t i = threadIdx.x * 4; i < (int64_t)n * K; i += blockDim.x * 4) {
        const int32_t j = (int32_t)(i / K), d = (int32_t)(i % K);
        const float4 v = cllm_cuda_norm_value4(nin.res, nin.add, i);
        const float4 w = *(const float4 *)(nin.g + d);
        const float sc = scale[j];
        xs[i] = cllm_cuda_norm_out(w.x, v.x, sc), xs[i + 1] = cllm_cuda_norm_out(w.y, v.y, sc);
        xs[i + 2] = cllm_cuda_norm_out(w.z, v.z, sc), xs[i + 3] = cllm_cuda_norm_out(w.w, v.w, sc);
        if (keep)
            *(float4 *)(nin.res_out + i) = v;
    }
    __syncthreads();
}

/* Shared memory of a skinny block beyond its slice sums: the normalized rows, the norm's
 * partial sums and scales. */
static size_t norm_smem(int32_t n, int32_t K)
{
    return ((size_t)n * (size_t)K * 2 + 15) / 16 * 16 +
           (CLLM_CUDA_NORM_THREADS + CLLM_CUDA_GEMM_NORM_MAX) * sizeof(float);
}

/* A step whose rows fit a block's shared memory (beside its slice sums). */
static bool norm_fits(int32_t n, int32_t K)
{
    return n >= 1 && n <= CLLM_CUDA_GEMM_NORM_MAX && K > 0 && K % 8 == 0 &&
           (size_t)MAX_SLICES * 4 * 32 * sizeof(float) + norm_smem(n, K) <= 48 * 1024;
}

/* A norm's operands: a step it can take, the rows it writes apart from those it reads, each
 * 16-byte aligned (the norm loads 4 floats at a time). */
int cllm_cuda_gemm_norm_supported(const cllm_cuda_norm_in *norm, int32_t n, int32_t K)
{
    const auto aligned = [](const void *p) { return (uintptr_t)p % 16 == 0; };
    return norm_fits(n, K) && norm->res && norm->g && aligned(norm->res) && aligned(norm->g) &&
           aligned(norm->add) && aligned(norm->res_out) &&
           (!norm->add || (norm->res_out && norm->res_out != norm->res));
}

/* An x row read by the skinny kernel: from global memory through the read-only cache, or
 * (normalized rows) from shared memory. */
template <bool SHARED>
static __device__ __forceinline__ uint4 load_x(const __nv_bfloat16 *row, int32_t k, int32_t K)
{
    if (!row || k >= K)
        return make_uint4(0, 0, 0, 0);
    if constexpr (SHARED)
        return *(const uint4 *)(row + k);
    else
        return __ldg((const uint4 *)(row + k));
}

/* Where the blocks of a split row tile (gridDim.y > 1) leave their slices' sums
 * ([tile][slice][NT][4][32]) and count themselves done (one count a tile, zero between
 * launches). */
struct skinny_split {
    float *partials;
    int32_t *counts;
};

/* The slices' sums of a split row tile, all in `part` in the block that finishes the tile last
 * (true), whose count it resets; the others return false. This block's slices are in part
 * already; every block also leaves them in sp for the last. */
template <int NT>
static __device__ CLLM_NOINLINE bool gather_split(const skinny_split &sp, float (*part)[NT][4][32],
                                                  int32_t S)
{
    const int32_t per = S / (int32_t)gridDim.y, own = (int32_t)blockIdx.y * per;
    const int64_t tile = (int64_t)blockIdx.x * S * NT * 128;
    float *flat = &part[0][0][0][0];
    for (int32_t i = threadIdx.x; i < per * NT * 128; i += blockDim.x)
        sp.partials[tile + own * NT * 128 + i] = flat[own * NT * 128 + i];
    __shared__ bool last;
    if (!cllm_cuda_last_block(&sp.counts[blockIdx.x], (int32_t)gridDim.y, &last))
        return false;
    for (int32_t i = threadIdx.x; i < S * NT * 128; i += blockDim.x)
        if (i / (NT * 128) / per != (int32_t)blockIdx.y)
            flat[i] = cllm_load_fresh(&sp.partials[tile + i]);
    __syncthreads();
    return true;
}

template <int NT, bool AHEAD, class EP, bool NORM>
static __global__ void __launch_bounds__(MAX_SLICES * 32)
    gemm_skinny(const __nv_bfloat16 *w, EP ep, int32_t N, int32_t K, const __nv_bfloat16 *x,
                int32_t n, float *y, int32_t ldy, int32_t S, cllm_cuda_norm_in nin, skinny_split sp)
{
    constexpr int UNROLL = NT <= 2 ? 4 : 2; /* chunks whose loads are issued together */
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    /* this warp's slice: blocks (x, 0 .. gridDim.y - 1) share row tile x's slices evenly */
    const int warp = (int)blockIdx.y * (S / (int32_t)gridDim.y) + (int)threadIdx.x / 32;
    const int32_t chunks = (K + CHUNK - 1) / CHUNK;
    const int32_t c0 = slice_start(warp, chunks, S), c1 = slice_start(warp + 1, chunks, S);
    int32_t row_lo, row_hi;
    block_rows(ep, (int32_t)blockIdx.x, g, &row_lo, &row_hi);
    const __nv_bfloat16 *w_lo = row_lo < N ? w + (int64_t)row_lo * K : NULL;
    const __nv_bfloat16 *w_hi = row_hi < N ? w + (int64_t)row_hi * K : NULL;
    uint4 vl[UNROLL], vh[UNROLL];
    load_w_chunks<UNROLL>(vl, vh, w_lo, w_hi, c0, c1, q, K);
    cllm_pdl_wait(); /* x, y and the epilogue's buffers from here on */
    /* [slice][token tile][element][lane], S slices: dynamic, so that a block of one or two
     * warps (the LM head, gate/up) holds 0.5-1 KiB rather than the 8 KiB of 16 slices, which
     * kept an SM below its 32 resident blocks */
    extern __shared__ float skinny_part[];
    using slice_part = float[NT][4][32];
    slice_part *part = reinterpret_cast<slice_part *>(skinny_part);
    if constexpr (NORM) { /* the rows normalized first, into shared memory after the sums */
        static_assert(NT == 1, "a norm takes steps of CLLM_CUDA_GEMM_NORM_MAX tokens at most");
        __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(part + S);
        float *partial = reinterpret_cast<float *>(xs + ((int64_t)n * K + 7) / 8 * 8);
        norm_rows(nin, n, K, xs, partial, partial + CLLM_CUDA_NORM_THREADS);
        x = xs;
    }
    const __nv_bfloat16 *xr[NT];
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xr[j] = j * 8 + g < n ? x + (int64_t)(j * 8 + g) * K : NULL;
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    }
    for (int32_t c = c0; c < c1; c += UNROLL) {
        /* AHEAD: the next chunks' W is requested before this group's tokens and MMAs, so the
         * weight stream does not wait for them (without, one memory round trip per group: the
         * 1536 x 8960 down projection, 96 blocks of 16 warps, streamed at 1.43 TB/s on an
         * H200). It costs registers, so only blocks of many warps (S >= AHEAD_MIN_SLICES), whose
         * SMs hold one block anyway, take it. */
        uint4 nl[UNROLL], nh[UNROLL];
        const bool more = AHEAD && c + UNROLL < c1;
        if (!AHEAD && c != c0)
            load_w_chunks<UNROLL>(vl, vh, w_lo, w_hi, c, c1, q, K);
        if (more)
            load_w_chunks<UNROLL>(nl, nh, w_lo, w_hi, c + UNROLL, c1, q, K);
        uint4 vx[UNROLL][NT];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int32_t k = (c + u) * CHUNK + q * 8;
#pragma unroll
            for (int j = 0; j < NT; j++)
                vx[u][j] = load_x<NORM>(c + u < c1 ? xr[j] : NULL, k, K);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (c + u >= c1) /* the same for the whole warp: the MMAs stay converged */
                break;
#pragma unroll
            for (int j = 0; j < NT; j++)
                mma_chunk(acc[j], vl[u], vh[u], vx[u][j]);
        }
        if (more) {
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                vl[u] = nl[u], vh[u] = nh[u];
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
        for (int e = 0; e < 4; e++)
            part[warp][j][e][lane] = acc[j][e];
    __syncthreads();
    if (gridDim.y > 1 && !gather_split<NT>(sp, part, S))
        return;
    finish<NT>(ep, part, S, N, n, y, ldy);
}
/* The skinny kernel with as many token tiles as n needs (n <= CLLM_CUDA_GEMM_SKINNY_MAX), or
 * (nin) normalizing its rows first (n <= CLLM_CUDA_GEMM_NORM_MAX, norm_supported); `parts`
 * blocks a row tile (split_fits; sp in the scratch) or one. */
template <bool AHEAD, class EP>
static void launch_skinny_as(const __nv_bfloat16 *w, const EP &ep, int32_t N, int32_t K,
                             const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy, int32_t S,
                             int parts, skinny_split sp, const cllm_cuda_norm_in *nin,
                             cudaStream_t stream)
{
    const dim3 grid((unsigned)((N + 15) / 16), (unsigned)parts);
    const unsigned threads = (unsigned)(S / parts) * 32;
    const size_t part = (size_t)S * 4 * 32 * sizeof(float); /* per token tile: every slice */
    const cllm_cuda_norm_in none = {NULL, NULL, NULL, 0.0f, NULL};
    if (nin)
        cllm_launch(gemm_skinny<1, AHEAD, EP, true>, grid, threads, part + norm_smem(n, K), stream,
                    w, ep, N, K, x, n, y, ldy, S, *nin, sp);
    else if (n <= 8)
        cllm_launch(gemm_skinny<1, AHEAD, EP, false>, grid, threads, part, stream, w, ep, N, K, x,
                    n, y, ldy, S, none, sp);
    else if (n <= 16)
        cllm_launch(gemm_skinny<2, AHEAD, EP, false>, grid, threads, 2 * part, stream, w, ep, N, K,
                    x, n, y, ldy, S, none, sp);
    else
        cllm_launch(gemm_skinny<4, AHEAD, EP, false>, grid, threads, 4 * part, stream, w, ep, N, K,
                    x, n, y, ldy, S, none, sp);
}

/* A skinny step the way `way` says (its split where the scratch holds it). Not split with the
 * norm inside: every block normalizes the rows itself, from L2, so 2-4 times the blocks would
 * be 2-4 times that traffic (for the 1.5B's QKV, ~2.3 MB a step more per doubling), which the
 * tuner, timing the GEMM alone, would not see; and its 128 row tiles keep most SMs busy anyway. */
template <class EP>
static void launch_skinny(const gemm_way &way, const __nv_bfloat16 *w, const EP &ep, int32_t N,
                          int32_t K, const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy,
                          void *scratch, size_t scratch_bytes, const cllm_cuda_norm_in *nin,
                          cudaStream_t stream)
{
    const int32_t S = cllm_cuda_gemm_slices(N, K);
    const int parts = scratch && !nin ? split_parts(way, N, K, n, scratch_bytes) : 1;
    const skinny_split sp = {parts > 1 ? scratch_partials(scratch) : NULL,
                             parts > 1 ? (int32_t *)scratch : NULL};
    if (way.ahead)
        launch_skinny_as<true>(w, ep, N, K, x, n, y, ldy, S, parts, sp, nin, stream);
    else
        launch_skinny_as<false>(w, ep, N, K, x, n, y, ldy, S, parts, sp, nin, stream);
}

/* One GEMM of checked operands, one way: the skinny kernel for decode steps, else the tiled
 * one (gemm_tiled.cu). */
template <bool PAIRED>
static cudaError_t launch_way(const gemm_way &way, const gemm_call &a, int32_t n)
{
    const int32_t N = a.N, K = a.K;
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX) {
        if constexpr (PAIRED)
            launch_skinny(way, a.w, silu_epilogue{N / 2, (__nv_bfloat16 *)a.y, a.ldy}, N, K, a.x, n,
                          NULL, 0, a.scratch, a.scratch_bytes, a.norm, a.stream);
        else
            launch_skinny(way, a.w, plain_epilogue{a.bias}, N, K, a.x, n, (float *)a.y, a.ldy,
                          a.scratch, a.scratch_bytes, a.norm, a.stream);
        return cudaGetLastError();
    }
    return cllm_cuda_gemm_launch_tiled(PAIRED, way, a, n);
}

cudaError_t cllm_cuda_gemm_launch(bool paired, const gemm_way &way, const gemm_call &a, int32_t n)
{
    return paired ? launch_way<true>(way, a, n) : launch_way<false>(way, a, n);
}

cudaError_t cllm_cuda_gemm(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                           const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy, void *scratch,
                           size_t scratch_bytes, cudaStream_t stream)
{
    if (N < 0 || n < 0 || ldy < N || !cllm_cuda_gemm_supported(w, x, K))
        return cudaErrorInvalidValue;
    if (N == 0 || n == 0)
        return cudaSuccess;
    const gemm_call a = {w, bias, N, K, x, y, ldy, scratch, scratch_bytes, stream, NULL};
    return launch_way<false>(cllm_cuda_gemm_way_for(N, K, n), a, n);
}

cudaError_t cllm_cuda_gemm_gate_up_silu(const __nv_bfloat16 *w, int32_t F, int32_t K,
                                        const __nv_bfloat16 *x, int32_t n, __nv_bfloat16 *out,
                                        int32_t ldo, void *scratch, size_t scratch_bytes,
                                        const cllm_cuda_norm_in *norm, cudaStream_t stream)
{
    if (norm && n > 0 && !cllm_cuda_gemm_norm_supported(norm, n, K))
        return cudaErrorInvalidValue;
    if (norm)
        x = w; /* unused; any 16-byte aligned pointer passes the operand check */
    if (F < 0 || F > INT32_MAX / 2 || n < 0 || ldo < F || !cllm_cuda_gemm_supported(w, x, K))
        return cudaErrorInvalidValue;
    if (F == 0 || n == 0)
        return cudaSuccess;
    const gemm_call a = {w, NULL, 2 * F, K, x, out, ldo, scratch, scratch_bytes, stream, norm};
    return launch_way<true>(cllm_cuda_gemm_way_for(2 * F, K, n), a, n);
}

int cllm_cuda_gemm_rope_supported(const void *w, const void *x, int32_t K, int32_t n,
                                  int32_t head_dim)
{
    return cllm_cuda_gemm_supported(w, x, K) && n >= 1 && n <= CLLM_CUDA_GEMM_SKINNY_MAX &&
           head_dim > 0 && head_dim % 16 == 0 && head_dim / 2 <= CLLM_CUDA_MAX_HALF_DIM;
}

cudaError_t cllm_cuda_gemm_rope_store(const __nv_bfloat16 *w, int32_t K, const __nv_bfloat16 *x,
                                      int32_t n, float *y, int32_t ldy,
                                      const struct cllm_cuda_rope_store *r,
                                      const cllm_cuda_norm_in *norm, void *scratch,
                                      size_t scratch_bytes, cudaStream_t stream)
{
    const int32_t N = (r->n_head + 2 * r->n_kv) * r->head_dim;
    if (norm && !cllm_cuda_gemm_norm_supported(norm, n, K))
        return cudaErrorInvalidValue;
    if (norm)
        x = w; /* unused, as above */
    if (!cllm_cuda_gemm_rope_supported(w, x, K, n, r->head_dim) || r->n_head < 1 || r->n_kv < 1 ||
        ldy < N)
        return cudaErrorInvalidValue;
    launch_skinny(cllm_cuda_gemm_way_for(N, K, n), w, *r, N, K, x, n, y, ldy, scratch,
                  scratch_bytes, norm, stream);
    return cudaGetLastError();
}
#else /* no tensor-core MMA on this vendor: the backend uses its BLAS */

int cllm_cuda_gemm_rope_supported(const void *w, const void *x, int32_t K, int32_t n,
                                  int32_t head_dim)
{
    (void)w, (void)x, (void)K, (void)n, (void)head_dim;
    return 0;
}

cudaError_t cllm_cuda_gemm_rope_store(const __nv_bfloat16 *w, int32_t K, const __nv_bfloat16 *x,
                                      int32_t n, float *y, int32_t ldy,
                                      const struct cllm_cuda_rope_store *r,
                                      const struct cllm_cuda_norm_in *norm, void *scratch,
                                      size_t scratch_bytes, cudaStream_t stream)
{
    (void)w, (void)K, (void)x, (void)n, (void)y, (void)ldy, (void)r, (void)norm, (void)scratch,
        (void)scratch_bytes, (void)stream;
    return cudaErrorInvalidValue;
}

int cllm_cuda_gemm_norm_supported(const struct cllm_cuda_norm_in *norm, int32_t n, int32_t K)
{
    (void)norm, (void)n, (void)K;
    return 0;
}

int cllm_cuda_gemm_supported(const void *w, const void *x, int32_t K)
{
    (void)w, (void)x, (void)K;
    return 0;
}

cudaError_t cllm_cuda_gemm(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                           const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy, void *scratch,
                           size_t scratch_bytes, cudaStream_t stream)
{
    (void)w, (void)bias, (void)N, (void)K, (void)x, (void)n, (void)y, (void)ldy, (void)scratch,
        (void)scratch_bytes, (void)stream;
    return cudaErrorInvalidValue;
}

cudaError_t cllm_cuda_gemm_gate_up_silu(const __nv_bfloat16 *w, int32_t F, int32_t K,
                                        const __nv_bfloat16 *x, int32_t n, __nv_bfloat16 *out,
                                        int32_t ldo, void *scratch, size_t scratch_bytes,
                                        const struct cllm_cuda_norm_in *norm, cudaStream_t stream)
{
    (void)w, (void)F, (void)K, (void)x, (void)n, (void)out, (void)ldo, (void)scratch,
        (void)scratch_bytes, (void)norm, (void)stream;
    return cudaErrorInvalidValue;
}

#endif
