/*
 * Open-addressing hash maps with linear probing, for read-mostly tables built at load time:
 *   cllm_strmap: byte-string keys (borrowed: the caller keeps them alive) -> uint64 values
 *   cllm_u64map: uint64 keys -> uint64 values (e.g. a BPE merge pair (left << 32 | right))
 * The table doubles when it is more than half full. Only the u64 map deletes (backward-shift
 * deletion, so no tombstones): the prefix cache forgets evicted blocks.
 */
#ifndef CLLM_CORE_HASHMAP_H
#define CLLM_CORE_HASHMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"

struct cllm_strmap {
    struct cllm_strmap_slot *slots; /* [cap]; key == NULL marks an empty slot */
    size_t cap;                     /* power of two */
    size_t len;                     /* occupied slots */
};

/* Sizes the table for n entries up front, so loading a known number of keys never rehashes. */
enum cllm_status cllm_strmap_reserve(struct cllm_strmap *m, size_t n);
/* Inserts or overwrites key[0..n) -> value. The key bytes are borrowed, not copied. */
enum cllm_status cllm_strmap_put(struct cllm_strmap *m, const char *key, size_t n, uint64_t value);
/* True and *value filled if key[0..n) is present. */
bool cllm_strmap_get(const struct cllm_strmap *m, const char *key, size_t n, uint64_t *value);
void cllm_strmap_free(struct cllm_strmap *m);

struct cllm_u64map {
    struct cllm_u64map_slot *slots; /* [cap] */
    size_t cap;                     /* power of two */
    size_t len;                     /* occupied slots */
};

enum cllm_status cllm_u64map_reserve(struct cllm_u64map *m, size_t n);
enum cllm_status cllm_u64map_put(struct cllm_u64map *m, uint64_t key, uint64_t value);
bool cllm_u64map_get(const struct cllm_u64map *m, uint64_t key, uint64_t *value);
/* Removes key; false if it was not there. */
bool cllm_u64map_del(struct cllm_u64map *m, uint64_t key);
void cllm_u64map_free(struct cllm_u64map *m);

/* 64-bit hash of n bytes (FNV-1a folded through a final avalanche). */
uint64_t cllm_hash_bytes(const void *data, size_t n);

#endif
