/*
 * Byte-pair merging: a piece's bytes start as single-byte tokens, and the adjacent pair with
 * the lowest merge rank is merged (leftmost first among equal ranks) until no pair has a
 * merge, as HF tokenizers' BPE model does.
 */
#ifndef CLLM_TOKENIZER_BPE_H
#define CLLM_TOKENIZER_BPE_H

#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "core/buf.h"
#include "core/hashmap.h"

struct cllm_bpe {
    struct cllm_u64map merges; /* (left << 32 | right) -> (rank << 32 | merged id) */
    int32_t byte_id[256];      /* token of each single byte; -1 until set */
    int32_t n_merges;          /* merges added; the next one gets this rank */
};

void cllm_bpe_init(struct cllm_bpe *b);
/* Adds a merge of ranks n_merges; a repeated pair takes the later rank (as HF does). */
enum cllm_status cllm_bpe_add_merge(struct cllm_bpe *b, int32_t left, int32_t right, int32_t merged);
/* Appends the ids of piece[0..n) to out. Every byte_id must be set. */
enum cllm_status cllm_bpe_encode(const struct cllm_bpe *b, const uint8_t *piece, size_t n,
                                 struct cllm_ids *out);
void cllm_bpe_free(struct cllm_bpe *b);

#endif
