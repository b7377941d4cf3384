/*
 * Overflow-checked allocation and size arithmetic. Sizes that come from files pass through
 * these so that a lying header yields CLLM_ERR_NOMEM or a format error, never a short buffer.
 */
#ifndef CLLM_CORE_ALLOC_H
#define CLLM_CORE_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* a * b into *out; false on overflow. */
static inline bool cllm_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* a + b into *out; false on overflow. */
static inline bool cllm_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* malloc(n * size), NULL on overflow or failure. n == 0 still returns a unique pointer. */
void *cllm_malloc_array(size_t n, size_t size);
/* calloc with the same contract. */
void *cllm_calloc_array(size_t n, size_t size);
/* realloc(p, n * size), NULL (and p untouched) on overflow or failure. */
void *cllm_realloc_array(void *p, size_t n, size_t size);
/* The capacity a growing array takes to hold need elements: cap doubled (from first when cap
 * is 0) until it does, or need itself where doubling would overflow. */
size_t cllm_grow_cap(size_t cap, size_t need, size_t first);
/* bytes for data read over and over from memory (weight matrices): from 2 MiB on, aligned to
 * 2 MiB and marked for the kernel's transparent huge pages, so that where it has them the
 * bytes lie in physically contiguous 2 MiB pages (one TLB entry each, not 512); smaller ones
 * 64-byte aligned. free() releases it. NULL on overflow or failure. */
void *cllm_alloc_streamed(size_t bytes);
/* A NUL-terminated copy of s[0..n); NULL on failure. */
char *cllm_strndup(const char *s, size_t n);

/*
 * A bump allocator for many small objects with one lifetime (token strings, parsed names).
 * Chunks are never moved, so pointers stay valid until cllm_arena_free.
 */
struct cllm_arena {
    struct cllm_arena_chunk *head; /* newest chunk first */
    size_t chunk_size;             /* default capacity of a new chunk */
};

void cllm_arena_init(struct cllm_arena *a, size_t chunk_size);
/* n bytes aligned to 8; NULL on failure. */
void *cllm_arena_alloc(struct cllm_arena *a, size_t n);
/* A NUL-terminated copy of s[0..n) inside the arena. */
char *cllm_arena_strndup(struct cllm_arena *a, const char *s, size_t n);
void cllm_arena_free(struct cllm_arena *a);

#endif
