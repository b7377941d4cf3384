/* The vendor BLAS under the CUDA emulator: the four calls blas.h resolves, with cuBLAS's
 * meaning (column-major operands, op(A) m x k, op(B) k x n, C = alpha op(A) op(B) + beta C,
 * F32 accumulation in k order), checked as cuBLAS checks them. The backend uses it where a
 * GPU build would: CLLM_CUBLAS=1, operands our GEMM refuses, and every GEMM of a build without
 * tensor-core MMA (the MUSA configuration, tests/emu's cllm_backend_emu_musa), so the
 * arguments the backend passes are checked against the documented semantics. Faults on
 * demand: EMU_NO_BLAS=1, the loader finds none (a machine without the library);
 * EMU_BLAS_NO_F32_OUT=1, BF16 inputs with an F32 output are not supported (what muBLAS may
 * do); EMU_BLAS_WRONG=1, every result is off by one; EMU_BLAS_SHORT_K=1, sums stop after 16
 * products (right for the backend's start-up probe, wrong for a model's GEMMs: what the
 * engine's device check must catch). */
#include "backend/cuda/blas.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct cublasContext {
    cudaStream_t stream;
};

static bool env_on(const char *name)
{
    const char *v = getenv(name);
    return v && !strcmp(v, "1");
}

static cublasStatus_t emu_create(cublasHandle_t *h)
{
    *h = new cublasContext{NULL};
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t emu_destroy(cublasHandle_t h)
{
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t emu_set_stream(cublasHandle_t h, cudaStream_t s)
{
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t emu_set_workspace(cublasHandle_t, void *, size_t)
{
    return CUBLAS_STATUS_SUCCESS;
}

static float element(const void *p, cudaDataType t, int64_t i)
{
    if (t == CUDA_R_32F)
        return ((const float *)p)[i];
    __nv_bfloat16 h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return __bfloat162float(h);
}

static cublasStatus_t emu_gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                  int m, int n, int k, const void *alpha, const void *A,
                                  cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb,
                                  const void *beta, void *C, cudaDataType ct, int ldc,
                                  cublasComputeType_t compute, cublasGemmAlgo_t)
{
    const bool ok_type =
        (at == CUDA_R_16BF || at == CUDA_R_32F) && bt == at && (ct == CUDA_R_32F || ct == at);
    if (!ok_type || compute != CUBLAS_COMPUTE_32F ||
        (env_on("EMU_BLAS_NO_F32_OUT") && at == CUDA_R_16BF && ct == CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!h || m < 0 || n < 0 || k < 0 || (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) ||
        (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T) || lda < (ta == CUBLAS_OP_N ? m : k) || lda < 1 ||
        ldb < (tb == CUBLAS_OP_N ? k : n) || ldb < 1 || ldc < m || ldc < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    const float a = *(const float *)alpha, b = *(const float *)beta;
    const float off = env_on("EMU_BLAS_WRONG") ? 1.0f : 0.0f;
    const int k_summed = env_on("EMU_BLAS_SHORT_K") && k > 16 ? 16 : k;
    emu_on_stream(h->stream, [=] {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float sum = 0.0f;
                for (int l = 0; l < k_summed; l++) {
                    int64_t ia = ta == CUBLAS_OP_N ? i + (int64_t)l * lda : l + (int64_t)i * lda;
                    int64_t ib = tb == CUBLAS_OP_N ? l + (int64_t)j * ldb : j + (int64_t)l * ldb;
                    sum += element(A, at, ia) * element(B, bt, ib);
                }
                const int64_t ic = i + (int64_t)j * ldc;
                /* C is not read where beta is 0 */
                float r = a * sum + (b != 0.0f ? b * element(C, ct, ic) : 0.0f) + off;
                if (ct == CUDA_R_32F) {
                    ((float *)C)[ic] = r;
                } else {
                    __nv_bfloat16 o = __float2bfloat16_rn(r);
                    memcpy((char *)C + 2 * ic, &o, 2);
                }
            }
    });
    return CUBLAS_STATUS_SUCCESS;
}

static const char *emu_status_string(cublasStatus_t s)
{
    return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "emulated BLAS error";
}

bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len)
{
    memset(b, 0, sizeof *b);
    if (env_on("EMU_NO_BLAS")) {
        snprintf(err, err_len, "no BLAS (EMU_NO_BLAS=1)");
        return false;
    }
    b->create = emu_create;
    b->destroy = emu_destroy;
    b->set_stream = emu_set_stream;
    b->set_workspace = emu_set_workspace;
    b->gemm_ex = emu_gemm_ex;
    b->status_string = emu_status_string;
    return true;
}

void cllm_blas_unload(struct cllm_blas *b)
{
    memset(b, 0, sizeof *b);
}
