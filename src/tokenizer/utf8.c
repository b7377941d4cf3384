/*
 * UTF-8 per Unicode Table 3-7 (well-formed byte sequences): the second byte's allowed range
 * depends on the lead byte (E0: A0..BF, ED: 80..9F, F0: 90..BF, F4: 80..8F), which is what
 * rules out overlongs, surrogates and code points above U+10FFFF.
 */
#include "tokenizer/utf8.h"

/* Length of the sequence a lead byte starts (0 if it cannot start one), and the allowed range
 * of the second byte. */
static int lead_info(uint8_t b, uint8_t *lo, uint8_t *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b < 0x80)
        return 1;
    if (b < 0xC2)
        return 0;
    if (b < 0xE0)
        return 2;
    if (b < 0xF0) {
        if (b == 0xE0)
            *lo = 0xA0;
        else if (b == 0xED)
            *hi = 0x9F;
        return 3;
    }
    if (b < 0xF5) {
        if (b == 0xF0)
            *lo = 0x90;
        else if (b == 0xF4)
            *hi = 0x8F;
        return 4;
    }
    return 0;
}

size_t cllm_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp, bool *valid)
{
    uint8_t lo, hi;
    int len = lead_info(s[0], &lo, &hi);
    *valid = false;
    *cp = CLLM_UTF8_REPLACEMENT;
    if (len == 1) {
        *cp = s[0];
        *valid = true;
        return 1;
    }
    if (len == 0)
        return 1;
    uint32_t c = s[0] & (0xFFu >> (len + 1));
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n)
            return (size_t)i; /* cut short by the end of input: the whole prefix is one U+FFFD */
        uint8_t b = s[i];
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h)
            return (size_t)i;
        c = (c << 6) | (b & 0x3Fu);
    }
    *cp = c;
    *valid = true;
    return (size_t)len;
}

size_t cllm_utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF)
        return 0;
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= 0x10FFFF) {
        out[0] = (char)(0xF0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

bool cllm_utf8_valid(const char *s, size_t n)
{
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        i += cllm_utf8_decode(p + i, n - i, &cp, &ok);
        if (!ok)
            return false;
    }
    return true;
}

enum cllm_status cllm_utf8_sanitize(const char *s, size_t n, struct cllm_buf *out)
{
    if (n == 0) /* s may be NULL then (an empty buffer's data): no pointer arithmetic on it */
        return cllm_buf_append(out, "", 0);
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0, run = 0; /* run: start of the current stretch of valid bytes */
    enum cllm_status st = cllm_buf_reserve(out, n);
    if (st)
        return st;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        size_t len = cllm_utf8_decode(p + i, n - i, &cp, &ok);
        if (!ok) {
            if ((st = cllm_buf_append(out, s + run, i - run)) ||
                (st = cllm_buf_append(out, "\xEF\xBF\xBD", 3)))
                return st;
            run = i + len;
        }
        i += len;
    }
    return cllm_buf_append(out, s + run, n - run);
}

size_t cllm_utf8_complete_prefix(const char *s, size_t n)
{
    const uint8_t *p = (const uint8_t *)s;
    /* Only the last 3 bytes can belong to an unfinished sequence. */
    size_t start = n > 3 ? n - 3 : 0;
    for (size_t i = start; i < n; i++) {
        uint8_t lo, hi;
        int len = lead_info(p[i], &lo, &hi);
        if (len <= 1 || i + (size_t)len <= n)
            continue;
        /* A lead byte whose sequence would end past n: incomplete if what is there is valid. */
        uint32_t cp;
        bool ok;
        size_t used = cllm_utf8_decode(p + i, n - i, &cp, &ok);
        if (i + used == n)
            return i;
    }
    return n;
}
