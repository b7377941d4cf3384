/* GPT-2's bytes_to_unicode() table in closed form: no state, so threads need no init. */
#include "tokenizer/bytelevel.h"

#include "tokenizer/utf8.h"

static bool printable_as_is(uint32_t b)
{
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* The 68 bytes that are not printable as themselves are 0x00..0x20, 0x7F..0xA0 and 0xAD; in
 * byte order they take U+0100..U+0143. */
uint32_t cllm_bytelevel_char(uint8_t b)
{
    if (printable_as_is(b))
        return b;
    if (b <= 0x20)
        return 0x100u + b;
    if (b <= 0xA0)
        return 0x100u + 33 + (b - 0x7Fu);
    return 0x100u + 67; /* 0xAD */
}

/* Byte shown by code point cp, or -1. */
static int byte_of(uint32_t cp)
{
    if (cp <= 0xFF)
        return printable_as_is(cp) ? (int)cp : -1;
    if (cp < 0x100 + 33)
        return (int)(cp - 0x100);
    if (cp < 0x100 + 67)
        return (int)(cp - 0x100 - 33 + 0x7F);
    if (cp == 0x100 + 67)
        return 0xAD;
    return -1;
}

bool cllm_bytelevel_decode(const char *s, size_t n, struct cllm_buf *out)
{
    size_t start = out->len;
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        bool ok;
        i += cllm_utf8_decode(p + i, n - i, &cp, &ok);
        int b = ok ? byte_of(cp) : -1;
        if (b < 0 || cllm_buf_append_byte(out, (char)b) != CLLM_OK) {
            out->len = start;
            if (out->data)
                out->data[start] = '\0';
            return false;
        }
    }
    return true;
}

enum cllm_status cllm_bytelevel_encode(const char *s, size_t n, struct cllm_buf *out)
{
    for (size_t i = 0; i < n; i++) {
        char enc[4];
        size_t len = cllm_utf8_encode(cllm_bytelevel_char((uint8_t)s[i]), enc);
        enum cllm_status st = cllm_buf_append(out, enc, len);
        if (st)
            return st;
    }
    return CLLM_OK;
}
