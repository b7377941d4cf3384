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
#include "model/model_internal.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/backoff.h"
#include "core/log.h"
#include "core/status.h"
#include "sampling/sampling.h"

/* Steps of decode tokens only are padded to one of these sizes and recorded once per size
 * (graph_begin/graph_end), so that replays see the same shapes and pointers. */
static const int32_t graph_buckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256};
#define N_GRAPH_BUCKETS (int32_t)(sizeof graph_buckets / sizeof graph_buckets[0])
#define GRAPH_MIN_LEN 256 /* attention length classes: powers of two from here */

/* Rejects a step the ops could not run safely. A step's tokens may be references to outputs
 * of the step queued just before it (see cllm_model_launch_sample): -1 - k for its output k,
 * with k < n_refs. */
static enum cllm_status check_step(const struct cllm_model *m, const struct cllm_kv_cache *kv,
                                   const struct cllm_step *s, int32_t n_refs)
{
    if (s->n_tokens < 1 || s->n_tokens > m->max_tokens || s->n_outputs < 0 ||
        s->n_outputs > m->max_outputs || s->n_seqs < 1 || s->max_blocks < 1)
        return CLLM_ERR_INVALID_ARG;
    int64_t n_slots = (int64_t)kv->n_blocks * kv->block_size;
    for (int32_t t = 0; t < s->n_tokens; t++) {
        if (s->tokens[t] < -n_refs || s->tokens[t] >= m->hp.n_vocab || s->seq[t] < 0 ||
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

/* Does every row of the step want logits, in order (decode steps)? (host arrays) */
static bool outputs_every_row(const struct cllm_step *s)
{
    if (s->n_outputs != s->n_tokens)
        return false;
    for (int32_t t = 0; t < s->n_tokens; t++)
        if (s->outputs[t] != t)
            return false;
    return true;
}

/* The bucket a step of decode tokens only (one token per sequence, each an output, in
 * order) is padded to, or 0: such steps are recorded once per shape and then replayed. */
static int32_t graph_bucket(const struct cllm_model *m, const struct cllm_step *s)
{
    if (m->graphs_off || m->unrecorded_left > 0 || s->n_seqs != s->n_tokens ||
        !outputs_every_row(s))
        return 0;
    for (int32_t t = 0; t < s->n_tokens; t++)
        if (s->seq[t] != t)
            return 0;
    for (int32_t i = 0; i < N_GRAPH_BUCKETS; i++) {
        int32_t b = graph_buckets[i];
        if (b >= s->n_tokens)
            return b <= m->max_outputs ? b : 0;
    }
    return 0;
}

/* Makes the host array *p of *cap elements hold at least need (contents not kept). */
static enum cllm_status grow_i32(int32_t **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return CLLM_OK;
    int32_t *q = realloc(*p, need * sizeof *q);
    if (!q)
        return CLLM_ERR_NOMEM;
    *p = q;
    *cap = need;
    return CLLM_OK;
}

/* The step padded to `bucket` rows: padding rows read token 0 at position 0 of an all-zero
 * block table row and write no KV (slot -1); their logits are never looked at. */
static enum cllm_status pad_step(struct cllm_model *m, const struct cllm_step *s, int32_t bucket,
                                 struct cllm_step *out)
{
    size_t B = (size_t)bucket, tbl = B * (size_t)s->max_blocks, need = 5 * B + tbl;
    if (grow_i32(&m->pad_i32, &m->pad_i32_cap, need))
        return CLLM_ERR_NOMEM;
    int32_t *tokens = m->pad_i32, *pos = tokens + B, *seq = pos + B, *slot = seq + B;
    int32_t *outputs = slot + B, *table = outputs + B;
    size_t n = (size_t)s->n_tokens, real_tbl = n * (size_t)s->max_blocks;
    memcpy(tokens, s->tokens, n * sizeof *tokens);
    memcpy(pos, s->pos, n * sizeof *pos);
    memcpy(slot, s->slot, n * sizeof *slot);
    memcpy(table, s->block_table, real_tbl * sizeof *table);
    memset(table + real_tbl, 0, (tbl - real_tbl) * sizeof *table);
    for (size_t t = 0; t < B; t++) {
        seq[t] = outputs[t] = (int32_t)t;
        if (t >= n)
            tokens[t] = pos[t] = 0, slot[t] = -1;
    }
    *out = (struct cllm_step){bucket, tokens, pos,           seq,    slot,
                              table,  bucket, s->max_blocks, bucket, outputs};
    return CLLM_OK;
}

/* Copies the step's index arrays to the device: [tokens | pos | seq | slot | outputs | table].
 * The buffer only grows, and is sized on first use for tables up to 2048 blocks wide, so
 * recorded steps keep seeing the same addresses. */
static enum cllm_status upload_step(struct cllm_model *m, const struct cllm_step *s,
                                    struct cllm_step *dev)
{
    size_t n = (size_t)s->n_tokens, tbl = (size_t)s->n_seqs * (size_t)s->max_blocks;
    size_t need = 4 * n + (size_t)s->n_outputs + tbl;
    const struct cllm_backend_iface *be = m->be->iface;
    if (need > m->step_i32_cap) {
        /* Room for tables up to 2048 blocks wide (32k tokens of 16), whatever this step's. */
        size_t T = (size_t)m->max_tokens, w = s->max_blocks > 2048 ? (size_t)s->max_blocks : 2048;
        size_t cap = 5 * T + T * w;
        if (cap < need)
            cap = need;
        if (m->step_i32)
            be->dealloc(m->be, m->step_i32);
        m->step_i32 = NULL;
        m->step_i32_cap = 0;
        m->step_i32_gen++;
        if (be->alloc(m->be, cap * sizeof(int32_t), (void **)&m->step_i32))
            return CLLM_ERR_NOMEM;
        m->step_i32_cap = cap;
    }
    /* One upload of the six arrays, packed on the host as on the device: each copy costs a
     * few microseconds of host time between two steps. */
    if (grow_i32(&m->step_host, &m->step_host_cap, need))
        return CLLM_ERR_NOMEM;
    *dev = *s;
    const int32_t *src[] = {s->tokens, s->pos, s->seq, s->slot, s->outputs, s->block_table};
    const int32_t **dst[] = {&dev->tokens, &dev->pos,     &dev->seq,
                             &dev->slot,   &dev->outputs, &dev->block_table};
    size_t len[] = {n, n, n, n, (size_t)s->n_outputs, tbl}, off = 0;
    for (int i = 0; i < 6; i++) {
        if (len[i])
            memcpy(m->step_host + off, src[i], len[i] * sizeof(int32_t));
        *dst[i] = m->step_i32 + off;
        off += len[i];
    }
    return be->upload(m->be, m->step_i32, m->step_host, need * sizeof(int32_t));
}

static enum cllm_status project(struct cllm_model *m, const struct proj *p, const void *x,
                                int32_t n, float *y, int32_t ldy);

/* Where a step's residual stream is (res) and the buffer a norm applied by a projection moves
 * it to (spare). */
struct stream {
    float *res, *spare;
};

/* The norm before a projection, by the projection's op where the backend applies it itself
 * (fused_st: what that op returned; CLLM_OK: one op less, and the stream has moved to
 * rs->spare if there was a residual to add), else rmsnorm / add_rmsnorm into xn first (the
 * stream stays where it is). */
static enum cllm_status norm_first(struct cllm_model *m, const struct cllm_norm_in *nin, int32_t n,
                                   enum cllm_status fused_st, struct stream *rs)
{
    const struct cllm_backend_iface *be = m->be->iface;
    if (fused_st == CLLM_OK) {
        if (nin->add) {
            float *t = rs->res;
            rs->res = rs->spare, rs->spare = t;
        }
        return CLLM_OK;
    }
    if (fused_st != CLLM_ERR_UNSUPPORTED)
        return fused_st;
    if (!nin->add)
        return be->rmsnorm(m->be, nin->res, nin->g, nin->eps, n, m->hp.n_embd, m->xn);
    return be->add_rmsnorm(m->be, (float *)nin->res, nin->add, nin->g, nin->eps, n, m->hp.n_embd,
                           m->xn);
}

/* ffo = W_down silu_mul(W_gate_up norm(...)): the norm and the gate/up product and SiLU in one
 * op where the backend fuses them (no F32 gate_up buffer between), else the norm, then the
 * product and SiLU in one op, else each apart. */
static enum cllm_status feed_forward(struct cllm_model *m, const struct layer *L, int32_t n,
                                     const struct cllm_norm_in *nin, struct stream *rs)
{
    const struct cllm_backend_iface *be = m->be->iface;
    int32_t F = m->hp.n_ff, E = m->hp.n_embd;
    const bool fusable = be->matmul_gate_up_silu && L->gate_up.stacked.host;
    enum cllm_status st = CLLM_ERR_UNSUPPORTED;
    if (fusable && !m->norms_apart)
        st = be->matmul_gate_up_silu(m->be, &L->gate_up.stacked, NULL, n, F, m->ff, nin);
    const bool normed = st == CLLM_OK;
    if ((st = norm_first(m, nin, n, st, rs)))
        return st;
    st = normed ? CLLM_OK : CLLM_ERR_UNSUPPORTED;
    if (!normed && fusable)
        st = be->matmul_gate_up_silu(m->be, &L->gate_up.stacked, m->xn, n, F, m->ff, NULL);
    if (st == CLLM_ERR_UNSUPPORTED) {
        if ((st = project(m, &L->gate_up, m->xn, n, m->gate_up, 2 * F)) ||
            (st = be->silu_mul(m->be, m->gate_up, n, F, m->ff)))
            return st;
    } else if (st)
        return st;
    return be->matmul(m->be, &L->w_down, NULL, m->ff, n, m->ffo, E);
}

/* q, k, v of the step's tokens: projected, biased, rotated, K and V stored in the layer's
 * cache -- in one op where the backend fuses them. */
static enum cllm_status qkv_projection(struct cllm_model *m, const struct layer *L,
                                       const struct cllm_attn_batch *ab,
                                       const struct cllm_rope *rope, void *k_cache, void *v_cache,
                                       const struct cllm_norm_in *nin, struct stream *rs)
{
    const struct cllm_backend_iface *be = m->be->iface;
    const struct cllm_hparams *hp = &m->hp;
    int32_t QKV = (hp->n_head + 2 * hp->n_head_kv) * hp->head_dim;
    const struct cllm_weight *bias = L->b_qkv.host ? &L->b_qkv : NULL;
    const bool fusable = be->matmul_rope_store && L->qkv.stacked.host;
    enum cllm_status st = CLLM_ERR_UNSUPPORTED;
    if (fusable && !m->norms_apart) /* the norm, the projection, RoPE and the KV store in one op */
        st = be->matmul_rope_store(m->be, &L->qkv.stacked, NULL, rope, ab, m->qkv, QKV, bias,
                                   hp->n_head, hp->n_head_kv, k_cache, v_cache, nin);
    const bool normed = st == CLLM_OK;
    if ((st = norm_first(m, nin, ab->n_tokens, st, rs)) || normed)
        return st;
    st = CLLM_ERR_UNSUPPORTED;
    if (fusable)
        st = be->matmul_rope_store(m->be, &L->qkv.stacked, m->xn, rope, ab, m->qkv, QKV, bias,
                                   hp->n_head, hp->n_head_kv, k_cache, v_cache, NULL);
    if (st != CLLM_ERR_UNSUPPORTED)
        return st;
    if ((st = project(m, &L->qkv, m->xn, ab->n_tokens, m->qkv, QKV)))
        return st;
    return be->qkv_rope_store(m->be, rope, ab, m->qkv, QKV, bias, hp->n_head, hp->n_head_kv,
                              k_cache, v_cache);
}

/* y[t] = the projection of x[t], into consecutive column ranges of y (row stride ldy). */
static enum cllm_status project(struct cllm_model *m, const struct proj *p, const void *x,
                                int32_t n, float *y, int32_t ldy)
{
    const struct cllm_backend_iface *be = m->be->iface;
    if (p->stacked.host)
        return be->matmul(m->be, &p->stacked, NULL, x, n, y, ldy);
    for (int i = 0; i < p->n_parts; i++) {
        enum cllm_status st = be->matmul(m->be, &p->parts[i], NULL, x, n, y, ldy);
        if (st)
            return st;
        y += p->parts[i].ne[1];
    }
    return CLLM_OK;
}

/* Queues the whole forward pass of a device-side step, up to the logits of its outputs
 * (every_row: they are the step's rows in order, so no rows are gathered). */
static enum cllm_status issue_ops(struct cllm_model *m, struct cllm_kv_cache *kv,
                                  const struct cllm_step *s, const struct cllm_attn_batch *ab,
                                  bool every_row)
{
    enum cllm_status st;
    struct cllm_backend *b = m->be;
    const struct cllm_backend_iface *be = b->iface;
    const struct cllm_hparams *hp = &m->hp;
    int32_t n = s->n_tokens, E = hp->n_embd, hd = hp->head_dim;
    int32_t Q = hp->n_head * hd, KV = hp->n_head_kv * hd, QKV = Q + 2 * KV;
    struct cllm_rope rope = {hp->rope_theta, hd};
    float scale = 1.0f / sqrtf((float)hd);

#define TRY(call)                                                                                  \
    do {                                                                                           \
        if ((st = (call)))                                                                         \
            return st;                                                                             \
    } while (0)

    TRY(be->embed(b, &m->tok_embd, s->tokens, n, m->x));
    /* The residual stream: in m->x, or in m->x_alt once a projection that applied its norm
     * itself has moved it there (struct cllm_norm_in); the two swap at each such norm. */
    struct stream rs = {m->x, m->x_alt};
    for (int32_t l = 0; l < hp->n_layer; l++) {
        const struct layer *L = &m->layers[l];
        /* the previous layer's MLP residual (none before layer 0), added in this norm */
        struct cllm_norm_in nin = {rs.res, l == 0 ? NULL : m->ffo, &L->attn_norm, hp->rms_eps,
                                   rs.spare};
        TRY(qkv_projection(m, L, ab, &rope, kv->k[l], kv->v[l], &nin, &rs));
        TRY(be->attention(b, ab, m->qkv, QKV, kv->k[l], kv->v[l], hp->n_head, hp->n_head_kv, hd,
                          scale, m->attn_scratch, m->attn));
        TRY(be->matmul(b, &L->wo, NULL, m->attn, n, m->ffo, E));
        nin = (struct cllm_norm_in){rs.res, m->ffo, &L->ffn_norm, hp->rms_eps, rs.spare};
        TRY(feed_forward(m, L, n, &nin, &rs));
    }
    if (s->n_outputs > 0) {
        /* Only the rows that need logits take the last residual add, norm and LM head: the
         * step's own rows where they are all wanted (two launches fewer a decode step). */
        float *res = rs.res, *add = m->ffo;
        if (!every_row) {
            TRY(be->gather_rows(b, rs.res, s->outputs, s->n_outputs, E, m->out_x));
            TRY(be->gather_rows(b, m->ffo, s->outputs, s->n_outputs, E, m->out_ffo));
            res = m->out_x, add = m->out_ffo;
        }
        TRY(be->add_rmsnorm(b, res, add, &m->output_norm, hp->rms_eps, s->n_outputs, E, m->out_n));
        TRY(be->matmul(b, &m->output, NULL, m->out_n, s->n_outputs, m->logits_dev, hp->n_vocab));
    }
#undef TRY
    return CLLM_OK;
}

static uint64_t mix64(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 31;
    return h * 0xbf58476d1ce4e5b9ull;
}

/* Runs the ops of a checked step (logits left on the device): recorded and replayed for
 * padded decode steps, issued one by one otherwise. With `resolve`, the backend replaces the
 * references among the tokens by the last draw's tokens once they are on the device. */
static enum cllm_status run_step(struct cllm_model *m, struct cllm_kv_cache *kv,
                                 const struct cllm_step *step, bool resolve)
{
    enum cllm_status st;
    int32_t bucket = graph_bucket(m, step);
    if (m->unrecorded_left > 0 && --m->unrecorded_left == 0)
        cllm_backoff_tried(&m->unrecorded_wait); /* the next recording tries again */
    struct cllm_step padded, s;
    if (bucket && (st = pad_step(m, step, bucket, &padded)))
        return st;
    if ((st = upload_step(m, bucket ? &padded : step, &s)))
        return st;
    if (resolve && (st = m->be->iface->resolve_tokens(m->be, (int32_t *)s.tokens, s.n_tokens)))
        return st;
    int32_t max_len = 0;
    for (int32_t t = 0; t < step->n_tokens; t++)
        if (step->pos[t] + 1 > max_len)
            max_len = step->pos[t] + 1;
    int32_t table_len = s.max_blocks * kv->block_size;
    if (bucket) {
        /* A length class, so a recording serves every step whose contexts fit in it. */
        int32_t cls = GRAPH_MIN_LEN;
        while (cls < max_len && cls < table_len)
            cls *= 2;
        max_len = cls < table_len ? cls : table_len;
    }
    struct cllm_attn_batch ab = {s.n_tokens,    s.pos,        s.seq,          s.slot,
                                 s.block_table, s.max_blocks, kv->block_size, max_len};
    const struct cllm_backend_iface *be = m->be->iface;
    const bool every_row = bucket || outputs_every_row(step); /* padded steps: every row */
    if (!bucket)
        return issue_ops(m, kv, &s, &ab, every_row);
    uint64_t key = mix64(mix64(mix64(mix64((uint64_t)bucket, (uint64_t)max_len), m->step_i32_gen),
                               (uint64_t)(uintptr_t)kv->k[0]),
                         (uint64_t)s.max_blocks * 65536u + (uint64_t)kv->block_size);
    bool replayed = false;
    if ((st = be->graph_begin(m->be, key, &replayed)))
        return st;
    if (replayed)
        return CLLM_OK;
    st = issue_ops(m, kv, &s, &ab, every_row);
    enum cllm_status end = be->graph_end(m->be, key);
    if (st == CLLM_OK && end == CLLM_OK)
        return CLLM_OK;
    /* Nothing recorded has run: this step runs op by op. A graph that found no room on the
     * device (the KV cache took it, or another process) may find it later: the steps after
     * it run op by op for a while, then recording is tried again. Anything else gives up on
     * recordings. */
    const enum cllm_status why = st ? st : end;
    if (why == CLLM_ERR_NOMEM) {
        m->unrecorded_left = cllm_backoff_failed(&m->unrecorded_wait);
        cllm_log(CLLM_LOG_WARN,
                 "model: no room on the device to record a %d-row step: it and the next %lld "
                 "steps run op by op, then recording is tried again",
                 (int)bucket, (long long)m->unrecorded_left);
    } else {
        cllm_log(CLLM_LOG_WARN,
                 "model: recording a %d-row step failed (%s); running steps unrecorded",
                 (int)bucket, cllm_status_str(why));
        m->graphs_off = true;
    }
    return issue_ops(m, kv, &s, &ab, every_row);
}

/* Runs a checked step to the end and brings its logits to m->logits_host. */
static enum cllm_status forward_checked(struct cllm_model *m, struct cllm_kv_cache *kv,
                                        const struct cllm_step *step)
{
    enum cllm_status st = run_step(m, kv, step, false);
    if (st)
        return st;
    const struct cllm_backend_iface *be = m->be->iface;
    if (step->n_outputs > 0 &&
        (st = be->download(m->be, m->logits_host, m->logits_dev,
                           (size_t)step->n_outputs * (size_t)m->hp.n_vocab * sizeof(float))))
        return st;
    return be->sync(m->be);
}

enum cllm_status cllm_model_forward(struct cllm_model *m, struct cllm_kv_cache *kv,
                                    const struct cllm_step *step, const float **logits)
{
    *logits = NULL;
    if (m->n_flights > 0)
        return CLLM_ERR_INVALID_ARG; /* launched steps are waited for first */
    enum cllm_status st = check_step(m, kv, step, 0);
    if (st || (st = forward_checked(m, kv, step)))
        return st;
    *logits = m->logits_host;
    return CLLM_OK;
}

bool cllm_model_samples_on_device(const struct cllm_model *m)
{
    return m->be->iface->sample != NULL;
}

int64_t cllm_model_unrecorded_steps(const struct cllm_model *m)
{
    return m->unrecorded_left;
}

bool cllm_model_queues_steps(const struct cllm_model *m)
{
    const struct cllm_backend_iface *be = m->be->iface;
    return be->sample && be->wait_draw && be->resolve_tokens;
}

/* A row drawn on the host as the device sampler would draw it: its penalties (over counts,
 * and the previous step's token `extra` when >= 0), then argmax when greedy, else the host
 * sampler's processors with a generator seeded by (seed, counter) alone. */
static int32_t draw_on_host(const struct cllm_sample_row *row,
                            const struct cllm_token_count *counts, int32_t extra, float *logits,
                            int32_t V)
{
    if (row->n_counts > 0 || extra >= 0) {
        const float rep = row->repetition_penalty == 0.0f ? 1.0f : row->repetition_penalty;
        cllm_penalize(logits, V, row->n_counts > 0 ? counts + row->counts_at : NULL,
                      row->n_counts > 0 ? (size_t)row->n_counts : 0, extra, rep,
                      row->presence_penalty, row->frequency_penalty);
    }
    struct cllm_sampling_params p;
    cllm_sampling_params_default(&p);
    if (row->temperature > 0.0f) {
        p.temperature = row->temperature;
        p.top_k = row->top_k;
        p.top_p = row->top_p;
        p.min_p = row->min_p;
        p.seed = mix64(row->seed, row->counter);
    }
    struct cllm_sampler *smp = NULL;
    if (cllm_sampler_new(&smp, &p, V, NULL, 0))
        return -1;
    int32_t token = cllm_sampler_sample(smp, logits);
    cllm_sampler_free(smp);
    return token;
}

static struct flight *flight_at(struct cllm_model *m, int32_t i)
{
    return &m->flights[(m->flight_head + i) % 2];
}

/* Without a device sampler the step runs now and its rows are drawn on the host: the queue
 * then only orders what the caller sees, exactly as a device would. */
static enum cllm_status run_and_draw_on_host(struct cllm_model *m, struct cllm_kv_cache *kv,
                                             const struct cllm_step *step,
                                             const struct cllm_sample_row *rows,
                                             const struct cllm_token_count *counts,
                                             struct flight *f)
{
    struct cllm_step s = *step;
    const int32_t *prev = m->n_flights > 0 ? flight_at(m, m->n_flights - 1)->drawn : NULL;
    /* as a device backend checks them: unseen outputs only of the previous step's */
    int64_t n_counts;
    int32_t max_unseen;
    if (!cllm_sample_rows_check(rows, step->n_outputs, counts, &n_counts, &max_unseen) ||
        max_unseen > (prev ? flight_at(m, m->n_flights - 1)->n_outputs : 0))
        return CLLM_ERR_INVALID_ARG;
    if (prev) { /* references to the previous step: its tokens are known here */
        for (int32_t t = 0; t < step->n_tokens; t++)
            m->resolved[t] = step->tokens[t] < 0 ? prev[-1 - step->tokens[t]] : step->tokens[t];
        s.tokens = m->resolved;
    }
    enum cllm_status st = forward_checked(m, kv, &s);
    size_t V = (size_t)m->hp.n_vocab;
    /* In place: only the caller's rows of logits are promised to the caller (model.h). */
    for (int32_t i = 0; st == CLLM_OK && i < step->n_outputs; i++) {
        f->drawn[i] = -1;
        const int32_t extra = rows[i].unseen_output > 0 ? prev[rows[i].unseen_output - 1] : -1;
        if (rows[i].temperature >= 0.0f &&
            (f->drawn[i] = draw_on_host(&rows[i], counts, extra, m->logits_host + (size_t)i * V,
                                        (int32_t)V)) < 0)
            st = CLLM_ERR_NOMEM;
    }
    return st;
}

enum cllm_status cllm_model_launch_sample(struct cllm_model *m, struct cllm_kv_cache *kv,
                                          const struct cllm_step *step,
                                          const struct cllm_sample_row *rows,
                                          const struct cllm_token_count *counts, int32_t *tokens)
{
    const struct cllm_backend_iface *be = m->be->iface;
    bool on_device = be->sample != NULL;
    if (m->n_flights >= (!on_device || cllm_model_queues_steps(m) ? 2 : 1))
        return CLLM_ERR_INVALID_ARG;
    const struct flight *prev = m->n_flights ? flight_at(m, m->n_flights - 1) : NULL;
    if (prev && prev->caller_rows) /* its logits are still to be downloaded */
        return CLLM_ERR_INVALID_ARG;
    enum cllm_status st = check_step(m, kv, step, prev ? prev->n_outputs : 0);
    if (st)
        return st;
    struct flight *f = flight_at(m, m->n_flights);
    int32_t n = step->n_outputs;
    *f = (struct flight){n, false, tokens, f->drawn};
    for (int32_t i = 0; i < n; i++)
        f->caller_rows |= rows[i].temperature < 0.0f;
    if (!on_device) {
        if ((st = run_and_draw_on_host(m, kv, step, rows, counts, f)))
            return st;
        m->n_flights++;
        return CLLM_OK;
    }
    bool refs = false;
    for (int32_t t = 0; t < step->n_tokens && !refs; t++)
        refs = step->tokens[t] < 0;
    if ((st = run_step(m, kv, step, refs)))
        return st;
    memcpy(m->rows, rows, (size_t)n * sizeof *rows);
    for (int32_t i = 0; i < n; i++)
        if (rows[i].temperature < 0.0f) /* the caller's row: any cheap draw will do */
            m->rows[i] = (struct cllm_sample_row){0};
    if (n > 0 &&
        (st = be->sample(m->be, m->logits_dev, n, m->hp.n_vocab, m->rows, counts, tokens)))
        return st;
    m->n_flights++;
    return CLLM_OK;
}

enum cllm_status cllm_model_wait_sample(struct cllm_model *m, const struct cllm_sample_row *rows,
                                        int32_t *tokens, const float **logits)
{
    *logits = NULL;
    const struct cllm_backend_iface *be = m->be->iface;
    if (m->n_flights == 0)
        return CLLM_ERR_INVALID_ARG;
    struct flight *f = flight_at(m, 0);
    if (f->tokens != tokens)
        return CLLM_ERR_INVALID_ARG; /* not the oldest step's */
    m->flight_head = (m->flight_head + 1) % 2;
    m->n_flights--;
    enum cllm_status st = CLLM_OK;
    if (!be->sample) {
        memcpy(tokens, f->drawn, (size_t)f->n_outputs * sizeof *tokens);
        *logits = m->logits_host;
        return CLLM_OK;
    }
    if (f->n_outputs > 0 && be->wait_draw)
        st = be->wait_draw(m->be);
    else if (f->n_outputs > 0 || m->n_flights == 0)
        st = be->sync(m->be); /* (no draw queued: nothing to fill, errors still surface) */
    if (st)
        return st;
    size_t V = (size_t)m->hp.n_vocab;
    bool downloaded = false; /* the caller's rows, for its own sampler */
    for (int32_t i = 0; i < f->n_outputs; i++) {
        if (rows[i].temperature >= 0.0f)
            continue;
        tokens[i] = -1;
        if ((st = be->download(m->be, m->logits_host + i * V, m->logits_dev + i * V,
                               V * sizeof(float))))
            return st;
        downloaded = true;
    }
    if (downloaded && (st = be->sync(m->be)))
        return st;
    *logits = m->logits_host;
    return CLLM_OK;
}

void cllm_model_drop_launched(struct cllm_model *m)
{
    if (m->n_flights > 0 && m->be->iface->sample)
        (void)m->be->iface->sync(m->be); /* the failure is the caller's already */
    m->n_flights = 0;
}

enum cllm_status cllm_model_forward_sample(struct cllm_model *m, struct cllm_kv_cache *kv,
                                           const struct cllm_step *step,
                                           const struct cllm_sample_row *rows,
                                           const struct cllm_token_count *counts, int32_t *tokens,
                                           const float **logits)
{
    *logits = NULL;
    enum cllm_status st = cllm_model_launch_sample(m, kv, step, rows, counts, tokens);
    return st ? st : cllm_model_wait_sample(m, rows, tokens, logits);
}
