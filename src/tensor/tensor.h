/*
 * A non-owning view of an n-dimensional tensor, ggml-style: ne[0] is the innermost
 * (contiguous) dimension, so a [rows][cols] matrix has ne = {cols, rows}. Safetensors shapes
 * are outermost-first and are reversed on load, so both formats describe the same bytes.
 */
#ifndef CLLM_TENSOR_TENSOR_H
#define CLLM_TENSOR_TENSOR_H

#include <stdint.h>

#include "tensor/dtype.h"

#define CLLM_MAX_DIMS 4

struct cllm_tensor {
    const char *name;        /* borrowed; lives as long as the file that owns the tensor */
    enum cllm_dtype dtype;   /* element type */
    int n_dims;              /* 1..CLLM_MAX_DIMS */
    int64_t ne[CLLM_MAX_DIMS]; /* elements per dimension, innermost first; unused dims are 1 */
    uint64_t nbytes;         /* total bytes of data */
    const void *data;        /* borrowed (usually mmap'd); nbytes long */
};

/* Number of elements (product of ne); tensors are validated on load so this cannot overflow. */
static inline int64_t cllm_tensor_nelements(const struct cllm_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < CLLM_MAX_DIMS; i++)
        n *= t->ne[i];
    return n;
}

/* Rows of a tensor viewed as a 2-D matrix of ne[0]-element rows. */
static inline int64_t cllm_tensor_nrows(const struct cllm_tensor *t)
{
    return cllm_tensor_nelements(t) / t->ne[0];
}

#endif
