/*
 * Widening any stored type to BF16, for devices that compute in BF16: rows are dequantized to
 * F32 (bit-exact with gguf-py, dequant.c) and rounded to nearest even, split over threads so
 * that loading a quantized GGUF onto a GPU takes a fraction of a second per GiB.
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

#ifdef __cplusplus
}
#endif

#endif
