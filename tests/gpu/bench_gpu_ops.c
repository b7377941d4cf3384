/*
 * Times each CUDA backend op of the forward pass at Qwen2.5-1.5B's shapes and the step sizes
 * the server runs (decode 1..192 tokens, a 512-token prefill chunk), issued as the model
 * issues them: 20 of the same op recorded into one replayed step (graph_begin/graph_end), so
 * launch costs are those of a recorded decode step. Prints one table: microseconds per op and
 * what that is in bytes moved and FLOPs. It tells where a step's time goes, beside the
 * whole-step numbers of `cllm bench`.
 *
 * A benchmark, not a test: nothing here fails on timing. The comparison rows come from the
 * backend's own switches, one run each (tests/gpu/run): CLLM_CUBLAS=1 (every GEMM through
 * cuBLAS), CLLM_ATTN_SIMT=1 (the CUDA-core attention kernel), CLLM_NO_PDL=1, CLLM_GEMM_TILE
 * and CLLM_GEMM_AHEAD (our GEMM's variants), CLLM_GEMM_TUNE=0 (the GEMMs' default ways, not the
 * ones tuned at start); `bench_gpu_ops --gemms` times the GEMMs alone.
 * Without a CUDA device it prints why and exits 77.
 *
 * `bench_gpu_ops --cpu` runs the same harness once over the CPU backend at the smaller step
 * sizes (ops issued one by one, no timing worth reading): a CTest smoke test, so that the
 * buffers and batches built here are checked (under ASan too) before a GPU run needs them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "core/f16.h"
#include "core/status.h"
#include "test.h"

/* Qwen2.5-1.5B */
#define DIM 1536
#define N_HEAD 12
#define N_KV 2
#define HD 128
#define FF 8960
#define VOCAB 151936
#define QKV_LD ((N_HEAD + 2 * N_KV) * HD)
#define BLOCK 16 /* KV block size, as the server's */

#define REPS 20 /* ops per recorded step */

static struct cllm_backend *gpu;
static const struct cllm_backend_iface *G;
static bool smoke; /* --cpu */
static uint64_t rng_state = 7;
static uint64_t next_key = 1;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    if (G->alloc(gpu, bytes, &p) != CLLM_OK) {
        fprintf(stderr, "bench_gpu_ops: out of device memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* n values in [-scale, scale) as dtype (F32 or BF16), in host memory. */
static void *host_random(int64_t n, enum cllm_dtype dtype, float scale)
{
    void *h = malloc((size_t)n * cllm_backend_elem_size(dtype));
    for (int64_t i = 0; i < n; i++) {
        float f = (float)((test_urand(&rng_state) * 2.0 - 1.0) * scale);
        if (dtype == CLLM_DTYPE_F32)
            ((float *)h)[i] = f;
        else
            ((uint16_t *)h)[i] = cllm_f32_to_bf16(f);
    }
    return h;
}

/* A device buffer of n random values of dtype: F32, or the backend's act_dtype / kv_dtype. */
static void *dev_random(int64_t n, enum cllm_dtype dtype, float scale)
{
    size_t bytes = (size_t)n * cllm_backend_elem_size(dtype);
    void *h = host_random(n, dtype, scale), *d = dev_alloc(bytes);
    CHECK(G->upload(gpu, d, h, bytes) == CLLM_OK);
    free(h);
    return d;
}

static void *dev_ints(const int32_t *v, int64_t n)
{
    void *d = dev_alloc((size_t)n * 4);
    CHECK(G->upload(gpu, d, v, (size_t)n * 4) == CLLM_OK);
    return d;
}

/* A weight and the host tensor it came from (the CPU backend borrows the latter). */
struct bench_weight {
    struct cllm_tensor t;
    struct cllm_weight w;
};

/* Random BF16 weight of rows x cols, or (f32) an F32 vector around 1 (norms, biases). */
static struct bench_weight *make_weight(int64_t cols, int64_t rows, bool f32)
{
    struct bench_weight *bw = calloc(1, sizeof *bw);
    enum cllm_dtype dt = f32 ? CLLM_DTYPE_F32 : CLLM_DTYPE_BF16;
    int64_t n = cols * rows;
    bw->t = (struct cllm_tensor){"w",
                                 dt,
                                 rows > 1 ? 2 : 1,
                                 {cols, rows, 1, 1},
                                 (uint64_t)n * cllm_backend_elem_size(dt),
                                 host_random(n, dt, 0.05f)};
    char err[256] = "";
    if (G->weight_init(gpu, &bw->t, &bw->w, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "bench_gpu_ops: weight: %s\n", err);
        exit(1);
    }
    return bw;
}

static void free_weight(struct bench_weight *bw)
{
    G->weight_free(gpu, &bw->w);
    free((void *)bw->t.data);
    free(bw);
}

/* One op with its operands; issue() queues it once. */
struct op {
    const char *name;
    enum cllm_status (*issue)(const struct op *o);
    int32_t n;           /* tokens of the step */
    double bytes, flops; /* per op, for the rate columns */
    struct cllm_weight *w, *b;
    void *x, *y, *res, *scratch, *k, *v;
    struct cllm_attn_batch batch;
    int32_t dim;
    const struct cllm_norm_in *norm; /* the fused projections' norm, or NULL */
};

static enum cllm_status issue_matmul(const struct op *o)
{
    return G->matmul(gpu, o->w, o->b, o->x, o->n, o->y, (int32_t)o->w->ne[1]);
}

static enum cllm_status issue_matmul_gate_up_silu(const struct op *o)
{
    if (!G->matmul_gate_up_silu)
        return CLLM_ERR_UNSUPPORTED;
    return G->matmul_gate_up_silu(gpu, o->w, o->x, o->n, o->dim, o->y, o->norm);
}

static enum cllm_status issue_add_rmsnorm(const struct op *o)
{
    return G->add_rmsnorm(gpu, o->res, o->x, o->w, 1e-6f, o->n, o->dim, o->y);
}

static enum cllm_status issue_rope_store(const struct op *o)
{
    struct cllm_rope rope = {1000000.0f, HD};
    return G->qkv_rope_store(gpu, &rope, &o->batch, o->x, QKV_LD, o->b, N_HEAD, N_KV, o->k, o->v);
}

/* The QKV projection with bias + RoPE + KV store in its epilogue (x: the act rows, y: qkv). */
static enum cllm_status issue_matmul_rope_store(const struct op *o)
{
    struct cllm_rope rope = {1000000.0f, HD};
    if (!G->matmul_rope_store)
        return CLLM_ERR_UNSUPPORTED;
    return G->matmul_rope_store(gpu, o->w, o->x, &rope, &o->batch, o->y, QKV_LD, o->b, N_HEAD, N_KV,
                                o->k, o->v, o->norm);
}

static enum cllm_status issue_attention(const struct op *o)
{
    return G->attention(gpu, &o->batch, o->x, QKV_LD, o->k, o->v, N_HEAD, N_KV, HD,
                        0.08838834764831845f, o->scratch, o->y);
}

static enum cllm_status issue_gather(const struct op *o)
{
    return G->gather_rows(gpu, o->x, o->batch.pos, 1, 1, o->y);
}

/* A row that has no time: the op (or its replay) failed with st. */
static void print_failed(const char *name, int32_t n, const char *what, enum cllm_status st)
{
    printf("  %-34s %5d  %s%s\n", name, (int)n, what, cllm_status_str(st));
}

static void print_row(const struct op *o, double us)
{
    printf("  %-34s %5d %9.2f %9.1f %9.1f\n", o->name, (int)o->n, us, o->bytes / us * 1e-3,
           o->flops / us * 1e-6);
}

/* Records REPS issues of o as one step, then replays it until ~50 ms have passed (--cpu:
 * issues it once). */
static void time_op(const struct op *o)
{
    enum cllm_status st = CLLM_OK;
    if (smoke) {
        double t0 = now_s();
        st = o->issue(o);
        if (st == CLLM_OK)
            st = G->sync(gpu);
        if (st == CLLM_OK)
            print_row(o, (now_s() - t0) * 1e6);
        else
            print_failed(o->name, o->n, "", st);
        return;
    }
    /* Once unrecorded first, as the engine's first step of a size is: a recording cannot grow
     * the backend's buffers (the GEMM's scratch), and without them it records a slower path. */
    st = o->issue(o);
    if (st == CLLM_OK)
        st = G->sync(gpu);
    uint64_t key = next_key++;
    bool replayed = false;
    if (st == CLLM_OK)
        st = G->graph_begin(gpu, key, &replayed);
    for (int r = 0; st == CLLM_OK && r < REPS; r++)
        st = o->issue(o);
    enum cllm_status end = G->graph_end(gpu, key);
    if (st == CLLM_OK)
        st = end;
    if (st == CLLM_OK)
        st = G->sync(gpu);
    if (st != CLLM_OK) {
        print_failed(o->name, o->n, "", st);
        return;
    }
    double t = 0.0;
    long iters = 1;
    for (;;) {
        double t0 = now_s();
        for (long i = 0; i < iters && st == CLLM_OK; i++) {
            st = G->graph_begin(gpu, key, &replayed);
            if (st == CLLM_OK && !replayed) { /* cannot happen: the step was just recorded */
                G->graph_end(gpu, key);
                st = CLLM_ERR_DEVICE;
            }
        }
        if (st == CLLM_OK)
            st = G->sync(gpu);
        t = now_s() - t0;
        if (st != CLLM_OK || t >= 0.05 || iters > 1 << 20)
            break;
        iters *= 4;
    }
    if (st != CLLM_OK)
        print_failed(o->name, o->n, "replay: ", st);
    else
        print_row(o, t / (double)(iters * REPS) * 1e6);
}

/* Times an eager sample() of n rows: queue, then the sync that delivers the tokens; with
 * seen > 0, Qwen's repetition penalty (1.1) over `seen` distinct tokens a row as well (the
 * counts' upload and the penalty kernel). */
static void time_sample(int32_t n, float temperature, int32_t seen)
{
    if (!G->sample)
        return; /* the host samples for this backend */
    float *logits = dev_random((int64_t)n * VOCAB, CLLM_DTYPE_F32, 8.0f);
    struct cllm_sample_row *rows = calloc((size_t)n, sizeof *rows);
    struct cllm_token_count *counts = calloc((size_t)n * (size_t)seen + 1, sizeof *counts);
    int32_t *tokens = malloc((size_t)n * 4);
    for (int32_t i = 0; i < n; i++) {
        rows[i] = (struct cllm_sample_row){.temperature = temperature,
                                           .top_k = temperature > 0 ? 20 : 0,
                                           .top_p = temperature > 0 ? 0.8f : 1.0f,
                                           .seed = 1u + (uint64_t)i,
                                           .repetition_penalty = seen > 0 ? 1.1f : 1.0f,
                                           .counts_at = i * seen,
                                           .n_counts = seen};
        for (int32_t k = 0; k < seen; k++) /* distinct tokens, spread over the vocabulary */
            counts[i * seen + k] =
                (struct cllm_token_count){(i * 7919 + k * 211) % VOCAB, (uint32_t)(k % 3)};
    }
    enum cllm_status st = CLLM_OK;
    int iters = 0;
    double t0 = now_s();
    while (st == CLLM_OK && (iters < 5 || now_s() - t0 < 0.05)) {
        st = G->sample(gpu, logits, n, VOCAB, rows, counts, tokens);
        if (st == CLLM_OK)
            st = G->sync(gpu);
        iters++;
    }
    double us = (now_s() - t0) / iters * 1e6;
    char name[64];
    snprintf(name, sizeof name, "sample %s%s (eager, incl. sync)",
             temperature > 0 ? "top-k/top-p" : "greedy", seen > 0 ? " + rep." : "");
    if (st != CLLM_OK)
        print_failed(name, n, "", st);
    else
        printf("  %-34s %5d %9.2f %9.1f %9s\n", name, (int)n, us, (double)n * VOCAB * 4 / us * 1e-3,
               "-");
    G->dealloc(gpu, logits);
    free(rows), free(counts), free(tokens);
}

/* A step's batch: n_seqs sequences whose query tokens are the last `q_per_seq` of `len`
 * tokens each, blocks laid out one sequence after the other. Arrays are device copies. */
static struct cllm_attn_batch make_batch(int32_t n_seqs, int32_t len, int32_t q_per_seq)
{
    int32_t max_blocks = (len + BLOCK - 1) / BLOCK, n = n_seqs * q_per_seq;
    int32_t *table = malloc((size_t)n_seqs * max_blocks * 4), *pos = malloc((size_t)n * 4),
            *seq = malloc((size_t)n * 4), *slot = malloc((size_t)n * 4);
    for (int32_t i = 0; i < n_seqs * max_blocks; i++)
        table[i] = i;
    for (int32_t s = 0, t = 0; s < n_seqs; s++)
        for (int32_t p = len - q_per_seq; p < len; p++, t++) {
            pos[t] = p, seq[t] = s;
            slot[t] = table[s * max_blocks + p / BLOCK] * BLOCK + p % BLOCK;
        }
    struct cllm_attn_batch b = {n,
                                dev_ints(pos, n),
                                dev_ints(seq, n),
                                dev_ints(slot, n),
                                dev_ints(table, (int64_t)n_seqs * max_blocks),
                                max_blocks,
                                BLOCK,
                                len};
    free(table), free(pos), free(seq), free(slot);
    return b;
}

static void free_batch(struct cllm_attn_batch *b)
{
    G->dealloc(gpu, (void *)b->pos), G->dealloc(gpu, (void *)b->seq);
    G->dealloc(gpu, (void *)b->slot), G->dealloc(gpu, (void *)b->block_table);
}

static void bench_gemms(void)
{
    struct {
        const char *name;
        int64_t N, K;
        bool silu, bias;
    } shapes[] = {
        {"matmul qkv 2048x1536 +bias", QKV_LD, DIM, false, true},
        {"matmul o 1536x1536", DIM, N_HEAD * HD, false, false},
        {"matmul gate_up 17920x1536", 2 * FF, DIM, false, false},
        /* the same weight with SiLU in the epilogue, BF16 out: what the model runs (session
         * 22's model applied SiLU as the down projection loaded its F32 input instead) */
        {"matmul_gate_up_silu 17920x1536", 2 * FF, DIM, true, false},
        {"matmul down 1536x8960", DIM, FF, false, false},
        {"matmul lm_head 151936x1536", VOCAB, DIM, false, false},
    };
    const int32_t steps[] = {1, 8, 64, 192, 512};
    const int32_t max_n = smoke ? 8 : 512;
    /* the norm's operands (x_residual, what is added, where it moves) and weight */
    float *res = dev_random((int64_t)3 * max_n * DIM, CLLM_DTYPE_F32, 1.0f);
    struct bench_weight *g = make_weight(DIM, 1, true);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        if (smoke && shapes[s].N == VOCAB)
            continue; /* the same kernels as the others, at 10x the host's time */
        struct bench_weight *w = make_weight(shapes[s].K, shapes[s].N, false);
        struct bench_weight *b = make_weight(shapes[s].N, 1, true);
        /* output rows: F32, or (SiLU) act_dtype, one per gate/up pair */
        int64_t out_cols = shapes[s].silu ? shapes[s].N / 2 : shapes[s].N;
        size_t act = cllm_backend_elem_size(G->act_dtype), out_elem = shapes[s].silu ? act : 4;
        void *x = dev_random(max_n * shapes[s].K, G->act_dtype, 1.0f);
        void *y = dev_alloc((size_t)max_n * shapes[s].N * 4);
        /* as the model does at load: the backend picks its fastest way per step size (the
         * GPU log says which, beside the default way's time; CLLM_GEMM_TUNE=0: defaults) */
        if (G->tune_matmul) {
            const int32_t n_tune = shapes[s].N == VOCAB ? 192 : max_n;
            const struct cllm_weight *ws[] = {&w->w};
            CHECK(G->tune_matmul(gpu, ws, 1, x, n_tune, y, (int32_t)out_cols, shapes[s].silu) ==
                  CLLM_OK);
        }
        for (size_t i = 0; i < sizeof steps / sizeof steps[0] && steps[i] <= max_n; i++) {
            int32_t n = steps[i];
            if (shapes[s].N == VOCAB && n > 192)
                continue; /* the LM head only sees the rows that sample */
            struct op o = {.name = shapes[s].name,
                           .issue = shapes[s].silu ? issue_matmul_gate_up_silu : issue_matmul,
                           .n = n};
            o.w = &w->w, o.b = shapes[s].bias ? &b->w : NULL, o.x = x, o.y = y;
            o.dim = (int32_t)out_cols;
            o.bytes = (double)shapes[s].N * shapes[s].K * 2 + (double)n * shapes[s].K * act +
                      (double)n * out_cols * out_elem;
            o.flops = 2.0 * n * shapes[s].N * shapes[s].K;
            time_op(&o);
            if (shapes[s].silu && n <= 8) { /* with the residual add + RMSNorm in it */
                struct cllm_norm_in nin = {res, res + (size_t)max_n * DIM, &g->w, 1e-6f,
                                           res + (size_t)2 * max_n * DIM};
                struct op f = o;
                f.name = "matmul_gate_up_silu +norm", f.norm = &nin;
                time_op(&f);
            }
        }
        free_weight(w), free_weight(b);
        G->dealloc(gpu, x), G->dealloc(gpu, y);
    }
    free_weight(g);
    G->dealloc(gpu, res);
}

static void bench_small_ops(void)
{
    struct bench_weight *g = make_weight(DIM, 1, true), *bias = make_weight(QKV_LD, 1, true);
    size_t act = cllm_backend_elem_size(G->act_dtype), kv = cllm_backend_elem_size(G->kv_dtype);
    void *res = dev_random(512 * DIM, CLLM_DTYPE_F32, 1.0f);
    void *res_alt = dev_random(512 * DIM, CLLM_DTYPE_F32, 1.0f); /* where a fused norm moves it */
    void *x = dev_random(512 * DIM, CLLM_DTYPE_F32, 1.0f);
    void *xn = dev_alloc((size_t)512 * DIM * act);
    const int32_t steps[] = {1, 192, 512};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        struct op o = {.name = "add_rmsnorm 1536", .issue = issue_add_rmsnorm, .n = steps[i]};
        o.w = &g->w, o.res = res, o.x = x, o.y = xn, o.dim = DIM;
        o.bytes = (double)steps[i] * DIM * (4 + 4 + 4 + (double)act);
        time_op(&o);
    }
    /* RoPE + KV store: 1, 8 or 192 sequences decoding at 320, or one 512-token prompt; the
     * QKV projection with both in its epilogue where the step is small enough for it */
    struct bench_weight *wqkv = make_weight(DIM, QKV_LD, false);
    void *xa = dev_random(32 * DIM, G->act_dtype, 1.0f);
    struct {
        int32_t n_seqs, len, q;
    } rs[] = {{1, 320, 1}, {8, 320, 1}, {192, 320, 1}, {1, 512, 512}};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) {
        struct cllm_attn_batch b = make_batch(rs[i].n_seqs, rs[i].len, rs[i].q);
        int64_t slots = (int64_t)rs[i].n_seqs * b.max_blocks * BLOCK;
        void *qkv = dev_random((int64_t)b.n_tokens * QKV_LD, CLLM_DTYPE_F32, 1.0f);
        void *k = dev_alloc((size_t)slots * N_KV * HD * kv);
        void *v = dev_alloc((size_t)slots * N_KV * HD * kv);
        struct op o = {.name = "qkv_rope_store +bias", .issue = issue_rope_store, .n = b.n_tokens};
        o.batch = b, o.x = qkv, o.b = &bias->w, o.k = k, o.v = v;
        o.bytes = (double)b.n_tokens * (QKV_LD * 4.0 * 2 + N_KV * HD * 2 * (double)kv);
        time_op(&o);
        if (b.n_tokens <= 32) {
            struct op f = {.name = "matmul_rope_store qkv +bias",
                           .issue = issue_matmul_rope_store,
                           .n = b.n_tokens};
            f.batch = b, f.w = &wqkv->w, f.x = xa, f.y = qkv, f.b = &bias->w, f.k = k, f.v = v;
            f.bytes = (double)QKV_LD * DIM * 2 +
                      (double)b.n_tokens *
                          (DIM * (double)act + QKV_LD * 4.0 + N_KV * HD * 2 * (double)kv);
            f.flops = 2.0 * b.n_tokens * QKV_LD * DIM;
            time_op(&f);
            /* ... and with the residual add + RMSNorm before it in the same kernel: against the
             * add_rmsnorm row and this one, what the norm costs there */
            struct cllm_norm_in nin = {res, x, &g->w, 1e-6f, res_alt};
            f.name = "matmul_rope_store qkv +norm +bias", f.norm = &nin;
            if (b.n_tokens <= 8)
                time_op(&f);
        }
        G->dealloc(gpu, qkv), G->dealloc(gpu, k), G->dealloc(gpu, v);
        free_batch(&b);
    }
    free_weight(wqkv);
    G->dealloc(gpu, xa);
    /* the floor: a one-element gather, i.e. what one more kernel in a step costs */
    struct cllm_attn_batch b = make_batch(1, 1, 1);
    struct op o = {.name = "launch floor (1-element gather)", .issue = issue_gather, .n = 1};
    o.batch = b, o.x = x, o.y = res, o.bytes = 8;
    time_op(&o);
    free_batch(&b);
    free_weight(g), free_weight(bias);
    G->dealloc(gpu, res), G->dealloc(gpu, res_alt), G->dealloc(gpu, x), G->dealloc(gpu, xn);
}

static void bench_attention(void)
{
    struct {
        const char *name;
        int32_t n_seqs, len, q;
    } cases[] = {
        {"attention decode len 320", 1, 320, 1},         {"attention decode len 4000", 1, 4000, 1},
        {"attention decode 192 x len 320", 192, 320, 1}, {"attention prefill 512", 1, 512, 512},
        {"attention prefill 2048", 1, 2048, 2048},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (smoke && cases[i].q > 1)
            continue; /* the host's attention is quadratic in the prompt */
        struct cllm_attn_batch b = make_batch(cases[i].n_seqs, cases[i].len, cases[i].q);
        int64_t slots = (int64_t)cases[i].n_seqs * b.max_blocks * BLOCK;
        void *q = dev_random((int64_t)b.n_tokens * QKV_LD, CLLM_DTYPE_F32, 1.0f);
        void *k = dev_random(slots * N_KV * HD, G->kv_dtype, 1.0f);
        void *v = dev_random(slots * N_KV * HD, G->kv_dtype, 1.0f);
        void *out =
            dev_alloc((size_t)b.n_tokens * N_HEAD * HD * cllm_backend_elem_size(G->act_dtype));
        size_t scratch_bytes = G->attention_scratch(gpu, b.n_tokens, N_HEAD, HD) + 1;
        void *scratch = dev_alloc(scratch_bytes);
        CHECK(G->memzero(gpu, scratch, scratch_bytes) == CLLM_OK);
        struct op o = {.name = cases[i].name, .issue = issue_attention, .n = b.n_tokens};
        o.batch = b, o.x = q, o.k = k, o.v = v, o.y = out, o.scratch = scratch;
        /* bytes: each sequence's K and V once (the floor); FLOPs: Q K^T and P V over the
         * causal keys of every query row */
        double keys = 0;
        for (int32_t p = cases[i].len - cases[i].q; p < cases[i].len; p++)
            keys += p + 1;
        keys *= cases[i].n_seqs;
        o.bytes = (double)cases[i].n_seqs * cases[i].len * N_KV * HD * 2 *
                  (double)cllm_backend_elem_size(G->kv_dtype);
        o.flops = 4.0 * keys * N_HEAD * HD;
        time_op(&o);
        G->dealloc(gpu, q), G->dealloc(gpu, k), G->dealloc(gpu, v), G->dealloc(gpu, out);
        G->dealloc(gpu, scratch);
        free_batch(&b);
    }
}

int main(int argc, char **argv)
{
    smoke = argc > 1 && strcmp(argv[1], "--cpu") == 0;
    const bool gemms_only = argc > 1 && strcmp(argv[1], "--gemms") == 0;
    struct cllm_backend_options opt = {
        smoke ? CLLM_BACKEND_CPU : CLLM_BACKEND_CUDA, 0, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    char err[256] = "";
    if (cllm_backend_new(&gpu, &opt, err, sizeof err) != CLLM_OK) {
        printf("skipped: %s\n", err);
        return smoke ? 1 : 77;
    }
    G = gpu->iface;
    if (!smoke && !G->graph_begin) {
        printf("bench_gpu_ops: the backend records no steps\n");
        return 1;
    }
    const char *env[] = {"CLLM_CUBLAS",    "CLLM_ATTN_SIMT",  "CLLM_NO_PDL",
                         "CLLM_GEMM_TILE", "CLLM_GEMM_AHEAD", "CLLM_GEMM_TUNE"};
    printf("bench_gpu_ops: %s backend, Qwen2.5-1.5B shapes, %d ops per recorded step;", G->name,
           smoke ? 1 : REPS);
    for (size_t i = 0; i < sizeof env / sizeof env[0]; i++)
        if (getenv(env[i]))
            printf(" %s=%s", env[i], getenv(env[i]));
    printf("\n  %-34s %5s %9s %9s %9s\n", "op", "n", "us/op", "GB/s", "TFLOP/s");
    if (gemms_only) {
        bench_gemms();
        cllm_backend_free(gpu);
        return test_summary();
    }
    bench_small_ops();
    bench_attention();
    bench_gemms();
    time_sample(1, 0.0f, 0);
    time_sample(192, 0.0f, 0);
    time_sample(192, 0.7f, 0);
    time_sample(192, 0.7f, 600); /* Qwen's defaults, ~600 tokens seen: prompt + answer */
    cllm_backend_free(gpu);
    return test_summary();
}
