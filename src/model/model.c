/*
 * The Qwen2 decoder, as transformers' Qwen2ForCausalLM computes it:
 *
 *   x = embed(tokens)
 *   for each layer:
 *       h = rmsnorm(x) ; q, k, v = h Wq + bq, h Wk + bk, h Wv + bv
 *       rotate q, k (rotate-half RoPE) ; append k, v to the cache
 *       x += softmax(q k^T / sqrt(d) + causal) v Wo
 *       h = rmsnorm(x) ; x += (silu(h Wgate) * h Wup) Wdown
 *   logits = rmsnorm(x) Wout          (Wout = Wembed when tied)
 *
 * Residual adds are fused into the following norm (add_rmsnorm). Only the rows named in
 * step->outputs go through the final norm and LM head.
 */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

struct layer {
    struct cllm_weight attn_norm, wq, wk, wv, bq, bk, bv, wo;
    struct cllm_weight ffn_norm, w_gate, w_up, w_down;
};

struct cllm_model {
    struct cllm_hparams hp;
    struct cllm_backend *be;
    struct cllm_weight tok_embd, output_norm, output;
    bool tied; /* output is tok_embd: do not free it twice */
    struct layer *layers;
    int32_t max_tokens, max_outputs;
    /* activations (device), sized for max_tokens rows */
    float *x, *xn, *q, *k, *v, *attn, *gate, *up, *ffo;
    float *out_x, *out_ffo, *out_n; /* [max_outputs][n_embd] */
    float *logits_dev;              /* [max_outputs][n_vocab] */
    float *logits_host;
    int32_t *step_i32; /* device copy of the step's index arrays */
    size_t step_i32_cap;
};

static const struct cllm_weight *const_w(const struct cllm_weight *w)
{
    return w->host ? w : NULL;
}

static enum cllm_status load(struct cllm_model *m, const struct cllm_model_files *mf,
                             const char *name, struct cllm_weight *w, bool optional, char *err,
                             size_t err_len)
{
    const struct cllm_tensor *t = cllm_model_files_tensor(mf, name);
    if (!t) {
        if (optional)
            return CLLM_OK;
        return cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND, "%s: tensor %s is missing", mf->path,
                         name);
    }
    return m->be->iface->weight_init(m->be, t, w, err, err_len);
}

static enum cllm_status alloc_f32(struct cllm_model *m, float **p, int64_t rows, int64_t cols)
{
    return m->be->iface->alloc(m->be, (size_t)(rows * cols) * sizeof(float), (void **)p);
}

enum cllm_status cllm_model_init(struct cllm_model **out, const struct cllm_model_files *mf,
                                 struct cllm_backend *be, int32_t max_tokens, int32_t max_outputs,
                                 char *err, size_t err_len)
{
    *out = NULL;
    enum cllm_status st = cllm_model_files_check_tensors(mf, err, err_len);
    if (st)
        return st;
    if (max_tokens < 1 || max_outputs < 1 || max_outputs > max_tokens)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "max_tokens (%d) and max_outputs (%d) must be >= 1, outputs <= tokens",
                         (int)max_tokens, (int)max_outputs);
    struct cllm_model *m = calloc(1, sizeof *m);
    if (!m)
        return CLLM_ERR_NOMEM;
    m->hp = mf->hp;
    m->be = be;
    m->max_tokens = max_tokens;
    m->max_outputs = max_outputs;
    const struct cllm_hparams *hp = &m->hp;
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        st = CLLM_ERR_NOMEM;
        goto fail;
    }
    if ((st = load(m, mf, "token_embd.weight", &m->tok_embd, false, err, err_len)) ||
        (st = load(m, mf, "output_norm.weight", &m->output_norm, false, err, err_len)) ||
        (st = load(m, mf, "output.weight", &m->output, true, err, err_len)))
        goto fail;
    if (!m->output.host) {
        m->output = m->tok_embd;
        m->tied = true;
    }
    for (int32_t l = 0; l < hp->n_layer; l++) {
        struct layer *L = &m->layers[l];
        static const struct {
            const char *name;
            size_t off;
            bool optional;
        } names[] = {
            {"attn_norm.weight", offsetof(struct layer, attn_norm), false},
            {"attn_q.weight", offsetof(struct layer, wq), false},
            {"attn_k.weight", offsetof(struct layer, wk), false},
            {"attn_v.weight", offsetof(struct layer, wv), false},
            {"attn_q.bias", offsetof(struct layer, bq), true},
            {"attn_k.bias", offsetof(struct layer, bk), true},
            {"attn_v.bias", offsetof(struct layer, bv), true},
            {"attn_output.weight", offsetof(struct layer, wo), false},
            {"ffn_norm.weight", offsetof(struct layer, ffn_norm), false},
            {"ffn_gate.weight", offsetof(struct layer, w_gate), false},
            {"ffn_up.weight", offsetof(struct layer, w_up), false},
            {"ffn_down.weight", offsetof(struct layer, w_down), false},
        };
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.%s", (int)l, names[i].name);
            if ((st = load(m, mf, name, (struct cllm_weight *)((char *)L + names[i].off),
                           names[i].optional, err, err_len)))
                goto fail;
        }
    }
    int64_t T = max_tokens, O = max_outputs, E = hp->n_embd, F = hp->n_ff;
    int64_t Q = (int64_t)hp->n_head * hp->head_dim, KV = (int64_t)hp->n_head_kv * hp->head_dim;
    if ((st = alloc_f32(m, &m->x, T, E)) || (st = alloc_f32(m, &m->xn, T, E)) ||
        (st = alloc_f32(m, &m->q, T, Q)) || (st = alloc_f32(m, &m->k, T, KV)) ||
        (st = alloc_f32(m, &m->v, T, KV)) || (st = alloc_f32(m, &m->attn, T, Q)) ||
        (st = alloc_f32(m, &m->gate, T, F)) || (st = alloc_f32(m, &m->up, T, F)) ||
        (st = alloc_f32(m, &m->ffo, T, E)) || (st = alloc_f32(m, &m->out_x, O, E)) ||
        (st = alloc_f32(m, &m->out_ffo, O, E)) || (st = alloc_f32(m, &m->out_n, O, E)) ||
        (st = alloc_f32(m, &m->logits_dev, O, hp->n_vocab))) {
        cllm_fail(err, err_len, st, "cannot allocate activations for %d tokens", (int)max_tokens);
        goto fail;
    }
    m->logits_host = malloc((size_t)(O * hp->n_vocab) * sizeof(float));
    if (!m->logits_host) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot allocate logits");
        goto fail;
    }
    *out = m;
    return CLLM_OK;
fail:
    if (st == CLLM_ERR_NOMEM && err && !err[0])
        cllm_fail(err, err_len, st, "out of memory loading the model");
    cllm_model_free(m);
    return st;
}

void cllm_model_free(struct cllm_model *m)
{
    if (!m)
        return;
    const struct cllm_backend_iface *be = m->be->iface;
    if (m->layers) {
        for (int32_t l = 0; l < m->hp.n_layer; l++) {
            struct cllm_weight *w = (struct cllm_weight *)&m->layers[l];
            for (size_t i = 0; i < sizeof(struct layer) / sizeof(struct cllm_weight); i++)
                be->weight_free(m->be, &w[i]);
        }
    }
    if (!m->tied)
        be->weight_free(m->be, &m->output);
    be->weight_free(m->be, &m->tok_embd);
    be->weight_free(m->be, &m->output_norm);
    float *bufs[] = {m->x,   m->xn,  m->q,     m->k,       m->v,     m->attn,      m->gate,
                     m->up,  m->ffo, m->out_x, m->out_ffo, m->out_n, m->logits_dev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->dealloc(m->be, bufs[i]);
    if (m->step_i32)
        be->dealloc(m->be, m->step_i32);
    free(m->logits_host);
    free(m->layers);
    free(m);
}

const struct cllm_hparams *cllm_model_hparams(const struct cllm_model *m)
{
    return &m->hp;
}

int32_t cllm_model_max_tokens(const struct cllm_model *m)
{
    return m->max_tokens;
}

uint64_t cllm_model_kv_bytes_per_token(const struct cllm_model *m)
{
    return (uint64_t)m->hp.n_layer * 2u * (uint64_t)m->hp.n_head_kv * (uint64_t)m->hp.head_dim *
           sizeof(float);
}

enum cllm_status cllm_kv_cache_init(struct cllm_kv_cache *kv, const struct cllm_model *m,
                                    int32_t n_blocks, int32_t block_size, char *err,
                                    size_t err_len)
{
    memset(kv, 0, sizeof *kv);
    if (n_blocks < 1 || block_size < 1 || (int64_t)n_blocks * block_size > INT32_MAX)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "bad KV cache size %d x %d",
                         (int)n_blocks, (int)block_size);
    kv->n_layer = m->hp.n_layer;
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->k = calloc((size_t)kv->n_layer, sizeof *kv->k);
    kv->v = calloc((size_t)kv->n_layer, sizeof *kv->v);
    if (!kv->k || !kv->v)
        goto nomem;
    size_t bytes = (size_t)n_blocks * (size_t)block_size * (size_t)m->hp.n_head_kv *
                   (size_t)m->hp.head_dim * sizeof(float);
    for (int32_t l = 0; l < kv->n_layer; l++)
        if (m->be->iface->alloc(m->be, bytes, (void **)&kv->k[l]) ||
            m->be->iface->alloc(m->be, bytes, (void **)&kv->v[l]))
            goto nomem;
    return CLLM_OK;
nomem:
    cllm_kv_cache_free(kv, m);
    return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot allocate a KV cache of %d blocks of %d",
                     (int)n_blocks, (int)block_size);
}

void cllm_kv_cache_free(struct cllm_kv_cache *kv, const struct cllm_model *m)
{
    for (int32_t l = 0; kv->k && l < kv->n_layer; l++)
        if (kv->k[l])
            m->be->iface->dealloc(m->be, kv->k[l]);
    for (int32_t l = 0; kv->v && l < kv->n_layer; l++)
        if (kv->v[l])
            m->be->iface->dealloc(m->be, kv->v[l]);
    free(kv->k);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

/* Rejects a step the ops could not run safely. */
static enum cllm_status check_step(const struct cllm_model *m, const struct cllm_kv_cache *kv,
                                   const struct cllm_step *s)
{
    if (s->n_tokens < 1 || s->n_tokens > m->max_tokens || s->n_outputs < 0 ||
        s->n_outputs > m->max_outputs || s->n_seqs < 1 || s->max_blocks < 1)
        return CLLM_ERR_INVALID_ARG;
    int64_t n_slots = (int64_t)kv->n_blocks * kv->block_size;
    for (int32_t t = 0; t < s->n_tokens; t++) {
        if (s->tokens[t] < 0 || s->tokens[t] >= m->hp.n_vocab || s->seq[t] < 0 ||
            s->seq[t] >= s->n_seqs || s->pos[t] < 0 || s->slot[t] < 0 || s->slot[t] >= n_slots ||
            s->pos[t] / kv->block_size >= s->max_blocks)
            return CLLM_ERR_RANGE;
        const int32_t *table = s->block_table + (int64_t)s->seq[t] * s->max_blocks;
        for (int32_t b = 0; b <= s->pos[t] / kv->block_size; b++)
            if (table[b] < 0 || table[b] >= kv->n_blocks)
                return CLLM_ERR_RANGE;
    }
    for (int32_t o = 0; o < s->n_outputs; o++)
        if (s->outputs[o] < 0 || s->outputs[o] >= s->n_tokens)
            return CLLM_ERR_RANGE;
    return CLLM_OK;
}

/* Copies the step's index arrays to the device: [tokens | pos | seq | slot | outputs | table]. */
static enum cllm_status upload_step(struct cllm_model *m, const struct cllm_step *s,
                                    struct cllm_step *dev)
{
    size_t n = (size_t)s->n_tokens, tbl = (size_t)s->n_seqs * (size_t)s->max_blocks;
    size_t need = 4 * n + (size_t)s->n_outputs + tbl;
    const struct cllm_backend_iface *be = m->be->iface;
    if (need > m->step_i32_cap) {
        if (m->step_i32)
            be->dealloc(m->be, m->step_i32);
        m->step_i32 = NULL;
        m->step_i32_cap = 0;
        if (be->alloc(m->be, need * 2 * sizeof(int32_t), (void **)&m->step_i32))
            return CLLM_ERR_NOMEM;
        m->step_i32_cap = need * 2;
    }
    int32_t *d = m->step_i32;
    *dev = *s;
    const int32_t *src[] = {s->tokens, s->pos, s->seq, s->slot, s->outputs, s->block_table};
    const int32_t **dst[] = {&dev->tokens, &dev->pos, &dev->seq, &dev->slot, &dev->outputs,
                             &dev->block_table};
    size_t len[] = {n, n, n, n, (size_t)s->n_outputs, tbl};
    for (int i = 0; i < 6; i++) {
        enum cllm_status st = len[i] ? be->upload(m->be, d, src[i], len[i] * sizeof(int32_t))
                                     : CLLM_OK;
        if (st)
            return st;
        *dst[i] = d;
        d += len[i];
    }
    return CLLM_OK;
}

enum cllm_status cllm_model_forward(struct cllm_model *m, struct cllm_kv_cache *kv,
                                    const struct cllm_step *step, const float **logits)
{
    *logits = NULL;
    enum cllm_status st = check_step(m, kv, step);
    if (st)
        return st;
    struct cllm_step s;
    if ((st = upload_step(m, step, &s)))
        return st;
    struct cllm_backend *b = m->be;
    const struct cllm_backend_iface *be = b->iface;
    const struct cllm_hparams *hp = &m->hp;
    int32_t n = s.n_tokens, E = hp->n_embd, F = hp->n_ff, hd = hp->head_dim;
    int32_t Q = hp->n_head * hd, KV = hp->n_head_kv * hd;
    struct cllm_attn_batch ab = {n, s.pos, s.seq, s.slot, s.block_table, s.max_blocks,
                                 kv->block_size};
    struct cllm_rope rope = {hp->rope_theta, hd};
    float scale = 1.0f / sqrtf((float)hd);

#define TRY(call)                                                                                  \
    do {                                                                                           \
        if ((st = (call)))                                                                         \
            return st;                                                                             \
    } while (0)

    TRY(be->embed(b, &m->tok_embd, s.tokens, n, m->x));
    for (int32_t l = 0; l < hp->n_layer; l++) {
        const struct layer *L = &m->layers[l];
        if (l == 0)
            TRY(be->rmsnorm(b, m->x, &L->attn_norm, hp->rms_eps, n, E, m->xn));
        else /* the previous layer's MLP residual, fused into this norm */
            TRY(be->add_rmsnorm(b, m->x, m->ffo, &L->attn_norm, hp->rms_eps, n, E, m->xn));
        TRY(be->matmul(b, &L->wq, const_w(&L->bq), m->xn, n, m->q, Q));
        TRY(be->matmul(b, &L->wk, const_w(&L->bk), m->xn, n, m->k, KV));
        TRY(be->matmul(b, &L->wv, const_w(&L->bv), m->xn, n, m->v, KV));
        TRY(be->rope_store_kv(b, &rope, &ab, m->q, m->k, m->v, hp->n_head, hp->n_head_kv,
                              kv->k[l], kv->v[l]));
        TRY(be->attention(b, &ab, m->q, kv->k[l], kv->v[l], hp->n_head, hp->n_head_kv, hd,
                          scale, m->attn));
        TRY(be->matmul(b, &L->wo, NULL, m->attn, n, m->ffo, E));
        TRY(be->add_rmsnorm(b, m->x, m->ffo, &L->ffn_norm, hp->rms_eps, n, E, m->xn));
        TRY(be->matmul(b, &L->w_gate, NULL, m->xn, n, m->gate, F));
        TRY(be->matmul(b, &L->w_up, NULL, m->xn, n, m->up, F));
        TRY(be->silu_mul(b, m->gate, m->up, n, F, m->gate));
        TRY(be->matmul(b, &L->w_down, NULL, m->gate, n, m->ffo, E));
    }
    if (s.n_outputs > 0) {
        /* Only the rows that need logits take the last residual add, norm and LM head. */
        TRY(be->gather_rows(b, m->x, s.outputs, s.n_outputs, E, m->out_x));
        TRY(be->gather_rows(b, m->ffo, s.outputs, s.n_outputs, E, m->out_ffo));
        TRY(be->add_rmsnorm(b, m->out_x, m->out_ffo, &m->output_norm, hp->rms_eps, s.n_outputs,
                            E, m->out_n));
        TRY(be->matmul(b, &m->output, NULL, m->out_n, s.n_outputs, m->logits_dev, hp->n_vocab));
        TRY(be->download(b, m->logits_host, m->logits_dev,
                         (size_t)s.n_outputs * (size_t)hp->n_vocab * sizeof(float)));
    }
    TRY(be->sync(b));
#undef TRY
    *logits = m->logits_host;
    return CLLM_OK;
}
