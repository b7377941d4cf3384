/* Emulator stand-in for src/backend/cuda/vendor.h: the CPU emulator's CUDA names. Built with
 * CLLM_EMU_MUSA it takes the MUSA build's configuration instead of sm_80+'s: no tensor-core
 * MMA (every GEMM through the BLAS, attention on CUDA cores, the unfused kernels) and ballots
 * built from shuffles (CLLM_WIDE_WARPS, for 128-thread hardware warps), steps recorded only
 * with CLLM_MUSA_GRAPHS=1. */
#ifndef CLLM_BACKEND_CUDA_VENDOR_H
#define CLLM_BACKEND_CUDA_VENDOR_H
#include "emu.h"

#define CLLM_NOINLINE __attribute__((noinline))

#ifdef CLLM_EMU_MUSA
#define CLLM_WIDE_WARPS 1
#define CLLM_GRAPHS_OPT_IN "CLLM_MUSA_GRAPHS"
#else

/* mma.m16n8k16 (BF16 in, F32 accumulate) as a warp collective, with the fragment layout of the
 * PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"): lane l, g = l / 4,
 * q = l % 4 holds A[g][2q,2q+1], A[g+8][2q,2q+1], A[g][2q+8,2q+9], A[g+8][2q+8,2q+9] (low half
 * first), B[2q,2q+1][g], B[2q+8,2q+9][g], and C/D[g][2q,2q+1], [g+8][2q,2q+1]. The hardware's
 * order of summation is unspecified; here: C, then k = 0..15 in F32. */
#define CLLM_HAVE_MMA 1
static inline void cllm_mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2])
{
    uint64_t a01[32], a23[32], bb[32], c01[32], c23[32];
    emu_warp_exchange(a[0] | (uint64_t)a[1] << 32, a01, EMU_SITE);
    emu_warp_exchange(a[2] | (uint64_t)a[3] << 32, a23, EMU_SITE);
    emu_warp_exchange(b[0] | (uint64_t)b[1] << 32, bb, EMU_SITE);
    emu_warp_exchange(emu_bits(d[0]) | emu_bits(d[1]) << 32, c01, EMU_SITE);
    emu_warp_exchange(emu_bits(d[2]) | emu_bits(d[3]) << 32, c23, EMU_SITE);
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l / 4, q = l % 4;
        const uint32_t r[4] = {(uint32_t)a01[l], (uint32_t)(a01[l] >> 32), (uint32_t)a23[l],
                               (uint32_t)(a23[l] >> 32)};
        for (int i = 0; i < 4; i++) {
            const int row = g + (i & 1) * 8, col = 2 * q + (i >> 1) * 8;
            A[row][col] = __uint_as_float(r[i] << 16);
            A[row][col + 1] = __uint_as_float(r[i] & 0xffff0000u);
        }
        const uint32_t rb[2] = {(uint32_t)bb[l], (uint32_t)(bb[l] >> 32)};
        for (int i = 0; i < 2; i++) {
            B[2 * q + i * 8][g] = __uint_as_float(rb[i] << 16);
            B[2 * q + i * 8 + 1][g] = __uint_as_float(rb[i] & 0xffff0000u);
        }
        C[g][2 * q] = __uint_as_float((uint32_t)c01[l]);
        C[g][2 * q + 1] = __uint_as_float((uint32_t)(c01[l] >> 32));
        C[g + 8][2 * q] = __uint_as_float((uint32_t)c23[l]);
        C[g + 8][2 * q + 1] = __uint_as_float((uint32_t)(c23[l] >> 32));
    }
    const int g = EMU_LANE / 4, q = EMU_LANE % 4;
    for (int e = 0; e < 4; e++) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        float sum = C[row][col];
        for (int k = 0; k < 16; k++)
            sum += A[row][k] * B[k][col];
        d[e] = sum;
    }
}

/* cp.async: the copy is held back until the issuing thread's wait retires its group, so a
 * kernel that reads the tile before cllm_cp_async_wait + __syncthreads sees stale bytes. */
static inline void cllm_cp_async16(void *smem, const void *gmem) { emu_cp_async(smem, gmem, 16); }
static inline void cllm_cp_async_commit(void) { emu_cp_commit(); }
template <int N> static inline void cllm_cp_async_wait(void) { emu_cp_wait(N); }
#endif /* CLLM_EMU_MUSA */

/* Launches run one after the other here, but under TSan a kernel launched this way is
 * ordered after the one before it only from its cllm_pdl_wait on, as programmatic dependent
 * launch allows on sm_90 (emu.cpp). The arguments are captured by value: a captured stream
 * replays the launch later. */
static inline void cllm_pdl_wait(void) { emu_pdl_wait(); }
template <class... KArgs, class... Args>
static cudaError_t cllm_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, Args... args)
{
    emu_launch([=] { kernel(static_cast<KArgs>(args)...); }, grid, block, smem, stream, true,
               (const void *)kernel);
    return cudaSuccess;
}

/* The cuBLAS names backend_cuda.cu and blas.h use (tests/emu/blas_emu.cpp is the library). */
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef struct cublasContext *cublasHandle_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

#include "backend/cuda/portable.h"
#endif
