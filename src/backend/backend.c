/* The backend registry: the only file that knows which backends are compiled in. */
#include "backend/backend.h"

#include <stdlib.h>

#include "backend/cpu/backend_cpu.h"
#include "backend/fault.h"
#ifdef CLLM_USE_CUDA
#include "backend/cuda/backend_cuda.h"
#endif
#include "core/log.h"
#include "core/status.h"

static enum cllm_status backend_new(struct cllm_backend **out, const struct cllm_backend_options *o,
                                    char *err, size_t err_len)
{
    *out = NULL;
    switch (o->kind) {
    case CLLM_BACKEND_CPU:
        return cllm_backend_cpu_new(out, o, err, err_len);
    case CLLM_BACKEND_CUDA:
#ifdef CLLM_USE_CUDA
        return cllm_backend_cuda_new(out, o->device, o->gemm_on_cores, err, err_len);
#else
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "this cllm was built without CUDA (configure with -DCLLM_CUDA=ON)");
#endif
    case CLLM_BACKEND_AUTO: {
#ifdef CLLM_USE_CUDA
        /* no device at all is the normal case on a CPU machine; a device that fails to
         * start is worth a warning */
        char why[256] = "";
        enum cllm_status st =
            cllm_backend_cuda_new(out, o->device, o->gemm_on_cores, why, sizeof why);
        if (st == CLLM_OK)
            return CLLM_OK;
        cllm_log(st == CLLM_ERR_UNSUPPORTED ? CLLM_LOG_INFO : CLLM_LOG_WARN,
                 "backend: no GPU (%s): running on the CPU", why);
#endif
        return cllm_backend_cpu_new(out, o, err, err_len);
    }
    }
    return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "unknown backend kind %d", (int)o->kind);
}

bool cllm_backend_gpu_possible(void)
{
#ifdef CLLM_USE_CUDA
    return true;
#else
    const char *trigger = getenv("CLLM_FAULT_FILE"), *name = getenv("CLLM_FAULT_NAME");
    return trigger && *trigger && name && *name;
#endif
}

enum cllm_status cllm_backend_new(struct cllm_backend **out, const struct cllm_backend_options *o,
                                  char *err, size_t err_len)
{
    enum cllm_status st = backend_new(out, o, err, err_len);
    /* Tests of a lost device (fault.h): the device fails once this file exists. A backend
     * asked for as the CPU by name is never wrapped: it is where a lost GPU's work goes. */
    const char *trigger = getenv("CLLM_FAULT_FILE");
    if (st || !trigger || !*trigger || o->kind == CLLM_BACKEND_CPU)
        return st;
    if ((st = cllm_backend_fault_wrap(out, trigger))) {
        cllm_backend_free(*out);
        *out = NULL;
        return cllm_fail(err, err_len, st, "out of memory");
    }
    return CLLM_OK;
}

void cllm_backend_free(struct cllm_backend *be)
{
    if (be)
        be->iface->free(be);
}

enum cllm_status cllm_backend_alloc_zeroed(struct cllm_backend *be, size_t bytes, void **out)
{
    const struct cllm_backend_iface *i = be->iface;
    if (i->alloc_zeroed)
        return i->alloc_zeroed(be, bytes, out);
    enum cllm_status st = i->alloc(be, bytes, out);
    if (!st && (st = i->memzero(be, *out, bytes))) {
        i->dealloc(be, *out);
        *out = NULL;
    }
    return st;
}

size_t cllm_backend_elem_size(enum cllm_dtype t)
{
    switch (t) {
    case CLLM_DTYPE_F32:
        return 4;
    case CLLM_DTYPE_F16:
    case CLLM_DTYPE_BF16:
        return 2;
    default:
        return 0;
    }
}
