/*
 * Tokenizer state and the encode/decode pipeline (see tokenizer.h for the steps). Token texts
 * are kept as raw bytes in one arena. While building, NORMAL tokens are also indexed by their
 * byte-level text, so merges ("Ġ t") resolve without decoding; the index is dropped at finish.
 */
#include "tokenizer/tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "core/alloc.h"
#include "core/hashmap.h"
#include "core/status.h"
#include "tokenizer/bpe.h"
#include "tokenizer/bytelevel.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/utf8.h"

struct token {
    const char *bytes; /* raw bytes (arena), NULL until set */
    uint32_t len;
    uint8_t kind; /* enum cllm_token_kind */
};

struct added {
    const char *text; /* raw text (arena) */
    uint32_t len;
    int32_t id;
};

struct cllm_tokenizer {
    int32_t n_vocab;
    struct token *tokens;      /* [n_vocab] */
    struct cllm_arena arena;   /* token bytes */
    struct cllm_strmap by_text; /* while building: NORMAL token byte-level text -> id */
    struct cllm_bpe bpe;
    struct added *added;       /* added tokens, sorted by first byte then longest first */
    size_t n_added;
    uint8_t added_first[32];   /* bitmap of the first bytes of added tokens */
    enum cllm_normalizer normalizer;
    bool finished;
};

enum cllm_status cllm_tokenizer_new(struct cllm_tokenizer **out, int32_t n_vocab)
{
    *out = NULL;
    if (n_vocab <= 0)
        return CLLM_ERR_INVALID_ARG;
    struct cllm_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return CLLM_ERR_NOMEM;
    t->tokens = cllm_calloc_array((size_t)n_vocab, sizeof *t->tokens);
    if (!t->tokens) {
        free(t);
        return CLLM_ERR_NOMEM;
    }
    t->n_vocab = n_vocab;
    cllm_arena_init(&t->arena, 1 << 20);
    cllm_bpe_init(&t->bpe);
    /* BPE vocabularies have about as many merges as tokens: size both tables once. */
    if (cllm_strmap_reserve(&t->by_text, (size_t)n_vocab) ||
        cllm_u64map_reserve(&t->bpe.merges, (size_t)n_vocab)) {
        cllm_tokenizer_free(t);
        return CLLM_ERR_NOMEM;
    }
    *out = t;
    return CLLM_OK;
}

void cllm_tokenizer_free(struct cllm_tokenizer *t)
{
    if (!t)
        return;
    free(t->tokens);
    free(t->added);
    cllm_arena_free(&t->arena);
    cllm_strmap_free(&t->by_text);
    cllm_bpe_free(&t->bpe);
    free(t);
}

enum cllm_status cllm_tokenizer_set_token(struct cllm_tokenizer *t, int32_t id, const char *text,
                                          size_t len, enum cllm_token_kind kind, char *err,
                                          size_t err_len)
{
    if (t->finished || id < 0 || id >= t->n_vocab)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "token id %d outside the vocabulary of %d",
                         (int)id, (int)t->n_vocab);
    if (len > UINT32_MAX)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "token %d is too long", (int)id);
    struct cllm_buf raw = {0};
    const char *src = text;
    size_t n = len;
    if (kind == CLLM_TOKEN_NORMAL || kind == CLLM_TOKEN_UNUSED) {
        if (!cllm_bytelevel_decode(text, len, &raw)) {
            cllm_buf_free(&raw);
            /* Padding slots of some files hold arbitrary text; keep it verbatim. */
            if (kind == CLLM_TOKEN_NORMAL)
                return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                                 "token %d (\"%.*s\") is not byte-level BPE text", (int)id,
                                 (int)(len > 40 ? 40 : len), text);
        } else {
            src = raw.data ? raw.data : "";
            n = raw.len;
        }
    }
    /* An id may be listed twice (an added token that is in the vocabulary too) but never for
     * two texts: encoding would find the first text's id and decoding give the second text. */
    const struct token *old = &t->tokens[id];
    if (old->bytes && (old->len != n || memcmp(old->bytes, src, n) != 0)) {
        cllm_buf_free(&raw);
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "token id %d is given to two different texts (the second: \"%.*s\")",
                         (int)id, (int)(len > 40 ? 40 : len), text);
    }
    char *bytes = cllm_arena_strndup(&t->arena, src, n);
    cllm_buf_free(&raw);
    if (!bytes)
        return CLLM_ERR_NOMEM;
    t->tokens[id] = (struct token){.bytes = bytes, .len = (uint32_t)n, .kind = (uint8_t)kind};
    if (kind == CLLM_TOKEN_NORMAL) {
        const char *key = cllm_arena_strndup(&t->arena, text, len);
        enum cllm_status st = key ? cllm_strmap_put(&t->by_text, key, len, (uint64_t)id)
                                  : CLLM_ERR_NOMEM;
        if (st)
            return st;
        if (n == 1)
            t->bpe.byte_id[(uint8_t)bytes[0]] = id;
    }
    return CLLM_OK;
}

/* Id of the NORMAL token whose byte-level text is s[0..n), or -1. */
static int32_t lookup_text(const struct cllm_tokenizer *t, const char *s, size_t n)
{
    uint64_t id;
    return cllm_strmap_get(&t->by_text, s, n, &id) ? (int32_t)id : -1;
}

enum cllm_status cllm_tokenizer_add_merge(struct cllm_tokenizer *t, const char *left, size_t llen,
                                          const char *right, size_t rlen, char *err,
                                          size_t err_len)
{
    if (t->finished)
        return CLLM_ERR_INVALID_ARG;
    int32_t l = lookup_text(t, left, llen), r = lookup_text(t, right, rlen), m = -1;
    if (l >= 0 && r >= 0) {
        /* Byte-level text concatenates like the bytes it stands for. */
        struct cllm_buf joined = {0};
        if (cllm_buf_append(&joined, left, llen) || cllm_buf_append(&joined, right, rlen)) {
            cllm_buf_free(&joined);
            return CLLM_ERR_NOMEM;
        }
        m = lookup_text(t, joined.data, joined.len);
        cllm_buf_free(&joined);
    }
    if (m < 0)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "merge %d (\"%.*s %.*s\") names a token that is not in the vocabulary",
                         (int)t->bpe.n_merges, (int)(llen > 40 ? 40 : llen), left,
                         (int)(rlen > 40 ? 40 : rlen), right);
    return cllm_bpe_add_merge(&t->bpe, l, r, m);
}

void cllm_tokenizer_set_normalizer(struct cllm_tokenizer *t, enum cllm_normalizer norm)
{
    t->normalizer = norm;
}

static int cmp_added(const void *a, const void *b)
{
    const struct added *x = a, *y = b;
    uint8_t fx = (uint8_t)x->text[0], fy = (uint8_t)y->text[0];
    if (fx != fy)
        return fx < fy ? -1 : 1;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1; /* longest first: matching is leftmost-longest */
    return x->id < y->id ? -1 : x->id > y->id;
}

enum cllm_status cllm_tokenizer_finish(struct cllm_tokenizer *t, char *err, size_t err_len)
{
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!t->tokens[id].bytes)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "token id %d is missing", (int)id);
        if (t->tokens[id].kind == CLLM_TOKEN_SPECIAL || t->tokens[id].kind == CLLM_TOKEN_ADDED)
            t->n_added++;
    }
    for (int b = 0; b < 256; b++)
        if (t->bpe.byte_id[b] < 0)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "the vocabulary has no token for the byte 0x%02x", b);
    t->added = cllm_calloc_array(t->n_added, sizeof *t->added);
    if (!t->added)
        return CLLM_ERR_NOMEM;
    size_t k = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const struct token *tk = &t->tokens[id];
        if (tk->kind != CLLM_TOKEN_SPECIAL && tk->kind != CLLM_TOKEN_ADDED)
            continue;
        if (tk->len == 0)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "added token %d is empty", (int)id);
        t->added[k++] = (struct added){tk->bytes, tk->len, id};
        uint8_t f = (uint8_t)tk->bytes[0];
        t->added_first[f >> 3] |= (uint8_t)(1u << (f & 7));
    }
    qsort(t->added, t->n_added, sizeof *t->added, cmp_added);
    cllm_strmap_free(&t->by_text);
    t->finished = true;
    return CLLM_OK;
}

int32_t cllm_tokenizer_n_vocab(const struct cllm_tokenizer *t)
{
    return t->n_vocab;
}

int32_t cllm_tokenizer_n_merges(const struct cllm_tokenizer *t)
{
    return t->bpe.n_merges;
}

enum cllm_normalizer cllm_tokenizer_normalizer(const struct cllm_tokenizer *t)
{
    return t->normalizer;
}

enum cllm_token_kind cllm_tokenizer_kind(const struct cllm_tokenizer *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab)
        return CLLM_TOKEN_UNUSED;
    return (enum cllm_token_kind)t->tokens[id].kind;
}

int32_t cllm_tokenizer_find_added(const struct cllm_tokenizer *t, const char *text)
{
    size_t n = strlen(text);
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && memcmp(t->added[i].text, text, n) == 0)
            return t->added[i].id;
    return -1;
}

const char *cllm_tokenizer_token_bytes(const struct cllm_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab)
        return NULL;
    *len = t->tokens[id].len;
    return t->tokens[id].bytes;
}

/* The longest added token starting at s[0..n), or NULL. */
static const struct added *match_added(const struct cllm_tokenizer *t, const char *s, size_t n)
{
    uint8_t f = (uint8_t)s[0];
    if (!(t->added_first[f >> 3] & (1u << (f & 7))))
        return NULL;
    for (size_t i = 0; i < t->n_added; i++) {
        const struct added *a = &t->added[i];
        if ((uint8_t)a->text[0] != f)
            continue;
        if (a->len <= n && memcmp(a->text, s, a->len) == 0)
            return a; /* sorted longest first */
    }
    return NULL;
}

struct encode_ctx {
    const struct cllm_tokenizer *t;
    struct cllm_ids *ids;
};

static int encode_piece(const char *piece, size_t len, void *arg)
{
    struct encode_ctx *c = arg;
    return (int)cllm_bpe_encode(&c->t->bpe, (const uint8_t *)piece, len, c->ids);
}

static bool is_ascii(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((uint8_t)s[i] >= 0x80)
            return false;
    return true;
}

/* Encodes text with no added tokens in it: sanitise, normalise, split, merge. */
static enum cllm_status encode_plain(const struct cllm_tokenizer *t, const char *s, size_t n,
                                     struct cllm_ids *ids)
{
    if (n == 0)
        return CLLM_OK;
    struct cllm_buf clean = {0};
    utf8proc_uint8_t *nfc = NULL;
    enum cllm_status st = CLLM_OK;
    bool ascii = is_ascii(s, n);
    if (!ascii && !cllm_utf8_valid(s, n)) {
        if ((st = cllm_utf8_sanitize(s, n, &clean)))
            goto done;
        s = clean.data;
        n = clean.len;
    }
    if (!ascii && t->normalizer == CLLM_NORMALIZER_NFC) {
        utf8proc_ssize_t len = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &nfc,
                                            UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (len < 0) {
            st = len == UTF8PROC_ERROR_NOMEM ? CLLM_ERR_NOMEM : CLLM_ERR_FORMAT;
            goto done;
        }
        s = (const char *)nfc;
        n = (size_t)len;
    }
    struct encode_ctx c = {t, ids};
    st = (enum cllm_status)cllm_pretokenize_qwen2(s, n, encode_piece, &c);
done:
    free(nfc);
    cllm_buf_free(&clean);
    return st;
}

enum cllm_status cllm_tokenize(const struct cllm_tokenizer *t, const char *text, size_t n,
                               struct cllm_ids *ids)
{
    size_t start = 0; /* start of the text not yet encoded */
    for (size_t i = 0; i < n; i++) {
        const struct added *a = match_added(t, text + i, n - i);
        if (!a)
            continue;
        enum cllm_status st = encode_plain(t, text + start, i - start, ids);
        if (st || (st = cllm_ids_push(ids, a->id)))
            return st;
        i += a->len - 1;
        start = i + 1;
    }
    return encode_plain(t, text + start, n - start, ids);
}

enum cllm_status cllm_detokenize(const struct cllm_tokenizer *t, const int32_t *ids, size_t n,
                                 bool skip_special, struct cllm_buf *out)
{
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return CLLM_ERR_RANGE;
        const struct token *tk = &t->tokens[ids[i]];
        if (skip_special && tk->kind == CLLM_TOKEN_SPECIAL)
            continue;
        enum cllm_status st = cllm_buf_append(out, tk->bytes, tk->len);
        if (st)
            return st;
    }
    return CLLM_OK;
}

void cllm_detok_stream_init(struct cllm_detok_stream *s, const struct cllm_tokenizer *t,
                            bool skip_special)
{
    s->tok = t;
    s->skip_special = skip_special;
    s->n_pending = 0;
}

enum cllm_status cllm_detok_stream_push(struct cllm_detok_stream *s, int32_t id,
                                        struct cllm_buf *out)
{
    const struct cllm_tokenizer *t = s->tok;
    if (id < 0 || id >= t->n_vocab)
        return CLLM_ERR_RANGE;
    const struct token *tk = &t->tokens[id];
    if (s->skip_special && tk->kind == CLLM_TOKEN_SPECIAL)
        return CLLM_OK;
    struct cllm_buf joined = {0};
    enum cllm_status st;
    if ((st = cllm_buf_append(&joined, s->pending, s->n_pending)) ||
        (st = cllm_buf_append(&joined, tk->bytes, tk->len)))
        goto done;
    size_t keep_from = cllm_utf8_complete_prefix(joined.data, joined.len);
    if ((st = cllm_utf8_sanitize(joined.data, keep_from, out)))
        goto done;
    s->n_pending = joined.len - keep_from; /* at most 3 bytes */
    memcpy(s->pending, joined.data + keep_from, s->n_pending);
done:
    cllm_buf_free(&joined);
    return st;
}

enum cllm_status cllm_detok_stream_flush(struct cllm_detok_stream *s, struct cllm_buf *out)
{
    enum cllm_status st = cllm_utf8_sanitize(s->pending, s->n_pending, out);
    s->n_pending = 0;
    return st;
}
