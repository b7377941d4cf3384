/* Overflow-checked allocators and the arena (a singly linked list of chunks). */
#include "core/alloc.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

void *cllm_malloc_array(size_t n, size_t size)
{
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes))
        return NULL;
    return malloc(bytes ? bytes : 1);
}

void *cllm_alloc_streamed(size_t bytes)
{
    const size_t huge = (size_t)2 << 20, align = bytes < huge ? 64 : huge;
    if (bytes > SIZE_MAX - huge)
        return NULL;
    /* posix_memalign: aligned_alloc (C11) wants the size a multiple of the alignment */
    void *p = NULL;
    if (posix_memalign(&p, align, bytes ? (bytes + 63) / 64 * 64 : 64) != 0)
        return NULL;
    /* Before the first touch, which is when the kernel picks the page size; whole 2 MiB pages
     * only, so that the tail (up to 2 MiB - 4 KiB past the last) takes 4 KiB pages rather than
     * a huge one mostly unused. A hint: a kernel without transparent huge pages (or with them
     * off) gives 4 KiB pages, as to malloc. */
    if (p && align == huge)
        (void)madvise(p, bytes / huge * huge, MADV_HUGEPAGE);
    return p;
}

void *cllm_calloc_array(size_t n, size_t size)
{
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes))
        return NULL;
    return calloc(bytes ? n : 1, bytes ? size : 1);
}

void *cllm_realloc_array(void *p, size_t n, size_t size)
{
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes))
        return NULL;
    return realloc(p, bytes ? bytes : 1);
}

size_t cllm_grow_cap(size_t cap, size_t need, size_t first)
{
    if (!cap)
        cap = first ? first : 1;
    while (cap < need) {
        if (cap > SIZE_MAX / 2)
            return need;
        cap *= 2;
    }
    return cap;
}

char *cllm_strndup(const char *s, size_t n)
{
    if (n == SIZE_MAX)
        return NULL;
    char *d = malloc(n + 1);
    if (!d)
        return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

struct cllm_arena_chunk {
    struct cllm_arena_chunk *next;
    size_t used, cap;
    _Alignas(8) unsigned char data[];
};

void cllm_arena_init(struct cllm_arena *a, size_t chunk_size)
{
    a->head = NULL;
    a->chunk_size = chunk_size ? chunk_size : 64 * 1024;
}

void *cllm_arena_alloc(struct cllm_arena *a, size_t n)
{
    if (n > SIZE_MAX - 8)
        return NULL;
    n = (n + 7) & ~(size_t)7;
    struct cllm_arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > a->chunk_size ? n : a->chunk_size;
        if (cap > SIZE_MAX - sizeof *c)
            return NULL;
        c = malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->used = 0;
        c->cap = cap;
        c->next = a->head;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

char *cllm_arena_strndup(struct cllm_arena *a, const char *s, size_t n)
{
    if (n == SIZE_MAX)
        return NULL;
    char *d = cllm_arena_alloc(a, n + 1);
    if (!d)
        return NULL;
    if (n)
        memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

void cllm_arena_free(struct cllm_arena *a)
{
    struct cllm_arena_chunk *c = a->head;
    while (c) {
        struct cllm_arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}
