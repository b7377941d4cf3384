/*
 * The stop-string matcher: one Knuth-Morris-Pratt automaton per stop string, advanced byte by
 * byte over the stream (amortised O(1) per byte and string). Each automaton's state is the
 * longest suffix of the stream that is a prefix of its string, so the longest such state is
 * exactly the tail that must be held back. The buffer holds that tail plus the newest chunk.
 */
#include "sampling/stop.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"

struct stop_string {
    char *s;
    size_t len;
    size_t *fail;  /* [len] KMP failure: longest proper prefix of s[0..i] that is its suffix */
    size_t state;  /* bytes of s matched by the end of the stream so far */
    int32_t index; /* position in the caller's list */
};

struct cllm_stop {
    struct stop_string *v; /* [n] the non-empty stop strings */
    size_t n;
    char *buf; /* [cap] the undecided tail, then the newest chunk */
    size_t len, cap;
    size_t released; /* bytes at the front of buf handed out by the last call */
    bool stopped;
    int32_t which;
};

static void build_fail(struct stop_string *t)
{
    t->fail[0] = 0;
    size_t k = 0;
    for (size_t i = 1; i < t->len; i++) {
        while (k > 0 && t->s[i] != t->s[k])
            k = t->fail[k - 1];
        if (t->s[i] == t->s[k])
            k++;
        t->fail[i] = k;
    }
}

enum cllm_status cllm_stop_new(struct cllm_stop **out, const char *const *stops, const size_t *lens,
                               size_t n)
{
    *out = NULL;
    if (n && !stops)
        return CLLM_ERR_INVALID_ARG;
    struct cllm_stop *m = calloc(1, sizeof *m);
    if (!m)
        return CLLM_ERR_NOMEM;
    m->which = -1;
    if (n && !(m->v = cllm_calloc_array(n, sizeof *m->v)))
        goto fail;
    for (size_t i = 0; i < n; i++) {
        if (!stops[i])
            continue;
        size_t len = lens ? lens[i] : strlen(stops[i]);
        if (len == 0)
            continue;
        struct stop_string *t = &m->v[m->n];
        if (!(t->s = cllm_strndup(stops[i], len)) ||
            !(t->fail = cllm_malloc_array(len, sizeof *t->fail))) {
            m->n++; /* so that free releases what was allocated */
            goto fail;
        }
        t->len = len;
        t->index = (int32_t)i;
        build_fail(t);
        m->n++;
    }
    *out = m;
    return CLLM_OK;
fail:
    cllm_stop_free(m);
    return CLLM_ERR_NOMEM;
}

void cllm_stop_free(struct cllm_stop *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n; i++) {
        free(m->v[i].s);
        free(m->v[i].fail);
    }
    free(m->v);
    free(m->buf);
    free(m);
}

/* Drops the bytes handed out by the previous call (the caller is done with them now). */
static void compact(struct cllm_stop *m)
{
    if (m->released) {
        memmove(m->buf, m->buf + m->released, m->len - m->released);
        m->len -= m->released;
        m->released = 0;
    }
}

/* Bytes at the end of buf[0..len) that start a UTF-8 sequence still missing bytes. */
static size_t utf8_incomplete_tail(const unsigned char *b, size_t len)
{
    for (size_t k = 1; k <= 3 && k <= len; k++) {
        unsigned char c = b[len - k];
        if ((c & 0xC0) == 0x80)
            continue; /* continuation byte: look further back for the lead */
        size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
        return need > k ? k : 0;
    }
    return 0;
}

enum cllm_status cllm_stop_push(struct cllm_stop *m, const char *chunk, size_t n,
                                struct cllm_stop_out *out)
{
    *out =
        (struct cllm_stop_out){.text = m->buf, .len = 0, .stopped = m->stopped, .which = m->which};
    if (m->stopped)
        return CLLM_OK;
    compact(m);
    uint64_t need;
    if (!cllm_add_u64(m->len, n, &need) || need > SIZE_MAX)
        return CLLM_ERR_NOMEM;
    if (need > m->cap) {
        size_t cap = m->cap ? m->cap : 64;
        while (cap < need)
            cap = cap > SIZE_MAX / 2 ? (size_t)need : cap * 2;
        char *b = realloc(m->buf, cap);
        if (!b)
            return CLLM_ERR_NOMEM;
        m->buf = b;
        m->cap = cap;
    }
    size_t old = m->len;
    if (n)
        memcpy(m->buf + old, chunk, n);
    m->len += n;

    /* The held bytes were already fed to the automata; only the new ones advance them. */
    for (size_t pos = old; pos < m->len; pos++) {
        char c = m->buf[pos];
        const struct stop_string *hit = NULL;
        for (size_t i = 0; i < m->n; i++) {
            struct stop_string *t = &m->v[i];
            size_t k = t->state;
            while (k > 0 && c != t->s[k])
                k = t->fail[k - 1];
            if (c == t->s[k])
                k++;
            t->state = k;
            if (k == t->len && (!hit || t->len > hit->len))
                hit = t;
        }
        if (hit) {
            m->stopped = true;
            m->which = hit->index;
            m->released = m->len; /* nothing is kept after a stop */
            *out = (struct cllm_stop_out){
                .text = m->buf, .len = pos + 1 - hit->len, .stopped = true, .which = hit->index};
            return CLLM_OK;
        }
    }

    size_t hold = utf8_incomplete_tail((const unsigned char *)m->buf, m->len);
    for (size_t i = 0; i < m->n; i++)
        hold = m->v[i].state > hold ? m->v[i].state : hold;
    m->released = m->len - hold;
    out->text = m->buf;
    out->len = m->released;
    return CLLM_OK;
}

void cllm_stop_flush(struct cllm_stop *m, struct cllm_stop_out *out)
{
    *out =
        (struct cllm_stop_out){.text = m->buf, .len = 0, .stopped = m->stopped, .which = m->which};
    if (!m->stopped) {
        compact(m);
        out->text = m->buf;
        out->len = m->len;
    }
    m->released = m->len;
    for (size_t i = 0; i < m->n; i++)
        m->v[i].state = 0;
    m->stopped = false;
    m->which = -1;
}
