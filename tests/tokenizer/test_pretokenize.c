/*
 * The hand-written Qwen2 pre-tokenizer against PCRE2 running the regex itself, on hand-picked
 * strings and on 200,000 random strings over an alphabet of class boundaries.
 *
 * One translation: Oniguruma (HF tokenizers' engine) takes \s as Unicode White_Space, which
 * includes U+0085; PCRE2's UCP \s does not, so the oracle spells \s out as that set.
 */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/buf.h"
#include "tokenizer/pretokenize.h"
#include "test.h"

#define WS "\\t\\n\\x0b\\f\\r\\x{85}\\p{Z}"
static const char ORACLE[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                             "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*|[" WS "]*[\\r\\n]+"
                             "|[" WS "]+(?![^" WS "])|[" WS "]+";

static pcre2_code *re;
static pcre2_match_data *md;

/* Pieces as "len:bytes|" records, so two splits compare as strings. */
static int record(const char *piece, size_t len, void *ctx)
{
    struct cllm_buf *b = ctx;
    cllm_buf_appendf(b, "%zu:", len);
    cllm_buf_append(b, piece, len);
    cllm_buf_append_byte(b, '|');
    return 0;
}

static void oracle_split(const char *s, size_t n, struct cllm_buf *out)
{
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (rc < 0 || ov[0] != pos || ov[1] == ov[0]) {
            /* Every code point starts a match of this regex, so this never happens. */
            cllm_buf_append(out, "NOMATCH", 7);
            return;
        }
        record(s + ov[0], ov[1] - ov[0], out);
        pos = ov[1];
    }
}

static int mismatches;

static void compare(const char *s, size_t n)
{
    struct cllm_buf got = {0}, want = {0};
    cllm_pretokenize_qwen2(s, n, record, &got);
    oracle_split(s, n, &want);
    bool same = got.len == want.len && (got.len == 0 || memcmp(got.data, want.data, got.len) == 0);
    if (!same && mismatches++ < 5)
        fprintf(stderr, "split differs for \"%.*s\":\n  ours:   %s\n  oracle: %s\n", (int)n, s,
                got.data ? got.data : "", want.data ? want.data : "");
    CHECK(same);
    cllm_buf_free(&got);
    cllm_buf_free(&want);
}

static void test_known(void)
{
    /* Expected splits, worked out from the regex by hand. */
    struct {
        const char *in, *out;
    } cases[] = {
        {"Hello world", "5:Hello|6: world|"},
        {"  two spaces", "1: |4: two|7: spaces|"},
        {"it's 42", "2:it|2:'s|1: |1:4|1:2|"},
        {"a\n\n b", "1:a|2:\n\n|2: b|"},
        {"x  \n  y", "1:x|3:  \n|1: |2: y|"},
        {"end   ", "3:end|3:   |"},
        {"!!!\n\nok", "5:!!!\n\n|2:ok|"},
        {" ?foo", "2: ?|3:foo|"},
        {"\tTab", "4:\tTab|"},
        {"中文abc 123", "9:中文abc|1: |1:1|1:2|1:3|"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct cllm_buf got = {0};
        cllm_pretokenize_qwen2(cases[i].in, strlen(cases[i].in), record, &got);
        CHECKF(got.data && strcmp(got.data, cases[i].out) == 0, "\"%s\" -> %s", cases[i].in,
               got.data ? got.data : "(nothing)");
        cllm_buf_free(&got);
        compare(cases[i].in, strlen(cases[i].in));
    }
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

static void test_random(void)
{
    static const char *const alphabet[] = {
        " ", " ", "\n", "\r", "\t", "\x0b", "\x0c", "a", "B", "z", "7", "0", "'", "s", "S", "t",
        "r", "e", "V", "l", "L", "d", "m", "M", ".", "!", "-", "_", "\xc2\x85" /* U+0085 */,
        "\xc2\xa0" /* NBSP */, "\xe3\x80\x80" /* ideographic space */, "\xe2\x80\xa8", "中",
        "é", "\xcc\x81" /* combining acute */, "😀", "²", "Ⅷ", "٣", "\xc5\xbf" /* long s */,
        "\xe2\x80\x8b" /* ZWSP, Cf */, "ß", "<", "|", "\x01",
    };
    const size_t na = sizeof alphabet / sizeof alphabet[0];
    int before = test_failed;
    for (int iter = 0; iter < 200000 && test_failed - before < 5; iter++) {
        char s[256];
        size_t n = 0;
        int len = 1 + (int)rnd(16);
        for (int k = 0; k < len; k++) {
            const char *a = alphabet[rnd((uint32_t)na)];
            size_t l = strlen(a);
            memcpy(s + n, a, l);
            n += l;
        }
        compare(s, n);
    }
}

int main(void)
{
    int errcode;
    PCRE2_SIZE erroff;
    re = pcre2_compile((PCRE2_SPTR)ORACLE, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &errcode,
                       &erroff, NULL);
    if (!re) {
        fprintf(stderr, "oracle regex does not compile at %zu\n", (size_t)erroff);
        return 1;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    md = pcre2_match_data_create_from_pattern(re, NULL);
    test_known();
    test_random();
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return test_summary();
}
