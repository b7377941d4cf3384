/*
 * The GEMM on CUDA cores (gemm_simt.h: why, and the formula). A warp computes R rows x T
 * tokens: lane l reads 16-byte vectors l, l + 32, ... of each of its R W rows and T token rows
 * (a warp's reads of a row are 512 consecutive bytes) and keeps R x T running sums; then the
 * butterfly. One kernel for decode steps and prefill: T grows with the step (1, 2, 4, 8 tokens
 * a warp), so a lone token does not pay for 8; which T runs changes the speed, never the bits.
 * No shared memory, no barrier: on a GPU whose hardware warps are 128 threads wide (MUSA's
 * QY2), a block of 4 warps is one of them, and the shuffles name width 32 (warp.h).
 *
 * Not measured on any GPU (written for the MUSA build without a working BLAS, in a session with
 * none): arithmetic says a decode step streams W at what 8 x 512 bytes in flight per warp allow,
 * and a prefill's 8 x 8 tiles do 2 multiply-adds per byte read from L1/L2.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm_simt.h"
#include "backend/cuda/warp.h"

#define SIMT_WARPS 4 /* warps a block: 128 threads */
#define SIMT_ROWS 8  /* W rows a warp */

int cllm_cuda_gemm_simt_supported(const void *w, const void *x, int32_t K)
{
    return K > 0 && K % 8 == 0 && (uintptr_t)w % 16 == 0 && (uintptr_t)x % 16 == 0;
}

/* acc += the products of 8 BF16 pairs, in element order (one fmaf each: BF16 widens exactly). */
static __device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc)
{
    const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(__uint_as_float(av[i] << 16), __uint_as_float(bv[i] << 16), acc);
        acc = fmaf(__uint_as_float(av[i] & 0xffff0000u), __uint_as_float(bv[i] & 0xffff0000u), acc);
    }
    return acc;
}

/* The butterfly of gemm_simt.h over a warp's M sums at once (M a power of two), halving: at
 * step S a lane sends the half of its sums that the lane `off` apart keeps and adds that lane's
 * half of its own, so 64 sums take 32 + 16 + 8 + 4 + 2 shuffles rather than 5 x 64, and each
 * output still gets the butterfly's additions (which lane adds a pair does not change a + b).
 * A template per step, so that every index is a constant and the sums stay in registers (as
 * loops, nvcc put them in local memory). After the last step, sums[0 .. max(M / 32, 1)) hold
 * outputs first + 0, + 1, ... */
template <int M, int S>
static __device__ __forceinline__ void butterfly(float (&sums)[M], int lane, int &first)
{
    static_assert(M > 0 && (M & (M - 1)) == 0, "a power of two");
    if constexpr (S < 5) {
        constexpr int off = CLLM_WARP / 2 >> S, half = (M >> S) / 2;
        if constexpr (half == 0) { /* one sum left: the plain butterfly */
            sums[0] = sums[0] + cllm_shfl_xor(sums[0], off);
        } else {
            const bool upper = (lane & off) != 0;
#pragma unroll
            for (int i = 0; i < half; i++) {
                const float send = upper ? sums[i] : sums[i + half];
                const float keep = upper ? sums[i + half] : sums[i];
                sums[i] = keep + cllm_shfl_xor(send, off);
            }
            first += upper ? half : 0;
        }
        butterfly<M, S + 1>(sums, lane, first);
    }
}

/* Block (x, y): tokens [T * x, +T); rows [SIMT_WARPS * R * y, +SIMT_WARPS * R), warp w the w-th
 * R of them. Tokens in x: the blocks of one row group run next to each other, so its W rows
 * come from memory once and from L2 for the other token groups (rows in x, a 192-token step
 * would stream all of W from memory 24 times). Rows past N and tokens past n read the last
 * row or token (so every load is in bounds and the loop has no branch) and are not written. */
/* (a minimum of one block an SM: with none given, ptxas held the 8 x 4 warp to 96 registers
 * and spilled its sums; so, 192 registers for 8 x 8, 128 for 8 x 4, no spills, sm_90a) */
template <int R, int T>
static __global__ void __launch_bounds__(SIMT_WARPS * 32, 1)
    gemm_simt(const __nv_bfloat16 *__restrict__ w, const float *__restrict__ bias, int32_t N,
              int32_t K, const __nv_bfloat16 *__restrict__ x, int32_t n, float *__restrict__ y,
              int32_t ldy)
{
    cllm_pdl_wait();
    const int lane = (int)threadIdx.x % CLLM_WARP;
    const int64_t row0 = ((int64_t)blockIdx.y * SIMT_WARPS + (int)threadIdx.x / CLLM_WARP) * R;
    const int64_t tok0 = (int64_t)blockIdx.x * T;
    if (row0 >= N) /* the whole warp: nothing below waits for the others */
        return;
    /* where each row starts, in 16-byte vectors from w or x (32 bits: the launcher checks that
     * they fit), rather than 64-bit pointers: 16 registers fewer for a warp of 8 x 8 */
    const uint32_t vecs = (uint32_t)K / 8;
    const uint4 *w4 = (const uint4 *)w, *x4 = (const uint4 *)x;
    uint32_t wr[R], xr[T];
#pragma unroll
    for (int r = 0; r < R; r++)
        wr[r] = (uint32_t)(row0 + r < N ? row0 + r : N - 1) * vecs;
#pragma unroll
    for (int t = 0; t < T; t++)
        xr[t] = (uint32_t)(tok0 + t < n ? tok0 + t : n - 1) * vecs;
    float acc[R * T]; /* output (r, t): acc[r * T + t] */
#pragma unroll
    for (int i = 0; i < R * T; i++)
        acc[i] = 0.0f;
    for (uint32_t v = lane; v < vecs; v += CLLM_WARP) {
        uint4 wv[R], xv[T]; /* every load of the step issued before the first multiply */
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[r] = w4[wr[r] + v];
#pragma unroll
        for (int t = 0; t < T; t++)
            xv[t] = x4[xr[t] + v];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < T; t++)
                acc[r * T + t] = dot8(wv[r], xv[t], acc[r * T + t]);
    }
    int held = 0;
    butterfly<R * T, 0>(acc, lane, held);
    /* sums a lane holds; with fewer sums than lanes, lanes less than `spread` apart hold the same
     * one and the first of them writes it */
    constexpr int per_lane = R * T >= CLLM_WARP ? R * T / CLLM_WARP : 1;
    constexpr int spread = R * T >= CLLM_WARP ? 1 : CLLM_WARP / (R * T);
#pragma unroll
    for (int j = 0; j < per_lane; j++) {
        const int o = held + j, r = o / T, t = o % T;
        const int64_t row = row0 + r, tok = tok0 + t;
        if (lane % spread == 0 && row < N && tok < n)
            y[tok * ldy + row] = bias ? acc[j] + bias[row] : acc[j];
    }
}

template <int T>
static cudaError_t launch(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                          const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy,
                          cudaStream_t stream)
{
    const int64_t rows_a_block = (int64_t)SIMT_WARPS * SIMT_ROWS;
    const int64_t row_groups = (N + rows_a_block - 1) / rows_a_block,
                  token_groups = (n + T - 1) / T;
    if (row_groups > 65535 || token_groups > 0x7fffffff || (int64_t)N * (K / 8) > UINT32_MAX ||
        (int64_t)n * (K / 8) > UINT32_MAX) /* (the kernel's 32-bit offsets: 64 GB and more) */
        return cudaErrorInvalidValue;
    return cllm_launch(gemm_simt<SIMT_ROWS, T>, dim3((unsigned)token_groups, (unsigned)row_groups),
                       dim3(SIMT_WARPS * 32), 0, stream, w, bias, N, K, x, n, y, ldy);
}

cudaError_t cllm_cuda_gemm_simt(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                                const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy,
                                cudaStream_t stream)
{
    if (N < 0 || n < 0 || ldy < N || !cllm_cuda_gemm_simt_supported(w, x, K))
        return cudaErrorInvalidValue;
    if (N == 0 || n == 0)
        return cudaSuccess;
    if (n == 1)
        return launch<1>(w, bias, N, K, x, n, y, ldy, stream);
    if (n == 2)
        return launch<2>(w, bias, N, K, x, n, y, ldy, stream);
    if (n <= 4)
        return launch<4>(w, bias, N, K, x, n, y, ldy, stream);
    return launch<8>(w, bias, N, K, x, n, y, ldy, stream);
}
