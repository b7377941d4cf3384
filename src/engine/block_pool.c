/*
 * Refcounted blocks with an LRU list of the unreferenced ones. Freed blocks without a hash go
 * to the head of the list (reused first, nothing lost); cached blocks go to the tail, so the
 * least recently released cache entry is the first evicted.
 */
#include "engine/block_pool.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

static void list_remove(struct cllm_block_pool *p, int32_t id)
{
    int32_t a = p->prev[id], b = p->next[id];
    if (a >= 0)
        p->next[a] = b;
    else
        p->free_head = b;
    if (b >= 0)
        p->prev[b] = a;
    else
        p->free_tail = a;
    p->prev[id] = p->next[id] = -1;
    p->n_free--;
}

static void list_push_head(struct cllm_block_pool *p, int32_t id)
{
    p->prev[id] = -1;
    p->next[id] = p->free_head;
    if (p->free_head >= 0)
        p->prev[p->free_head] = id;
    else
        p->free_tail = id;
    p->free_head = id;
    p->n_free++;
}

static void list_push_tail(struct cllm_block_pool *p, int32_t id)
{
    p->next[id] = -1;
    p->prev[id] = p->free_tail;
    if (p->free_tail >= 0)
        p->next[p->free_tail] = id;
    else
        p->free_head = id;
    p->free_tail = id;
    p->n_free++;
}

enum cllm_status cllm_block_pool_init(struct cllm_block_pool *p, int32_t n_blocks,
                                      int32_t block_size)
{
    memset(p, 0, sizeof *p);
    if (n_blocks < 1 || block_size < 1)
        return CLLM_ERR_INVALID_ARG;
    p->n_blocks = n_blocks;
    p->block_size = block_size;
    p->refcount = cllm_calloc_array((size_t)n_blocks, sizeof *p->refcount);
    p->hash = cllm_calloc_array((size_t)n_blocks, sizeof *p->hash);
    p->prev = cllm_malloc_array((size_t)n_blocks, sizeof *p->prev);
    p->next = cllm_malloc_array((size_t)n_blocks, sizeof *p->next);
    if (!p->refcount || !p->hash || !p->prev || !p->next ||
        cllm_u64map_reserve(&p->by_hash, (size_t)n_blocks)) {
        cllm_block_pool_free(p);
        return CLLM_ERR_NOMEM;
    }
    p->free_head = p->free_tail = -1;
    for (int32_t i = 0; i < n_blocks; i++)
        list_push_tail(p, i);
    return CLLM_OK;
}

void cllm_block_pool_free(struct cllm_block_pool *p)
{
    free(p->refcount);
    free(p->hash);
    free(p->prev);
    free(p->next);
    cllm_u64map_free(&p->by_hash);
    memset(p, 0, sizeof *p);
}

uint64_t cllm_block_hash(uint64_t parent, const int32_t *tokens, int32_t block_size)
{
    uint64_t h = parent ^ 0x9E3779B97F4A7C15ULL;
    h ^= cllm_hash_bytes(tokens, (size_t)block_size * sizeof *tokens) + (h << 6) + (h >> 2);
    return h ? h : 1;
}

int32_t cllm_block_pool_available(const struct cllm_block_pool *p)
{
    return p->n_free;
}

int32_t cllm_block_pool_alloc(struct cllm_block_pool *p)
{
    int32_t id = p->free_head;
    if (id < 0)
        return -1;
    list_remove(p, id);
    if (p->hash[id]) { /* evicted from the prefix cache */
        cllm_u64map_del(&p->by_hash, p->hash[id]);
        p->hash[id] = 0;
    }
    p->refcount[id] = 1;
    return id;
}

int32_t cllm_block_pool_lookup(struct cllm_block_pool *p, uint64_t hash)
{
    p->prefix_queries++;
    uint64_t v;
    if (!cllm_u64map_get(&p->by_hash, hash, &v))
        return -1;
    int32_t id = (int32_t)v;
    if (p->refcount[id]++ == 0)
        list_remove(p, id);
    p->prefix_hits++;
    return id;
}

void cllm_block_pool_publish(struct cllm_block_pool *p, int32_t id, uint64_t hash)
{
    uint64_t v;
    if (p->hash[id] || cllm_u64map_get(&p->by_hash, hash, &v))
        return; /* already published, or an identical block is cached: this one stays private */
    if (cllm_u64map_put(&p->by_hash, hash, (uint64_t)id) == CLLM_OK)
        p->hash[id] = hash;
}

void cllm_block_pool_release(struct cllm_block_pool *p, int32_t id)
{
    if (id < 0 || id >= p->n_blocks || p->refcount[id] <= 0)
        return;
    if (--p->refcount[id] > 0)
        return;
    if (p->hash[id])
        list_push_tail(p, id); /* cached: evicted last */
    else
        list_push_head(p, id); /* plain free: reused first */
}

int32_t cllm_block_pool_in_use(const struct cllm_block_pool *p)
{
    return p->n_blocks - p->n_free;
}
