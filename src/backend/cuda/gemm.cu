/*
 * Batch-invariant BF16 GEMM on tensor cores: the formula both kernels compute is in gemm.h.
 *
 * Operand order. An m16n8k16 MMA sums over 16 K positions, and which K index a lane's
 * register holds is ours to choose as long as A (W rows) and B (tokens) agree. Lane
 * (g = lane / 4, q = lane % 4) loads 8 consecutive BF16 (16 bytes) at k = chunk start + 8q from
 * W rows g and g + 8 and from token g; the chunk's first MMA takes elements 0..3 of those
 * loads and its second 4..7. So operands go from one 16-byte load (global or shared memory)
 * straight into the MMA with no shuffles, and W streams at full vector width.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm.h"
#include "backend/cuda/kernels.h"

#include <string.h>

#define CHUNK 32         /* K elements per step: two MMAs */
#define VECS (CHUNK / 8) /* 16-byte vectors per row and chunk */
#define MAX_SLICES 16
#define MIN_SLICE_CHUNKS 4
/* Skinny warps that keep enough loads in flight to saturate HBM (~4 KB each, ~8 MB in all:
 * bandwidth x latency on an H100/H200 is about 6 MB). */
#define TARGET_WARPS 2048

/* The tiled kernel's block shape: WARPS_M x WARPS_N warps, each MT 16-row x NT 8-token MMA
 * tiles, a ring of STAGES chunks in shared memory. Which one runs changes the speed, never the
 * bits (the formula is per element). A warp's tile sets how many MMAs each shared-memory load
 * feeds: 32 x 32 (session 22's 128 x 64 blocks, ~135 TFLOP/s on an H200) issues 8 loads for
 * 16 MMAs a chunk; 64 x 32 issues 12 for 32, and half the barriers per MMA. */
template <int WARPS_M_, int WARPS_N_, int MT_, int NT_, int STAGES_, int MIN_BLOCKS_>
struct tiling {
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, MT = MT_, NT = NT_;
    static constexpr int STAGES = STAGES_, MIN_BLOCKS = MIN_BLOCKS_;
    static constexpr int WARP_M = 16 * MT, WARP_N = 8 * NT;
    static constexpr int M = WARPS_M * WARP_M; /* W rows per block */
    static constexpr int N = WARPS_N * WARP_N; /* tokens per block */
    static constexpr int THREADS = WARPS_M * WARPS_N * 32;
    static constexpr int LOADS = (M + N) * VECS / THREADS; /* vectors per thread and chunk */
    static constexpr int LOADS_W = M * VECS / THREADS;     /* the first of them: W rows */
    static constexpr size_t SMEM = (size_t)STAGES * (M + N) * VECS * 16;
    static_assert((M + N) * VECS % THREADS == 0, "tiles load evenly");
    static_assert(M * VECS % THREADS == 0, "a thread's first loads are W rows only");
};
using tiling_128x64 = tiling<4, 2, 2, 4, 4, 2>;  /* 48 KiB, two blocks an SM */
using tiling_256x64 = tiling<4, 2, 4, 4, 4, 1>;  /* 80 KiB */
using tiling_128x128 = tiling<2, 4, 4, 4, 4, 1>; /* 64 KiB */

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

/* The tiled kernel's shapes by name (the tiling structs below, for the host), and the one this
 * process uses: one choice for every GEMM, so that a token's bits never depend on it changing
 * between steps (they would not anyway: the formula is per element). */
enum { TILING_128X64, TILING_256X64, TILING_128X128, N_TILINGS };
struct tiling_shape {
    const char *name;
    int m, n, min_blocks;
};
static const struct tiling_shape tilings[N_TILINGS] = {
    {"128x64", 128, 64, 2}, {"256x64", 256, 64, 1}, {"128x128", 128, 128, 1}};
static int current_tiling = TILING_128X64;

const char *cllm_cuda_gemm_tiling(void)
{
    return tilings[current_tiling].name;
}

static cudaError_t prepare_tiling(int id);

cudaError_t cllm_cuda_gemm_use_tiling(const char *name)
{
    for (int i = 0; i < N_TILINGS; i++)
        if (name && strcmp(name, tilings[i].name) == 0) {
            cudaError_t e = prepare_tiling(i);
            if (e == cudaSuccess)
                current_tiling = i;
            return e;
        }
    return cudaErrorInvalidValue;
}

#ifdef CLLM_HAVE_MMA

int cllm_cuda_gemm_supported(const void *w, const void *x, int32_t K)
{
    return K > 0 && K % 8 == 0 && (uintptr_t)w % 16 == 0 && (uintptr_t)x % 16 == 0;
}

/* 8 BF16 of row at k, zeros past K or for a missing row (the K tail and the edge tiles). */
static __device__ __forceinline__ uint4 load_vec(const __nv_bfloat16 *row, int32_t k, int32_t K)
{
    if (!row || k >= K)
        return make_uint4(0, 0, 0, 0);
    return __ldg((const uint4 *)(row + k));
}

/* 8 inputs of token row `row` at k: BF16 as they are, or (SILU) bf16(silu(gate) * up) from
 * the F32 [gate | up] row of K + K floats, computed exactly as the silu_mul kernel does. */
template <bool SILU>
static __device__ __forceinline__ uint4 load_x(const void *row, int32_t k, int32_t K)
{
    if (!SILU)
        return load_vec((const __nv_bfloat16 *)row, k, K);
    if (!row || k >= K)
        return make_uint4(0, 0, 0, 0);
    const float4 *gate = (const float4 *)((const float *)row + k);
    const float4 *up = (const float4 *)((const float *)row + K + k);
    float4 g0 = __ldg(gate), g1 = __ldg(gate + 1), u0 = __ldg(up), u1 = __ldg(up + 1);
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    unsigned packed[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        packed[i] = cllm_cuda_pack_bf16x2(cllm_cuda_silu_mul_one(gv[2 * i], uv[2 * i]),
                                          cllm_cuda_silu_mul_one(gv[2 * i + 1], uv[2 * i + 1]));
    return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

/* Where token t's row of x starts: [n][K] BF16, or (SILU) [n][2K] F32. */
template <bool SILU>
static __device__ __forceinline__ const void *x_row(const void *x, int32_t t, int32_t K)
{
    if (SILU)
        return (const float *)x + (int64_t)t * 2 * K;
    return (const __nv_bfloat16 *)x + (int64_t)t * K;
}

/* acc += one chunk of a 16 x 8 tile: w_lo / w_hi are the lane's vectors of rows g and g + 8,
 * xv its token's (see the top of the file). */
static __device__ __forceinline__ void mma_chunk(float acc[4], uint4 w_lo, uint4 w_hi, uint4 xv)
{
    const unsigned a0[4] = {w_lo.x, w_hi.x, w_lo.y, w_hi.y}, b0[2] = {xv.x, xv.y};
    cllm_mma_bf16_16816(acc, a0, b0);
    const unsigned a1[4] = {w_lo.z, w_hi.z, w_lo.w, w_hi.w}, b1[2] = {xv.z, xv.w};
    cllm_mma_bf16_16816(acc, a1, b1);
}

/* First chunk of slice s when `chunks` chunks are split S ways: the one split both kernels use. */
static __device__ __forceinline__ int32_t slice_start(int32_t s, int32_t chunks, int32_t S)
{
    return (int32_t)((int64_t)s * chunks / S);
}

/* Element e of a lane's accumulator sits at this row and token of its 16 x 8 tile. */
static __device__ __forceinline__ int32_t acc_row(int lane, int e)
{
    return lane / 4 + (e >= 2 ? 8 : 0);
}
static __device__ __forceinline__ int32_t acc_tok(int lane, int e)
{
    return (lane % 4) * 2 + (e & 1);
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
template <int NT, bool SILU, bool AHEAD, class EP>
static __global__ void __launch_bounds__(MAX_SLICES * 32)
    gemm_skinny(const __nv_bfloat16 *w, EP ep, int32_t N, int32_t K, const void *x, int32_t n,
                float *y, int32_t ldy, int32_t S)
{
    /* chunks whose loads are issued together (AHEAD: two groups in registers; a SiLU step of
     * 9-16 tokens spills with four) */
    constexpr int UNROLL = NT == 1 ? 4 : NT == 2 && !(SILU && AHEAD) ? 4 : 2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int32_t chunks = (K + CHUNK - 1) / CHUNK;
    const int32_t c0 = slice_start(warp, chunks, S), c1 = slice_start(warp + 1, chunks, S);
    int32_t row_lo, row_hi;
    block_rows(ep, (int32_t)blockIdx.x, g, &row_lo, &row_hi);
    const __nv_bfloat16 *w_lo = row_lo < N ? w + (int64_t)row_lo * K : NULL;
    const __nv_bfloat16 *w_hi = row_hi < N ? w + (int64_t)row_hi * K : NULL;
    uint4 vl[UNROLL], vh[UNROLL];
    load_w_chunks<UNROLL>(vl, vh, w_lo, w_hi, c0, c1, q, K);
    cllm_pdl_wait();                              /* x, y and the epilogue's buffers from here on */
    __shared__ float part[MAX_SLICES][NT][4][32]; /* [slice][token tile][element][lane] */
    const void *xr[NT];
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xr[j] = j * 8 + g < n ? x_row<SILU>(x, j * 8 + g, K) : NULL;
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
                vx[u][j] = load_x<SILU>(c + u < c1 ? xr[j] : NULL, k, K);
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
    finish<NT>(ep, part, S, N, n, y, ldy);
}

/* Where tile row r's vector v of chunk c of the tiled kernel comes from (W rows first, then
 * tokens): row or token src of W or x (-1: past the edge), NULL past K or the edge (zeros). */
template <class T, bool SILU>
static __device__ __forceinline__ const void *tile_src(const __nv_bfloat16 *w, const void *x,
                                                       int32_t src, int r, int32_t k, int32_t K)
{
    if (src < 0 || k >= K)
        return NULL;
    if (r < T::M)
        return w + (int64_t)src * K + k;
    return SILU ? (const void *)((const float *)x + (int64_t)src * 2 * K + k)
                : (const void *)((const __nv_bfloat16 *)x + (int64_t)src * K + k);
}

/* The loads of chunk c into stage slot `slot`, loads [i0, i1) of this thread (W loads first:
 * i < TILED_LOADS_W). Straight from global to shared memory (cp.async) where the bytes are
 * used as they are; zeros (past K or the edge) stored directly. SILU tokens are computed, so
 * they are not copied here: see load_silu_x / store_silu_x. */
template <class T, bool SILU, int i0, int i1>
static __device__ __forceinline__ void copy_chunk(uint4 (*slot)[VECS], const __nv_bfloat16 *w,
                                                  const void *x, const int32_t (&src)[T::LOADS],
                                                  int32_t c, int32_t K)
{
#pragma unroll
    for (int i = i0; i < i1; i++) {
        const int idx = (int)threadIdx.x + i * T::THREADS, r = idx / VECS, v = idx % VECS;
        if (SILU && r >= T::M)
            continue;
        const void *from = tile_src<T, SILU>(w, x, src[i], r, c * CHUNK + v * 8, K);
        if (from)
            cllm_cp_async16(&slot[r][v], from);
        else
            slot[r][v] = make_uint4(0, 0, 0, 0);
    }
}

/* The W part of chunk c (loads i < T::LOADS_W): the one thing the tiled kernel touches
 * before cllm_pdl_wait() (weights are never written by a kernel). */
template <class T, bool SILU>
static __device__ __forceinline__ void load_w_tile(uint4 (*slot)[VECS], const __nv_bfloat16 *w,
                                                   const int32_t (&src)[T::LOADS], int32_t c,
                                                   int32_t K)
{
    copy_chunk<T, SILU, 0, T::LOADS_W>(slot, w, NULL, src, c, K);
}

/* SILU: this thread's token vectors of chunk c, computed from gate and up into registers
 * (staged), and then stored into their slot. */
template <class T, bool SILU>
static __device__ __forceinline__ void load_silu_x(uint4 (&staged)[T::LOADS], const void *x,
                                                   const int32_t (&src)[T::LOADS], int32_t c,
                                                   int32_t K)
{
    if constexpr (SILU) {
#pragma unroll
        for (int i = T::LOADS_W; i < T::LOADS; i++) {
            const int idx = (int)threadIdx.x + i * T::THREADS;
            staged[i] = load_x<true>(src[i] < 0 ? NULL : x_row<true>(x, src[i], K),
                                     c * CHUNK + idx % VECS * 8, K);
        }
    }
}
template <class T, bool SILU>
static __device__ __forceinline__ void store_silu_x(uint4 (*slot)[VECS],
                                                    const uint4 (&staged)[T::LOADS])
{
    if constexpr (SILU) {
#pragma unroll
        for (int i = T::LOADS_W; i < T::LOADS; i++) {
            const int idx = (int)threadIdx.x + i * T::THREADS;
            slot[idx / VECS][idx % VECS] = staged[i];
        }
    }
}

/* Prefill steps: block = T::M rows x T::N tokens staged through shared memory in a ring of
 * T::STAGES chunks: chunk c + STAGES - 1 is in flight (cp.async) while chunk c is multiplied, so
 * memory latency hides behind STAGES - 1 chunks of MMAs rather than one. (The SiLU variant's
 * tokens are computed on load and go through registers, one chunk ahead.) Each element keeps
 * the running slice (acc) apart from the finished ones (total), so the sums happen in exactly
 * the skinny kernel's order; how the bytes arrive does not change them. With `partials`,
 * block z computes slice z alone and stores it there ([S][n][N]) for gemm_reduce: the same
 * sums, spread over more blocks when the tiles alone would leave SMs idle (N = 1536 at 192
 * tokens is 36 tiles of 128 x 64). As in the skinny kernel, the first chunk's W vectors are
 * requested before cllm_pdl_wait(). The ring is dynamic shared memory (T::SMEM, up to 80 KiB:
 * cllm_cuda_gemm_use_tiling raises the limit). */
template <class T, bool SILU>
static __global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    gemm_tiled(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K, const void *x,
               int32_t n, float *y, int32_t ldy, int32_t S, float *partials)
{
    constexpr int STAGES = T::STAGES, MT = T::MT, NT = T::NT;
    /* [STAGES][T::M + T::N][VECS]: rows 0..T::M-1 the W rows of the tile, then its tokens */
    extern __shared__ uint4 gemm_ring[];
    using stage = uint4[T::M + T::N][VECS];
    stage *tile = reinterpret_cast<stage *>(gemm_ring);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const int wm = warp % T::WARPS_M, wn = warp / T::WARPS_M;
    const int32_t row0 = (int32_t)blockIdx.y * T::M, tok0 = (int32_t)blockIdx.x * T::N;
    const int32_t chunks = (K + CHUNK - 1) / CHUNK;

    /* This thread's vectors of each chunk: tile row (tid + i * T::THREADS) / VECS, which is
     * W row src[i] or token src[i] (-1: past the edge), vector (tid + i * T::THREADS) % VECS.
     * Indices, not pointers: two fewer registers each. */
    int32_t src[T::LOADS];
#pragma unroll
    for (int i = 0; i < T::LOADS; i++) {
        const int r = (tid + i * T::THREADS) / VECS;
        if (r < T::M)
            src[i] = row0 + r < N ? row0 + r : -1;
        else
            src[i] = tok0 + r - T::M < n ? tok0 + r - T::M : -1;
    }
    uint4 staged[T::LOADS]; /* SILU: the next chunk's tokens */
    float acc[MT][NT][4], total[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        for (int nt = 0; nt < NT; nt++)
            for (int e = 0; e < 4; e++)
                acc[mt][nt][e] = total[mt][nt][e] = 0.0f;

    /* chunks [c_begin, c_end): all of K, or slice blockIdx.z alone */
    int32_t s = partials ? (int32_t)blockIdx.z : 0;
    const int32_t c_begin = slice_start(s, chunks, S);
    const int32_t c_end = partials ? slice_start(s + 1, chunks, S) : chunks;
    int32_t slice_end = slice_start(s + 1, chunks, S);
    bool first = true;

    /* The ring's first STAGES - 1 chunks, one commit group each (empty past c_end, so that
     * "group c done" is always "at most STAGES - 2 groups pending"). */
    load_w_tile<T, SILU>(tile[0], w, src, c_begin, K);
    cllm_pdl_wait(); /* x, y and partials from here on */
    copy_chunk<T, SILU, T::LOADS_W, T::LOADS>(tile[0], w, x, src, c_begin, K);
    cllm_cp_async_commit();
#pragma unroll
    for (int st = 1; st < STAGES - 1; st++) {
        if (c_begin + st < c_end)
            copy_chunk<T, SILU, 0, T::LOADS>(tile[st], w, x, src, c_begin + st, K);
        cllm_cp_async_commit();
    }
    load_silu_x<T, SILU>(staged, x, src, c_begin, K);
    store_silu_x<T, SILU>(tile[0], staged);

    for (int32_t c = c_begin; c < c_end; c++) {
        const int b = (int)((c - c_begin) % STAGES);
        cllm_cp_async_wait<STAGES - 2>(); /* this thread's copies of chunk c have landed... */
        __syncthreads(); /* ... everyone's have, and nobody still reads chunk c - 1's slot */
        /* Chunk c + STAGES - 1 into the slot chunk c - 1 used. */
        const int32_t ahead = c + STAGES - 1;
        if (ahead < c_end)
            copy_chunk<T, SILU, 0, T::LOADS>(tile[(b + STAGES - 1) % STAGES], w, x, src, ahead, K);
        cllm_cp_async_commit();
        const bool more = c + 1 < c_end;
        if (more)
            load_silu_x<T, SILU>(staged, x, src, c + 1, K);

        uint4 vx[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            vx[nt] = tile[b][T::M + wn * T::WARP_N + nt * 8 + g][q];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const uint4 vl = tile[b][wm * T::WARP_M + mt * 16 + g][q];
            const uint4 vh = tile[b][wm * T::WARP_M + mt * 16 + g + 8][q];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mma_chunk(acc[mt][nt], vl, vh, vx[nt]);
        }
        if (c + 1 == slice_end) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                for (int nt = 0; nt < NT; nt++)
                    for (int e = 0; e < 4; e++) {
                        total[mt][nt][e] =
                            first ? acc[mt][nt][e] : total[mt][nt][e] + acc[mt][nt][e];
                        acc[mt][nt][e] = 0.0f;
                    }
            first = false;
            s++;
            slice_end = slice_start(s + 1, chunks, S);
        }
        /* SILU: chunk c + 1's tokens into its slot (not chunk c's, which is being read; no
         * copy writes token rows then). The barrier at the top of the next step publishes
         * them. */
        if (more)
            store_silu_x<T, SILU>(tile[(b + 1) % STAGES], staged);
    }
    cllm_cp_async_wait<0>(); /* no copy may outlive the block (the empty groups aside) */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        for (int nt = 0; nt < NT; nt++)
            for (int e = 0; e < 4; e++) {
                const int32_t row = row0 + wm * T::WARP_M + mt * 16 + acc_row(lane, e);
                const int32_t tok = tok0 + wn * T::WARP_N + nt * 8 + acc_tok(lane, e);
                if (row >= N || tok >= n)
                    continue;
                if (partials)
                    partials[((int64_t)blockIdx.z * n + tok) * N + row] = total[mt][nt][e];
                else
                    y[(int64_t)tok * ldy + row] =
                        bias ? total[mt][nt][e] + bias[row] : total[mt][nt][e];
            }
}

/* y = ((P_0 + P_1) + ... + P_{S-1}) + bias from the tiled kernel's per-slice partials. */
static __global__ void gemm_reduce(const float *partials, const float *bias, int32_t N, int32_t n,
                                   int32_t S, float *y, int32_t ldy)
{
    cllm_pdl_wait();
    const int64_t total = (int64_t)n * N;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t tok = (int32_t)(i / N), row = (int32_t)(i % N);
        float v = partials[i];
        for (int32_t sl = 1; sl < S; sl++)
            v += partials[(int64_t)sl * total + i];
        y[(int64_t)tok * ldy + row] = bias ? v + bias[row] : v;
    }
}

/* The tiled kernel spreads slices over blocks when its tiles number fewer than about two
 * blocks per SM of an H100/H200 (132 SMs): 256 tiles of a shape two of whose blocks fit an SM,
 * 128 of one that takes the SM alone. */
static bool slices_in_parallel(int32_t N, int32_t K, int32_t n)
{
    const struct tiling_shape *t = &tilings[current_tiling];
    int64_t tiles = ((int64_t)n + t->n - 1) / t->n * (((int64_t)N + t->m - 1) / t->m);
    return n > CLLM_CUDA_GEMM_SKINNY_MAX && cllm_cuda_gemm_slices(N, K) > 1 &&
           tiles < 128 * t->min_blocks;
}

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n)
{
    if (N <= 0 || n <= 0 || !slices_in_parallel(N, K, n))
        return 0;
    return (size_t)cllm_cuda_gemm_slices(N, K) * (size_t)n * (size_t)N * sizeof(float);
}

/* Slices (warps per block) from which the skinny kernel loads W a group ahead. */
#define AHEAD_MIN_SLICES 4

/* The skinny kernel with as many token tiles as n needs (n <= CLLM_CUDA_GEMM_SKINNY_MAX). */
template <bool SILU, bool AHEAD, class EP>
static void launch_skinny_as(const __nv_bfloat16 *w, const EP &ep, int32_t N, int32_t K,
                             const void *x, int32_t n, float *y, int32_t ldy, int32_t S,
                             cudaStream_t stream)
{
    const unsigned row_tiles = (unsigned)((N + 15) / 16), threads = (unsigned)S * 32;
    if (n <= 8)
        cllm_launch(gemm_skinny<1, SILU, AHEAD, EP>, row_tiles, threads, 0, stream, w, ep, N, K, x,
                    n, y, ldy, S);
    else if (n <= 16)
        cllm_launch(gemm_skinny<2, SILU, AHEAD, EP>, row_tiles, threads, 0, stream, w, ep, N, K, x,
                    n, y, ldy, S);
    else
        cllm_launch(gemm_skinny<4, SILU, AHEAD, EP>, row_tiles, threads, 0, stream, w, ep, N, K, x,
                    n, y, ldy, S);
}

template <bool SILU, class EP>
static void launch_skinny(const __nv_bfloat16 *w, const EP &ep, int32_t N, int32_t K, const void *x,
                          int32_t n, float *y, int32_t ldy, cudaStream_t stream)
{
    const int32_t S = cllm_cuda_gemm_slices(N, K);
    if (S >= AHEAD_MIN_SLICES)
        launch_skinny_as<SILU, true>(w, ep, N, K, x, n, y, ldy, S, stream);
    else
        launch_skinny_as<SILU, false>(w, ep, N, K, x, n, y, ldy, S, stream);
}

/* The tiled kernel of shape T over all of n and N (partials: one slice per block, in z). */
template <class T, bool SILU>
static void launch_tiled(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                         const void *x, int32_t n, float *y, int32_t ldy, int32_t S,
                         float *partials, cudaStream_t stream)
{
    dim3 grid((unsigned)((n + T::N - 1) / T::N), (unsigned)((N + T::M - 1) / T::M),
              partials ? (unsigned)S : 1u);
    cllm_launch(gemm_tiled<T, SILU>, grid, T::THREADS, T::SMEM, stream, w, bias, N, K, x, n, y, ldy,
                S, partials);
}

/* Lets both variants of shape T take its ring (past the 48 KiB a block gets unasked). */
template <class T> static cudaError_t allow_ring()
{
    if (T::SMEM <= 48 * 1024)
        return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(gemm_tiled<T, false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(gemm_tiled<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)T::SMEM);
    return e;
}

static cudaError_t prepare_tiling(int id)
{
    if (id == TILING_256X64)
        return allow_ring<tiling_256x64>();
    if (id == TILING_128X128)
        return allow_ring<tiling_128x128>();
    return allow_ring<tiling_128x64>();
}

template <bool SILU>
static cudaError_t launch_gemm(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                               const void *x, int32_t n, float *y, int32_t ldy, void *scratch,
                               size_t scratch_bytes, cudaStream_t stream)
{
    if (N < 0 || n < 0 || ldy < N || !cllm_cuda_gemm_supported(w, x, K))
        return cudaErrorInvalidValue;
    if (N == 0 || n == 0)
        return cudaSuccess;
    const int32_t S = cllm_cuda_gemm_slices(N, K);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX)
        launch_skinny<SILU>(w, plain_epilogue{bias}, N, K, x, n, y, ldy, stream);
    else {
        const size_t need = cllm_cuda_gemm_scratch_bytes(N, K, n);
        const bool parallel = need > 0 && scratch && scratch_bytes >= need;
        float *partials = parallel ? (float *)scratch : NULL;
        if (current_tiling == TILING_256X64)
            launch_tiled<tiling_256x64, SILU>(w, bias, N, K, x, n, y, ldy, S, partials, stream);
        else if (current_tiling == TILING_128X128)
            launch_tiled<tiling_128x128, SILU>(w, bias, N, K, x, n, y, ldy, S, partials, stream);
        else
            launch_tiled<tiling_128x64, SILU>(w, bias, N, K, x, n, y, ldy, S, partials, stream);
        if (parallel) {
            cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess)
                return e;
            const int64_t blocks = ((int64_t)n * N + 255) / 256;
            cllm_launch(gemm_reduce, (unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream,
                        partials, bias, N, n, S, y, ldy);
        }
    }
    return cudaGetLastError();
}

cudaError_t cllm_cuda_gemm(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                           const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy, void *scratch,
                           size_t scratch_bytes, cudaStream_t stream)
{
    return launch_gemm<false>(w, bias, N, K, x, n, y, ldy, scratch, scratch_bytes, stream);
}

cudaError_t cllm_cuda_gemm_silu(const __nv_bfloat16 *w, int32_t N, int32_t K, const float *gate_up,
                                int32_t n, float *y, int32_t ldy, void *scratch,
                                size_t scratch_bytes, cudaStream_t stream)
{
    return launch_gemm<true>(w, NULL, N, K, gate_up, n, y, ldy, scratch, scratch_bytes, stream);
}

int cllm_cuda_gemm_rope_supported(const void *w, const void *x, int32_t K, int32_t n,
                                  int32_t head_dim)
{
    return cllm_cuda_gemm_supported(w, x, K) && n >= 1 && n <= CLLM_CUDA_GEMM_SKINNY_MAX &&
           head_dim > 0 && head_dim % 16 == 0 && head_dim / 2 <= CLLM_CUDA_MAX_HALF_DIM;
}

cudaError_t cllm_cuda_gemm_rope_store(const __nv_bfloat16 *w, int32_t K, const __nv_bfloat16 *x,
                                      int32_t n, float *y, int32_t ldy,
                                      const struct cllm_cuda_rope_store *r, cudaStream_t stream)
{
    const int32_t N = (r->n_head + 2 * r->n_kv) * r->head_dim;
    if (!cllm_cuda_gemm_rope_supported(w, x, K, n, r->head_dim) || r->n_head < 1 || r->n_kv < 1 ||
        ldy < N)
        return cudaErrorInvalidValue;
    launch_skinny<false>(w, *r, N, K, x, n, y, ldy, stream);
    return cudaGetLastError();
}

#else /* no tensor-core MMA on this vendor: the backend uses its BLAS */

static cudaError_t prepare_tiling(int id)
{
    (void)id;
    return cudaSuccess;
}

int cllm_cuda_gemm_rope_supported(const void *w, const void *x, int32_t K, int32_t n,
                                  int32_t head_dim)
{
    (void)w, (void)x, (void)K, (void)n, (void)head_dim;
    return 0;
}

cudaError_t cllm_cuda_gemm_rope_store(const __nv_bfloat16 *w, int32_t K, const __nv_bfloat16 *x,
                                      int32_t n, float *y, int32_t ldy,
                                      const struct cllm_cuda_rope_store *r, cudaStream_t stream)
{
    (void)w, (void)K, (void)x, (void)n, (void)y, (void)ldy, (void)r, (void)stream;
    return cudaErrorInvalidValue;
}

int cllm_cuda_gemm_supported(const void *w, const void *x, int32_t K)
{
    (void)w, (void)x, (void)K;
    return 0;
}

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n)
{
    (void)N, (void)K, (void)n;
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

cudaError_t cllm_cuda_gemm_silu(const __nv_bfloat16 *w, int32_t N, int32_t K, const float *gate_up,
                                int32_t n, float *y, int32_t ldy, void *scratch,
                                size_t scratch_bytes, cudaStream_t stream)
{
    (void)w, (void)N, (void)K, (void)gate_up, (void)n, (void)y, (void)ldy, (void)scratch,
        (void)scratch_bytes, (void)stream;
    return cudaErrorInvalidValue;
}

#endif
