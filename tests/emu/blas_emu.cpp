/* The emulator has no cuBLAS: the CUDA backend under it runs every GEMM through our own
 * kernel (gemm.cu), as it does on a GPU for the shapes that kernel takes. */
#include "backend/cuda/blas.h"

#include <stdio.h>
#include <string.h>

bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len)
{
    memset(b, 0, sizeof *b);
    snprintf(err, err_len, "no cuBLAS under the CUDA emulator");
    return false;
}

void cllm_blas_unload(struct cllm_blas *b)
{
    memset(b, 0, sizeof *b);
}
