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

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

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
template <int WARPS_M_, int WARPS_N_, int MT_, int NT_, int STAGES_, int MIN_BLOCKS_,
          bool ONE_SLICE_ = false>
struct tiling {
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, MT = MT_, NT = NT_;
    static constexpr int STAGES = STAGES_, MIN_BLOCKS = MIN_BLOCKS_;
    /* A block computes one slice only (the weight has one, or the slices run in parallel
     * blocks): no running total beside the slice's sums, which leaves the registers for warps
     * of 64 x 64 */
    static constexpr bool ONE_SLICE = ONE_SLICE_;
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
/* 96 KiB. Loads per MMA are what bound the others (session 22: the 128 x 64 blocks read ~3 TB/s
 * from L2 at 135 TFLOP/s, 21 multiply-adds per byte); 256 x 128 blocks do 43. */
using tiling_256x128 = tiling<4, 2, 4, 8, 4, 1, true>;

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

/* The tiled kernel's shapes by name (the tiling structs below, for the host), and the one a
 * step takes where no tuned plan says otherwise (below). */
enum { TILING_128X64, TILING_256X64, TILING_128X128, TILING_256X128, N_TILINGS };
struct tiling_shape {
    const char *name;
    int m, n, min_blocks;
    bool one_slice; /* only for blocks of one slice: else the step runs in 128x64 blocks */
};
static const struct tiling_shape tilings[N_TILINGS] = {{"128x64", 128, 64, 2, false},
                                                       {"256x64", 256, 64, 1, false},
                                                       {"128x128", 128, 128, 1, false},
                                                       {"256x128", 256, 128, 1, true}};
static int current_tiling = TILING_128X64;
/* The skinny kernel's W prefetch: 0 by its slices (AHEAD_MIN_SLICES), 1 always, -1 never. */
static int skinny_ahead = 0;
/* Slices (warps per block) from which the skinny kernel loads W a group ahead by default. */
#define AHEAD_MIN_SLICES 4
/* Blocks a skinny row tile by default (cllm_cuda_gemm_force_split). */
static int skinny_parts = 1;

void cllm_cuda_gemm_force_ahead(int mode)
{
    skinny_ahead = mode > 0 ? 1 : mode < 0 ? -1 : 0;
}

void cllm_cuda_gemm_force_split(int parts)
{
    skinny_parts = parts == 2 || parts == 4 ? parts : 1;
}

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

/* --- ways and plans --- */

/* How one GEMM runs a step: the tiled kernel's shape and whether its slices run in parallel
 * blocks (steps of more than CLLM_CUDA_GEMM_SKINNY_MAX tokens), or whether the skinny kernel
 * requests W a group ahead (the others). Every way computes the same bits -- the formula
 * (gemm.h) is per element and fixes the order of every sum -- so which one runs is a matter of
 * speed alone, and that depends on the GPU, the weight's shape and the step's size: measured
 * at start-up (cllm_cuda_gemm_tune), not guessed. */
struct gemm_way {
    int tiling;
    bool parallel;
    bool ahead;
    int parts; /* skinny steps: blocks sharing a row tile's slices (1: one block a tile) */
};

/* Step sizes a plan keeps one way for: the skinny kernel's three token-tile counts, then
 * powers of two. A bucket is timed at one step size: one sequence's decode step, the skinny
 * tiles' fullest steps, then the middle of each range (192: the evaluation's batch). */
#define N_BUCKETS 11
static const int32_t bucket_max[N_BUCKETS] = {8,   16,   32,   64,   128,      256,
                                              512, 1024, 2048, 4096, INT32_MAX};
static const int32_t bucket_probe[N_BUCKETS] = {1, 16, 32, 48, 96, 192, 384, 768, 1536, 3072, 6144};

static int bucket_of(int32_t n)
{
    int b = 0;
    while (n > bucket_max[b])
        b++;
    return b;
}

/* The ways tuned for one weight shape, bucket by bucket (bit b of `tuned`). Process-wide, as
 * the tiling is: all the devices of a process are alike (backend_cuda.cu). */
#define MAX_PLANS 32
struct gemm_plan {
    int32_t N, K;
    unsigned tuned;
    gemm_way way[N_BUCKETS];
};
static gemm_plan plans[MAX_PLANS];
static int n_plans;
static std::mutex plans_lock; /* a backend may tune while another one's steps launch */

static int64_t tiles_of(int tiling, int32_t N, int32_t n)
{
    const struct tiling_shape *t = &tilings[tiling];
    return ((int64_t)n + t->n - 1) / t->n * (((int64_t)N + t->m - 1) / t->m);
}

/* The way of an untuned step: the process's tiling, its slices in parallel when its tiles
 * number fewer than about two blocks per SM of an H100/H200 (132 SMs: 256 tiles of a shape two
 * of whose blocks fit an SM, 128 of one that takes the SM alone), the skinny prefetch in blocks
 * of AHEAD_MIN_SLICES warps or more. */
static bool split_fits(int32_t N, int32_t K, int parts);

static gemm_way default_way(int32_t N, int32_t K, int32_t n)
{
    gemm_way w;
    w.parts = split_fits(N, K, skinny_parts) ? skinny_parts : 1;
    w.tiling = current_tiling;
    w.parallel = tiles_of(current_tiling, N, n) < 128 * tilings[current_tiling].min_blocks;
    w.ahead =
        skinny_ahead != 0 ? skinny_ahead > 0 : cllm_cuda_gemm_slices(N, K) >= AHEAD_MIN_SLICES;
    return w;
}

static gemm_way way_for(int32_t N, int32_t K, int32_t n)
{
    const int b = bucket_of(n);
    std::lock_guard<std::mutex> hold(plans_lock);
    for (int i = 0; i < n_plans; i++)
        if (plans[i].N == N && plans[i].K == K && (plans[i].tuned >> b & 1u))
            return plans[i].way[b];
    return default_way(N, K, n);
}

static void keep_way(int32_t N, int32_t K, int b, const gemm_way &w)
{
    std::lock_guard<std::mutex> hold(plans_lock);
    int i = 0;
    while (i < n_plans && !(plans[i].N == N && plans[i].K == K))
        i++;
    if (i == MAX_PLANS)
        return; /* full: this shape keeps the default ways */
    if (i == n_plans) {
        plans[i] = gemm_plan{N, K, 0u, {}};
        n_plans++;
    }
    plans[i].way[b] = w;
    plans[i].tuned |= 1u << b;
}

void cllm_cuda_gemm_forget_plans(void)
{
    std::lock_guard<std::mutex> hold(plans_lock);
    n_plans = 0;
}

int cllm_cuda_gemm_tuned(int32_t N, int32_t K, int32_t n_max)
{
    if (n_max < 1)
        return 0;
    const unsigned want = (2u << bucket_of(n_max)) - 1u; /* buckets 0 .. n_max's */
    std::lock_guard<std::mutex> hold(plans_lock);
    for (int i = 0; i < n_plans; i++)
        if (plans[i].N == N && plans[i].K == K)
            return (plans[i].tuned & want) == want;
    return 0;
}

/* Does this way run the slices in parallel blocks for a step of n tokens (given the scratch)? */
static bool runs_parallel(const gemm_way &w, int32_t N, int32_t K, int32_t n)
{
    return w.parallel && n > CLLM_CUDA_GEMM_SKINNY_MAX && cllm_cuda_gemm_slices(N, K) > 1;
}

/* The scratch: CLLM_CUDA_GEMM_COUNT_BYTES of counts (split skinny tiles: one per row tile),
 * then the partial sums of either kernel. */
static size_t parallel_scratch(int32_t N, int32_t K, int32_t n)
{
    return CLLM_CUDA_GEMM_COUNT_BYTES +
           (size_t)cllm_cuda_gemm_slices(N, K) * (size_t)n * (size_t)N * sizeof(float);
}

static float *scratch_partials(void *scratch)
{
    return (float *)((char *)scratch + CLLM_CUDA_GEMM_COUNT_BYTES);
}

/* A skinny row tile's slices spread over `parts` blocks: an even share each, and row tiles few
 * enough that one block a tile leaves SMs idle (fewer than about two a SM of an H100/H200) and
 * that each has a count. */
static bool split_fits(int32_t N, int32_t K, int parts)
{
    const int64_t tiles = ((int64_t)N + 15) / 16;
    return parts > 1 && cllm_cuda_gemm_slices(N, K) % parts == 0 && tiles < 256 &&
           tiles <= (int64_t)(CLLM_CUDA_GEMM_COUNT_BYTES / sizeof(int32_t));
}

/* Token tiles of 8 the skinny kernel takes for n tokens. */
static int32_t skinny_tiles(int32_t n)
{
    return n <= 8 ? 1 : n <= 16 ? 2 : 4;
}

/* Every slice's sums of every row tile ([tile][slice][token tile][4][32] F32). */
static size_t split_scratch(int32_t N, int32_t K, int32_t n)
{
    return CLLM_CUDA_GEMM_COUNT_BYTES + (size_t)((N + 15) / 16) *
                                            (size_t)cllm_cuda_gemm_slices(N, K) *
                                            (size_t)skinny_tiles(n) * 4 * 32 * sizeof(float);
}

/* The blocks a skinny step of this way takes a row tile (given the scratch). */
static int split_parts(const gemm_way &w, int32_t N, int32_t K, int32_t n, size_t scratch_bytes)
{
    return n <= CLLM_CUDA_GEMM_SKINNY_MAX && split_fits(N, K, w.parts) &&
                   scratch_bytes >= split_scratch(N, K, n)
               ? w.parts
               : 1;
}

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
            flat[i] = __ldcg(&sp.partials[tile + i]);
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
    cllm_pdl_wait();                              /* x, y and the epilogue's buffers from here on */
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

/* Where tile row r's vector v of chunk c of the tiled kernel comes from (W rows first, then
 * tokens): row or token src of W or x (-1: past the edge), NULL past K or the edge (zeros). */
template <class T>
static __device__ __forceinline__ const __nv_bfloat16 *
tile_src(const __nv_bfloat16 *w, const __nv_bfloat16 *x, int32_t src, int r, int32_t k, int32_t K)
{
    if (src < 0 || k >= K)
        return NULL;
    return (r < T::M ? w : x) + (int64_t)src * K + k;
}

/* The loads of chunk c into stage slot `slot`, loads [i0, i1) of this thread (W loads first:
 * i < T::LOADS_W): straight from global to shared memory (cp.async); zeros (past K or the
 * edge) stored directly. */
template <class T, int i0, int i1>
static __device__ __forceinline__ void
copy_chunk(uint4 (*slot)[VECS], const __nv_bfloat16 *w, const __nv_bfloat16 *x,
           const int32_t (&src)[T::LOADS], int32_t c, int32_t K)
{
#pragma unroll
    for (int i = i0; i < i1; i++) {
        const int idx = (int)threadIdx.x + i * T::THREADS, r = idx / VECS, v = idx % VECS;
        const __nv_bfloat16 *from = tile_src<T>(w, x, src[i], r, c * CHUNK + v * 8, K);
        if (from)
            cllm_cp_async16(&slot[r][v], from);
        else
            slot[r][v] = make_uint4(0, 0, 0, 0);
    }
}

/* The W part of chunk c (loads i < T::LOADS_W): the one thing the tiled kernel touches
 * before cllm_pdl_wait() (weights are never written by a kernel). */
template <class T>
static __device__ __forceinline__ void load_w_tile(uint4 (*slot)[VECS], const __nv_bfloat16 *w,
                                                   const int32_t (&src)[T::LOADS], int32_t c,
                                                   int32_t K)
{
    copy_chunk<T, 0, T::LOADS_W>(slot, w, NULL, src, c, K);
}

/* The W row behind row r of a tile whose rows start at row0 (N rows in all). PAIRED (the
 * stacked [gate | up] weight, N = 2F): each 16 tile rows are 8 gate rows and then the same 8
 * features' up rows, so that an MMA tile's rows g and g + 8 are one feature's two factors. */
template <class T, bool PAIRED>
static __device__ __forceinline__ int32_t tile_w_row(int32_t row0, int r, int32_t N)
{
    if (!PAIRED)
        return row0 + r < N ? row0 + r : -1;
    const int32_t F = N / 2, f = row0 / 2 + r / 16 * 8 + r % 8;
    return f >= F ? -1 : r % 16 < 8 ? f : F + f;
}

/* Prefill steps: block = T::M rows x T::N tokens staged through shared memory in a ring of
 * T::STAGES chunks: chunk c + STAGES - 1 is in flight (cp.async) while chunk c is multiplied, so
 * memory latency hides behind STAGES - 1 chunks of MMAs rather than one. Each element keeps
 * the running slice (acc) apart from the finished ones (total), so the sums happen in exactly
 * the skinny kernel's order; how the bytes arrive does not change them. With `partials`,
 * block z computes slice z alone and stores it there ([S][n][N], by W row) for gemm_reduce:
 * the same sums, spread over more blocks when the tiles alone would leave SMs idle (N = 1536
 * at 192 tokens is 36 tiles of 128 x 64). As in the skinny kernel, the first chunk's W
 * vectors are requested before cllm_pdl_wait(). The ring is dynamic shared memory (T::SMEM,
 * up to 80 KiB: cllm_cuda_gemm_use_tiling raises the limit). Output: y[tok][row] (+ bias)
 * F32, or (PAIRED) bf16(silu(gate) * up) into out [n][ldo] BF16 as the silu_mul kernel
 * computes it. */
template <class T, bool PAIRED>
static __global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    gemm_tiled(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
               const __nv_bfloat16 *x, int32_t n, void *y, int32_t ldy, int32_t S, float *partials)
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
            src[i] = tile_w_row<T, PAIRED>(row0, r, N);
        else
            src[i] = tok0 + r - T::M < n ? tok0 + r - T::M : -1;
    }
    /* ONE_SLICE: acc is the block's one slice; total is not used (and not allocated) */
    constexpr int TM = T::ONE_SLICE ? 1 : MT, TN = T::ONE_SLICE ? 1 : NT;
    float acc[MT][NT][4], total[TM][TN][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        for (int nt = 0; nt < NT; nt++)
            for (int e = 0; e < 4; e++)
                acc[mt][nt][e] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < TM; mt++)
        for (int nt = 0; nt < TN; nt++)
            for (int e = 0; e < 4; e++)
                total[mt][nt][e] = 0.0f;

    /* chunks [c_begin, c_end): all of K, or slice blockIdx.z alone */
    int32_t s = partials ? (int32_t)blockIdx.z : 0;
    const int32_t c_begin = slice_start(s, chunks, S);
    const int32_t c_end = partials ? slice_start(s + 1, chunks, S) : chunks;
    int32_t slice_end = slice_start(s + 1, chunks, S);
    bool first = true;

    /* The ring's first STAGES - 1 chunks, one commit group each (empty past c_end, so that
     * "group c done" is always "at most STAGES - 2 groups pending"). */
    load_w_tile<T>(tile[0], w, src, c_begin, K);
    cllm_pdl_wait(); /* x, y and partials from here on */
    copy_chunk<T, T::LOADS_W, T::LOADS>(tile[0], w, x, src, c_begin, K);
    cllm_cp_async_commit();
#pragma unroll
    for (int st = 1; st < STAGES - 1; st++) {
        if (c_begin + st < c_end)
            copy_chunk<T, 0, T::LOADS>(tile[st], w, x, src, c_begin + st, K);
        cllm_cp_async_commit();
    }

    for (int32_t c = c_begin; c < c_end; c++) {
        const int b = (int)((c - c_begin) % STAGES);
        cllm_cp_async_wait<STAGES - 2>(); /* this thread's copies of chunk c have landed... */
        __syncthreads(); /* ... everyone's have, and nobody still reads chunk c - 1's slot */
        /* Chunk c + STAGES - 1 into the slot chunk c - 1 used. */
        const int32_t ahead = c + STAGES - 1;
        if (ahead < c_end)
            copy_chunk<T, 0, T::LOADS>(tile[(b + STAGES - 1) % STAGES], w, x, src, ahead, K);
        cllm_cp_async_commit();

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
        if constexpr (!T::ONE_SLICE) {
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
        }
    }
    (void)first, (void)slice_end;
    cllm_cp_async_wait<0>(); /* no copy may outlive the block (the empty groups aside) */
    /* fully unrolled: an index the compiler cannot resolve would put acc in local memory */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = wm * T::WARP_M + mt * 16 + acc_row(lane, e);
                const int32_t row = tile_w_row<T, PAIRED>(row0, r, N);
                const int32_t tok = tok0 + wn * T::WARP_N + nt * 8 + acc_tok(lane, e);
                if (row < 0 || tok >= n)
                    continue;
                float v, up;
                if constexpr (T::ONE_SLICE)
                    v = acc[mt][nt][e], up = acc[mt][nt][e | 2];
                else
                    v = total[mt][nt][e], up = total[mt][nt][e | 2];
                if (partials)
                    partials[((int64_t)blockIdx.z * n + tok) * N + row] = v;
                else if (PAIRED) {
                    if (e < 2) /* row: feature row's gate; element e + 2 its up */
                        ((__nv_bfloat16 *)y)[(int64_t)tok * ldy + row] =
                            cllm_cuda_silu_mul_one(v, up);
                } else
                    ((float *)y)[(int64_t)tok * ldy + row] = bias ? v + bias[row] : v;
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

/* The same sums of a stacked [gate | up] weight (N = 2F rows), finished as the silu_mul kernel
 * does: out[tok][f] = bf16(silu(gate) * up) of rows f and F + f. */
static __global__ void gemm_reduce_silu(const float *partials, int32_t N, int32_t n, int32_t S,
                                        __nv_bfloat16 *out, int32_t ldo)
{
    cllm_pdl_wait();
    const int32_t F = N / 2;
    const int64_t total = (int64_t)n * N, outputs = (int64_t)n * F;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < outputs;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t tok = (int32_t)(i / F), f = (int32_t)(i % F);
        const int64_t at = (int64_t)tok * N + f;
        float gate = partials[at], up = partials[at + F];
        for (int32_t sl = 1; sl < S; sl++) {
            gate += partials[(int64_t)sl * total + at];
            up += partials[(int64_t)sl * total + at + F];
        }
        out[(int64_t)tok * ldo + f] = cllm_cuda_silu_mul_one(gate, up);
    }
}

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n, bool norm_inside)
{
    if (N <= 0 || n <= 0 || norm_inside) /* the norm: decode steps, never split (launch_skinny) */
        return 0;
    const gemm_way w = way_for(N, K, n);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX)
        return split_fits(N, K, w.parts) ? split_scratch(N, K, n) : 0;
    return runs_parallel(w, N, K, n) ? parallel_scratch(N, K, n) : 0;
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

/* The tiled kernel of shape T over all of n and N (partials: one slice per block, in z). */
template <class T, bool PAIRED>
static void launch_tiled(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                         const __nv_bfloat16 *x, int32_t n, void *y, int32_t ldy, int32_t S,
                         float *partials, cudaStream_t stream)
{
    dim3 grid((unsigned)((n + T::N - 1) / T::N), (unsigned)((N + T::M - 1) / T::M),
              partials ? (unsigned)S : 1u);
    cllm_launch(gemm_tiled<T, PAIRED>, grid, T::THREADS, T::SMEM, stream, w, bias, N, K, x, n, y,
                ldy, S, partials);
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
    if (id == TILING_256X128)
        return allow_ring<tiling_256x128>();
    return allow_ring<tiling_128x64>();
}

/* One GEMM's operands. PAIRED: W is the stacked [gate | up] weight (N = 2F rows) and y the
 * BF16 [n][ldy] output of SiLU, no bias. */
struct gemm_call {
    const __nv_bfloat16 *w;
    const float *bias;
    int32_t N, K;
    const __nv_bfloat16 *x;
    void *y;
    int32_t ldy;
    void *scratch;
    size_t scratch_bytes;
    cudaStream_t stream;
    const cllm_cuda_norm_in *norm; /* skinny steps only (checked by the caller), or NULL */
};

/* One GEMM of checked operands, one way: the skinny kernel for decode steps, else the tiled
 * one (its slices in parallel blocks when the way says so and the scratch holds them, then
 * summed in order). */
template <bool PAIRED>
static cudaError_t launch_way(const gemm_way &way, const gemm_call &a, int32_t n)
{
    const int32_t N = a.N, K = a.K, S = cllm_cuda_gemm_slices(N, K);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX) {
        if constexpr (PAIRED)
            launch_skinny(way, a.w, silu_epilogue{N / 2, (__nv_bfloat16 *)a.y, a.ldy}, N, K, a.x, n,
                          NULL, 0, a.scratch, a.scratch_bytes, a.norm, a.stream);
        else
            launch_skinny(way, a.w, plain_epilogue{a.bias}, N, K, a.x, n, (float *)a.y, a.ldy,
                          a.scratch, a.scratch_bytes, a.norm, a.stream);
        return cudaGetLastError();
    }
    const bool parallel =
        runs_parallel(way, N, K, n) && a.scratch && a.scratch_bytes >= parallel_scratch(N, K, n);
    float *partials = parallel ? scratch_partials(a.scratch) : NULL;
    /* a shape for blocks of one slice takes only steps whose blocks are (same bits) */
    const int tiling =
        tilings[way.tiling].one_slice && S > 1 && !parallel ? (int)TILING_128X64 : way.tiling;
    if (tiling == TILING_256X128)
        launch_tiled<tiling_256x128, PAIRED>(a.w, a.bias, N, K, a.x, n, a.y, a.ldy, S, partials,
                                             a.stream);
    else if (tiling == TILING_256X64)
        launch_tiled<tiling_256x64, PAIRED>(a.w, a.bias, N, K, a.x, n, a.y, a.ldy, S, partials,
                                            a.stream);
    else if (tiling == TILING_128X128)
        launch_tiled<tiling_128x128, PAIRED>(a.w, a.bias, N, K, a.x, n, a.y, a.ldy, S, partials,
                                             a.stream);
    else
        launch_tiled<tiling_128x64, PAIRED>(a.w, a.bias, N, K, a.x, n, a.y, a.ldy, S, partials,
                                            a.stream);
    if (parallel) {
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
        const int64_t blocks = ((int64_t)n * (PAIRED ? N / 2 : N) + 255) / 256;
        const unsigned grid = (unsigned)(blocks < 65535 ? blocks : 65535);
        if constexpr (PAIRED)
            cllm_launch(gemm_reduce_silu, grid, 256, 0, a.stream, partials, N, n, S,
                        (__nv_bfloat16 *)a.y, a.ldy);
        else
            cllm_launch(gemm_reduce, grid, 256, 0, a.stream, partials, a.bias, N, n, S,
                        (float *)a.y, a.ldy);
    }
    return cudaGetLastError();
}

static cudaError_t launch_call(bool paired, const gemm_way &way, const gemm_call &a, int32_t n)
{
    return paired ? launch_way<true>(way, a, n) : launch_way<false>(way, a, n);
}

/* --- tuning --- */

/* The ways worth timing for a step of n tokens, the default way first: both skinny
 * prefetches, each with one block a row tile and with 2 or 4 where split_fits and the scratch
 * holds them; each tiled shape with its slices in series, and in parallel blocks where there
 * are slices and the tiles number fewer than about four blocks per SM (twice the default
 * rule's bound) and the scratch holds them. Restricted to the process's tiling, the default
 * prefetch and the default split where `what` does not include CLLM_CUDA_GEMM_TUNE_TILING /
 * _AHEAD / _SPLIT. */
static int ways_to_time(int32_t N, int32_t K, int32_t n, unsigned what, size_t scratch_bytes,
                        gemm_way *out)
{
    const gemm_way base = default_way(N, K, n);
    int count = 0;
    out[count++] = base;
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX) {
        for (int parts = 1; parts <= 4; parts *= 2) {
            const bool open = (what & CLLM_CUDA_GEMM_TUNE_SPLIT) &&
                              (parts == 1 || (split_fits(N, K, parts) &&
                                              scratch_bytes >= split_scratch(N, K, n)));
            if (!open && parts != base.parts)
                continue;
            for (int other = 0; other < ((what & CLLM_CUDA_GEMM_TUNE_AHEAD) ? 2 : 1); other++) {
                if (parts == base.parts && !other)
                    continue; /* the default way, already first */
                out[count] = base;
                out[count].parts = parts;
                out[count++].ahead = other ? !base.ahead : base.ahead;
            }
        }
        return count;
    }
    const bool sliced = cllm_cuda_gemm_slices(N, K) > 1;
    for (int t = 0; t < N_TILINGS; t++) {
        if (!(what & CLLM_CUDA_GEMM_TUNE_TILING) && t != current_tiling)
            continue;
        if (prepare_tiling(t) != cudaSuccess) {
            (void)cudaGetLastError(); /* a shape this device cannot give its ring: not timed */
            continue;
        }
        for (int parallel = 0; parallel < 2; parallel++) {
            /* a shape for blocks of one slice: in series only where there is one slice, in
             * parallel however many tiles there are (its blocks are too few otherwise) */
            const bool one = tilings[t].one_slice;
            if (!parallel && one && sliced)
                continue;
            if (parallel && !(sliced && (one || tiles_of(t, N, n) < 256 * tilings[t].min_blocks) &&
                              scratch_bytes >= parallel_scratch(N, K, n)))
                continue;
            if (t == base.tiling && (parallel != 0) == (base.parallel && sliced))
                continue; /* the default way, already first */
            out[count++] = gemm_way{t, parallel != 0, base.ahead, base.parts};
        }
    }
    return count;
}

size_t cllm_cuda_gemm_tune_scratch_bytes(int32_t N, int32_t K, int32_t n_max)
{
    size_t need = 0;
    for (int b = 0; b < N_BUCKETS && N > 0 && n_max > 0; b++) {
        const int32_t n = bucket_probe[b] < n_max ? bucket_probe[b] : n_max;
        size_t s = 0;
        if (n > CLLM_CUDA_GEMM_SKINNY_MAX && cllm_cuda_gemm_slices(N, K) > 1)
            s = parallel_scratch(N, K, n);
        else if (n <= CLLM_CUDA_GEMM_SKINNY_MAX && (split_fits(N, K, 2) || split_fits(N, K, 4)))
            s = split_scratch(N, K, n);
        need = s > need ? s : need;
        if (n == n_max)
            break;
    }
    return need;
}

/* Times one way as the engine runs it: `reps` launches recorded as one graph, the weights in
 * turn (as the layers follow each other: from HBM, not from the L2 the launch before filled),
 * replayed three times; the faster of the last two, per launch. */
static cudaError_t time_way(bool paired, const gemm_way &way, const gemm_call &a,
                            const __nv_bfloat16 *const *w, int32_t n_w, int32_t n, int reps,
                            cudaEvent_t start, cudaEvent_t stop, float *us)
{
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamBeginCapture(a.stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess)
        return e;
    for (int r = 0; r < reps && e == cudaSuccess; r++) {
        gemm_call ar = a;
        ar.w = w[r % n_w];
        e = launch_call(paired, way, ar, n);
    }
    const cudaError_t ended = cudaStreamEndCapture(a.stream, &graph);
    if (e == cudaSuccess)
        e = ended;
    if (e == cudaSuccess)
        e = cudaGraphInstantiate(&exec, graph, 0);
    *us = INFINITY;
    for (int i = 0; i < 3 && e == cudaSuccess; i++) {
        float ms = 0.0f;
        e = cudaEventRecord(start, a.stream);
        if (e == cudaSuccess)
            e = cudaGraphLaunch(exec, a.stream);
        if (e == cudaSuccess)
            e = cudaEventRecord(stop, a.stream);
        if (e == cudaSuccess)
            e = cudaEventSynchronize(stop);
        if (e == cudaSuccess)
            e = cudaEventElapsedTime(&ms, start, stop);
        if (e == cudaSuccess && i > 0 && 1000.0f * ms / (float)reps < *us)
            *us = 1000.0f * ms / (float)reps;
    }
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    return e;
}

static int describe_way(char *out, size_t len, int32_t N, int32_t K, int32_t n, const gemm_way &w)
{
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX && split_fits(N, K, w.parts))
        return snprintf(out, len, "%s, %d blocks a tile", w.ahead ? "ahead" : "not ahead", w.parts);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX)
        return snprintf(out, len, "%s", w.ahead ? "ahead" : "not ahead");
    const bool parallel = runs_parallel(w, N, K, n);
    const bool fallback =
        tilings[w.tiling].one_slice && cllm_cuda_gemm_slices(N, K) > 1 && !parallel;
    return snprintf(out, len, "%s%s", tilings[fallback ? TILING_128X64 : w.tiling].name,
                    parallel ? " parallel" : "");
}

void cllm_cuda_gemm_way(int32_t N, int32_t K, int32_t n, char *out, size_t len)
{
    describe_way(out, len, N, K, n, way_for(N, K, n));
}

/* Appends to report without overrunning it. */
static void report_add(char *report, size_t len, size_t *at, const char *fmt, ...)
{
    if (!report || *at >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(report + *at, len - *at, fmt, ap);
    va_end(ap);
    if (k > 0)
        *at = *at + (size_t)k < len ? *at + (size_t)k : len;
}

cudaError_t cllm_cuda_gemm_tune(const __nv_bfloat16 *const *w, int32_t n_w, int32_t N, int32_t K,
                                int paired, const __nv_bfloat16 *x, int32_t n_max, void *y,
                                int32_t ldy, void *scratch, size_t scratch_bytes, unsigned what,
                                cudaStream_t stream, char *report, size_t report_len)
{
    if (report && report_len)
        report[0] = '\0';
    if (N < 1 || n_max < 1 || n_w < 1 || (paired && N % 2) || ldy < (paired ? N / 2 : N))
        return cudaErrorInvalidValue;
    for (int32_t i = 0; i < n_w; i++)
        if (!cllm_cuda_gemm_supported(w[i], x, K))
            return cudaErrorInvalidValue;
    const gemm_call a = {w[0], NULL, N, K, x, y, ldy, scratch, scratch_bytes, stream, NULL};
    cudaEvent_t start = NULL, stop = NULL;
    cudaError_t e = cudaEventCreate(&start);
    if (e == cudaSuccess)
        e = cudaEventCreate(&stop);
    size_t at = 0;
    report_add(report, report_len, &at, "%dx%d", (int)N, (int)K);
    for (int b = 0; b < N_BUCKETS && e == cudaSuccess; b++) {
        const int32_t n = bucket_probe[b] < n_max ? bucket_probe[b] : n_max;
        gemm_way ways[2 * N_TILINGS + 1];
        const int count = ways_to_time(N, K, n, what, scratch_bytes, ways);
        /* enough launches a graph (~20 us at least on an H200) that the gaps between the
         * kernels of a recorded step are in the time, and the graph's own start is not; every
         * weight once in decode steps, whose time is the weights' stream */
        int reps = n <= CLLM_CUDA_GEMM_SKINNY_MAX ? 8 : n <= 256 ? 2 : 1;
        const int32_t distinct = n <= CLLM_CUDA_GEMM_SKINNY_MAX ? n_w : n_w < 4 ? n_w : 4;
        reps = reps > distinct ? reps : (int)distinct;
        float best = INFINITY, first = INFINITY;
        int won = 0;
        for (int i = 0; i < count && count > 1 && e == cudaSuccess; i++) {
            float us;
            e = time_way(paired != 0, ways[i], a, w, n_w, n, reps, start, stop, &us);
            if (i == 0)
                first = us; /* ways[0] is the default way */
            if (e == cudaSuccess && us < best)
                best = us, won = i;
        }
        if (e != cudaSuccess)
            break;
        keep_way(N, K, b, ways[won]);
        char name[48];
        describe_way(name, sizeof name, N, K, n, ways[won]);
        if (count > 1)
            report_add(report, report_len, &at, "; n<=%d: %s %.1f us (default %.1f)",
                       bucket_max[b] == INT32_MAX ? (int)n : (int)bucket_max[b], name, (double)best,
                       (double)first);
        if (n == n_max)
            break;
    }
    if (start)
        cudaEventDestroy(start);
    if (stop)
        cudaEventDestroy(stop);
    return e;
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
    return launch_way<false>(way_for(N, K, n), a, n);
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
    return launch_way<true>(way_for(2 * F, K, n), a, n);
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
    launch_skinny(way_for(N, K, n), w, *r, N, K, x, n, y, ldy, scratch, scratch_bytes, norm,
                  stream);
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

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n, bool norm_inside)
{
    (void)N, (void)K, (void)n, (void)norm_inside;
    return 0;
}

size_t cllm_cuda_gemm_tune_scratch_bytes(int32_t N, int32_t K, int32_t n_max)
{
    (void)N, (void)K, (void)n_max;
    return 0;
}

cudaError_t cllm_cuda_gemm_tune(const __nv_bfloat16 *const *w, int32_t n_w, int32_t N, int32_t K,
                                int paired, const __nv_bfloat16 *x, int32_t n_max, void *y,
                                int32_t ldy, void *scratch, size_t scratch_bytes, unsigned what,
                                cudaStream_t stream, char *report, size_t report_len)
{
    (void)w, (void)n_w, (void)N, (void)K, (void)paired, (void)x, (void)n_max, (void)y, (void)ldy,
        (void)scratch, (void)scratch_bytes, (void)what, (void)stream;
    if (report && report_len)
        report[0] = '\0';
    return cudaErrorInvalidValue;
}

void cllm_cuda_gemm_forget_plans(void)
{
}

int cllm_cuda_gemm_tuned(int32_t N, int32_t K, int32_t n_max)
{
    (void)N, (void)K, (void)n_max;
    return 0;
}

void cllm_cuda_gemm_way(int32_t N, int32_t K, int32_t n, char *out, size_t len)
{
    (void)N, (void)K, (void)n;
    snprintf(out, len, "vendor BLAS");
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
