/*
 * A job's progress as bytes (src/server/progress.h): what is encoded comes back decoded, an
 * answer that failed counts as unfinished, and bytes that are not exactly the progress of a job
 * of that many prompts are refused -- every truncation, every single-byte change that breaks
 * the layout, bytes left over, the wrong count -- without reading past the end (the sanitizer
 * suite runs this too).
 */
#include <stdlib.h>
#include <string.h>

#include "core/buf.h"
#include "engine/request.h"
#include "server/progress.h"
#include "test.h"

static void set_text(struct cllm_request_output *o, const char *s)
{
    o->text.len = 0;
    cllm_buf_append(&o->text, s, strlen(s));
}

static void test_round_trip(void)
{
    struct cllm_request_output outs[4];
    memset(outs, 0, sizeof outs);
    set_text(&outs[0], "Paris is the capital");
    outs[0].n_generated = 4;
    set_text(&outs[1], "Done.");
    outs[1].n_generated = 2;
    outs[1].finished = true;
    outs[1].reason = CLLM_FINISH_STOP;
    set_text(&outs[2], "half");
    outs[2].n_generated = 7; /* tokens whose text is held back */
    outs[2].finished = true;
    outs[2].reason = CLLM_FINISH_ERROR; /* failed: a replay makes it again */
    /* outs[3]: nothing yet */

    struct cllm_buf b = {0};
    CHECK(cllm_progress_encode(&b, outs, 4) == CLLM_OK);
    struct cllm_progress_entry e[4];
    CHECK(cllm_progress_decode(b.data, b.len, 4, e) == CLLM_OK);
    CHECK(!e[0].finished && e[0].reason == CLLM_FINISH_NONE && e[0].n_generated == 4 &&
          e[0].len == 20 && !memcmp(e[0].text, "Paris is the capital", 20));
    CHECK(e[1].finished && e[1].reason == CLLM_FINISH_STOP && e[1].n_generated == 2 &&
          e[1].len == 5 && !memcmp(e[1].text, "Done.", 5));
    CHECK(!e[2].finished && e[2].reason == CLLM_FINISH_NONE && e[2].n_generated == 7 &&
          e[2].len == 4);
    CHECK(!e[3].finished && e[3].n_generated == 0 && e[3].len == 0);

    /* the wrong number of prompts, and no prompts */
    CHECK(cllm_progress_decode(b.data, b.len, 3, e) == CLLM_ERR_FORMAT);
    CHECK(cllm_progress_decode(b.data, b.len, 5, e) == CLLM_ERR_FORMAT);
    CHECK(cllm_progress_decode(b.data, b.len, 0, e) == CLLM_ERR_FORMAT);

    /* every truncation, and a byte left over */
    int refused = 0;
    for (size_t n = 0; n < b.len; n++) {
        char *cut = malloc(n ? n : 1); /* its own allocation: ASan sees a read past it */
        memcpy(cut, b.data, n);
        refused += cllm_progress_decode(cut, n, 4, e) == CLLM_ERR_FORMAT;
        free(cut);
    }
    CHECKF(refused == (int)b.len, "%d of %zu truncations refused", refused, b.len);
    cllm_buf_append_byte(&b, 'x');
    CHECK(cllm_progress_decode(b.data, b.len, 4, e) == CLLM_ERR_FORMAT);
    b.len--;

    /* Every byte outside the texts changed to each value: either refused, or decoded into
     * entries that stay inside the bytes with a known reason. */
    int bad = 0, flips = 0;
    for (size_t at = 0; at < b.len; at++) {
        for (int v = 0; v < 256; v += 3) {
            char *m = malloc(b.len);
            memcpy(m, b.data, b.len);
            m[at] = (char)v;
            if (cllm_progress_decode(m, b.len, 4, e) == CLLM_OK) {
                for (int i = 0; i < 4; i++)
                    bad += e[i].text < m || e[i].text + e[i].len > m + b.len ||
                           e[i].n_generated < 0 || (e[i].len && !e[i].n_generated) ||
                           (e[i].finished ? e[i].reason != CLLM_FINISH_STOP &&
                                                e[i].reason != CLLM_FINISH_LENGTH &&
                                                e[i].reason != CLLM_FINISH_TIME
                                          : e[i].reason != CLLM_FINISH_NONE);
            }
            flips++;
            free(m);
        }
    }
    CHECKF(bad == 0, "%d bad entries in %d changed inputs", bad, flips);

    /* the reason byte of entry 0 (after "CLPR" and the count: finished, then reason) */
    char *m = malloc(b.len);
    memcpy(m, b.data, b.len);
    m[8] = 1; /* finished, but reason NONE */
    CHECK(cllm_progress_decode(m, b.len, 4, e) == CLLM_ERR_FORMAT);
    m[9] = CLLM_FINISH_LENGTH;
    CHECK(cllm_progress_decode(m, b.len, 4, e) == CLLM_OK && e[0].finished &&
          e[0].reason == CLLM_FINISH_LENGTH);
    m[9] = CLLM_FINISH_CANCELLED;
    CHECK(cllm_progress_decode(m, b.len, 4, e) == CLLM_ERR_FORMAT);
    m[8] = 2;
    m[9] = CLLM_FINISH_NONE;
    CHECK(cllm_progress_decode(m, b.len, 4, e) == CLLM_ERR_FORMAT);
    free(m);

    cllm_buf_free(&b);
    for (int i = 0; i < 4; i++)
        cllm_buf_free(&outs[i].text);
}

static void test_limits(void)
{
    struct cllm_request_output o;
    memset(&o, 0, sizeof o);
    struct cllm_buf b = {0};
    CHECK(cllm_progress_encode(&b, &o, -1) == CLLM_ERR_RANGE);
    o.text.len = CLLM_PROGRESS_MAX_LEN; /* (never read: the size is refused first) */
    o.text.data = "";
    CHECK(cllm_progress_encode(&b, &o, 1) == CLLM_ERR_RANGE);
    o.text.len = 0;
    o.n_generated = -3; /* decoding refuses what encoding would never write */
    CHECK(cllm_progress_encode(&b, &o, 1) == CLLM_OK);
    struct cllm_progress_entry e;
    CHECK(cllm_progress_decode(b.data, b.len, 1, &e) == CLLM_ERR_FORMAT);
    CHECK(cllm_progress_decode(NULL, 0, 1, &e) == CLLM_ERR_FORMAT);
    b.len = 0;
    o.n_generated = 0; /* text that no token made */
    o.text.data = "x";
    o.text.len = 1;
    CHECK(cllm_progress_encode(&b, &o, 1) == CLLM_OK);
    CHECK(cllm_progress_decode(b.data, b.len, 1, &e) == CLLM_ERR_FORMAT);
    cllm_buf_free(&b);
}

int main(void)
{
    test_round_trip();
    test_limits();
    return test_summary();
}
