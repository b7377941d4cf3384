/*
 * The stop-string matcher: stops split across chunks, false starts, overlapping and nested
 * stop strings, UTF-8 (Chinese stop strings, characters never split on release), empty lists,
 * flush, a long stream, and random texts in random chunkings against a whole-text oracle.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "core/buf.h"
#include "sampling/stop.h"
#include "test.h"

/* What a matcher released over a whole run. */
struct run {
    struct cllm_buf text;
    bool stopped;
    int32_t which;
    size_t max_held; /* most bytes pushed but not yet released at any point */
};

/* Pushes each chunk, then flushes; collects every release. */
static struct run run_chunks(const char *const *stops, size_t n_stops, const char *const *chunks,
                             const size_t *lens, size_t n_chunks)
{
    struct run r = {.which = -1};
    struct cllm_stop *m;
    if (cllm_stop_new(&m, stops, NULL, n_stops)) {
        CHECK(0);
        return r;
    }
    size_t pushed = 0;
    struct cllm_stop_out out;
    for (size_t i = 0; i < n_chunks; i++) {
        size_t len = lens ? lens[i] : strlen(chunks[i]);
        CHECK(cllm_stop_push(m, chunks[i], len, &out) == CLLM_OK);
        pushed += len;
        CHECK(cllm_buf_append(&r.text, out.text, out.len) == CLLM_OK);
        if (out.stopped) {
            r.stopped = true;
            r.which = out.which;
        } else if (pushed - r.text.len > r.max_held) {
            r.max_held = pushed - r.text.len;
        }
    }
    cllm_stop_flush(m, &out);
    CHECK(cllm_buf_append(&r.text, out.text, out.len) == CLLM_OK);
    CHECK(out.stopped == r.stopped);
    cllm_stop_free(m);
    return r;
}

static bool run_is(struct run *r, const char *text, bool stopped, int32_t which)
{
    bool ok = r->text.len == strlen(text) &&
              memcmp(r->text.data ? r->text.data : "", text, r->text.len) == 0 &&
              r->stopped == stopped && r->which == which;
    if (!ok)
        fprintf(stderr, "  got '%.*s' stopped %d which %d; want '%s' %d %d\n", (int)r->text.len,
                r->text.data ? r->text.data : "", r->stopped, r->which, text, stopped, which);
    cllm_buf_free(&r->text);
    return ok;
}

#define RUN(stops, chunks)                                                                         \
    run_chunks(stops, sizeof stops / sizeof stops[0], chunks, NULL,                                \
               sizeof chunks / sizeof chunks[0])

static void test_basic(void)
{
    /* No stop strings: everything passes straight through, at once. */
    {
        struct cllm_stop *m;
        CHECK(cllm_stop_new(&m, NULL, NULL, 0) == CLLM_OK);
        struct cllm_stop_out out;
        CHECK(cllm_stop_push(m, "hello ", 6, &out) == CLLM_OK);
        CHECK(out.len == 6 && memcmp(out.text, "hello ", 6) == 0 && !out.stopped &&
              out.which == -1);
        CHECK(cllm_stop_push(m, "", 0, &out) == CLLM_OK && out.len == 0);
        CHECK(cllm_stop_push(m, "world", 5, &out) == CLLM_OK);
        CHECK(out.len == 5 && memcmp(out.text, "world", 5) == 0);
        cllm_stop_flush(m, &out);
        CHECK(out.len == 0 && !out.stopped);
        cllm_stop_free(m);
        cllm_stop_free(NULL);
    }
    const char *stop1[] = {"STOP"};
    const char *one[] = {"abcSTOPdef"};
    struct run r = RUN(stop1, one);
    CHECK(run_is(&r, "abc", true, 0));

    /* A stop split across three chunks: the start is held back until decided. */
    const char *im_end[] = {"<|im_end|>"};
    {
        struct cllm_stop *m;
        CHECK(cllm_stop_new(&m, im_end, NULL, 1) == CLLM_OK);
        struct cllm_stop_out out;
        CHECK(cllm_stop_push(m, "Hello <|im", 10, &out) == CLLM_OK);
        CHECK(out.len == 6 && memcmp(out.text, "Hello ", 6) == 0 && !out.stopped);
        CHECK(cllm_stop_push(m, "_e", 2, &out) == CLLM_OK);
        CHECK(out.len == 0 && !out.stopped);
        CHECK(cllm_stop_push(m, "nd|> more", 9, &out) == CLLM_OK);
        CHECK(out.len == 0 && out.stopped && out.which == 0);
        /* After a stop nothing more comes out. */
        CHECK(cllm_stop_push(m, "x", 1, &out) == CLLM_OK);
        CHECK(out.len == 0 && out.stopped && out.which == 0);
        cllm_stop_flush(m, &out);
        CHECK(out.len == 0 && out.stopped);
        /* ...and flush starts a new stream. */
        CHECK(cllm_stop_push(m, "ok<|im_end|>", 12, &out) == CLLM_OK);
        CHECK(out.len == 2 && memcmp(out.text, "ok", 2) == 0 && out.stopped);
        cllm_stop_free(m);
    }
    /* A false start is released once it diverges, including bytes held from earlier chunks. */
    {
        struct cllm_stop *m;
        CHECK(cllm_stop_new(&m, im_end, NULL, 1) == CLLM_OK);
        struct cllm_stop_out out;
        CHECK(cllm_stop_push(m, "a <|im", 6, &out) == CLLM_OK && out.len == 2);
        CHECK(cllm_stop_push(m, "_start", 6, &out) == CLLM_OK);
        CHECK(out.len == 10 && memcmp(out.text, "<|im_start", 10) == 0);
        cllm_stop_free(m);
    }
    /* The stop string ends the text exactly at a chunk end, and held text flushes at the end. */
    const char *c2[] = {"abc", "ST", "OP"};
    r = RUN(stop1, c2);
    CHECK(run_is(&r, "abc", true, 0));
    const char *c3[] = {"abc", "STO"};
    r = RUN(stop1, c3);
    CHECK(run_is(&r, "abcSTO", false, -1));
    const char *c4[] = {"STOP"};
    r = RUN(stop1, c4);
    CHECK(run_is(&r, "", true, 0));
}

static void test_overlaps(void)
{
    /* One stop a prefix of another: the shorter completes first. List order does not matter. */
    const char *nested[] = {"abcd", "ab"};
    const char *t1[] = {"xx", "a", "bcd"};
    struct run r = RUN(nested, t1);
    CHECK(run_is(&r, "xx", true, 1));
    const char *t2[] = {"xxabd"};
    const char *nested2[] = {"abc", "abcd"};
    r = RUN(nested2, t2);
    CHECK(run_is(&r, "xxabd", false, -1));
    /* Two stops ending at the same byte: the longer (earlier start) wins. */
    const char *same_end[] = {"bc", "abc"};
    const char *t3[] = {"xa", "bc"};
    r = RUN(same_end, t3);
    CHECK(run_is(&r, "x", true, 1));
    /* The first to end wins even if another started earlier. */
    const char *cross[] = {"abcd", "bc"};
    const char *t4[] = {"abcd"};
    r = RUN(cross, t4);
    CHECK(run_is(&r, "a", true, 1));
    /* Self-overlapping stops need the automaton's fallback, not a restart. */
    const char *aab[] = {"aab"};
    const char *t5[] = {"a", "a", "a", "b"};
    r = RUN(aab, t5);
    CHECK(run_is(&r, "a", true, 0));
    const char *abab[] = {"abab"};
    const char *t6[] = {"aba", "ab", "ab"};
    r = RUN(abab, t6);
    CHECK(run_is(&r, "aba", true, 0));
    /* Duplicates: the lowest index; empty strings are ignored, not matched everywhere. */
    const char *dup[] = {"", "zz", "zz"};
    const char *t7[] = {"azz"};
    r = RUN(dup, t7);
    CHECK(run_is(&r, "a", true, 1));
    /* Explicit lengths: a stop string holding a NUL byte. */
    {
        const char *s[] = {"a\0b"};
        const size_t lens[] = {3};
        struct cllm_stop *m;
        CHECK(cllm_stop_new(&m, s, lens, 1) == CLLM_OK);
        struct cllm_stop_out out;
        CHECK(cllm_stop_push(m, "xa\0bc", 5, &out) == CLLM_OK);
        CHECK(out.stopped && out.len == 1 && out.text[0] == 'x');
        cllm_stop_free(m);
    }
}

/* Each release must end on a character boundary of valid UTF-8 input. */
static bool ends_on_char(const char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
        if (i + n > len)
            return false;
        i += n;
    }
    return true;
}

static void test_utf8(void)
{
    const char *stops[] = {"你好", "。\n"};
    const char *text = "我说：今天天气很好。然后你好吗";
    /* Byte by byte: every release is whole characters; the stop cuts right before 你好. */
    struct cllm_stop *m;
    CHECK(cllm_stop_new(&m, stops, NULL, 2) == CLLM_OK);
    struct cllm_buf got = {0};
    struct cllm_stop_out out = {0};
    bool whole = true;
    for (size_t i = 0; text[i] && !out.stopped; i++) {
        CHECK(cllm_stop_push(m, text + i, 1, &out) == CLLM_OK);
        whole &= ends_on_char(out.text, out.len);
        CHECK(cllm_buf_append(&got, out.text, out.len) == CLLM_OK);
    }
    CHECK(whole);
    CHECK(out.stopped && out.which == 0);
    const char *want = "我说：今天天气很好。然后";
    CHECK(got.len == strlen(want) && memcmp(got.data, want, got.len) == 0);
    cllm_buf_free(&got);
    cllm_stop_free(m);

    /* A multi-byte stop ending in ASCII: "。" is held until the next chunk decides it. */
    const char *chunks[] = {"很好。", "\n后面"};
    struct run r = RUN(stops, chunks);
    CHECK(run_is(&r, "很好", true, 1));

    /* No stops at all: an incomplete character is still held, then released when complete. */
    CHECK(cllm_stop_new(&m, NULL, NULL, 0) == CLLM_OK);
    CHECK(cllm_stop_push(m, "a\xe4\xbd", 3, &out) == CLLM_OK && out.len == 1);
    CHECK(cllm_stop_push(m, "\xa0", 1, &out) == CLLM_OK && out.len == 3);
    CHECK(memcmp(out.text, "\xe4\xbd\xa0", 3) == 0);
    CHECK(cllm_stop_push(m, "\xf0\x9f", 2, &out) == CLLM_OK && out.len == 0);
    cllm_stop_flush(m, &out); /* the end releases even an incomplete character */
    CHECK(out.len == 2 && memcmp(out.text, "\xf0\x9f", 2) == 0);
    /* Invalid bytes are not held: they can never complete. */
    CHECK(cllm_stop_push(m, "\xff\x80", 2, &out) == CLLM_OK && out.len == 2);
    cllm_stop_free(m);
}

/* A 4 MB stream: releases keep up, and at most the longest stop minus one byte is held. */
static void test_long(void)
{
    const char *stops[] = {"<|endoftext|>", "\n\nHuman:", "<|im_end|>"};
    struct cllm_stop *m;
    CHECK(cllm_stop_new(&m, stops, NULL, 3) == CLLM_OK);
    const char piece[] = "some text <|im_ and \n\nHum then <|endoftext and on ";
    size_t total = 0, released = 0, max_held = 0;
    struct cllm_stop_out out;
    for (int i = 0; i < 80000; i++) {
        CHECK(cllm_stop_push(m, piece, sizeof piece - 1, &out) == CLLM_OK);
        total += sizeof piece - 1;
        released += out.len;
        max_held = total - released > max_held ? total - released : max_held;
        if (out.stopped)
            break;
    }
    CHECK(!out.stopped);
    CHECKF(max_held <= strlen("<|endoftext|>") - 1, "held %zu bytes", max_held);
    CHECK(cllm_stop_push(m, "end<|im_end|>tail", 17, &out) == CLLM_OK);
    released += out.len;
    CHECK(out.stopped && out.which == 2 && released == total + 3);
    cllm_stop_free(m);
}

/* The oracle: on the whole text, the first end position where a stop ends; longest there. */
static void oracle(const char *text, size_t len, const char *const *stops, size_t n, size_t *emit,
                   int32_t *which)
{
    for (size_t e = 1; e <= len; e++) {
        int32_t best = -1;
        for (size_t i = 0; i < n; i++) {
            size_t l = strlen(stops[i]);
            if (l == 0 || l > e || memcmp(text + e - l, stops[i], l) != 0)
                continue;
            if (best < 0 || l > strlen(stops[best]))
                best = (int32_t)i;
        }
        if (best >= 0) {
            *emit = e - strlen(stops[best]);
            *which = best;
            return;
        }
    }
    *emit = len;
    *which = -1;
}

static uint64_t rnd(uint64_t *x)
{
    *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
    return *x >> 33;
}

static void test_random_chunkings(void)
{
    const char *stop_sets[][4] = {
        {"abc", "bca", "cc", "abcab"},
        {"aab", "ab", "baab", ""},
        {"abacaba", "aca", "cab", "bb"},
    };
    uint64_t x = 2024;
    int bad = 0;
    for (int iter = 0; iter < 3000; iter++) {
        const char *const *stops = stop_sets[iter % 3];
        char text[200];
        size_t len = 1 + rnd(&x) % (sizeof text - 1);
        for (size_t i = 0; i < len; i++)
            text[i] = (char)('a' + rnd(&x) % 3);
        size_t want_emit;
        int32_t want_which;
        oracle(text, len, stops, 4, &want_emit, &want_which);

        const char *chunks[400];
        size_t lens[400], n_chunks = 0;
        for (size_t pos = 0; pos < len; n_chunks++) {
            size_t l = rnd(&x) % 6; /* empty chunks too */
            if (l > len - pos || n_chunks == 399)
                l = len - pos;
            chunks[n_chunks] = text + pos;
            lens[n_chunks] = l;
            pos += l;
        }
        struct run r = run_chunks(stops, 4, chunks, lens, n_chunks);
        bool ok = r.text.len == want_emit && memcmp(r.text.data, text, want_emit) == 0 &&
                  r.which == want_which && r.stopped == (want_which >= 0) &&
                  r.max_held <= 6; /* longest stop minus one */
        if (!ok && bad++ < 5)
            fprintf(stderr, "chunking case %d: '%.*s' got %zu/%d want %zu/%d held %zu\n", iter,
                    (int)len, text, r.text.len, r.which, want_emit, want_which, r.max_held);
        cllm_buf_free(&r.text);
    }
    CHECKF(bad == 0, "%d of 3000 chunkings disagree with the oracle", bad);
}

int main(void)
{
    test_basic();
    test_overlaps();
    test_utf8();
    test_long();
    test_random_chunkings();
    return test_summary();
}
