/*
 * The Qwen2 split regex as a scanner. At each position the alternatives are tried in the
 * regex's order (leftmost-first, like Oniguruma in HF tokenizers); each comment below names
 * the alternative and the backtracking it reproduces. Input must be valid UTF-8 (the
 * tokenizer sanitises first).
 */
#include "tokenizer/pretokenize.h"

#include <stdbool.h>
#include <stdint.h>

#include <utf8proc.h>

#include "tokenizer/utf8.h"

enum cls { C_OTHER, C_LETTER, C_NUMBER, C_SPACE, C_NEWLINE /* \r or \n, also whitespace */ };

/* Classes of ASCII, precomputed: most text is mostly ASCII. */
static enum cls ascii_class(uint32_t c)
{
    if (c == '\r' || c == '\n')
        return C_NEWLINE;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D))
        return C_SPACE;
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')
        return C_LETTER;
    if (c >= '0' && c <= '9')
        return C_NUMBER;
    return C_OTHER;
}

static enum cls classify(uint32_t c)
{
    if (c < 0x80)
        return ascii_class(c);
    /* \s is Unicode White_Space: Zs, Zl, Zp plus U+0085 (the ASCII ones are handled above). */
    if (c == 0x85)
        return C_SPACE;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
        return C_LETTER;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
        return C_NUMBER;
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
        return C_SPACE;
    default:
        return C_OTHER;
    }
}

struct scanner {
    const uint8_t *s;
    size_t n;
};

/* Decodes the code point at byte offset i (< n); sets *next to the offset after it. */
static uint32_t cp_at(const struct scanner *sc, size_t i, size_t *next)
{
    if (sc->s[i] < 0x80) {
        *next = i + 1;
        return sc->s[i];
    }
    uint32_t cp;
    bool ok;
    *next = i + cllm_utf8_decode(sc->s + i, sc->n - i, &cp, &ok);
    return cp;
}

static enum cls cls_at(const struct scanner *sc, size_t i, size_t *next)
{
    return classify(cp_at(sc, i, next));
}

static bool is_space(enum cls c)
{
    return c == C_SPACE || c == C_NEWLINE;
}

/* Lower-cased ASCII letter at i, or 0. Case folding also maps U+017F (long s) to 's'. */
static int fold_at(const struct scanner *sc, size_t i, size_t *next)
{
    if (i >= sc->n)
        return 0;
    uint32_t c = cp_at(sc, i, next);
    if (c == 0x17F)
        return 's';
    if (c < 0x80 && ((c | 0x20) >= 'a' && (c | 0x20) <= 'z'))
        return (int)(c | 0x20);
    return 0;
}

/* Alternative 1: (?i:'s|'t|'re|'ve|'m|'ll|'d). Returns the end offset, or 0 for no match. */
static size_t match_contraction(const struct scanner *sc, size_t i)
{
    if (sc->s[i] != '\'')
        return 0;
    size_t j, k;
    int a = fold_at(sc, i + 1, &j);
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
        return j;
    int b = a ? fold_at(sc, j, &k) : 0;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        return k;
    return 0;
}

/* Skips code points of class `want` from i; returns the end offset. */
static size_t skip_class(const struct scanner *sc, size_t i, enum cls want)
{
    size_t next;
    while (i < sc->n && cls_at(sc, i, &next) == want)
        i = next;
    return i;
}

/* Length of the piece starting at i (always > 0: some alternative matches any code point). */
static size_t next_piece(const struct scanner *sc, size_t i)
{
    size_t end, i1;
    if ((end = match_contraction(sc, i)))
        return end;
    enum cls c0 = cls_at(sc, i, &i1);

    /* Alternative 2: [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (c0 == C_LETTER)
        return skip_class(sc, i1, C_LETTER);
    if (c0 != C_NEWLINE && c0 != C_NUMBER && i1 < sc->n) {
        size_t i2;
        if (cls_at(sc, i1, &i2) == C_LETTER)
            return skip_class(sc, i2, C_LETTER);
    }

    /* Alternative 3: \p{N} (one code point: numbers split digit by digit) */
    if (c0 == C_NUMBER)
        return i1;

    /* Alternative 4: ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    size_t start = i;
    if (sc->s[i] == ' ' && i1 < sc->n) {
        size_t i2;
        if (cls_at(sc, i1, &i2) == C_OTHER)
            start = i1;
    }
    {
        size_t next;
        if (cls_at(sc, start, &next) == C_OTHER) {
            end = skip_class(sc, next, C_OTHER);
            return skip_class(sc, end, C_NEWLINE);
        }
    }

    /* Only whitespace is left (c0 is a space or newline). */
    size_t run_end = i, last_nl_end = 0, next;
    while (run_end < sc->n) {
        enum cls c = cls_at(sc, run_end, &next);
        if (!is_space(c))
            break;
        if (c == C_NEWLINE)
            last_nl_end = next;
        run_end = next;
    }
    /* Alternative 5: \s*[\r\n]+ -- backtracking ends it just after the run's last newline. */
    if (last_nl_end)
        return last_nl_end;
    /* Alternative 6: \s+(?!\S) -- the whole run at the end of text, else all but its last
     * code point (which then starts the next piece, e.g. " " before a word). */
    if (run_end == sc->n)
        return run_end;
    size_t last = i, p = i;
    while (p < run_end) {
        last = p;
        cp_at(sc, p, &p);
    }
    if (last > i)
        return last;
    /* Alternative 7: \s+ */
    return run_end;
}

int cllm_pretokenize_qwen2(const char *s, size_t n, cllm_piece_fn fn, void *ctx)
{
    struct scanner sc = {(const uint8_t *)s, n};
    size_t i = 0;
    while (i < n) {
        size_t end = next_piece(&sc, i);
        int rc = fn(s + i, end - i, ctx);
        if (rc)
            return rc;
        i = end;
    }
    return 0;
}
