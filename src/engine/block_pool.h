/*
 * The KV cache's block allocator with prefix caching (vLLM v1's KV cache manager, in C).
 *
 * The cache is n_blocks blocks of block_size token slots. A block is free, in use (refcount >
 * 0: held by that many requests' block tables) or cached (refcount 0 but holding a full block
 * of known tokens, findable by its hash and evictable, least recently released first).
 * A full block's hash covers (parent block's hash, its block_size tokens), so equal hashes
 * mean equal whole prefixes: requests sharing a prompt prefix (every /predict prompt shares
 * the ChatML system prompt) share its blocks instead of recomputing them.
 */
#ifndef CLLM_ENGINE_BLOCK_POOL_H
#define CLLM_ENGINE_BLOCK_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "cllm.h"
#include "core/hashmap.h"

struct cllm_block_pool {
    int32_t n_blocks;
    int32_t block_size;
    int32_t *refcount;  /* [n_blocks] */
    uint64_t *hash;     /* [n_blocks] hash of the full block's prefix; 0 = not cached */
    /* Blocks with refcount 0, in eviction order (a doubly linked list: head is evicted first);
     * never-used blocks come first, then cached blocks from least to most recently released. */
    int32_t *prev, *next; /* [n_blocks], -1 terminates */
    int32_t free_head, free_tail;
    int32_t n_free;       /* blocks with refcount 0 (free or cached) */
    struct cllm_u64map by_hash; /* hash -> block id of cached or in-use full blocks */
    /* statistics for /metrics */
    uint64_t prefix_queries, prefix_hits; /* blocks looked up / found by allocate_prefix */
};

enum cllm_status cllm_block_pool_init(struct cllm_block_pool *p, int32_t n_blocks,
                                      int32_t block_size);
void cllm_block_pool_free(struct cllm_block_pool *p);

/* Hash of a full block: chains the parent's hash with the block's tokens. Never 0. */
uint64_t cllm_block_hash(uint64_t parent, const int32_t *tokens, int32_t block_size);

/* Blocks that can be handed out now (free or evictable). */
int32_t cllm_block_pool_available(const struct cllm_block_pool *p);

/* Takes one block for exclusive use (evicting the least recently used cached block if
 * needed); -1 if none is available. */
int32_t cllm_block_pool_alloc(struct cllm_block_pool *p);

/* Looks up the cached block holding the prefix whose last full block has this hash; on a hit
 * takes a reference and returns its id, else -1. Counts the query for the hit rate. */
int32_t cllm_block_pool_lookup(struct cllm_block_pool *p, uint64_t hash);

/* Marks block id (held by the caller, now full of tokens) as the block with this hash, so
 * later requests can find it. If another block already has the hash nothing changes. */
void cllm_block_pool_publish(struct cllm_block_pool *p, int32_t id, uint64_t hash);

/* Drops one reference; at zero the block becomes free (no hash) or cached (with one). */
void cllm_block_pool_release(struct cllm_block_pool *p, int32_t id);

/* Number of blocks with refcount > 0 (for usage metrics and leak checks). */
int32_t cllm_block_pool_in_use(const struct cllm_block_pool *p);

#endif
