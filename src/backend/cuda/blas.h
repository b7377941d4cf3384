/*
 * The vendor BLAS (cuBLAS; muBLAS in a MUSA build), opened at run time with dlopen. Our own
 * GEMM (gemm.cu) does the model's work, so the BLAS is only the fallback for operands that GEMM
 * refuses and the CLLM_CUBLAS=1 comparison; not linking it keeps the binary self-contained: a
 * CUDA build starts without the CUDA libraries (the runtime is linked statically and finds the
 * driver itself).
 */
#ifndef CLLM_BACKEND_CUDA_BLAS_H
#define CLLM_BACKEND_CUDA_BLAS_H

#include "backend/cuda/vendor.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* The functions we call, resolved from the library. */
struct cllm_blas {
    void *lib; /* dlopen's handle; NULL: not loaded, or linked (MUSA, the emulator) */
    cublasStatus_t (*create)(cublasHandle_t *handle);
    cublasStatus_t (*destroy)(cublasHandle_t handle);
    cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
    cublasStatus_t (*set_workspace)(cublasHandle_t handle, void *workspace,
                                    size_t bytes); /* NULL: the library has none */
    cublasStatus_t (*gemm_ex)(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const void *alpha,
                              const void *A, cudaDataType Atype, int lda, const void *B,
                              cudaDataType Btype, int ldb, const void *beta, void *C,
                              cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                              cublasGemmAlgo_t algo);
    const char *(*status_string)(cublasStatus_t status); /* NULL: none (cllm_blas_status) */
};

/* Opens the library (by its soname, then in the toolkit's directory named at build time) and
 * resolves the functions; false with the reason in err when one is missing (set_workspace
 * may be). */
bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len);
void cllm_blas_unload(struct cllm_blas *b);
/* The library's text for s, or "BLAS status N" in buf. */
static inline const char *cllm_blas_status(const struct cllm_blas *b, cublasStatus_t s, char *buf,
                                           size_t len)
{
    if (b->status_string)
        return b->status_string(s);
    snprintf(buf, len, "BLAS status %d", (int)s);
    return buf;
}

#endif
