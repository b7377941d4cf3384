/*
 * Building the model on a backend: the weights uploaded (QKV and gate/up stacked where the
 * backend can), the activation buffers sized for a step, the backend's matmuls timed on
 * them, and the KV cache; and freeing it all.
 */
#include "model/model_internal.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

/* After a recording found no room on the device (its graph could not be instantiated), this
 * many steps run op by op before one is recorded again (CLLM_UNRECORDED_STEPS, for tests);
 * each failure of that next recording doubles it, up to 16 times (core/backoff.h). */
#define UNRECORDED_STEPS 256

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

/* Loads blk.<l>.<names[i]> stacked by rows if the backend can, else as separate parts. With
 * optional set, all parts missing is fine (no bias) but some missing is not. */
static enum cllm_status load_stacked(struct cllm_model *m, const struct cllm_model_files *mf,
                                     int32_t l, const char *const *names, int n,
                                     struct cllm_weight *stacked, struct cllm_weight *parts,
                                     int *n_parts, bool optional, char *err, size_t err_len)
{
    const struct cllm_tensor *t[3];
    int found = 0;
    for (int i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.%s", (int)l, names[i]);
        t[i] = cllm_model_files_tensor(mf, name);
        found += t[i] != NULL;
        if (!t[i] && !optional)
            return cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND, "%s: tensor %s is missing", mf->path,
                             name);
    }
    if (found == 0)
        return CLLM_OK;
    if (found != n)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: layer %d has only some of its %s",
                         mf->path, (int)l, names[0]);
    const struct cllm_backend_iface *be = m->be->iface;
    if (be->weight_init_stacked) {
        enum cllm_status st = be->weight_init_stacked(m->be, t, n, stacked, err, err_len);
        if (st != CLLM_ERR_UNSUPPORTED)
            return st;
    }
    if (!parts) /* the caller needs one stacked vector */
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "the %s backend cannot stack %s",
                         be->name, names[0]);
    for (int i = 0; i < n; i++) {
        enum cllm_status st = be->weight_init(m->be, t[i], &parts[i], err, err_len);
        if (st)
            return st;
        (*n_parts)++;
    }
    return CLLM_OK;
}

static enum cllm_status alloc_rows(struct cllm_model *m, void *p, int64_t rows, int64_t cols,
                                   size_t elem)
{
    return m->be->iface->alloc(m->be, (size_t)(rows * cols) * elem, (void **)p);
}

/* Lets the backend time its ways of computing each matmul shape of the model -- the same bits
 * whichever it picks (backend.h) -- before the first step, on each projection's weights of
 * every layer in turn. The activation buffers serve as operands: inputs zeroed first, so that
 * the timed kernels read numbers rather than whatever the allocations held. */
static enum cllm_status tune_matmuls(struct cllm_model *m)
{
    struct cllm_backend *b = m->be;
    const struct cllm_backend_iface *be = b->iface;
    const struct cllm_hparams *hp = &m->hp;
    if (!be->tune_matmul || hp->n_layer < 1)
        return CLLM_OK;
    const int32_t T = m->max_tokens, O = m->max_outputs, E = hp->n_embd, F = hp->n_ff;
    const int32_t Q = hp->n_head * hp->head_dim;
    const int32_t QKV = Q + 2 * hp->n_head_kv * hp->head_dim;
    const size_t act = m->act_size;
    enum cllm_status st;
    if ((st = be->memzero(b, m->xn, (size_t)T * E * act)) ||
        (st = be->memzero(b, m->attn, (size_t)T * Q * act)) ||
        (st = be->memzero(b, m->ff, (size_t)T * F * act)) ||
        (st = be->memzero(b, m->out_n, (size_t)O * E * act)))
        return st;
    const struct layer *L0 = &m->layers[0];
    const bool gu_stacked = L0->gate_up.stacked.host != NULL;
    const bool gu_silu = gu_stacked && be->matmul_gate_up_silu;
    const struct {
        size_t at; /* the weight's offset in struct layer; SIZE_MAX: the LM head */
        bool used; /* false: not one matmul in this model */
        const void *x;
        int32_t n_max;
        void *y;
        int32_t ldy;
        bool silu;
    } shapes[] = {
        {offsetof(struct layer, qkv.stacked), L0->qkv.stacked.host != NULL, m->xn, T, m->qkv, QKV,
         false},
        {offsetof(struct layer, wo), true, m->attn, T, m->ffo, E, false},
        {offsetof(struct layer, gate_up.stacked), gu_stacked, m->xn, T,
         gu_silu ? m->ff : (void *)m->gate_up, gu_silu ? F : 2 * F, gu_silu},
        {offsetof(struct layer, w_down), true, m->ff, T, m->ffo, E, false},
        {SIZE_MAX, true, m->out_n, O, m->logits_dev, hp->n_vocab, false},
    };
    const struct cllm_weight **ws = malloc((size_t)hp->n_layer * sizeof *ws);
    if (!ws)
        return CLLM_ERR_NOMEM;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0] && st == CLLM_OK; i++) {
        if (!shapes[i].used)
            continue;
        int32_t n_w = 1;
        if (shapes[i].at == SIZE_MAX)
            ws[0] = &m->output;
        else
            for (n_w = 0; n_w < hp->n_layer; n_w++)
                ws[n_w] =
                    (const struct cllm_weight *)((const char *)&m->layers[n_w] + shapes[i].at);
        st = be->tune_matmul(b, ws, n_w, shapes[i].x, shapes[i].n_max, shapes[i].y, shapes[i].ldy,
                             shapes[i].silu);
    }
    free(ws);
    return st;
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
    size_t act = cllm_backend_elem_size(be->iface->act_dtype);
    if (!act || !cllm_backend_elem_size(be->iface->kv_dtype))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "backend %s: bad activation type",
                         be->iface->name);
    struct cllm_model *m = calloc(1, sizeof *m);
    if (!m)
        return CLLM_ERR_NOMEM;
    m->hp = mf->hp;
    m->be = be;
    m->act_size = act;
    m->max_tokens = max_tokens;
    m->max_outputs = max_outputs;
    const char *no_graphs = getenv("CLLM_NO_GRAPHS");
    m->graphs_off = !be->iface->graph_begin || (no_graphs && no_graphs[0] && no_graphs[0] != '0');
    const char *unrecorded = getenv("CLLM_UNRECORDED_STEPS");
    cllm_backoff_init(&m->unrecorded_wait,
                      unrecorded && atoi(unrecorded) > 0 ? atoi(unrecorded) : UNRECORDED_STEPS);
    /* for comparisons (tests, benchmarks): every norm its own op */
    const char *apart = getenv("CLLM_NORMS_APART");
    m->norms_apart = apart && apart[0] && apart[0] != '0';
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
    static const char *const qkv_w[] = {"attn_q.weight", "attn_k.weight", "attn_v.weight"};
    static const char *const qkv_b[] = {"attn_q.bias", "attn_k.bias", "attn_v.bias"};
    static const char *const gu_w[] = {"ffn_gate.weight", "ffn_up.weight"};
    for (int32_t l = 0; l < hp->n_layer; l++) {
        struct layer *L = &m->layers[l];
        char name[64];
        static const struct {
            const char *name;
            size_t off;
        } single[] = {
            {"attn_norm.weight", offsetof(struct layer, attn_norm)},
            {"attn_output.weight", offsetof(struct layer, wo)},
            {"ffn_norm.weight", offsetof(struct layer, ffn_norm)},
            {"ffn_down.weight", offsetof(struct layer, w_down)},
        };
        for (size_t i = 0; i < sizeof single / sizeof single[0]; i++) {
            snprintf(name, sizeof name, "blk.%d.%s", (int)l, single[i].name);
            if ((st = load(m, mf, name, (struct cllm_weight *)((char *)L + single[i].off), false,
                           err, err_len)))
                goto fail;
        }
        if ((st = load_stacked(m, mf, l, qkv_w, 3, &L->qkv.stacked, L->qkv.parts, &L->qkv.n_parts,
                               false, err, err_len)) ||
            (st = load_stacked(m, mf, l, qkv_b, 3, &L->b_qkv, NULL, NULL, true, err, err_len)) ||
            (st = load_stacked(m, mf, l, gu_w, 2, &L->gate_up.stacked, L->gate_up.parts,
                               &L->gate_up.n_parts, false, err, err_len)))
            goto fail;
    }
    int64_t T = max_tokens, O = max_outputs, E = hp->n_embd, F = hp->n_ff;
    int64_t Q = (int64_t)hp->n_head * hp->head_dim, KV = (int64_t)hp->n_head_kv * hp->head_dim;
    const size_t f32 = sizeof(float);
    /* the residual's second buffer: for backends whose projections can apply their norm */
    const bool own_norms =
        !m->norms_apart && (be->iface->matmul_rope_store || be->iface->matmul_gate_up_silu);
    if ((st = alloc_rows(m, &m->x, T, E, f32)) ||
        (own_norms && (st = alloc_rows(m, &m->x_alt, T, E, f32))) ||
        (st = alloc_rows(m, &m->xn, T, E, act)) ||
        (st = alloc_rows(m, &m->qkv, T, Q + 2 * KV, f32)) ||
        (st = alloc_rows(m, &m->attn, T, Q, act)) ||
        (st = alloc_rows(m, &m->gate_up, T, 2 * F, f32)) ||
        (st = alloc_rows(m, &m->ff, T, F, act)) || (st = alloc_rows(m, &m->ffo, T, E, f32)) ||
        (st = alloc_rows(m, &m->out_x, O, E, f32)) ||
        (st = alloc_rows(m, &m->out_ffo, O, E, f32)) ||
        (st = alloc_rows(m, &m->out_n, O, E, act)) ||
        (st = alloc_rows(m, &m->logits_dev, O, hp->n_vocab, f32))) {
        cllm_fail(err, err_len, st, "cannot allocate activations for %d tokens", (int)max_tokens);
        goto fail;
    }
    size_t scratch = be->iface->attention_scratch(be, max_tokens, hp->n_head, hp->head_dim);
    if (scratch && (st = cllm_backend_alloc_zeroed(be, scratch, &m->attn_scratch))) {
        cllm_fail(err, err_len, st, "cannot allocate activations for %d tokens", (int)max_tokens);
        goto fail;
    }
    if ((st = tune_matmuls(m))) {
        cllm_fail(err, err_len, st, "cannot time the matmuls on the device");
        goto fail;
    }
    m->logits_host = malloc((size_t)(O * hp->n_vocab) * sizeof(float));
    m->rows = calloc((size_t)O, sizeof *m->rows);
    m->flights[0].drawn = calloc((size_t)O, sizeof(int32_t));
    m->flights[1].drawn = calloc((size_t)O, sizeof(int32_t));
    m->resolved = calloc((size_t)T, sizeof(int32_t));
    if (!m->logits_host || !m->rows || !m->flights[0].drawn || !m->flights[1].drawn ||
        !m->resolved) {
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

static void free_proj(struct cllm_backend *be, struct proj *p)
{
    be->iface->weight_free(be, &p->stacked);
    for (int i = 0; i < p->n_parts; i++)
        be->iface->weight_free(be, &p->parts[i]);
}

void cllm_model_free(struct cllm_model *m)
{
    if (!m)
        return;
    const struct cllm_backend_iface *be = m->be->iface;
    if (m->layers) {
        for (int32_t l = 0; l < m->hp.n_layer; l++) {
            struct layer *L = &m->layers[l];
            struct cllm_weight *single[] = {&L->attn_norm, &L->ffn_norm, &L->b_qkv, &L->wo,
                                            &L->w_down};
            for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
                be->weight_free(m->be, single[i]);
            free_proj(m->be, &L->qkv);
            free_proj(m->be, &L->gate_up);
        }
    }
    if (!m->tied)
        be->weight_free(m->be, &m->output);
    be->weight_free(m->be, &m->tok_embd);
    be->weight_free(m->be, &m->output_norm);
    void *bufs[] = {m->x,       m->x_alt,      m->xn,       m->qkv,         m->attn,
                    m->gate_up, m->ff,         m->ffo,      m->out_x,       m->out_ffo,
                    m->out_n,   m->logits_dev, m->step_i32, m->attn_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->dealloc(m->be, bufs[i]);
    free(m->pad_i32);
    free(m->step_host);
    free(m->rows);
    free(m->flights[0].drawn);
    free(m->flights[1].drawn);
    free(m->resolved);
    free(m->logits_host);
    free(m->layers);
    free(m);
}

const struct cllm_hparams *cllm_model_hparams(const struct cllm_model *m)
{
    return &m->hp;
}

struct cllm_backend *cllm_model_backend(const struct cllm_model *m)
{
    return m->be;
}

int32_t cllm_model_max_tokens(const struct cllm_model *m)
{
    return m->max_tokens;
}

uint64_t cllm_model_kv_bytes_per_token(const struct cllm_model *m)
{
    return (uint64_t)m->hp.n_layer * 2u * (uint64_t)m->hp.n_head_kv * (uint64_t)m->hp.head_dim *
           cllm_backend_elem_size(m->be->iface->kv_dtype);
}

enum cllm_status cllm_kv_cache_init(struct cllm_kv_cache *kv, const struct cllm_model *m,
                                    int32_t n_blocks, int32_t block_size, char *err, size_t err_len)
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
                   (size_t)m->hp.head_dim * cllm_backend_elem_size(m->be->iface->kv_dtype);
    /* Zeroed: padding rows of recorded steps read slot 0, and must read finite numbers. */
    for (int32_t l = 0; l < kv->n_layer; l++)
        if (cllm_backend_alloc_zeroed(m->be, bytes, &kv->k[l]) ||
            cllm_backend_alloc_zeroed(m->be, bytes, &kv->v[l]))
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
