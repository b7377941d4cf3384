/*
 * CPU matrix multiplication: y = x * W^T for weights of any dtype of dtype.h, the hot path of
 * inference. Quantized weights are multiplied with activations quantized to 8 bits once per
 * call (Q8_K-style 256-blocks for K-quants, Q8_0-style 32-blocks for legacy types); float
 * weights (F32/F16/BF16) with f32 activations and f32 accumulation in a fixed order, except
 * BF16 weights on a CPU with AVX-512 BF16: with activations rounded to BF16 once per call, as
 * transformers' BF16 GEMMs take them (twice the products per instruction).
 * Results depend neither on the thread count nor on the batch: a token's row is bit-identical
 * whether it is computed alone or with others. Kernels are chosen once, at first use, by CPU
 * feature detection (AVX-512 F/BW/VL, with VNNI and/or BF16, on top of AVX2+FMA+F16C, else
 * AVX2 with AVX-VNNI, else AVX2 alone, else portable scalar code); the environment variable
 * CLLM_CPU_ISA (scalar, avx2, avxvnni, avx512, avx512vnni, avx512bf16) picks a slower family.
 */
#ifndef CLLM_BACKEND_CPU_MATMUL_H
#define CLLM_BACKEND_CPU_MATMUL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/cpu/attend.h"
#include "backend/cpu/threadpool.h"
#include "cllm.h"
#include "tensor/tensor.h"

/* Bytes of scratch cllm_cpu_matmul needs for n_tokens rows of K activations against weights of
 * type wtype with the kernels now chosen (0 for float weights, but BF16 ones where
 * cllm_cpu_matmul_bf16_activations); 0 also for arguments cllm_cpu_matmul would reject. */
size_t cllm_cpu_matmul_scratch_size(enum cllm_dtype wtype, int64_t K, int64_t n_tokens);

/*
 * y[t][n] = sum_k w[n][k] * x[t][k] for t < n_tokens, n < N, where w is a weight tensor with
 * ne = {K, N} (rows of K elements, any dtype of dtype.h), x is F32 [n_tokens][K] (row stride K),
 * y is F32 [n_tokens][ldy] with ldy >= N. Work is split over the pool's threads (tp may be NULL:
 * the caller alone). scratch: at least cllm_cpu_matmul_scratch_size bytes, any alignment.
 * CLLM_ERR_INVALID_ARG for a bad shape or dtype, K not a multiple of the block size, a tensor
 * shorter than its shape, or too little scratch; n_tokens == 0 does nothing.
 */
enum cllm_status cllm_cpu_matmul(struct cllm_threadpool *tp, const struct cllm_tensor *w,
                                 const float *x, int64_t n_tokens, float *y, int64_t ldy,
                                 void *scratch, size_t scratch_size);

/* Whether the kernel family now chosen multiplies a matrix of this dtype and shape (K-element
 * rows, N of them) faster packed (pack_x16.h: Q4_K or Q6_K, 16 rows at a time; N a multiple of
 * 16): the CPU backend then packs it at load and multiplies it with cllm_cpu_matmul_packed. */
bool cllm_cpu_matmul_packs(enum cllm_dtype t, int64_t K, int64_t N);
/* cllm_cpu_matmul for a matrix packed by cllm_x16_pack (w's dtype, shape and size as the
 * file's; its data packed): the same results, bit for bit, under any kernel family. */
enum cllm_status cllm_cpu_matmul_packed(struct cllm_threadpool *tp, const struct cllm_tensor *w,
                                        const float *x, int64_t n_tokens, float *y, int64_t ldy,
                                        void *scratch, size_t scratch_size);

/* Which kernel family runs ("avx512bf16", "avx512vnni", "avx512", "avx2", "scalar"), for logs. */
const char *cllm_cpu_matmul_isa(void);
/* Whether BF16 weights are multiplied with activations rounded to BF16 (the avx512bf16 family). */
bool cllm_cpu_matmul_bf16_activations(void);
/* Uses the kernel family named isa, or this CPU's fastest for NULL (tests and benchmarks); false,
 * changing nothing, where this CPU cannot run it. Not to be called while a matmul runs. */
bool cllm_cpu_matmul_use_isa(const char *isa);
/* The chosen family's attention kernel for one item and its SiLU (attend.h): the same family
 * as the matmul's, so CLLM_CPU_ISA and cllm_cpu_matmul_use_isa choose them too. */
void cllm_cpu_attend(const struct cllm_attend_item *it);
void cllm_cpu_silu_mul(const float *gate, const float *up, int64_t n, float *out);
/* Whether float kernels ask for the next rows early where a call's rows are not in the caches yet
 * (struct cllm_act_view's weights_cold; on by default): off only for benchmarks to compare. */
void cllm_cpu_matmul_fetch_ahead(bool on);

#endif
