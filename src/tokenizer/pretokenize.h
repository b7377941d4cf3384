/*
 * The Qwen2 pre-tokenizer: splits text into the pieces that BPE then encodes separately,
 * exactly as the regex of Qwen2's tokenizer.json (HF "Split", behavior "Isolated") does:
 *
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*
 *   |\s*[\r\n]+|\s+(?!\S)|\s+
 *
 * Hand-written as a scanner over code points (Unicode classes from utf8proc) rather than run
 * through a regex engine: it is the tokenizer's hot loop, and the one regex is all we need.
 * tests/tokenizer/test_pretokenize.c checks it against PCRE2 running the regex itself.
 */
#ifndef CLLM_TOKENIZER_PRETOKENIZE_H
#define CLLM_TOKENIZER_PRETOKENIZE_H

#include <stddef.h>

/* Called once per piece, in order; a non-zero return stops the split and is passed back. */
typedef int (*cllm_piece_fn)(const char *piece, size_t len, void *ctx);

/* Splits valid UTF-8 text s[0..n) into pieces. Returns 0, or the callback's non-zero value. */
int cllm_pretokenize_qwen2(const char *s, size_t n, cllm_piece_fn fn, void *ctx);

#endif
