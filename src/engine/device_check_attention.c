/* The device check's attention at long contexts (device_check.h, cllm_attention_compare). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/f16.h"
#include "core/status.h"
#include "engine/device_check.h"

#define BLOCK 16
#define LEN0 4200 /* > 16 splits of 256: its splits are 263 keys, not on 32-key tiles */
#define LEN1 300
#define N_BLOCKS0 ((LEN0 + BLOCK - 1) / BLOCK)
#define N_BLOCKS1 ((LEN1 + BLOCK - 1) / BLOCK)
#define N_BLOCKS (N_BLOCKS0 + N_BLOCKS1)
#define N_STORED (LEN0 + LEN1)
#define CHUNK 256  /* tokens stored per qkv_rope_store call */
#define CHUNK0 250 /* the prefill chunk: positions CHUNK0 .. CHUNK0 + 15 (251 to 266 keys) */
#define N_QUERY 20
#define PEAK 6.0f /* odd heads' queries are scaled by it: a peaked softmax */

/* The query tokens: sequence and position. */
static void query_token(int32_t i, int32_t *seq, int32_t *pos)
{
    static const int32_t decode[4][2] = {{0, LEN0 - 1}, {0, 1099}, {1, LEN1 - 1}, {1, 0}};
    if (i < 4) {
        *seq = decode[i][0], *pos = decode[i][1];
    } else {
        *seq = 0, *pos = CHUNK0 + (i - 4);
    }
}

/* Block b of sequence s: the pool's blocks in a shuffled order (97 is prime to N_BLOCKS). */
static int32_t block_id(int32_t s, int32_t b)
{
    const int32_t i = s == 0 ? b : N_BLOCKS0 + b;
    return (int32_t)(((int64_t)i * 97 + 5) % N_BLOCKS);
}

static int32_t slot_of(int32_t s, int32_t p)
{
    return block_id(s, p / BLOCK) * BLOCK + p % BLOCK;
}

/* Element e of token (s, p)'s q | k | v row, uniform in [-1, 1), a function of the three. */
static float value_at(int32_t s, int32_t p, int32_t e)
{
    uint64_t x = ((uint64_t)(uint32_t)s << 58) ^ ((uint64_t)(uint32_t)p << 24) ^ (uint32_t)e;
    x += 0x9e3779b97f4a7c15ull; /* splitmix64's finalizer */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return (float)(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* What the two backends share: shapes and the host's staging buffers. */
struct plan {
    int32_t n_head, n_kv, hd, ld;
    struct cllm_rope rope;
    int32_t table[2][N_BLOCKS0];
    float *rows;                                 /* [CHUNK][ld] */
    int32_t pos[CHUNK], seq[CHUNK], slot[CHUNK]; /* the tokens being stored or queried */
};

/* One backend's buffers (its device pointers). */
struct side {
    struct cllm_backend *be;
    void *k, *v, *rows, *pos, *seq, *slot, *table, *scratch, *out;
    size_t kv_bytes, out_bytes, scratch_bytes;
};

static enum cllm_status side_alloc(struct side *d, const struct plan *pl)
{
    const struct cllm_backend_iface *f = d->be->iface;
    d->kv_bytes = (size_t)N_BLOCKS * BLOCK * (size_t)(pl->n_kv * pl->hd) *
                  cllm_backend_elem_size(f->kv_dtype);
    d->out_bytes =
        (size_t)N_QUERY * (size_t)(pl->n_head * pl->hd) * cllm_backend_elem_size(f->act_dtype);
    d->scratch_bytes =
        f->attention_scratch ? f->attention_scratch(d->be, N_QUERY, pl->n_head, pl->hd) : 0;
    if (!d->kv_bytes || !d->out_bytes)
        return CLLM_ERR_UNSUPPORTED;
    enum cllm_status s;
    void **bufs[] = {&d->k, &d->v, &d->rows, &d->pos, &d->seq, &d->slot, &d->table, &d->out};
    const size_t bytes[] = {d->kv_bytes, d->kv_bytes, (size_t)CHUNK * pl->ld * 4, CHUNK * 4,
                            CHUNK * 4,   CHUNK * 4,   sizeof pl->table,           d->out_bytes};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if ((s = f->alloc(d->be, bytes[i], bufs[i])))
            return s;
    if (d->scratch_bytes && (s = f->alloc(d->be, d->scratch_bytes, &d->scratch)))
        return s;
    /* unwritten slots read as zeros (never attended to); the scratch as backend.h asks */
    if ((s = f->memzero(d->be, d->k, d->kv_bytes)) || (s = f->memzero(d->be, d->v, d->kv_bytes)))
        return s;
    if (d->scratch && (s = f->memzero(d->be, d->scratch, d->scratch_bytes)))
        return s;
    return f->upload(d->be, d->table, pl->table, sizeof pl->table);
}

static void side_free(struct side *d)
{
    void *bufs[] = {d->k, d->v, d->rows, d->pos, d->seq, d->slot, d->table, d->scratch, d->out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            d->be->iface->dealloc(d->be, bufs[i]);
}

/* The n staged tokens of pl (rows, positions, slots) to d: rotated and stored in its caches. */
static enum cllm_status side_store(struct side *d, const struct plan *pl, int32_t n)
{
    const struct cllm_backend_iface *f = d->be->iface;
    enum cllm_status s;
    if ((s = f->upload(d->be, d->rows, pl->rows, (size_t)n * pl->ld * 4)) ||
        (s = f->upload(d->be, d->pos, pl->pos, (size_t)n * 4)) ||
        (s = f->upload(d->be, d->seq, pl->seq, (size_t)n * 4)) ||
        (s = f->upload(d->be, d->slot, pl->slot, (size_t)n * 4)))
        return s;
    const struct cllm_attn_batch b = {n, d->pos, d->seq, d->slot, d->table, N_BLOCKS0, BLOCK, LEN0};
    return f->qkv_rope_store(d->be, &pl->rope, &b, d->rows, pl->ld, NULL, pl->n_head, pl->n_kv,
                             d->k, d->v);
}

/* Attention of the N_QUERY staged (and stored) query tokens into out (host F32). */
static enum cllm_status side_attend(struct side *d, const struct plan *pl, float *out)
{
    const struct cllm_backend_iface *f = d->be->iface;
    const struct cllm_attn_batch b = {N_QUERY,  d->pos,    d->seq, d->slot,
                                      d->table, N_BLOCKS0, BLOCK,  LEN0};
    enum cllm_status s = f->attention(d->be, &b, d->rows, pl->ld, d->k, d->v, pl->n_head, pl->n_kv,
                                      pl->hd, 1.0f / sqrtf((float)pl->hd), d->scratch, d->out);
    if (!s)
        s = f->sync(d->be);
    if (s)
        return s;
    const int64_t n = (int64_t)N_QUERY * pl->n_head * pl->hd;
    if (f->act_dtype == CLLM_DTYPE_F32)
        return f->download(d->be, out, d->out, d->out_bytes);
    uint16_t *half = malloc(d->out_bytes);
    if (!half)
        return CLLM_ERR_NOMEM;
    s = f->download(d->be, half, d->out, d->out_bytes);
    for (int64_t i = 0; !s && i < n; i++)
        out[i] =
            f->act_dtype == CLLM_DTYPE_BF16 ? cllm_bf16_to_f32(half[i]) : cllm_f16_to_f32(half[i]);
    free(half);
    return s;
}

/* Stages tokens [g0, g1) of the two sequences laid end to end (keys and values only). */
static void stage_stored(struct plan *pl, int32_t g0, int32_t g1)
{
    const int32_t q = pl->n_head * pl->hd;
    for (int32_t g = g0; g < g1; g++) {
        const int32_t i = g - g0, s = g < LEN0 ? 0 : 1, p = s == 0 ? g : g - LEN0;
        float *row = pl->rows + (int64_t)i * pl->ld;
        memset(row, 0, (size_t)q * sizeof *row);
        for (int32_t e = q; e < pl->ld; e++)
            row[e] = value_at(s, p, e);
        pl->pos[i] = p, pl->seq[i] = s, pl->slot[i] = slot_of(s, p);
    }
}

/* Stages the query tokens: their whole rows (the same keys and values again). */
static void stage_queries(struct plan *pl)
{
    for (int32_t i = 0; i < N_QUERY; i++) {
        int32_t s, p;
        query_token(i, &s, &p);
        float *row = pl->rows + (int64_t)i * pl->ld;
        for (int32_t e = 0; e < pl->ld; e++) {
            const float peak = e < pl->n_head * pl->hd && (e / pl->hd) % 2 ? PEAK : 1.0f;
            row[e] = peak * value_at(s, p, e);
        }
        pl->pos[i] = p, pl->seq[i] = s, pl->slot[i] = slot_of(s, p);
    }
}

/* Rows of a against the reference b: (token, head) segments of hd. */
static void compare_rows(const struct plan *pl, const float *a, const float *b,
                         struct cllm_attn_agreement *r)
{
    for (int32_t i = 0; i < N_QUERY; i++) {
        int32_t s, p;
        query_token(i, &s, &p);
        for (int32_t h = 0; h < pl->n_head; h++) {
            const int64_t at = ((int64_t)i * pl->n_head + h) * pl->hd;
            float diff = 0.0f, mag = 0.0f;
            bool finite = true;
            for (int32_t e = 0; e < pl->hd; e++) {
                finite = finite && isfinite(a[at + e]);
                diff = fmaxf(diff, fabsf(a[at + e] - b[at + e]));
                mag = fmaxf(mag, fabsf(b[at + e]));
            }
            const float err = !finite        ? INFINITY
                              : diff == 0.0f ? 0.0f
                              : mag > 0.0f   ? diff / mag
                                             : INFINITY;
            if (!(err <= r->worst)) {
                r->worst = err;
                r->worst_len = p + 1;
            }
            r->rows++;
        }
    }
}

enum cllm_status cllm_attention_compare(struct cllm_backend *a, struct cllm_backend *b,
                                        const struct cllm_hparams *hp,
                                        struct cllm_attn_agreement *r, bool *a_failed, char *err,
                                        size_t err_len)
{
    *r = (struct cllm_attn_agreement){.worst = -1.0f, .longest = LEN0};
    *a_failed = false;
    struct plan pl = {.n_head = hp->n_head, .n_kv = hp->n_head_kv, .hd = hp->head_dim};
    if (pl.n_head <= 0 || pl.n_kv <= 0 || pl.hd <= 0 || pl.n_head % pl.n_kv)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "attention check: bad head shape");
    pl.ld = (pl.n_head + 2 * pl.n_kv) * pl.hd;
    pl.rope = (struct cllm_rope){hp->rope_theta, hp->head_dim};
    for (int32_t s = 0; s < 2; s++)
        for (int32_t i = 0; i < N_BLOCKS0; i++) /* past a sequence's end: any valid block */
            pl.table[s][i] = block_id(s, i < (s ? N_BLOCKS1 : N_BLOCKS0) ? i : 0);
    const size_t out_n = (size_t)N_QUERY * (size_t)(pl.n_head * pl.hd);
    pl.rows = malloc((size_t)CHUNK * pl.ld * sizeof *pl.rows);
    float *out[3] = {malloc(out_n * 4), malloc(out_n * 4), malloc(out_n * 4)}; /* b, a, a */
    struct side sides[2] = {{.be = b}, {.be = a}};
    enum cllm_status st = pl.rows && out[0] && out[1] && out[2] ? CLLM_OK : CLLM_ERR_NOMEM;
    int failed = -1; /* the side whose op failed */
    for (int i = 0; i < 2 && !st; i++)
        if ((st = side_alloc(&sides[i], &pl)))
            failed = i;
    for (int32_t g0 = 0; !st && g0 < N_STORED; g0 += CHUNK) {
        const int32_t g1 = g0 + CHUNK < N_STORED ? g0 + CHUNK : N_STORED;
        stage_stored(&pl, g0, g1);
        for (int i = 0; i < 2 && !st; i++)
            if ((st = side_store(&sides[i], &pl, g1 - g0)))
                failed = i;
    }
    if (!st)
        stage_queries(&pl);
    for (int i = 0; i < 2 && !st; i++) /* the queries' own keys again: the same values */
        if ((st = side_store(&sides[i], &pl, N_QUERY)) ||
            (st = side_attend(&sides[i], &pl, out[i])))
            failed = i;
    if (!st && (st = side_attend(&sides[1], &pl, out[2]))) /* a's op again, same scratch */
        failed = 1;
    if (!st) {
        compare_rows(&pl, out[1], out[0], r);
        compare_rows(&pl, out[2], out[0], r);
    }
    for (int i = 0; i < 2; i++)
        side_free(&sides[i]);
    free(pl.rows);
    for (int i = 0; i < 3; i++)
        free(out[i]);
    if (st) {
        *a_failed = failed == 1;
        return cllm_fail(err, err_len, st, "attention check: the %s backend failed: %s",
                         failed == 1   ? "checked"
                         : failed == 0 ? "reference"
                                       : "host's",
                         cllm_status_str(st));
    }
    return CLLM_OK;
}
