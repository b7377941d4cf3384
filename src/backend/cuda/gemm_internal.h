/*
 * Inside the batch-invariant GEMM (its interface is gemm.h): what its files share -- gemm.cu
 * (the skinny kernel, the entry points), gemm_tiled.cu (the tiled kernel) and gemm_plan.cu
 * (which way each GEMM runs a step: the tiled kernel's shapes, the plans tuned at start-up, the
 * scratch they need).
 */
#ifndef CLLM_BACKEND_CUDA_GEMM_INTERNAL_H
#define CLLM_BACKEND_CUDA_GEMM_INTERNAL_H

#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm.h"

#include <stddef.h>
#include <stdint.h>

/* The tiled kernel's shapes by name (gemm_tiled.cu's tiling structs, for the host). */
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

#define CHUNK 32 /* K elements per step of either kernel: two MMAs */

/* Lets the tiled kernel of shape `id` take its ring of shared memory (gemm_tiled.cu). */
cudaError_t cllm_cuda_gemm_prepare_tiling(int id);

#ifdef CLLM_HAVE_MMA

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

/* The way a GEMM of this shape runs a step of n tokens: the plan tuned for it, else the
 * default way (gemm_plan.cu). */
gemm_way cllm_cuda_gemm_way_for(int32_t N, int32_t K, int32_t n);

/* One GEMM of checked operands, the way given (gemm.cu). */
cudaError_t cllm_cuda_gemm_launch(bool paired, const gemm_way &way, const gemm_call &a, int32_t n);

/* --- the scratch's layout, and which ways it lets run --- */

/* Does this way run the slices in parallel blocks for a step of n tokens (given the scratch)? */
static inline bool runs_parallel(const gemm_way &w, int32_t N, int32_t K, int32_t n)
{
    return w.parallel && n > CLLM_CUDA_GEMM_SKINNY_MAX && cllm_cuda_gemm_slices(N, K) > 1;
}

/* The scratch: CLLM_CUDA_GEMM_COUNT_BYTES of counts (split skinny tiles: one per row tile),
 * then the partial sums of either kernel. */
static inline size_t parallel_scratch(int32_t N, int32_t K, int32_t n)
{
    return CLLM_CUDA_GEMM_COUNT_BYTES +
           (size_t)cllm_cuda_gemm_slices(N, K) * (size_t)n * (size_t)N * sizeof(float);
}

static inline float *scratch_partials(void *scratch)
{
    return (float *)((char *)scratch + CLLM_CUDA_GEMM_COUNT_BYTES);
}

/* A skinny row tile's slices spread over `parts` blocks: an even share each, and row tiles few
 * enough that one block a tile leaves SMs idle (fewer than about two a SM of an H100/H200) and
 * that each has a count. */
static inline bool split_fits(int32_t N, int32_t K, int parts)
{
    const int64_t tiles = ((int64_t)N + 15) / 16;
    return parts > 1 && cllm_cuda_gemm_slices(N, K) % parts == 0 && tiles < 256 &&
           tiles <= (int64_t)(CLLM_CUDA_GEMM_COUNT_BYTES / sizeof(int32_t));
}

/* Token tiles of 8 the skinny kernel takes for n tokens. */
static inline int32_t skinny_tiles(int32_t n)
{
    return n <= 8 ? 1 : n <= 16 ? 2 : 4;
}

/* Every slice's sums of every row tile ([tile][slice][token tile][4][32] F32). */
static inline size_t split_scratch(int32_t N, int32_t K, int32_t n)
{
    return CLLM_CUDA_GEMM_COUNT_BYTES + (size_t)((N + 15) / 16) *
                                            (size_t)cllm_cuda_gemm_slices(N, K) *
                                            (size_t)skinny_tiles(n) * 4 * 32 * sizeof(float);
}

/* The blocks a skinny step of this way takes a row tile (given the scratch). */
static inline int split_parts(const gemm_way &w, int32_t N, int32_t K, int32_t n,
                              size_t scratch_bytes)
{
    return n <= CLLM_CUDA_GEMM_SKINNY_MAX && split_fits(N, K, w.parts) &&
                   scratch_bytes >= split_scratch(N, K, n)
               ? w.parts
               : 1;
}

/* --- device code both kernels share --- */

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

/* A step of more than CLLM_CUDA_GEMM_SKINNY_MAX tokens, the way given (gemm_tiled.cu). */
cudaError_t cllm_cuda_gemm_launch_tiled(bool paired, const gemm_way &way, const gemm_call &a,
                                        int32_t n);

#endif /* CLLM_HAVE_MMA */

#endif
