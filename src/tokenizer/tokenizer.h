/*
 * The Qwen2 byte-level BPE tokenizer, the way HF tokenizers runs Qwen2's tokenizer.json:
 *   1. added tokens (<|im_start|>, <|endoftext|>, ...) are matched in the raw text first,
 *      leftmost-longest, and never go through BPE;
 *   2. the text between them is sanitised (invalid UTF-8 -> U+FFFD, see utf8.h), optionally
 *      NFC-normalised, and split by the Qwen2 pre-tokenizer (pretokenize.h);
 *   3. each piece's bytes are merged by BPE rank (bpe.h) into vocabulary ids.
 * Decoding maps ids back to bytes; cllm_detok_stream never emits half a UTF-8 character.
 *
 * A tokenizer is built by a loader (model/vocab_load.c: tokenizer.json or GGUF metadata)
 * through the builder calls below and is immutable, so threads may share it, once finished.
 */
#ifndef CLLM_TOKENIZER_TOKENIZER_H
#define CLLM_TOKENIZER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "core/buf.h"

enum cllm_token_kind {
    CLLM_TOKEN_NORMAL = 0, /* a BPE vocabulary entry (text in byte-level form) */
    CLLM_TOKEN_SPECIAL,    /* added token, special (control): <|im_start|>, <|endoftext|> */
    CLLM_TOKEN_ADDED,      /* added token, not special: matched in text, kept when decoding */
    CLLM_TOKEN_UNUSED,     /* a padding slot of the embedding matrix: never produced by encode */
};

enum cllm_normalizer {
    CLLM_NORMALIZER_NONE = 0,
    CLLM_NORMALIZER_NFC,
};

struct cllm_tokenizer;

/* --- building (loaders only) --- */

/* An empty tokenizer with n_vocab id slots (ids 0..n_vocab-1). */
enum cllm_status cllm_tokenizer_new(struct cllm_tokenizer **out, int32_t n_vocab);
/* Sets token id. NORMAL and UNUSED text is in byte-level form ("Ġthe"), added tokens are raw
 * text. Errors name the token when its text is not valid byte-level form. */
enum cllm_status cllm_tokenizer_set_token(struct cllm_tokenizer *t, int32_t id, const char *text,
                                          size_t len, enum cllm_token_kind kind, char *err,
                                          size_t err_len);
/* Appends the next merge (rank = number of merges added before it); both sides are
 * byte-level token texts. */
enum cllm_status cllm_tokenizer_add_merge(struct cllm_tokenizer *t, const char *left, size_t llen,
                                          const char *right, size_t rlen, char *err,
                                          size_t err_len);
void cllm_tokenizer_set_normalizer(struct cllm_tokenizer *t, enum cllm_normalizer norm);
/* Checks completeness (every id set, all 256 byte tokens present) and builds the lookup
 * tables. No builder call may follow. */
enum cllm_status cllm_tokenizer_finish(struct cllm_tokenizer *t, char *err, size_t err_len);
void cllm_tokenizer_free(struct cllm_tokenizer *t);

/* --- using --- */

int32_t cllm_tokenizer_n_vocab(const struct cllm_tokenizer *t);
int32_t cllm_tokenizer_n_merges(const struct cllm_tokenizer *t);
enum cllm_normalizer cllm_tokenizer_normalizer(const struct cllm_tokenizer *t);
enum cllm_token_kind cllm_tokenizer_kind(const struct cllm_tokenizer *t, int32_t id);
/* The id of an added token's exact text (e.g. "<|im_end|>"), or -1. */
int32_t cllm_tokenizer_find_added(const struct cllm_tokenizer *t, const char *text);
/* Raw bytes a token decodes to (*len set); NULL for an id out of range. */
const char *cllm_tokenizer_token_bytes(const struct cllm_tokenizer *t, int32_t id, size_t *len);

/* Appends the ids of text[0..n) (any bytes; invalid UTF-8 is replaced) to ids. Added tokens in
 * the text are recognised; nothing else (no BOS) is added. */
enum cllm_status cllm_tokenize(const struct cllm_tokenizer *t, const char *text, size_t n,
                               struct cllm_ids *ids);

/* Appends the bytes of ids to out. Special tokens are skipped when skip_special is true.
 * Invalid ids give CLLM_ERR_RANGE. Bytes are raw: a sequence cut mid-character stays cut. */
enum cllm_status cllm_detokenize(const struct cllm_tokenizer *t, const int32_t *ids, size_t n,
                                 bool skip_special, struct cllm_buf *out);

/* Incremental decoding for streaming: feed ids one at a time; text comes out only in whole
 * UTF-8 characters. Ill-formed bytes come out as U+FFFD, like HF's lossy decode. */
struct cllm_detok_stream {
    const struct cllm_tokenizer *tok; /* borrowed; must outlive the stream */
    bool skip_special;
    char pending[8]; /* bytes of an unfinished character */
    size_t n_pending;
};

void cllm_detok_stream_init(struct cllm_detok_stream *s, const struct cllm_tokenizer *t,
                            bool skip_special);
/* Appends the text that became complete with token id to out (maybe nothing). */
enum cllm_status cllm_detok_stream_push(struct cllm_detok_stream *s, int32_t id,
                                        struct cllm_buf *out);
/* Appends what is left (an unfinished character becomes U+FFFD) and resets the stream. */
enum cllm_status cllm_detok_stream_flush(struct cllm_detok_stream *s, struct cllm_buf *out);

#endif
