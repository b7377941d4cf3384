/*
 * The device sampler's building blocks (sample.cu, the only file that includes this): its
 * block shape and limits, the block's shared state, order-preserving keys and weights, the
 * counter-based generator, and the block-wide reductions every pass ends in. Static device
 * code of one kernel, compiled with it (a second file would need relocatable device code).
 */
#ifndef CLLM_BACKEND_CUDA_SAMPLE_BLOCK_H
#define CLLM_BACKEND_CUDA_SAMPLE_BLOCK_H

#include "backend/cuda/vendor.h"

#include <math.h>
#include <stdint.h>

#include "backend/cuda/warp.h"

#ifndef CLLM_CUDA_SAMPLE_THREADS
#define CLLM_CUDA_SAMPLE_THREADS 1024 /* a power of two, 32..1024 */
#endif
#define THREADS CLLM_CUDA_SAMPLE_THREADS
#define WARPS (THREADS / 32)
#define NONE 0xffffffffu
#define UNROLL 4 /* loads in flight per thread in a pass */

#define KEY_NEG_INF 0x007fffffu    /* fkey(-inf) */
#define KEY_FINITE_MIN 0x00800000u /* fkey(-FLT_MAX) */

#define KEY_BINS 4096 /* top-k bound: bins of the top 12 bits of the key */
#define KEY_SHIFT 20
#define GAP_BINS 1024 /* top-p bound: bins of 1/16 of max - x; the last takes gaps >= 63.94 */
#define GAP_PER_LOGIT 16.0f
#define GAP_MAX 64.0f
#define CAND_MAX 16384           /* candidates sorted in shared memory, at most */
#define CAND_MIN 4096            /* the same region holds the histograms: >= 32 KiB */
#define DEFAULT_SMEM (48 * 1024) /* shared memory per block on every device, without opt-in */

static_assert((THREADS & (THREADS - 1)) == 0 && THREADS >= 32 && THREADS <= 1024,
              "THREADS must be a power of two in [32, 1024]");
static_assert(CAND_MIN * 8 + 2048 <= DEFAULT_SMEM, "the smallest region needs no opt-in");
static_assert(CAND_MIN * 8 >= KEY_BINS * 4 && CAND_MIN * 8 >= GAP_BINS * 8 * 2 &&
                  CAND_MIN * 8 >= 2048 * 4 + 2048 * 8,
              "the shared region must hold every histogram (see where each is laid out)");

/* Values one thread hands to the others, and reduction scratch. */
struct block_state {
    uint64_t u64[WARPS];
    double f64[WARPS];
    uint32_t u32[WARPS];
    uint32_t n_cand; /* candidates gathered (may exceed the room) */
    uint32_t word;
    double dword;
    int32_t token;
};

/* ---- keys and weights ---- */

/* Order-preserving key of a float: NaN lowest (0), -0 as +0. */
static __device__ __forceinline__ uint32_t fkey(float f)
{
    if (f != f)
        return 0;
    uint32_t b = f == 0.0f ? 0u : __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static __device__ __forceinline__ float kval(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

/* Sort key of token i: its key first, then the lower id. */
static __device__ __forceinline__ uint64_t pack(uint32_t k, int32_t i)
{
    return (uint64_t)k << 32 | (uint32_t) ~(uint32_t)i;
}

static __device__ __forceinline__ int32_t unpack_id(uint64_t p)
{
    return (int32_t) ~(uint32_t)p;
}

/* The host's scaled logit: l / T in float, NaN as -inf. */
static __device__ __forceinline__ float scaled(float v, float t)
{
    return v != v ? -INFINITY : __fdiv_rn(v, t);
}

/* Weight of a sorted candidate: exp(x - max) in double, as the host computes it. */
static __device__ __forceinline__ double cand_weight(uint64_t c, float mx)
{
    return exp((double)kval((uint32_t)(c >> 32)) - (double)mx);
}

static __device__ __forceinline__ uint64_t fixed_weight(float x, float mx, double fix_one)
{
    return (uint64_t)__double2ull_rn(exp((double)x - (double)mx) * fix_one);
}

/* Bin of max - x in the top-p histogram; non-increasing in x. */
static __device__ __forceinline__ uint32_t gap_bin(float x, float mx)
{
    float g = __fsub_rn(mx, x);
    return g < GAP_MAX ? (uint32_t)__fmul_rn(g, GAP_PER_LOGIT) : GAP_BINS - 1;
}

static __device__ __forceinline__ uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1): draw `counter` of splitmix64's stream started from the seed. */
static __device__ double uniform(uint64_t seed, uint64_t counter)
{
    uint64_t h = mix64(mix64(seed ^ 0x6a09e667f3bcc909ull) + (counter + 1) * 0x9e3779b97f4a7c15ull);
    return (double)(h >> 11) * 0x1.0p-53;
}

/* ---- block primitives (every thread of the CTA calls them; all get the result) ---- */

static __device__ uint64_t block_max_u64(uint64_t v, struct block_state *st)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        uint64_t w = cllm_shfl_xor(v, o);
        v = w > v ? w : v;
    }
    if (lane == 0)
        st->u64[warp] = v;
    __syncthreads();
    v = lane < WARPS ? st->u64[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) {
        uint64_t w = cllm_shfl_xor(v, o);
        v = w > v ? w : v;
    }
    __syncthreads();
    return v;
}

static __device__ uint32_t block_min_u32(uint32_t v, struct block_state *st)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        uint32_t w = cllm_shfl_xor(v, o);
        v = w < v ? w : v;
    }
    if (lane == 0)
        st->u32[warp] = v;
    __syncthreads();
    v = lane < WARPS ? st->u32[lane] : NONE;
    for (int o = 16; o > 0; o >>= 1) {
        uint32_t w = cllm_shfl_xor(v, o);
        v = w < v ? w : v;
    }
    __syncthreads();
    return v;
}

/* Exclusive prefix sum over the threads in order; *total gets the sum of all. warp_sums is
 * the block's shared room of WARPS values of T (st->u64 or st->f64). */
template <class T> static __device__ T block_scan(T v, T *total, T *warp_sums)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T x = v;
    for (int o = 1; o < 32; o <<= 1) {
        T y = cllm_shfl_up(x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        warp_sums[warp] = x;
    __syncthreads();
    T w = lane < WARPS ? warp_sums[lane] : T(0);
    for (int o = 1; o < 32; o <<= 1) {
        T y = cllm_shfl_up(w, o);
        if (lane >= o)
            w += y;
    }
    T before_warp = cllm_shfl(w, (warp + 31) & 31);
    *total = cllm_shfl(w, 31);
    T before_lane = cllm_shfl_up(x, 1);
    __syncthreads();
    return (warp ? before_warp : T(0)) + (lane ? before_lane : T(0));
}

static __device__ uint64_t block_scan_u64(uint64_t v, uint64_t *total, struct block_state *st)
{
    return block_scan(v, total, st->u64);
}

static __device__ double block_scan_f64(double v, double *total, struct block_state *st)
{
    return block_scan(v, total, st->f64);
}

static __device__ double block_sum_f64(double v, struct block_state *st)
{
    double total;
    block_scan_f64(v, &total, st);
    return total;
}

/* Thread 0's value, to every thread. */
static __device__ uint32_t from_thread0(uint32_t v, struct block_state *st)
{
    if (threadIdx.x == 0)
        st->word = v;
    __syncthreads();
    v = st->word;
    __syncthreads();
    return v;
}

/* Walking bins in order (from the last bin down when desc), the first bin at which the running
 * sum of the bin values reaches target; NONE when the total stays below it. *before gets the
 * sum of the bins walked before it, *total the sum of all. Values: v32 or, if NULL, v64. */
static __device__ uint32_t find_bin(const uint32_t *v32, const uint64_t *v64, uint32_t n_bins,
                                    bool desc, uint64_t target, uint64_t *before, uint64_t *total,
                                    struct block_state *st)
{
    const uint32_t per = (n_bins + THREADS - 1) / THREADS;
    const uint32_t lo = threadIdx.x * per < n_bins ? threadIdx.x * per : n_bins;
    const uint32_t hi = lo + per < n_bins ? lo + per : n_bins;
    uint64_t s = 0;
    for (uint32_t q = lo; q < hi; q++) {
        uint32_t b = desc ? n_bins - 1 - q : q;
        s += v32 ? v32[b] : v64[b];
    }
    uint64_t run = block_scan_u64(s, total, st);
    uint32_t found = NONE;
    uint64_t found_before = 0;
    for (uint32_t q = lo; q < hi; q++) {
        uint32_t b = desc ? n_bins - 1 - q : q;
        uint64_t next = run + (v32 ? v32[b] : v64[b]);
        if (next >= target) {
            found = q;
            found_before = run;
            break;
        }
        run = next;
    }
    uint32_t q = block_min_u32(found, st);
    if (q != NONE && found == q) {
        st->u64[0] = found_before;
    }
    __syncthreads();
    *before = q != NONE ? st->u64[0] : 0;
    __syncthreads();
    if (q == NONE)
        return NONE;
    return desc ? n_bins - 1 - q : q;
}

#endif
