/*
 * UTF-8 decoding with the replacement policy of Python's bytes.decode("utf-8", "replace")
 * (Unicode's "maximal subpart" practice): each maximal prefix of a well-formed sequence that
 * is cut short, and each byte that cannot start one, becomes one U+FFFD. Text that reaches the
 * tokenizer is sanitised this way, so invalid input tokenizes exactly as HF does on the
 * replaced string.
 */
#ifndef CLLM_TOKENIZER_UTF8_H
#define CLLM_TOKENIZER_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/buf.h"

#define CLLM_UTF8_REPLACEMENT 0xFFFDu

/* Decodes one code point from s[0..n) (n >= 1). Returns the bytes consumed (1..4) and sets
 * *cp; an ill-formed sequence sets *cp = U+FFFD, *valid = false and consumes its maximal
 * subpart (at least one byte). */
size_t cllm_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp, bool *valid);

/* Encodes cp (<= 0x10FFFF, not a surrogate) into out; returns 1..4, or 0 for an invalid cp. */
size_t cllm_utf8_encode(uint32_t cp, char out[4]);

/* True if s[0..n) is well-formed UTF-8. */
bool cllm_utf8_valid(const char *s, size_t n);

/* Appends s[0..n) to out with every ill-formed subpart replaced by U+FFFD (EF BF BD). */
enum cllm_status cllm_utf8_sanitize(const char *s, size_t n, struct cllm_buf *out);

/* Length of the longest prefix of s[0..n) that does not end inside a sequence which is still
 * well-formed so far but incomplete: the bytes after it may be completed by later input. */
size_t cllm_utf8_complete_prefix(const char *s, size_t n);

#endif
