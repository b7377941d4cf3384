/*
 * The model's recorded decode steps (graph_begin/graph_end, which the CUDA backend turns into
 * CUDA graphs), checked on the CPU: a wrapper backend records op calls instead of running
 * them, exactly as stream capture does (nothing runs while recording; arguments are taken by
 * value, pointers included), and replays the list on graph_end and on every later
 * graph_begin with the same key. Greedy decoding of several prompts together through it must
 * give the bits that the plain CPU backend gives: so the model pads decode steps correctly
 * (padding rows write no KV), keys recordings by everything they bake in, and uploads each
 * step's data to the addresses the recording reads. The CPU matmul is batch-invariant, so
 * padding must not change a single logit.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/model.h"
#include "test.h"

/* --- the recording wrapper --- */

enum op_kind { OP_EMBED, OP_RMSNORM, OP_ADD_RMSNORM, OP_MATMUL, OP_QKV, OP_ATTN, OP_SILU, OP_GATHER };

struct op {
    enum op_kind kind;
    const struct cllm_weight *w, *w2;
    const void *a, *b;
    void *c, *d, *out;
    int32_t i0, i1, i2, i3;
    float f0;
    struct cllm_attn_batch batch;
    struct cllm_rope rope;
};

struct graph {
    uint64_t key;
    struct op *ops;
    int n_ops, cap;
};

struct rec {
    struct cllm_backend be;
    struct cllm_backend *cpu;
    struct cllm_backend_iface iface;
    struct graph graphs[64];
    int n_graphs;
    struct graph *recording;
    int launches, recordings;
};

static struct rec *rec_of(struct cllm_backend *be)
{
    return be->ctx;
}

static const struct cllm_backend_iface *C(struct cllm_backend *be)
{
    return rec_of(be)->cpu->iface;
}

static enum cllm_status run_op(struct cllm_backend *cpu, const struct op *o)
{
    const struct cllm_backend_iface *I = cpu->iface;
    switch (o->kind) {
    case OP_EMBED: return I->embed(cpu, o->w, o->a, o->i0, o->out);
    case OP_RMSNORM: return I->rmsnorm(cpu, o->a, o->w, o->f0, o->i0, o->i1, o->out);
    case OP_ADD_RMSNORM: return I->add_rmsnorm(cpu, o->c, o->a, o->w, o->f0, o->i0, o->i1, o->out);
    case OP_MATMUL: return I->matmul(cpu, o->w, o->w2, o->a, o->i0, o->out, o->i1);
    case OP_QKV:
        return I->qkv_rope_store(cpu, &o->rope, &o->batch, o->out, o->i0, o->w, o->i1, o->i2, o->c,
                                 o->d);
    case OP_ATTN:
        return I->attention(cpu, &o->batch, o->a, o->i0, o->b, o->c, o->i1, o->i2, o->i3, o->f0,
                            o->d, o->out);
    case OP_SILU: return I->silu_mul(cpu, o->a, o->i0, o->i1, o->out);
    case OP_GATHER: return I->gather_rows(cpu, o->a, o->b, o->i0, o->i1, o->out);
    }
    return CLLM_ERR_INVALID_ARG;
}

/* Records o while recording, else runs it. */
static enum cllm_status issue(struct cllm_backend *be, struct op o)
{
    struct rec *r = rec_of(be);
    struct graph *g = r->recording;
    if (!g)
        return run_op(r->cpu, &o);
    if (g->n_ops == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 64;
        g->ops = realloc(g->ops, (size_t)g->cap * sizeof *g->ops);
    }
    g->ops[g->n_ops++] = o;
    return CLLM_OK;
}

static enum cllm_status replay(struct rec *r, const struct graph *g)
{
    r->launches++;
    for (int i = 0; i < g->n_ops; i++) {
        enum cllm_status st = run_op(r->cpu, &g->ops[i]);
        if (st)
            return st;
    }
    return CLLM_OK;
}

static enum cllm_status w_embed(struct cllm_backend *be, const struct cllm_weight *e,
                                const int32_t *tokens, int32_t n, float *out)
{
    return issue(be, (struct op){.kind = OP_EMBED, .w = e, .a = tokens, .i0 = n, .out = out});
}

static enum cllm_status w_rmsnorm(struct cllm_backend *be, const float *x,
                                  const struct cllm_weight *w, float eps, int32_t n, int32_t dim,
                                  void *out)
{
    return issue(be, (struct op){.kind = OP_RMSNORM, .a = x, .w = w, .f0 = eps, .i0 = n, .i1 = dim,
                                 .out = out});
}

static enum cllm_status w_add_rmsnorm(struct cllm_backend *be, float *res, const float *x,
                                      const struct cllm_weight *w, float eps, int32_t n,
                                      int32_t dim, void *out)
{
    return issue(be, (struct op){.kind = OP_ADD_RMSNORM, .c = res, .a = x, .w = w, .f0 = eps,
                                 .i0 = n, .i1 = dim, .out = out});
}

static enum cllm_status w_matmul(struct cllm_backend *be, const struct cllm_weight *w,
                                 const struct cllm_weight *bias, const void *x, int32_t n,
                                 float *y, int32_t ldy)
{
    return issue(be, (struct op){.kind = OP_MATMUL, .w = w, .w2 = bias, .a = x, .i0 = n, .out = y,
                                 .i1 = ldy});
}

static enum cllm_status w_qkv(struct cllm_backend *be, const struct cllm_rope *rope,
                              const struct cllm_attn_batch *b, float *qkv, int32_t ld,
                              const struct cllm_weight *bias, int32_t n_head, int32_t n_kv,
                              void *k_cache, void *v_cache)
{
    return issue(be, (struct op){.kind = OP_QKV, .rope = *rope, .batch = *b, .out = qkv, .i0 = ld,
                                 .w = bias, .i1 = n_head, .i2 = n_kv, .c = k_cache, .d = v_cache});
}

static enum cllm_status w_attention(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                    const float *q, int32_t ldq, const void *k_cache,
                                    const void *v_cache, int32_t n_head, int32_t n_kv,
                                    int32_t head_dim, float scale, void *scratch, void *out)
{
    return issue(be, (struct op){.kind = OP_ATTN, .batch = *b, .a = q, .i0 = ldq, .b = k_cache,
                                 .c = (void *)v_cache, .i1 = n_head, .i2 = n_kv, .i3 = head_dim,
                                 .f0 = scale, .d = scratch, .out = out});
}

static enum cllm_status w_silu(struct cllm_backend *be, const float *gate_up, int32_t n,
                               int32_t dim, void *out)
{
    return issue(be, (struct op){.kind = OP_SILU, .a = gate_up, .i0 = n, .i1 = dim, .out = out});
}

static enum cllm_status w_gather(struct cllm_backend *be, const float *x, const int32_t *idx,
                                 int32_t n_idx, int32_t dim, float *out)
{
    return issue(be, (struct op){.kind = OP_GATHER, .a = x, .b = idx, .i0 = n_idx, .i1 = dim,
                                 .out = out});
}

static enum cllm_status w_graph_begin(struct cllm_backend *be, uint64_t key, bool *replayed)
{
    struct rec *r = rec_of(be);
    *replayed = false;
    if (r->recording)
        return CLLM_ERR_INVALID_ARG;
    for (int i = 0; i < r->n_graphs; i++)
        if (r->graphs[i].key == key) {
            *replayed = true;
            return replay(r, &r->graphs[i]);
        }
    if (r->n_graphs == 64)
        return CLLM_ERR_NOMEM;
    r->recording = &r->graphs[r->n_graphs];
    *r->recording = (struct graph){.key = key};
    return CLLM_OK;
}

static enum cllm_status w_graph_end(struct cllm_backend *be, uint64_t key)
{
    struct rec *r = rec_of(be);
    struct graph *g = r->recording;
    if (!g || g->key != key)
        return CLLM_ERR_INVALID_ARG;
    r->recording = NULL;
    r->n_graphs++;
    r->recordings++;
    return replay(r, g);
}

/* Everything else goes straight to the CPU backend. */
#define PASS(name, ret, params, args)                                                              \
    static ret p_##name params                                                                     \
    {                                                                                              \
        return C(be)->name args;                                                                   \
    }
PASS(alloc, enum cllm_status, (struct cllm_backend * be, size_t n, void **out),
     (rec_of(be)->cpu, n, out))
PASS(upload, enum cllm_status, (struct cllm_backend * be, void *d, const void *s, size_t n),
     (rec_of(be)->cpu, d, s, n))
PASS(download, enum cllm_status, (struct cllm_backend * be, void *d, const void *s, size_t n),
     (rec_of(be)->cpu, d, s, n))
PASS(memzero, enum cllm_status, (struct cllm_backend * be, void *d, size_t n),
     (rec_of(be)->cpu, d, n))
PASS(weight_init, enum cllm_status,
     (struct cllm_backend * be, const struct cllm_tensor *t, struct cllm_weight *w, char *e,
      size_t el),
     (rec_of(be)->cpu, t, w, e, el))
PASS(weight_init_stacked, enum cllm_status,
     (struct cllm_backend * be, const struct cllm_tensor *const *p, int n, struct cllm_weight *w,
      char *e, size_t el),
     (rec_of(be)->cpu, p, n, w, e, el))
PASS(attention_scratch, size_t, (struct cllm_backend * be, int32_t n, int32_t h, int32_t d),
     (rec_of(be)->cpu, n, h, d))
PASS(sync, enum cllm_status, (struct cllm_backend * be), (rec_of(be)->cpu))

static void p_dealloc(struct cllm_backend *be, void *p)
{
    C(be)->dealloc(rec_of(be)->cpu, p);
}

static void p_weight_free(struct cllm_backend *be, struct cllm_weight *w)
{
    C(be)->weight_free(rec_of(be)->cpu, w);
}

static void w_free(struct cllm_backend *be)
{
    struct rec *r = rec_of(be);
    for (int i = 0; i < r->n_graphs; i++)
        free(r->graphs[i].ops);
    cllm_backend_free(r->cpu);
    free(r);
}

static struct cllm_backend *recording_backend(void)
{
    struct rec *r = calloc(1, sizeof *r);
    struct cllm_backend_options o = {CLLM_BACKEND_CPU, 2, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    if (!r || cllm_backend_new(&r->cpu, &o, NULL, 0)) {
        free(r);
        return NULL;
    }
    r->iface = *r->cpu->iface;
    r->iface.name = "cpu-recording";
    r->iface.free = w_free;
    r->iface.alloc = p_alloc, r->iface.dealloc = p_dealloc, r->iface.upload = p_upload;
    r->iface.download = p_download, r->iface.memzero = p_memzero;
    r->iface.weight_init = p_weight_init, r->iface.weight_init_stacked = p_weight_init_stacked;
    r->iface.weight_free = p_weight_free, r->iface.attention_scratch = p_attention_scratch;
    r->iface.sync = p_sync;
    r->iface.embed = w_embed, r->iface.rmsnorm = w_rmsnorm, r->iface.add_rmsnorm = w_add_rmsnorm;
    r->iface.matmul = w_matmul, r->iface.qkv_rope_store = w_qkv, r->iface.attention = w_attention;
    r->iface.silu_mul = w_silu, r->iface.gather_rows = w_gather;
    r->iface.graph_begin = w_graph_begin, r->iface.graph_end = w_graph_end;
    r->iface.host_threads = NULL, r->iface.host_run = NULL; /* they would take r for the CPU's */
    r->be.iface = &r->iface;
    r->be.ctx = r;
    return &r->be;
}

/* --- greedy decoding of several prompts together --- */

#define BLOCK 16
#define BLOCKS_PER_SEQ 8
#define N_SEQS 3
#define N_GEN 20

/* Prefill each prompt, then N_GEN decode steps of all still-running sequences; sequence s
 * stops after N_GEN - 3 * s tokens, so the batch shrinks across buckets (3 -> 2 -> 1 rows). */
static bool decode(struct cllm_backend *be, const struct cllm_model_files *mf,
                   int32_t out[N_SEQS][N_GEN], float *last_logits)
{
    static const int32_t prompts[N_SEQS][6] = {{9707, 11, 1879, 0, 0, 0},
                                               {785, 3974, 13876, 38835, 916, 0},
                                               {27, 1318, 29, 220, 16, 17}};
    static const int32_t lens[N_SEQS] = {3, 5, 6};
    struct cllm_model *m;
    struct cllm_kv_cache kv;
    char err[512] = "";
    if (cllm_model_init(&m, mf, be, 16, 8, err, sizeof err) ||
        cllm_kv_cache_init(&kv, m, N_SEQS * BLOCKS_PER_SEQ + 1, BLOCK, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return false;
    }
    int32_t V = cllm_model_hparams(m)->n_vocab;
    int32_t table[N_SEQS][BLOCKS_PER_SEQ];
    for (int32_t s = 0; s < N_SEQS; s++)
        for (int32_t b = 0; b < BLOCKS_PER_SEQ; b++) /* block 0 stays free: padding reads it */
            table[s][b] = 1 + (b * N_SEQS + s);
    int32_t next[N_SEQS];
    const float *logits;
    bool ok = true;
    for (int32_t s = 0; s < N_SEQS && ok; s++) {
        int32_t pos[6], seq[6], slot[6], outs[1] = {lens[s] - 1};
        for (int32_t i = 0; i < lens[s]; i++)
            pos[i] = i, seq[i] = 0, slot[i] = table[s][0] * BLOCK + i;
        struct cllm_step st = {lens[s], prompts[s], pos, seq, slot, table[s], 1, BLOCKS_PER_SEQ,
                               1, outs};
        ok = cllm_model_forward(m, &kv, &st, &logits) == CLLM_OK;
        if (ok)
            next[s] = test_argmax(logits, V);
    }
    for (int32_t k = 0; k < N_GEN && ok; k++) {
        int32_t tok[N_SEQS], pos[N_SEQS], seq[N_SEQS], slot[N_SEQS], outs[N_SEQS], who[N_SEQS];
        int32_t tbl[N_SEQS][BLOCKS_PER_SEQ], n = 0;
        for (int32_t s = 0; s < N_SEQS; s++) {
            out[s][k] = -1;
            if (k >= N_GEN - 3 * s)
                continue;
            out[s][k] = tok[n] = next[s];
            pos[n] = lens[s] + k;
            seq[n] = outs[n] = n;
            slot[n] = table[s][pos[n] / BLOCK] * BLOCK + pos[n] % BLOCK;
            memcpy(tbl[n], table[s], sizeof tbl[n]);
            who[n++] = s;
        }
        struct cllm_step st = {n, tok, pos, seq, slot, &tbl[0][0], n, BLOCKS_PER_SEQ, n, outs};
        ok = cllm_model_forward(m, &kv, &st, &logits) == CLLM_OK;
        for (int32_t i = 0; ok && i < n; i++)
            next[who[i]] = test_argmax(logits + (int64_t)i * V, V);
        if (ok && k == N_GEN - 1)
            memcpy(last_logits, logits, (size_t)V * sizeof(float));
    }
    CHECK(ok);
    cllm_kv_cache_free(&kv, m);
    cllm_model_free(m);
    return ok;
}

int main(void)
{
    char err[1024] = "";
    struct cllm_model_files *mf;
    if (cllm_model_files_open(&mf, test_env("CLLM_TEST_GGUF"), err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int32_t V = mf->hp.n_vocab;
    float *plain_last = malloc((size_t)V * 4), *rec_last = malloc((size_t)V * 4);
    int32_t plain[N_SEQS][N_GEN], recorded[N_SEQS][N_GEN];
    struct cllm_backend *cpu, *rec = recording_backend();
    struct cllm_backend_options o = {CLLM_BACKEND_CPU, 2, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    CHECK(rec != NULL && cllm_backend_new(&cpu, &o, NULL, 0) == CLLM_OK);
    if (rec && decode(cpu, mf, plain, plain_last) && decode(rec, mf, recorded, rec_last)) {
        struct rec *r = rec_of(rec);
        printf("recordings %d, replays %d\n", r->recordings, r->launches - r->recordings);
        /* buckets 4 (3 rows), 2 and 1: one recording each, all other steps replayed */
        CHECKF(r->recordings == 3, "%d recordings", r->recordings);
        CHECKF(r->launches == N_GEN, "%d launches for %d decode steps", r->launches, N_GEN);
        CHECK(memcmp(plain, recorded, sizeof plain) == 0);
        CHECK(memcmp(plain_last, rec_last, (size_t)V * 4) == 0);
    }
    cllm_backend_free(cpu);
    cllm_backend_free(rec);
    cllm_model_files_free(mf);
    free(plain_last), free(rec_last);
    return test_summary();
}
