/*
 * The tiled GEMM kernel (gemm.h: the formula; gemm.cu: the skinny kernel and the operand
 * order both share): prefill steps and large batches, blocks of W rows x tokens staged through
 * shared memory, their slices one after the other in the block or in parallel blocks summed in
 * order by a second kernel.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_internal.h"
#include "backend/cuda/kernels.h"

#define VECS (CHUNK / 8) /* 16-byte vectors per row and chunk */

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

#ifdef CLLM_HAVE_MMA

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

cudaError_t cllm_cuda_gemm_prepare_tiling(int id)
{
    if (id == TILING_256X64)
        return allow_ring<tiling_256x64>();
    if (id == TILING_128X128)
        return allow_ring<tiling_128x128>();
    if (id == TILING_256X128)
        return allow_ring<tiling_256x128>();
    return allow_ring<tiling_128x64>();
}
/* A step of more than CLLM_CUDA_GEMM_SKINNY_MAX tokens: the tiled kernel (its slices in
 * parallel blocks when the way says so and the scratch holds them, then summed in order). */
template <bool PAIRED>
static cudaError_t launch_tiled_way(const gemm_way &way, const gemm_call &a, int32_t n)
{
    const int32_t N = a.N, K = a.K, S = cllm_cuda_gemm_slices(N, K);
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

cudaError_t cllm_cuda_gemm_launch_tiled(bool paired, const gemm_way &way, const gemm_call &a,
                                        int32_t n)
{
    return paired ? launch_tiled_way<true>(way, a, n) : launch_tiled_way<false>(way, a, n);
}

#else /* no tensor-core MMA on this vendor: the backend uses its BLAS */

cudaError_t cllm_cuda_gemm_prepare_tiling(int id)
{
    (void)id;
    return cudaSuccess;
}

#endif
