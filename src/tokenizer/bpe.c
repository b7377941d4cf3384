/*
 * The merge loop keeps, for each adjacent pair of symbols, its merge rank; each round scans
 * for the lowest rank, merges that pair and looks up only the two pairs that changed. That is
 * O(n^2) integer compares but O(n) hash lookups per piece, and pieces are short (a word, a
 * run of CJK characters), so it beats a heap in practice.
 */
#include "tokenizer/bpe.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

#define NO_MERGE UINT64_MAX

void cllm_bpe_init(struct cllm_bpe *b)
{
    memset(&b->merges, 0, sizeof b->merges);
    for (int i = 0; i < 256; i++)
        b->byte_id[i] = -1;
    b->n_merges = 0;
}

enum cllm_status cllm_bpe_add_merge(struct cllm_bpe *b, int32_t left, int32_t right, int32_t merged)
{
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    uint64_t val = (uint64_t)(uint32_t)b->n_merges << 32 | (uint32_t)merged;
    enum cllm_status st = cllm_u64map_put(&b->merges, key, val);
    if (st == CLLM_OK)
        b->n_merges++;
    return st;
}

/* (rank << 32 | merged id) of the pair, or NO_MERGE. */
static uint64_t pair_merge(const struct cllm_bpe *b, int32_t left, int32_t right)
{
    uint64_t v;
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    return cllm_u64map_get(&b->merges, key, &v) ? v : NO_MERGE;
}

enum cllm_status cllm_bpe_encode(const struct cllm_bpe *b, const uint8_t *piece, size_t n,
                                 struct cllm_ids *out)
{
    if (n == 0)
        return CLLM_OK;
    if (n == 1)
        return cllm_ids_push(out, b->byte_id[piece[0]]);

    /* Small pieces (nearly all) live on the stack. */
    enum { STACK_SYMS = 128 };
    int32_t sym_stack[STACK_SYMS];
    uint64_t merge_stack[STACK_SYMS];
    int32_t *sym = sym_stack;
    uint64_t *merge = merge_stack; /* merge[i]: merge of sym[i] and sym[i+1] */
    if (n > STACK_SYMS) {
        sym = cllm_malloc_array(n, sizeof *sym);
        merge = cllm_malloc_array(n, sizeof *merge);
        if (!sym || !merge) {
            free(sym);
            free(merge);
            return CLLM_ERR_NOMEM;
        }
    }

    size_t len = n;
    for (size_t i = 0; i < n; i++)
        sym[i] = b->byte_id[piece[i]];
    for (size_t i = 0; i + 1 < len; i++)
        merge[i] = pair_merge(b, sym[i], sym[i + 1]);

    for (;;) {
        /* The rank sits in the high 32 bits, so the smallest value is the lowest rank; strict
         * '<' keeps the leftmost of equal ranks. */
        uint64_t best = NO_MERGE;
        size_t at = 0;
        for (size_t i = 0; i + 1 < len; i++) {
            if (merge[i] < best) {
                best = merge[i];
                at = i;
            }
        }
        if (best == NO_MERGE)
            break;
        sym[at] = (int32_t)(uint32_t)best;
        memmove(sym + at + 1, sym + at + 2, (len - at - 2) * sizeof *sym);
        /* merge[] has len - 1 entries; those after the merged pair's right neighbour shift. */
        if (at + 3 < len)
            memmove(merge + at + 1, merge + at + 2, (len - at - 3) * sizeof *merge);
        len--;
        if (at > 0)
            merge[at - 1] = pair_merge(b, sym[at - 1], sym[at]);
        if (at + 1 < len)
            merge[at] = pair_merge(b, sym[at], sym[at + 1]);
    }

    enum cllm_status st = cllm_ids_append(out, sym, len);
    if (sym != sym_stack) {
        free(sym);
        free(merge);
    }
    return st;
}

void cllm_bpe_free(struct cllm_bpe *b)
{
    cllm_u64map_free(&b->merges);
}
