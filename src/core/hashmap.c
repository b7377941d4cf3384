/* Linear-probing maps. Load factor stays <= 1/2, so probes are short and lookups need no tombstones. */
#include "core/hashmap.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

struct cllm_strmap_slot {
    const char *key;
    size_t n;
    uint64_t hash;
    uint64_t value;
};

struct cllm_u64map_slot {
    uint64_t key;
    uint64_t value;
    bool used;
};

static uint64_t mix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

uint64_t cllm_hash_bytes(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ULL;
    size_t i = 0;
    /* Eight bytes at a time, then the tail: keys are short but hashing sits on the tokenizer's hot path. */
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ULL;
    return mix64(h ^ n);
}

static enum cllm_status strmap_resize(struct cllm_strmap *m, size_t cap)
{
    struct cllm_strmap_slot *slots = cllm_calloc_array(cap, sizeof *slots);
    if (!slots)
        return CLLM_ERR_NOMEM;
    for (size_t i = 0; i < m->cap; i++) {
        struct cllm_strmap_slot *s = &m->slots[i];
        if (!s->key)
            continue;
        size_t j = s->hash & (cap - 1);
        while (slots[j].key)
            j = (j + 1) & (cap - 1);
        slots[j] = *s;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return CLLM_OK;
}

/* The power-of-two capacity that keeps n entries at most half full. */
static size_t cap_for(size_t n)
{
    size_t cap = 64;
    while (cap / 2 < n && cap < SIZE_MAX / 4)
        cap *= 2;
    return cap;
}

enum cllm_status cllm_strmap_reserve(struct cllm_strmap *m, size_t n)
{
    size_t cap = cap_for(m->len > n ? m->len : n);
    return cap > m->cap ? strmap_resize(m, cap) : CLLM_OK;
}

enum cllm_status cllm_strmap_put(struct cllm_strmap *m, const char *key, size_t n, uint64_t value)
{
    if ((m->len + 1) * 2 > m->cap) {
        enum cllm_status st = strmap_resize(m, m->cap ? m->cap * 2 : 64);
        if (st)
            return st;
    }
    uint64_t h = cllm_hash_bytes(key, n);
    size_t j = h & (m->cap - 1);
    for (;; j = (j + 1) & (m->cap - 1)) {
        struct cllm_strmap_slot *s = &m->slots[j];
        if (!s->key) {
            *s = (struct cllm_strmap_slot){.key = key ? key : "", .n = n, .hash = h, .value = value};
            m->len++;
            return CLLM_OK;
        }
        if (s->hash == h && s->n == n && memcmp(s->key, key, n) == 0) {
            s->value = value;
            return CLLM_OK;
        }
    }
}

bool cllm_strmap_get(const struct cllm_strmap *m, const char *key, size_t n, uint64_t *value)
{
    if (!m->cap)
        return false;
    uint64_t h = cllm_hash_bytes(key, n);
    for (size_t j = h & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        const struct cllm_strmap_slot *s = &m->slots[j];
        if (!s->key)
            return false;
        if (s->hash == h && s->n == n && memcmp(s->key, key, n) == 0) {
            if (value)
                *value = s->value;
            return true;
        }
    }
}

void cllm_strmap_free(struct cllm_strmap *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->len = 0;
}

static enum cllm_status u64map_resize(struct cllm_u64map *m, size_t cap)
{
    struct cllm_u64map_slot *slots = cllm_calloc_array(cap, sizeof *slots);
    if (!slots)
        return CLLM_ERR_NOMEM;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->slots[i].used)
            continue;
        size_t j = mix64(m->slots[i].key) & (cap - 1);
        while (slots[j].used)
            j = (j + 1) & (cap - 1);
        slots[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    return CLLM_OK;
}

enum cllm_status cllm_u64map_reserve(struct cllm_u64map *m, size_t n)
{
    size_t cap = cap_for(m->len > n ? m->len : n);
    return cap > m->cap ? u64map_resize(m, cap) : CLLM_OK;
}

enum cllm_status cllm_u64map_put(struct cllm_u64map *m, uint64_t key, uint64_t value)
{
    if ((m->len + 1) * 2 > m->cap) {
        enum cllm_status st = u64map_resize(m, m->cap ? m->cap * 2 : 64);
        if (st)
            return st;
    }
    for (size_t j = mix64(key) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        struct cllm_u64map_slot *s = &m->slots[j];
        if (!s->used) {
            *s = (struct cllm_u64map_slot){.key = key, .value = value, .used = true};
            m->len++;
            return CLLM_OK;
        }
        if (s->key == key) {
            s->value = value;
            return CLLM_OK;
        }
    }
}

bool cllm_u64map_get(const struct cllm_u64map *m, uint64_t key, uint64_t *value)
{
    if (!m->cap)
        return false;
    for (size_t j = mix64(key) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        const struct cllm_u64map_slot *s = &m->slots[j];
        if (!s->used)
            return false;
        if (s->key == key) {
            if (value)
                *value = s->value;
            return true;
        }
    }
}

bool cllm_u64map_del(struct cllm_u64map *m, uint64_t key)
{
    if (!m->cap)
        return false;
    size_t mask = m->cap - 1, j = mix64(key) & mask;
    while (m->slots[j].used && m->slots[j].key != key)
        j = (j + 1) & mask;
    if (!m->slots[j].used)
        return false;
    /* Shift later members of the probe run back over the hole, unless they sit at or after
     * their home slot relative to the hole (moving them would put them before their home). */
    size_t hole = j;
    for (size_t k = (j + 1) & mask; m->slots[k].used; k = (k + 1) & mask) {
        size_t home = mix64(m->slots[k].key) & mask;
        bool movable = hole <= k ? (home <= hole || home > k) : (home <= hole && home > k);
        if (movable) {
            m->slots[hole] = m->slots[k];
            hole = k;
        }
    }
    m->slots[hole].used = false;
    m->len--;
    return true;
}

void cllm_u64map_free(struct cllm_u64map *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->len = 0;
}
