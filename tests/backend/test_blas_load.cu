/* cuBLAS is opened at run time (src/backend/cuda/blas.cu): where the toolkit is installed (any
 * machine that builds the CUDA backend, CI included), it must load and resolve every function
 * it calls. No GPU is needed to load a library. */
#include "backend/cuda/vendor.h"

#include <stdio.h>

#include "backend/cuda/blas.h"

int main(void)
{
    struct cllm_blas b;
    char err[512] = "";
    if (!cllm_blas_load(&b, err, sizeof err)) {
        printf("FAIL: %s\n", err);
        return 1;
    }
    int missing =
        !b.create + !b.destroy + !b.set_stream + !b.set_workspace + !b.gemm_ex + !b.status_string;
    const char *ok = b.status_string ? b.status_string(CUBLAS_STATUS_SUCCESS) : NULL;
    printf("%s loaded, %d functions missing, status 0 reads \"%s\"\n", CLLM_BLAS_LIBRARY, missing,
           ok ? ok : "(none)");
    cllm_blas_unload(&b);
    if (missing || !ok || b.lib) {
        printf("FAIL\n");
        return 1;
    }
    return 0;
}
