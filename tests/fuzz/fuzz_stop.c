/*
 * Fuzz target: stop strings over streamed text (sampling/stop.c), against a plain reference.
 * An input is: a byte k (1 + k % 4 stop strings), then each stop string as a length byte
 * (% 9) and its bytes, then the text. The text is pushed whole, byte by byte, and in chunks
 * of input-derived sizes; every way must release exactly the reference's output: the text up
 * to the first stop string to end in it (ties: the longest, then the lowest index), or all of
 * it, and report the same stop. When the text and the stop strings are valid UTF-8, no
 * released piece may split a character.
 */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>

#include "core/buf.h"
#include "sampling/stop.h"
#include "tokenizer/utf8.h"

const int fuzz_full_stage = 1;

#define MAX_STOPS 4

struct parsed {
    const char *stops[MAX_STOPS];
    size_t lens[MAX_STOPS];
    size_t n_stops;
    const char *text;
    size_t n_text;
};

static bool parse(const uint8_t *d, size_t n, struct parsed *p)
{
    if (n < 1)
        return false;
    p->n_stops = 1 + d[0] % MAX_STOPS;
    size_t at = 1;
    for (size_t i = 0; i < p->n_stops; i++) {
        if (at >= n)
            return false;
        const size_t len = d[at++] % 9;
        if (len > n - at)
            return false;
        p->stops[i] = (const char *)d + at;
        p->lens[i] = len;
        at += len;
    }
    p->text = (const char *)d + at;
    p->n_text = n - at;
    return true;
}

/* The reference: where the output ends (*cut) and which stop string ended it (-1: none). */
static int32_t reference(const struct parsed *p, size_t *cut)
{
    for (size_t end = 1; end <= p->n_text; end++) {
        int32_t best = -1;
        for (size_t i = 0; i < p->n_stops; i++) {
            const size_t l = p->lens[i];
            if (l == 0 || l > end || memcmp(p->text + end - l, p->stops[i], l) != 0)
                continue;
            if (best < 0 || l > p->lens[best])
                best = (int32_t)i;
        }
        if (best >= 0) {
            *cut = end - p->lens[best];
            return best;
        }
    }
    *cut = p->n_text;
    return -1;
}

/* Pushes the text in chunks (sizes from sizes[], cycling; 0 = whole) and collects the output. */
static int32_t stream(struct cllm_stop *m, const struct parsed *p, const uint8_t *sizes,
                      size_t n_sizes, bool check_utf8, struct cllm_buf *out)
{
    struct cllm_stop_out o;
    int32_t which = -1;
    size_t at = 0, k = 0;
    while (at < p->n_text) {
        size_t c = n_sizes ? (size_t)(1 + sizes[k++ % n_sizes] % 7) : p->n_text;
        if (c > p->n_text - at)
            c = p->n_text - at;
        FUZZ_ASSERT(cllm_stop_push(m, p->text + at, c, &o) == CLLM_OK, "push failed");
        at += c;
        if (o.len) {
            FUZZ_ASSERT(!check_utf8 || cllm_utf8_valid(o.text, o.len),
                        "a released piece splits a character");
            cllm_buf_append(out, o.text, o.len);
        }
        if (o.stopped) {
            which = o.which;
            break;
        }
    }
    if (which < 0) {
        cllm_stop_flush(m, &o);
        if (o.len)
            cllm_buf_append(out, o.text, o.len);
        if (o.stopped)
            which = o.which;
    } else {
        cllm_stop_flush(m, &o); /* starts afresh for the next stream */
    }
    return which;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct parsed p;
    if (!parse(data, size, &p))
        return 0;
    size_t cut;
    const int32_t want = reference(&p, &cut);
    bool valid = cllm_utf8_valid(p.text, p.n_text);
    for (size_t i = 0; i < p.n_stops; i++)
        valid = valid && cllm_utf8_valid(p.stops[i], p.lens[i]);

    struct cllm_stop *m = NULL;
    FUZZ_ASSERT(cllm_stop_new(&m, p.stops, p.lens, p.n_stops) == CLLM_OK, "new failed");
    const uint8_t one = 0; /* 1 + 0 % 7: byte by byte */
    const struct {
        const uint8_t *sizes;
        size_t n;
    } ways[] = {{NULL, 0}, {&one, 1}, {data, size}};
    for (size_t w = 0; w < 3; w++) {
        struct cllm_buf out = {0};
        const int32_t got = stream(m, &p, ways[w].sizes, ways[w].n, valid, &out);
        FUZZ_ASSERT(got == want && out.len == cut && (cut == 0 || memcmp(out.data, p.text, cut) == 0),
                    "way %zu: stop %d after %zu bytes, the reference: stop %d after %zu", w, got,
                    out.len, want, cut);
        cllm_buf_free(&out);
    }
    cllm_stop_free(m);
    fuzz_stage = 1;
    return 0;
}
