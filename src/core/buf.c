/* Growable byte buffer and id vector; capacity doubles so appends are amortised O(1). */
#include "core/buf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

enum cllm_status cllm_buf_reserve(struct cllm_buf *b, size_t extra)
{
    if (extra > SIZE_MAX - b->len - 1)
        return CLLM_ERR_NOMEM;
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return CLLM_OK;
    size_t cap = cllm_grow_cap(b->cap, need, 16);
    char *d = realloc(b->data, cap);
    if (!d)
        return CLLM_ERR_NOMEM;
    b->data = d;
    b->cap = cap;
    return CLLM_OK;
}

enum cllm_status cllm_buf_append(struct cllm_buf *b, const void *data, size_t n)
{
    enum cllm_status st = cllm_buf_reserve(b, n);
    if (st)
        return st;
    if (n)
        memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
    return CLLM_OK;
}

enum cllm_status cllm_buf_append_byte(struct cllm_buf *b, char c)
{
    return cllm_buf_append(b, &c, 1);
}

enum cllm_status cllm_buf_appendf(struct cllm_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return CLLM_ERR_INVALID_ARG;
    enum cllm_status st = cllm_buf_reserve(b, (size_t)n);
    if (st)
        return st;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return CLLM_OK;
}

void cllm_buf_free(struct cllm_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

enum cllm_status cllm_ids_append(struct cllm_ids *ids, const int32_t *v, size_t n)
{
    if (n > SIZE_MAX - ids->n)
        return CLLM_ERR_NOMEM;
    if (ids->n + n > ids->cap) {
        size_t cap = cllm_grow_cap(ids->cap, ids->n + n, 16);
        int32_t *d = cllm_realloc_array(ids->v, cap, sizeof *d);
        if (!d)
            return CLLM_ERR_NOMEM;
        ids->v = d;
        ids->cap = cap;
    }
    if (n)
        memcpy(ids->v + ids->n, v, n * sizeof *v);
    ids->n += n;
    return CLLM_OK;
}

enum cllm_status cllm_ids_push(struct cllm_ids *ids, int32_t id)
{
    return cllm_ids_append(ids, &id, 1);
}

void cllm_ids_free(struct cllm_ids *ids)
{
    free(ids->v);
    ids->v = NULL;
    ids->n = ids->cap = 0;
}
