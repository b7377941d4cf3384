/* Loads the vendor BLAS at run time (blas.h). The symbol names come from the same macros the
 * headers use (cublasCreate is cublasCreate_v2; in a MUSA build vendor.h renames them), so
 * the names looked up are the ones a link would have used. */
#include "backend/cuda/vendor.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/blas.h"

static void *open_library(char *err, size_t err_len)
{
    void *lib = dlopen(CLLM_BLAS_LIBRARY, RTLD_NOW | RTLD_LOCAL);
#ifdef CLLM_BLAS_DIR
    if (!lib) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", CLLM_BLAS_DIR, CLLM_BLAS_LIBRARY);
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
#endif
    if (!lib)
        snprintf(err, err_len, "cannot open %s: %s", CLLM_BLAS_LIBRARY, dlerror());
    return lib;
}

bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len)
{
    memset(b, 0, sizeof *b);
    void *lib = open_library(err, err_len);
    if (!lib)
        return false;
    struct {
        void **fn;
        const char *name;
    } syms[] = {
        {(void **)&b->create, CLLM_VENDOR_STR(cublasCreate)},
        {(void **)&b->destroy, CLLM_VENDOR_STR(cublasDestroy)},
        {(void **)&b->set_stream, CLLM_VENDOR_STR(cublasSetStream)},
        {(void **)&b->set_workspace, CLLM_VENDOR_STR(cublasSetWorkspace)},
        {(void **)&b->gemm_ex, CLLM_VENDOR_STR(cublasGemmEx)},
        {(void **)&b->status_string, CLLM_VENDOR_STR(cublasGetStatusString)},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].fn = dlsym(lib, syms[i].name);
        if (!*syms[i].fn) {
            snprintf(err, err_len, "%s has no %s", CLLM_BLAS_LIBRARY, syms[i].name);
            dlclose(lib);
            memset(b, 0, sizeof *b);
            return false;
        }
    }
    b->lib = lib;
    return true;
}

void cllm_blas_unload(struct cllm_blas *b)
{
    if (b->lib)
        dlclose(b->lib);
    memset(b, 0, sizeof *b);
}
