/*
 * Stand-in for the MUSA SDK's mublas.h (tests/tools/test_musa_frontend.py), declarations only
 * (the check compiles, it does not link). What public code shows of muBLAS: cuBLAS's names
 * with mu/MU for cu/CU; mublasGemmEx is a C++ overload set, called by llama.cpp with a
 * musaDataType_t as its compute type (MUSA_R_32F) and exported also with a
 * mublasComputeType_t (MUBLAS_COMPUTE_32F_FAST_16F exists), so both are declared: a call or
 * an address taken must pick one. The enumerators' values are not the SDK's; nothing here
 * depends on them.
 */
#ifndef CLLM_MUSA_STANDIN_MUBLAS_H
#define CLLM_MUSA_STANDIN_MUBLAS_H
#include <stddef.h>

#include "musa_runtime.h"

typedef cudaDataType_t musaDataType_t;
#define MUSA_R_16BF CUDA_R_16BF
#define MUSA_R_32F CUDA_R_32F

typedef enum {
    MUBLAS_STATUS_SUCCESS = 0,
    MUBLAS_STATUS_NOT_INITIALIZED = 1,
    MUBLAS_STATUS_ALLOC_FAILED = 3,
    MUBLAS_STATUS_INVALID_VALUE = 7
} mublasStatus_t;
typedef struct mublasContext *mublasHandle_t;
typedef enum { MUBLAS_OP_N = 0, MUBLAS_OP_T = 1, MUBLAS_OP_C = 2 } mublasOperation_t;
typedef enum { MUBLAS_DEFAULT_MATH = 0, MUBLAS_MATH_MODE_DEFAULT = 0 } mublasMath_t;
typedef enum { MUBLAS_COMPUTE_32F = 68, MUBLAS_COMPUTE_32F_FAST_16F = 74 } mublasComputeType_t;
typedef enum { MUBLAS_GEMM_DEFAULT = -1 } mublasGemmAlgo_t;

mublasStatus_t mublasCreate(mublasHandle_t *handle);
mublasStatus_t mublasDestroy(mublasHandle_t handle);
mublasStatus_t mublasSetStream(mublasHandle_t handle, musaStream_t stream);
mublasStatus_t mublasSetMathMode(mublasHandle_t handle, mublasMath_t mode);
mublasStatus_t mublasGemmEx(mublasHandle_t handle, mublasOperation_t transa,
                            mublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, musaDataType_t Atype, int lda, const void *B,
                            musaDataType_t Btype, int ldb, const void *beta, void *C,
                            musaDataType_t Ctype, int ldc, musaDataType_t computeType,
                            mublasGemmAlgo_t algo);
mublasStatus_t mublasGemmEx(mublasHandle_t handle, mublasOperation_t transa,
                            mublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, musaDataType_t Atype, int lda, const void *B,
                            musaDataType_t Btype, int ldb, const void *beta, void *C,
                            musaDataType_t Ctype, int ldc, mublasComputeType_t computeType,
                            mublasGemmAlgo_t algo);

#endif
