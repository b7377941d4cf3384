/*
 * The GEMM on CUDA cores: y[t] = W x[t] (+ bias), BF16 W [N][K] and x [n][K], F32 sums and
 * output, batch-invariant, with no tensor-core instruction and no library. What runs every GEMM
 * where neither the tensor-core GEMM (gemm.h: needs mma.sync) nor the vendor BLAS can: a build
 * without MMA (MUSA) whose BLAS is not there (built with CLLM_MUSA_BLAS=OFF, or the library
 * missing at run time) or computes wrong at the start-up probe. A deployment then keeps its GPU
 * rather than moving to the CPU, ~20x slower. CLLM_GEMM_SIMT=1 takes it on any build (for
 * comparison, and for its tests on the CUDA configuration).
 *
 * The formula, one per output element whatever the step:
 *
 *   y[t][i] = (tree of the 32 lane sums L_0 .. L_31) + bias[i]
 *   L_l     = the fmaf chain, from zero, over K's 8-element vectors v = l, l + 32, l + 64, ...
 *             in order, each vector's elements 8v .. 8v + 7 in order
 *   tree    = a butterfly: each lane adds the lane 16 apart, then 8, 4, 2, 1 (every lane ends
 *             with the same bits: a + b is b + a)
 *
 * Nothing in it depends on the other rows or tokens of the step or on which warp computes it,
 * so a token's row has the same bits in any batch. It is not the tensor-core GEMM's formula
 * (the two differ in the last bits); a process uses one of them throughout.
 */
#ifndef CLLM_BACKEND_CUDA_GEMM_SIMT_H
#define CLLM_BACKEND_CUDA_GEMM_SIMT_H

#include "backend/cuda/vendor.h"

#include <stdint.h>

/* Operands it takes: K a positive multiple of 8, w and x 16-byte aligned (every row is then). */
int cllm_cuda_gemm_simt_supported(const void *w, const void *x, int32_t K);

/* y[t][0..N) = W x_t (+ bias) for t < n, rows ldy apart; nothing else of y is written.
 * cudaErrorInvalidValue for operands it does not take. */
cudaError_t cllm_cuda_gemm_simt(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                                const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy,
                                cudaStream_t stream);

#endif
