/*
 * Tokenizer pieces without a model: UTF-8 decoding and replacement (expected values are what
 * Python's bytes.decode("utf-8", "replace") gives), the byte-level alphabet, BPE merge order on
 * a toy vocabulary, added-token matching, and the streaming decoder.
 */
#include <string.h>

#include "core/buf.h"
#include "tokenizer/bytelevel.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "test.h"

static void check_sanitize(const char *in, size_t n, const char *want)
{
    struct cllm_buf out = {0};
    CHECK(cllm_utf8_sanitize(in, n, &out) == CLLM_OK);
    CHECKF(out.len == strlen(want) && memcmp(out.data, want, out.len) == 0, "sanitize gave \"%s\"",
           out.data ? out.data : "");
    cllm_buf_free(&out);
}

#define R "\xEF\xBF\xBD" /* U+FFFD */

static void test_utf8(void)
{
    check_sanitize("abc", 3, "abc");
    check_sanitize("a\x80z", 3, "a" R "z");
    check_sanitize("\xe4\xb8", 2, R);                  /* truncated: one U+FFFD */
    check_sanitize("\xe4\xb8z", 3, R "z");
    check_sanitize("\xc0\xaf", 2, R R);                /* C0 never starts a sequence */
    check_sanitize("\xe0\x80\xaf", 3, R R R);          /* E0 needs A0..BF next */
    check_sanitize("\xed\xa0\x80", 3, R R R);          /* surrogates */
    check_sanitize("\xf0\x90\x80", 3, R);              /* truncated 4-byte */
    check_sanitize("\xf4\x90\x80\x80", 4, R R R R);    /* above U+10FFFF */
    check_sanitize("\xf0\x9f\x98\x80", 4, "\xf0\x9f\x98\x80");
    check_sanitize("\xff", 1, R);
    CHECK(cllm_utf8_valid("\xe4\xb8\xad", 3));
    CHECK(!cllm_utf8_valid("\xe4\xb8", 2));

    CHECK(cllm_utf8_complete_prefix("ab\xe4\xb8", 4) == 2);
    CHECK(cllm_utf8_complete_prefix("ab\xe4\xb8\xad", 5) == 5);
    CHECK(cllm_utf8_complete_prefix("ab\xf0\x9f\x98", 5) == 2);
    CHECK(cllm_utf8_complete_prefix("ab\xe4" "x", 4) == 4); /* already invalid: nothing to wait for */
    CHECK(cllm_utf8_complete_prefix("\xe0\x80", 2) == 2);    /* E0 80 can never complete */

    char enc[4];
    CHECK(cllm_utf8_encode(0x4E2D, enc) == 3 && memcmp(enc, "\xe4\xb8\xad", 3) == 0);
    CHECK(cllm_utf8_encode(0xD800, enc) == 0);
    CHECK(cllm_utf8_encode(0x110000, enc) == 0);
}

static void test_bytelevel(void)
{
    CHECK(cllm_bytelevel_char(' ') == 0x120);  /* "Ġ" */
    CHECK(cllm_bytelevel_char('\n') == 0x10A); /* "Ċ" */
    CHECK(cllm_bytelevel_char('a') == 'a');
    CHECK(cllm_bytelevel_char(0xAD) == 0x143);
    struct cllm_buf raw = {0}, back = {0};
    char all[256];
    for (int i = 0; i < 256; i++)
        all[i] = (char)i;
    CHECK(cllm_bytelevel_encode(all, 256, &back) == CLLM_OK);
    CHECK(cllm_bytelevel_decode(back.data, back.len, &raw) && raw.len == 256 &&
          memcmp(raw.data, all, 256) == 0);
    raw.len = 0;
    CHECK(!cllm_bytelevel_decode("\xe4\xb8\xad", 3, &raw) && raw.len == 0); /* 中 is no byte */
    cllm_buf_free(&raw);
    cllm_buf_free(&back);
}

/* A toy vocabulary: all 256 bytes, then merged tokens, then added tokens. */
static struct cllm_tokenizer *toy(void)
{
    static const char *const merged[] = {"ab", "bc", "abc", "ĠĠ", "ĠĠĠĠ", "aa"};
    static const char *const merges[][2] = {{"b", "c"}, {"a", "b"}, {"a", "bc"}, {"Ġ", "Ġ"},
                                            {"ĠĠ", "ĠĠ"}, {"a", "a"}};
    struct cllm_tokenizer *t;
    int n = 256 + 6 + 3;
    if (cllm_tokenizer_new(&t, n))
        return NULL;
    struct cllm_buf b = {0};
    for (int i = 0; i < 256; i++) {
        char c = (char)i;
        b.len = 0;
        cllm_bytelevel_encode(&c, 1, &b);
        cllm_tokenizer_set_token(t, i, b.data, b.len, CLLM_TOKEN_NORMAL, NULL, 0);
    }
    cllm_buf_free(&b);
    for (int i = 0; i < 6; i++)
        CHECK(cllm_tokenizer_set_token(t, 256 + i, merged[i], strlen(merged[i]), CLLM_TOKEN_NORMAL,
                                       NULL, 0) == CLLM_OK);
    cllm_tokenizer_set_token(t, 262, "<|end|>", 7, CLLM_TOKEN_SPECIAL, NULL, 0);
    cllm_tokenizer_set_token(t, 263, "<|end|>x", 8, CLLM_TOKEN_ADDED, NULL, 0);
    cllm_tokenizer_set_token(t, 264, "<pad>", 5, CLLM_TOKEN_UNUSED, NULL, 0);
    for (int i = 0; i < 6; i++)
        CHECK(cllm_tokenizer_add_merge(t, merges[i][0], strlen(merges[i][0]), merges[i][1],
                                       strlen(merges[i][1]), NULL, 0) == CLLM_OK);
    char err[200];
    CHECK(cllm_tokenizer_add_merge(t, "z", 1, "q", 1, err, sizeof err) == CLLM_ERR_FORMAT);
    CHECK(cllm_tokenizer_finish(t, err, sizeof err) == CLLM_OK);
    return t;
}

static void check_ids(const struct cllm_tokenizer *t, const char *text, const int32_t *want,
                      size_t n)
{
    struct cllm_ids ids = {0};
    CHECK(cllm_tokenize(t, text, strlen(text), &ids) == CLLM_OK);
    bool same = ids.n == n && (n == 0 || memcmp(ids.v, want, n * sizeof *want) == 0);
    CHECKF(same, "\"%s\": got %zu ids", text, ids.n);
    cllm_ids_free(&ids);
}

static void test_bpe_and_added(void)
{
    struct cllm_tokenizer *t = toy();
    if (!t) {
        CHECK(!"toy tokenizer");
        return;
    }
    /* "abc": b+c has rank 0, so bc forms first, then a+bc -> abc (not ab + c). */
    check_ids(t, "abc", (int32_t[]){258}, 1);
    check_ids(t, "ab", (int32_t[]){256}, 1);
    /* "aaa": equal ranks merge leftmost first -> aa + a. */
    check_ids(t, "aaa", (int32_t[]){261, 'a'}, 2);
    /* Six spaces then x: the pre-tokenizer gives "     " + " x"; BPE: ĠĠĠĠ + Ġ. */
    check_ids(t, "      x", (int32_t[]){260, ' ', ' ', 'x'}, 4);
    /* Leftmost-longest added tokens; the unused one is never matched. */
    check_ids(t, "a<|end|>xb<|end|>", (int32_t[]){'a', 263, 'b', 262}, 4);
    check_ids(t, "<pad>", (int32_t[]){'<', 'p', 'a', 'd', '>'}, 5);
    check_ids(t, "<|end", (int32_t[]){'<', '|', 'e', 'n', 'd'}, 5);
    check_ids(t, "", NULL, 0);
    CHECK(cllm_tokenizer_find_added(t, "<|end|>") == 262);
    CHECK(cllm_tokenizer_find_added(t, "<pad>") == -1);

    struct cllm_buf out = {0};
    int32_t ids[] = {258, 262, ' '};
    CHECK(cllm_detokenize(t, ids, 3, false, &out) == CLLM_OK && strcmp(out.data, "abc<|end|> ") == 0);
    out.len = 0;
    CHECK(cllm_detokenize(t, ids, 3, true, &out) == CLLM_OK && strcmp(out.data, "abc ") == 0);
    int32_t bad = 9999;
    CHECK(cllm_detokenize(t, &bad, 1, false, &out) == CLLM_ERR_RANGE);

    /* Streaming "中" (E4 B8 AD) one byte-token at a time, then a truncated one. */
    struct cllm_detok_stream s;
    cllm_detok_stream_init(&s, t, true);
    out.len = 0;
    CHECK(cllm_detok_stream_push(&s, 0xE4, &out) == CLLM_OK && out.len == 0);
    CHECK(cllm_detok_stream_push(&s, 0xB8, &out) == CLLM_OK && out.len == 0);
    CHECK(cllm_detok_stream_push(&s, 0xAD, &out) == CLLM_OK && out.len == 3);
    CHECK(cllm_detok_stream_push(&s, 262, &out) == CLLM_OK && out.len == 3); /* special skipped */
    CHECK(cllm_detok_stream_push(&s, 0xE4, &out) == CLLM_OK && out.len == 3);
    CHECK(cllm_detok_stream_push(&s, 'z', &out) == CLLM_OK); /* E4 then z: U+FFFD z */
    CHECK(cllm_detok_stream_push(&s, 0xF0, &out) == CLLM_OK);
    CHECK(cllm_detok_stream_flush(&s, &out) == CLLM_OK);
    CHECKF(strcmp(out.data, "\xe4\xb8\xad" R "z" R) == 0, "stream gave \"%s\"", out.data);
    CHECK(cllm_detok_stream_push(&s, -1, &out) == CLLM_ERR_RANGE);
    cllm_buf_free(&out);
    cllm_tokenizer_free(t);
}

static void test_builder_errors(void)
{
    struct cllm_tokenizer *t;
    char err[200] = "";
    CHECK(cllm_tokenizer_new(&t, 0) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_tokenizer_new(&t, 300) == CLLM_OK);
    CHECK(cllm_tokenizer_set_token(t, 300, "a", 1, CLLM_TOKEN_NORMAL, err, sizeof err) ==
          CLLM_ERR_RANGE);
    CHECK(cllm_tokenizer_set_token(t, 0, "中", 3, CLLM_TOKEN_NORMAL, err, sizeof err) ==
          CLLM_ERR_FORMAT);
    CHECK(strstr(err, "byte-level") != NULL);
    /* an id given twice: the same text again is fine (an added token also in the vocabulary),
     * another text is not (a fuzzed tokenizer.json with a duplicate id made "(" decode as
     * spaces) */
    CHECK(cllm_tokenizer_set_token(t, 7, "(", 1, CLLM_TOKEN_NORMAL, err, sizeof err) == CLLM_OK);
    CHECK(cllm_tokenizer_set_token(t, 7, "(", 1, CLLM_TOKEN_SPECIAL, err, sizeof err) == CLLM_OK);
    CHECK(cllm_tokenizer_set_token(t, 7, "\xc4\xa0", 2, CLLM_TOKEN_NORMAL, err, sizeof err) ==
          CLLM_ERR_FORMAT);
    CHECK(strstr(err, "two different texts") != NULL);
    CHECK(cllm_tokenizer_finish(t, err, sizeof err) == CLLM_ERR_FORMAT); /* ids missing */
    CHECK(strstr(err, "missing") != NULL);
    cllm_tokenizer_free(t);
}

int main(void)
{
    test_utf8();
    test_bytelevel();
    test_bpe_and_added();
    test_builder_errors();
    return test_summary();
}
