/*
 * Growable arrays: a byte buffer (text, file bytes) and an int32 vector (token ids).
 * Both start zeroed ({0}) and are released with their _free; growth is overflow-checked.
 */
#ifndef CLLM_CORE_BUF_H
#define CLLM_CORE_BUF_H

#include <stddef.h>
#include <stdint.h>

#include "cllm.h"

struct cllm_buf {
    char *data; /* NUL-terminated when len > 0 or after any append */
    size_t len; /* bytes in use, excluding the terminating NUL */
    size_t cap; /* bytes allocated */
};

enum cllm_status cllm_buf_reserve(struct cllm_buf *b, size_t extra);
enum cllm_status cllm_buf_append(struct cllm_buf *b, const void *data, size_t n);
enum cllm_status cllm_buf_append_byte(struct cllm_buf *b, char c);
enum cllm_status cllm_buf_appendf(struct cllm_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void cllm_buf_free(struct cllm_buf *b);

struct cllm_ids {
    int32_t *v; /* token ids */
    size_t n;   /* ids in use */
    size_t cap; /* ids allocated */
};

enum cllm_status cllm_ids_push(struct cllm_ids *ids, int32_t id);
enum cllm_status cllm_ids_append(struct cllm_ids *ids, const int32_t *v, size_t n);
void cllm_ids_free(struct cllm_ids *ids);

#endif
