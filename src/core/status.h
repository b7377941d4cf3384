/*
 * Status names and the error-text convention: parsers take an optional (char *err, size_t
 * err_len) buffer and fill it with one line naming what was wrong; NULL means "don't care".
 */
#ifndef CLLM_CORE_STATUS_H
#define CLLM_CORE_STATUS_H

#include <stddef.h>

#include "cllm.h"

/* A short constant name for a status, e.g. "format error". */
const char *cllm_status_str(enum cllm_status st);

/* Writes a printf-style message into err (if non-NULL) and returns st, so a failing path can
 * `return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: bad magic", path);`. */
enum cllm_status cllm_fail(char *err, size_t err_len, enum cllm_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
