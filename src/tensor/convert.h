/*
 * Re-encoding stored weights at load, rows split over threads so that a GiB takes a fraction of
 * a second: widening any stored type to BF16, for devices that compute in BF16 (rows are
 * dequantized to F32, bit-exact with gguf-py, dequant.c, and rounded to nearest even); and
 * quantizing float weights to Q6_K, for the CPU's 8-bit matmuls (--cpu-weights q6_k).
 */
#ifndef CLLM_TENSOR_CONVERT_H
#define CLLM_TENSOR_CONVERT_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[r][0..ne[0]) = BF16 bits of rows [row0, row0 + n_rows) of t, viewed as a matrix of ne[0]-
 * element rows, on up to n_threads threads (<= 1: the calling thread). False if t's type
 * cannot be widened or the rows are out of range (dst is then partly written). */
bool cllm_convert_rows_bf16(const struct cllm_tensor *t, int64_t row0, int64_t n_rows,
                            uint16_t *dst, int n_threads);

/* One row of n floats (n a multiple of 256) as n / 256 Q6_K blocks (tensor/quant.h): per
 * sub-block of 16 a scale s = amax / 31, stored as an int8 multiple sc of the block's F16
 * scale d (max(s) / 127 rounded up to an F16); each element q = x / (d * sc) clamped to
 * [-32, 31] and rounded to nearest (ties to even). A plain quantizer (ggml's also searches
 * each sub-block's scale): per element the error is at most max(amax of its 16 / 62 + d / 4,
 * 15.5 d). False, dst then partly written, if a value is not finite or d does not fit an F16. */
bool cllm_quantize_row_q6_k(const float *x, int64_t n, void *dst);

/* dst = rows [row0, row0 + n_rows) of t (any float or quantized type, dequantized first) as
 * Q6_K rows of ne[0] / 256 blocks, on up to n_threads threads. False if ne[0] is not a
 * multiple of 256, t cannot be dequantized, the rows are out of range or a row cannot be
 * quantized (cllm_quantize_row_q6_k). */
bool cllm_convert_rows_q6_k(const struct cllm_tensor *t, int64_t row0, int64_t n_rows, void *dst,
                            int n_threads);

#ifdef __cplusplus
}
#endif

#endif
