/*
 * GPT-2's byte-level alphabet: every byte 0..255 is shown as one printable code point
 * (printable Latin-1 bytes as themselves, the rest as U+0100 + k), so vocabularies store raw
 * bytes as text ("Ġ" is the byte 0x20). These map between the two forms.
 */
#ifndef CLLM_TOKENIZER_BYTELEVEL_H
#define CLLM_TOKENIZER_BYTELEVEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/buf.h"

/* The code point that shows byte b. */
uint32_t cllm_bytelevel_char(uint8_t b);

/* Decodes byte-level text s[0..n) into raw bytes appended to out; false (out unchanged in
 * length) if s holds a code point outside the alphabet or ill-formed UTF-8. */
bool cllm_bytelevel_decode(const char *s, size_t n, struct cllm_buf *out);

/* Appends the byte-level form of raw bytes s[0..n) to out. */
enum cllm_status cllm_bytelevel_encode(const char *s, size_t n, struct cllm_buf *out);

#endif
