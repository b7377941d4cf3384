/* Binds the vendor BLAS (blas.h). cuBLAS is opened at run time: the symbol names come from
 * the same macros the headers use (cublasCreate is cublasCreate_v2), so the names looked up
 * are the ones a link would have used. muBLAS is linked instead: its mublasGemmEx is a C++
 * overload set (the SDK exports it with C++ linkage, so no C name finds it), and taking its
 * address as our pointer type lets the compiler pick the overload that takes a
 * mublasComputeType_t. A build without the BLAS (CLLM_NO_BLAS) finds none: our GEMM on CUDA
 * cores does every GEMM there. */
#include "backend/cuda/vendor.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/blas.h"

#if defined(CLLM_NO_BLAS)

bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len)
{
    memset(b, 0, sizeof *b);
    snprintf(err, err_len, "built without the vendor BLAS (CLLM_MUSA_BLAS=OFF)");
    return false;
}

void cllm_blas_unload(struct cllm_blas *b)
{
    memset(b, 0, sizeof *b);
}

#elif defined(CLLM_MUSA)

bool cllm_blas_load(struct cllm_blas *b, char *err, size_t err_len)
{
    (void)err, (void)err_len;
    memset(b, 0, sizeof *b);
    b->create = cublasCreate;
    b->destroy = cublasDestroy;
    b->set_stream = cublasSetStream;
    b->gemm_ex = cublasGemmEx;
    /* no workspace call and no status text: neither is in llama.cpp's MUSA map, the one
     * known to build against the SDK */
    return true;
}

void cllm_blas_unload(struct cllm_blas *b)
{
    memset(b, 0, sizeof *b);
}

#else

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
        bool optional;
    } syms[] = {
        {(void **)&b->create, CLLM_VENDOR_STR(cublasCreate), false},
        {(void **)&b->destroy, CLLM_VENDOR_STR(cublasDestroy), false},
        {(void **)&b->set_stream, CLLM_VENDOR_STR(cublasSetStream), false},
        /* optional: without it a recording that needs cuBLAS to allocate fails, and the
         * model runs its steps unrecorded */
        {(void **)&b->set_workspace, CLLM_VENDOR_STR(cublasSetWorkspace), true},
        {(void **)&b->gemm_ex, CLLM_VENDOR_STR(cublasGemmEx), false},
        {(void **)&b->status_string, CLLM_VENDOR_STR(cublasGetStatusString), false},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].fn = dlsym(lib, syms[i].name);
        if (!*syms[i].fn && !syms[i].optional) {
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

#endif
