/* Status names and the error-text helper shared by every parser. */
#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>

const char *cllm_status_str(enum cllm_status st)
{
    switch (st) {
    case CLLM_OK: return "ok";
    case CLLM_ERR_NOMEM: return "out of memory";
    case CLLM_ERR_IO: return "i/o error";
    case CLLM_ERR_FORMAT: return "format error";
    case CLLM_ERR_UNSUPPORTED: return "unsupported";
    case CLLM_ERR_INVALID_ARG: return "invalid argument";
    case CLLM_ERR_NOT_FOUND: return "not found";
    case CLLM_ERR_RANGE: return "out of range";
    case CLLM_ERR_BUSY: return "busy";
    case CLLM_ERR_DEVICE: return "device error";
    }
    return "unknown status";
}

enum cllm_status cllm_fail(char *err, size_t err_len, enum cllm_status st, const char *fmt, ...)
{
    if (err && err_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return st;
}
