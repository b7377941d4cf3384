/*
 * CPU implementation of backend.h. Device pointers are host pointers; weights are used in
 * place from the mapped file or, within cpu_copy_budget, from a copy in 2 MiB pages (matrices
 * in their stored dtype, unless CLLM_CPU_WEIGHTS_Q6_K quantizes float ones at load; only small
 * vectors such as norm weights and biases are widened to F32 once). Ops run synchronously; each
 * splits its rows over the pool unless it is too small to be worth a dispatch.
 */
#include "backend/cpu/backend_cpu.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/matmul.h"
#include "backend/cpu/pack_x16.h"
#include "backend/cpu/ref.h"
#include "backend/cpu/threadpool.h"
#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "tensor/convert.h"
#include "tensor/quant.h"

/* Below this many elements an elementwise op runs on the calling thread alone. */
#define MIN_PARALLEL_ELEMS 32768
/* Below this many bytes a weight's copy at load does too. */
#define MIN_PARALLEL_COPY_BYTES (256u << 10)

struct cpu {
    struct cllm_backend be;
    struct cllm_threadpool *tp;
    enum cllm_cpu_weights weights;
    uint64_t copy_budget;   /* bytes copy_weight may still copy */
    bool copy_budget_spent; /* said so in the log */
    /* copies are packed where the kernels multiply them faster so (CLLM_CPU_PACKED_WEIGHTS=0:
     * never, to compare) */
    bool pack;
    void *scratch; /* matmul activation quantization buffer */
    size_t scratch_size;
    float *rope_cos, *rope_sin; /* [rope_positions][head_dim / 2], computed on demand */
    int32_t rope_positions;
    struct cllm_rope rope_for; /* the parameters the table was computed for */
};

static struct cpu *cpu_of(struct cllm_backend *be)
{
    return be->ctx;
}

static void run(struct cpu *c, int64_t elems, cllm_task_fn fn, void *ctx)
{
    cllm_threadpool_run(elems < MIN_PARALLEL_ELEMS ? NULL : c->tp, fn, ctx);
}

static void cpu_free(struct cllm_backend *be)
{
    struct cpu *c = cpu_of(be);
    cllm_threadpool_free(c->tp);
    free(c->scratch);
    free(c->rope_cos);
    free(c->rope_sin);
    free(c);
}

static enum cllm_status cpu_alloc(struct cllm_backend *be, size_t bytes, void **out)
{
    (void)be;
    /* 64-byte alignment: whole cache lines, and aligned SIMD loads where kernels want them. */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes || !(*out = aligned_alloc(64, rounded ? rounded : 64)))
        return CLLM_ERR_NOMEM;
    return CLLM_OK;
}

/* calloc rather than alloc + memset, for the KV cache: a large block comes from fresh
 * anonymous pages (glibc maps it, and skips the clearing), which the kernel zeroes as they are
 * first touched. So a cache sized for the machine (12.5 GB on a 100 GB one) costs nothing at
 * start-up, where memset took 1.4-3.8 s per GiB on this project's VM, and takes memory only as it
 * fills. Aligned as malloc aligns (16 bytes): the kernels load unaligned. */
static enum cllm_status cpu_alloc_zeroed(struct cllm_backend *be, size_t bytes, void **out)
{
    (void)be;
    return (*out = calloc(1, bytes ? bytes : 1)) ? CLLM_OK : CLLM_ERR_NOMEM;
}

static void cpu_dealloc(struct cllm_backend *be, void *p)
{
    (void)be;
    free(p);
}

static enum cllm_status cpu_copy(struct cllm_backend *be, void *dst, const void *src, size_t n)
{
    (void)be;
    if (n)
        memcpy(dst, src, n);
    return CLLM_OK;
}

/* Vectors only (biases): matrices are used in place from the mapping, and a stacked copy
 * would cost a pass over them at load for no speed-up on the CPU. */
static enum cllm_status cpu_weight_init_stacked(struct cllm_backend *be,
                                                const struct cllm_tensor *const *parts,
                                                int n_parts, struct cllm_weight *w, char *err,
                                                size_t err_len)
{
    (void)be;
    memset(w, 0, sizeof *w);
    int64_t total = 0;
    for (int i = 0; i < n_parts; i++) {
        if (parts[i]->n_dims != 1)
            return CLLM_ERR_UNSUPPORTED;
        total += parts[i]->ne[0];
    }
    float *f = n_parts > 0 ? cllm_malloc_array((size_t)total, sizeof *f) : NULL;
    if (!f)
        return n_parts > 0 ? CLLM_ERR_NOMEM : CLLM_ERR_INVALID_ARG;
    for (int i = 0, at = 0; i < n_parts; at += (int)parts[i]->ne[0], i++)
        if (!cllm_dequant_row(parts[i]->dtype, parts[i]->data, f + at, parts[i]->ne[0])) {
            free(f);
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "tensor %s: cannot convert %s",
                             parts[i]->name, cllm_dtype_name(parts[i]->dtype));
        }
    w->host = parts[0];
    w->data = f;
    w->dtype = CLLM_DTYPE_F32;
    w->ne[0] = total;
    w->ne[1] = 1;
    return CLLM_OK;
}

struct copy_job {
    uint8_t *dst;
    const uint8_t *src;
    size_t bytes;
};

/* The threads' shares are whole 64-byte lines (the last one partial): no line is written by
 * two threads. */
static void copy_task(void *ctx, int ith, int nth)
{
    struct copy_job *j = ctx;
    int64_t a, b;
    cllm_split_rows((int64_t)((j->bytes + 63) / 64), ith, nth, &a, &b);
    const size_t from = (size_t)a * 64, to = (size_t)b * 64 < j->bytes ? (size_t)b * 64 : j->bytes;
    if (from < to)
        memcpy(j->dst + from, j->src + from, to - from);
}

/* w's layout where its rows are packed (pack_x16.h). */
#define LAYOUT_X16 1

struct pack_job {
    uint8_t *dst;
    const void *src;
    enum cllm_dtype dtype;
    int64_t K, N;
};

/* The threads' shares are whole groups of packed rows. */
static void pack_task(void *ctx, int ith, int nth)
{
    struct pack_job *j = ctx;
    int64_t a, b;
    cllm_split_rows(j->N / CLLM_PACK_ROWS, ith, nth, &a, &b);
    cllm_x16_pack(j->dtype, j->src, j->K, a * CLLM_PACK_ROWS, b * CLLM_PACK_ROWS, j->dst);
}

/* The N rows of K elements of dtype t at src, packed into dst (pack_x16.h), on the pool's
 * threads where there are enough of them. */
static void pack_rows(struct cpu *c, enum cllm_dtype t, const void *src, int64_t K, int64_t N,
                      uint64_t bytes, uint8_t *dst)
{
    struct pack_job j = {dst, src, t, K, N};
    cllm_threadpool_run(bytes < MIN_PARALLEL_COPY_BYTES ? NULL : c->tp, pack_task, &j);
}

/* w (a matrix) becomes an owned copy of t in memory from cllm_alloc_streamed, copied on the
 * pool's threads (each thread's first touch of its pages, which the kernel then clears and
 * maps), if it fits what is left of the copy budget; packed (pack_x16.h) where the kernels
 * multiply it faster so. Else, or without the memory, w stays on the mapped file: slower,
 * never wrong. */
static void copy_weight(struct cpu *c, const struct cllm_tensor *t, struct cllm_weight *w)
{
    if (t->nbytes > c->copy_budget) {
        if (c->copy_budget && !c->copy_budget_spent) {
            cllm_log(CLLM_LOG_INFO,
                     "cpu: the weight copy budget is spent at tensor %s: it and "
                     "matrices as large are read from the files",
                     t->name);
            c->copy_budget_spent = true;
        }
        return;
    }
    uint8_t *p = cllm_alloc_streamed((size_t)t->nbytes);
    if (!p) {
        cllm_log(CLLM_LOG_DEBUG, "cpu: no memory to copy tensor %s: used from the file", t->name);
        return;
    }
    if (c->pack && cllm_cpu_matmul_packs(t->dtype, t->ne[0], t->ne[1])) {
        pack_rows(c, t->dtype, t->data, t->ne[0], t->ne[1], t->nbytes, p);
        w->layout = LAYOUT_X16;
    } else {
        struct copy_job j = {p, t->data, (size_t)t->nbytes};
        cllm_threadpool_run(t->nbytes < MIN_PARALLEL_COPY_BYTES ? NULL : c->tp, copy_task, &j);
    }
    w->data = p;
    c->copy_budget -= t->nbytes;
}

/* w (a float matrix) becomes an owned Q6_K copy of t, quantized on the pool's threads, and
 * packed where the kernels multiply it faster so (with the memory for a second copy a while;
 * else it stays in the file's layout). */
static enum cllm_status quantize_q6_k(struct cpu *c, const struct cllm_tensor *t,
                                      struct cllm_weight *w, char *err, size_t err_len)
{
    uint64_t row_bytes, bytes;
    void *q = NULL;
    if (!cllm_dtype_row_bytes(CLLM_DTYPE_Q6_K, t->ne[0], &row_bytes) ||
        !cllm_mul_u64(row_bytes, (uint64_t)t->ne[1], &bytes) || bytes > SIZE_MAX ||
        !(q = cllm_alloc_streamed((size_t)bytes)))
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "tensor %s: no memory to quantize it",
                         t->name);
    if (!cllm_convert_rows_q6_k(t, 0, t->ne[1], q, cllm_threadpool_n_threads(c->tp))) {
        free(q);
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "tensor %s: cannot quantize it to Q6_K (a value that is not finite, "
                         "or too large): use --cpu-weights stored",
                         t->name);
    }
    w->data = q;
    w->dtype = CLLM_DTYPE_Q6_K;
    uint8_t *p;
    if (c->pack && cllm_cpu_matmul_packs(CLLM_DTYPE_Q6_K, t->ne[0], t->ne[1]) &&
        (p = cllm_alloc_streamed((size_t)bytes))) {
        pack_rows(c, CLLM_DTYPE_Q6_K, q, t->ne[0], t->ne[1], bytes, p);
        free(q);
        w->data = p;
        w->layout = LAYOUT_X16;
    }
    return CLLM_OK;
}

static enum cllm_status cpu_weight_init(struct cllm_backend *be, const struct cllm_tensor *t,
                                        struct cllm_weight *w, char *err, size_t err_len)
{
    memset(w, 0, sizeof *w);
    if (t->n_dims > 2)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "tensor %s has %d dimensions",
                         t->name, t->n_dims);
    /* Vectors (norms, biases) are read elementwise by the ops: widen them once. */
    if (t->n_dims == 1 && t->dtype != CLLM_DTYPE_F32)
        return cpu_weight_init_stacked(be, &t, 1, w, err, err_len);
    w->host = t;
    w->dtype = t->dtype;
    w->ne[0] = t->ne[0];
    w->ne[1] = t->n_dims == 2 ? t->ne[1] : 1;
    w->data = t->data;
    if (cpu_of(be)->weights == CLLM_CPU_WEIGHTS_Q6_K && t->n_dims == 2 &&
        cllm_backend_elem_size(t->dtype) && t->ne[0] % CLLM_QK_K == 0)
        return quantize_q6_k(cpu_of(be), t, w, err, err_len);
    if (t->n_dims == 2)
        copy_weight(cpu_of(be), t, w);
    return CLLM_OK;
}

static void cpu_weight_free(struct cllm_backend *be, struct cllm_weight *w)
{
    (void)be;
    if (w->host && w->data && w->data != w->host->data)
        free((void *)w->data);
    memset(w, 0, sizeof *w);
}

/* --- embed --- */

struct embed_job {
    const struct cllm_weight *w;
    const int32_t *tokens;
    int32_t n;
    uint64_t row_bytes;
    float *out;
};

static void embed_task(void *arg, int ith, int nth)
{
    struct embed_job *j = arg;
    int64_t s, e;
    cllm_split_rows(j->n, ith, nth, &s, &e);
    const int64_t K = j->w->ne[0];
    for (int64_t i = s; i < e; i++) {
        const char *src = (const char *)j->w->data + (uint64_t)j->tokens[i] * j->row_bytes;
        float *out = j->out + i * K;
        if (j->w->layout != LAYOUT_X16) {
            cllm_dequant_row(j->w->dtype, src, out, K);
            continue;
        }
        /* packed rows: each block back in the file's layout, then dequantized (per block) */
        for (int64_t b = 0; b < K / CLLM_QK_K; b++) {
            uint8_t blk[sizeof(struct cllm_block_q6_k)];
            cllm_x16_unpack_block(j->w->dtype,
                                  cllm_x16_record(j->w->dtype, j->w->data, K, j->tokens[i], b),
                                  j->tokens[i] % CLLM_PACK_ROWS, blk);
            cllm_dequant_row(j->w->dtype, blk, out + b * CLLM_QK_K, CLLM_QK_K);
        }
    }
}

static enum cllm_status cpu_embed(struct cllm_backend *be, const struct cllm_weight *embd,
                                  const int32_t *tokens, int32_t n, float *out)
{
    struct embed_job j = {embd, tokens, n, 0, out};
    if (!cllm_dtype_row_bytes(embd->dtype, embd->ne[0], &j.row_bytes))
        return CLLM_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= embd->ne[1])
            return CLLM_ERR_RANGE;
    run(cpu_of(be), (int64_t)n * embd->ne[0], embed_task, &j);
    return CLLM_OK;
}

/* --- rmsnorm, add, add_rmsnorm --- */

struct rows_job {
    float *res;
    const float *x;
    const float *w;
    float eps;
    int32_t n, dim;
    float *out;
};

static void add_rows(float *res, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        res[i] += x[i];
}

static void norm_task(void *arg, int ith, int nth)
{
    struct rows_job *j = arg;
    int64_t s, e;
    cllm_split_rows(j->n, ith, nth, &s, &e);
    for (int64_t r = s; r < e; r++) {
        const float *x = j->x + r * j->dim;
        if (j->res) {
            float *res = j->res + r * j->dim;
            add_rows(res, x, j->dim);
            x = res;
        }
        if (j->out)
            cllm_ref_rmsnorm_row(x, j->w, j->eps, j->dim, j->out + r * j->dim);
    }
}

static enum cllm_status cpu_rmsnorm(struct cllm_backend *be, const float *x,
                                    const struct cllm_weight *w, float eps, int32_t n, int32_t dim,
                                    void *out)
{
    struct rows_job j = {NULL, x, w->data, eps, n, dim, out};
    run(cpu_of(be), (int64_t)n * dim, norm_task, &j);
    return CLLM_OK;
}

static enum cllm_status cpu_add_rmsnorm(struct cllm_backend *be, float *res, const float *x,
                                        const struct cllm_weight *w, float eps, int32_t n,
                                        int32_t dim, void *out)
{
    struct rows_job j = {res, x, w->data, eps, n, dim, out};
    run(cpu_of(be), (int64_t)n * dim, norm_task, &j);
    return CLLM_OK;
}

/* --- matmul --- */

/* The weight as the tensor the matmul reads: the file's, or the backend's own copy of it (a
 * quantized one under CLLM_CPU_WEIGHTS_Q6_K). */
static struct cllm_tensor weight_tensor(const struct cllm_weight *w)
{
    struct cllm_tensor t = *w->host;
    uint64_t row_bytes;
    if (w->data != w->host->data && cllm_dtype_row_bytes(w->dtype, w->ne[0], &row_bytes)) {
        t.dtype = w->dtype;
        t.data = w->data;
        t.nbytes = row_bytes * (uint64_t)w->ne[1]; /* allocated as such: no overflow */
    }
    return t;
}

static enum cllm_status cpu_matmul(struct cllm_backend *be, const struct cllm_weight *w,
                                   const struct cllm_weight *bias, const void *x, int32_t n,
                                   float *y, int32_t ldy)
{
    struct cpu *c = cpu_of(be);
    size_t need = cllm_cpu_matmul_scratch_size(w->dtype, w->ne[0], n);
    if (need > c->scratch_size) {
        void *p = NULL;
        if (cpu_alloc(be, need, &p))
            return CLLM_ERR_NOMEM;
        free(c->scratch);
        c->scratch = p;
        c->scratch_size = need;
    }
    const struct cllm_tensor wt = weight_tensor(w);
    enum cllm_status st =
        w->layout == LAYOUT_X16
            ? cllm_cpu_matmul_packed(c->tp, &wt, x, n, y, ldy, c->scratch, c->scratch_size)
            : cllm_cpu_matmul(c->tp, &wt, x, n, y, ldy, c->scratch, c->scratch_size);
    if (st || !bias)
        return st;
    const float *b = bias->data;
    for (int32_t t = 0; t < n; t++)
        add_rows(y + (int64_t)t * ldy, b, w->ne[1]);
    return CLLM_OK;
}

/* --- rope + KV store --- */

/* Grows the cos/sin table to cover positions [0, max_pos]. */
static enum cllm_status rope_table(struct cpu *c, const struct cllm_rope *rope, int32_t max_pos)
{
    int32_t half = rope->head_dim / 2;
    if (c->rope_for.theta != rope->theta || c->rope_for.head_dim != rope->head_dim)
        c->rope_positions = 0;
    if (max_pos < c->rope_positions)
        return CLLM_OK;
    int32_t cap = c->rope_positions ? c->rope_positions : 256;
    while (cap <= max_pos)
        cap *= 2;
    float *cs = cllm_realloc_array(c->rope_cos, (size_t)cap * (size_t)half, sizeof *cs);
    if (!cs)
        return CLLM_ERR_NOMEM;
    c->rope_cos = cs;
    float *sn = cllm_realloc_array(c->rope_sin, (size_t)cap * (size_t)half, sizeof *sn);
    if (!sn)
        return CLLM_ERR_NOMEM;
    c->rope_sin = sn;
    for (int32_t p = c->rope_positions; p < cap; p++)
        cllm_ref_rope_cos_sin(rope, p, cs + (int64_t)p * half, sn + (int64_t)p * half);
    c->rope_positions = cap;
    c->rope_for = *rope;
    return CLLM_OK;
}

struct rope_job {
    struct cpu *c;
    const struct cllm_attn_batch *b;
    float *qkv;
    int32_t ld;
    const float *bias; /* [q | k | v] or NULL */
    int32_t n_head, n_kv, head_dim;
    float *k_cache, *v_cache;
};

static void rope_task(void *arg, int ith, int nth)
{
    struct rope_job *j = arg;
    int32_t hd = j->head_dim, half = hd / 2, kv = j->n_kv * hd;
    int32_t width = (j->n_head + 2 * j->n_kv) * hd;
    int64_t s, e;
    cllm_split_rows(j->b->n_tokens, ith, nth, &s, &e);
    for (int64_t t = s; t < e; t++) {
        float *q = j->qkv + t * j->ld, *k = q + (int64_t)j->n_head * hd, *v = k + kv;
        if (j->bias)
            add_rows(q, j->bias, width);
        const float *cs = j->c->rope_cos + (int64_t)j->b->pos[t] * half;
        const float *sn = j->c->rope_sin + (int64_t)j->b->pos[t] * half;
        for (int32_t h = 0; h < j->n_head; h++)
            cllm_ref_rope_apply(q + (int64_t)h * hd, cs, sn, hd);
        for (int32_t h = 0; h < j->n_kv; h++)
            cllm_ref_rope_apply(k + (int64_t)h * hd, cs, sn, hd);
        int64_t slot = j->b->slot[t];
        if (slot < 0)
            continue; /* a padding row */
        memcpy(j->k_cache + slot * kv, k, (size_t)kv * sizeof(float));
        memcpy(j->v_cache + slot * kv, v, (size_t)kv * sizeof(float));
    }
}

static enum cllm_status cpu_qkv_rope_store(struct cllm_backend *be, const struct cllm_rope *rope,
                                           const struct cllm_attn_batch *b, float *qkv,
                                           int32_t ld, const struct cllm_weight *bias,
                                           int32_t n_head, int32_t n_kv, void *k_cache,
                                           void *v_cache)
{
    struct cpu *c = cpu_of(be);
    int32_t max_pos = 0;
    for (int32_t t = 0; t < b->n_tokens; t++) {
        if (b->pos[t] < 0)
            return CLLM_ERR_RANGE;
        if (b->pos[t] > max_pos)
            max_pos = b->pos[t];
    }
    if (ld < (n_head + 2 * n_kv) * rope->head_dim ||
        (bias && bias->ne[0] != (int64_t)(n_head + 2 * n_kv) * rope->head_dim))
        return CLLM_ERR_INVALID_ARG;
    enum cllm_status st = rope_table(c, rope, max_pos);
    if (st)
        return st;
    struct rope_job j = {c,      b,    qkv,           ld, bias ? bias->data : NULL, n_head,
                         n_kv,   rope->head_dim, k_cache, v_cache};
    run(c, (int64_t)b->n_tokens * (n_head + n_kv) * rope->head_dim, rope_task, &j);
    return CLLM_OK;
}

/* --- attention --- */

/* Tokens a thread from which a step's attention items are whole tokens (cpu_attention). */
#define ATTEND_TOKENS_PER_THREAD 4

struct attn_job {
    const struct cllm_attn_batch *b;
    const float *q, *k_cache, *v_cache;
    int32_t ldq, n_head, n_kv, head_dim;
    int32_t kv_per_item; /* n_kv (a token an item) or 1 (a token's KV head an item) */
    float scale;
    float *out;
    atomic_long next; /* next item to take */
};

/* One token, kv_per_item of its KV heads from kvh on, and the query heads that share them
 * (attend.h): each K/V row is read once for all of them, and the order of work never depends
 * on the batch. */
static void attend_group(const struct attn_job *j, int32_t t, int32_t kvh)
{
    const struct cllm_attn_batch *b = j->b;
    const int32_t hd = j->head_dim, group = j->n_head / j->n_kv, h = kvh * group;
    const struct cllm_attend_item it = {
        .q = j->q + (int64_t)t * j->ldq + (int64_t)h * hd,
        .out = j->out + ((int64_t)t * j->n_head + h) * hd,
        .k = j->k_cache + (int64_t)kvh * hd,
        .v = j->v_cache + (int64_t)kvh * hd,
        .slot_stride = (int64_t)j->n_kv * hd,
        .block_table = b->block_table + (int64_t)b->seq[t] * b->max_blocks,
        .block_size = b->block_size,
        .n_pos = b->pos[t] + 1,
        .group = group,
        .n_kv = j->kv_per_item,
        .head_dim = hd,
        .scale = j->scale,
    };
    cllm_cpu_attend(&it);
}

/* Items are taken one at a time from a shared counter: causal attention makes later tokens
 * cost more, so a fixed split would leave one thread waiting on the other. */
static void attn_task(void *arg, int ith, int nth)
{
    (void)ith;
    (void)nth;
    struct attn_job *j = arg;
    const int32_t per_token = j->n_kv / j->kv_per_item;
    long n_items = (long)j->b->n_tokens * per_token;
    for (long i; (i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < n_items;)
        attend_group(j, (int32_t)(i / per_token), (int32_t)(i % per_token) * j->kv_per_item);
}

static enum cllm_status cpu_attention(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                      const float *q, int32_t ldq, const void *k_cache,
                                      const void *v_cache, int32_t n_head, int32_t n_kv,
                                      int32_t head_dim, float scale, void *scratch,
                                      void *out)
{
    (void)scratch;
    if (n_kv <= 0 || n_head % n_kv != 0 || n_head / n_kv > CLLM_ATTEND_MAX_GROUP ||
        ldq < n_head * head_dim)
        return CLLM_ERR_INVALID_ARG;
    struct cllm_threadpool *tp = cpu_of(be)->tp;
    /* A token an item where the tokens are many for the threads: all its KV heads' rows are
     * read whole, which memory serves faster than a head's part of each (attend.h); else a KV
     * head an item, so that a few tokens' heads share the threads and a long sequence's
     * token, which costs more, is not one thread's alone. Same bits either way. */
    const int64_t nth = tp ? cllm_threadpool_n_threads(tp) : 1;
    const int32_t kv_per_item =
        b->n_tokens >= ATTEND_TOKENS_PER_THREAD * nth && n_head <= CLLM_ATTEND_MAX_GROUP ? n_kv : 1;
    struct attn_job j = {b,    q,        k_cache,     v_cache, ldq, n_head,
                         n_kv, head_dim, kv_per_item, scale,   out, 0};
    /* Work grows with context length, so always split unless there is only one item. */
    cllm_threadpool_run((int64_t)b->n_tokens * (n_kv / kv_per_item) > 1 ? tp : NULL, attn_task, &j);
    return CLLM_OK;
}

/* --- silu_mul, gather --- */

struct silu_job {
    const float *gate_up;
    int32_t n, dim;
    float *out;
};

static void silu_task(void *arg, int ith, int nth)
{
    struct silu_job *j = arg;
    int64_t s, e;
    cllm_split_rows(j->n, ith, nth, &s, &e);
    for (int64_t r = s; r < e; r++) {
        const float *gate = j->gate_up + r * 2 * j->dim;
        cllm_cpu_silu_mul(gate, gate + j->dim, j->dim, j->out + r * j->dim);
    }
}

static enum cllm_status cpu_silu_mul(struct cllm_backend *be, const float *gate_up, int32_t n,
                                     int32_t dim, void *out)
{
    struct silu_job j = {gate_up, n, dim, out};
    run(cpu_of(be), (int64_t)n * dim, silu_task, &j);
    return CLLM_OK;
}

static enum cllm_status cpu_gather_rows(struct cllm_backend *be, const float *x,
                                        const int32_t *idx, int32_t n_idx, int32_t dim, float *out)
{
    (void)be;
    for (int32_t i = 0; i < n_idx; i++)
        memmove(out + (int64_t)i * dim, x + (int64_t)idx[i] * dim, (size_t)dim * sizeof(float));
    return CLLM_OK;
}

static size_t cpu_attention_scratch(struct cllm_backend *be, int32_t n_tokens, int32_t n_head,
                                    int32_t head_dim)
{
    (void)be, (void)n_tokens, (void)n_head, (void)head_dim;
    return 0;
}

static enum cllm_status cpu_memzero(struct cllm_backend *be, void *dst, size_t n)
{
    (void)be;
    if (n)
        memset(dst, 0, n);
    return CLLM_OK;
}

static enum cllm_status cpu_sync(struct cllm_backend *be)
{
    (void)be;
    return CLLM_OK;
}

static int32_t cpu_host_threads(struct cllm_backend *be)
{
    return cllm_threadpool_n_threads(cpu_of(be)->tp);
}

static void cpu_host_run(struct cllm_backend *be, cllm_task_fn fn, void *ctx)
{
    cllm_threadpool_run(cpu_of(be)->tp, fn, ctx);
}

static const struct cllm_backend_iface cpu_iface = {
    .name = "cpu",
    .act_dtype = CLLM_DTYPE_F32,
    .kv_dtype = CLLM_DTYPE_F32,
    .free = cpu_free,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .upload = cpu_copy,
    .download = cpu_copy,
    .memzero = cpu_memzero,
    .alloc_zeroed = cpu_alloc_zeroed,
    .weight_init = cpu_weight_init,
    .weight_init_stacked = cpu_weight_init_stacked,
    .weight_free = cpu_weight_free,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .matmul = cpu_matmul,
    .qkv_rope_store = cpu_qkv_rope_store,
    .attention = cpu_attention,
    .attention_scratch = cpu_attention_scratch,
    .silu_mul = cpu_silu_mul,
    .gather_rows = cpu_gather_rows,
    .sync = cpu_sync,
    .host_threads = cpu_host_threads,
    .host_run = cpu_host_run,
};

enum cllm_status cllm_backend_cpu_new(struct cllm_backend **out,
                                      const struct cllm_backend_options *o, char *err,
                                      size_t err_len)
{
    *out = NULL;
    int32_t n_threads = o->n_threads;
    if (n_threads <= 0)
        n_threads = cllm_cpu_physical_cores();
    if (n_threads > 256)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "--threads %d is too many (max 256)",
                         (int)n_threads);
    struct cpu *c = calloc(1, sizeof *c);
    if (!c)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    enum cllm_status st = cllm_threadpool_new(&c->tp, n_threads);
    if (st) {
        free(c);
        return cllm_fail(err, err_len, st, "cannot start %d threads", (int)n_threads);
    }
    c->weights = o->cpu_weights;
    c->copy_budget = o->cpu_copy_budget;
    const char *pack = getenv("CLLM_CPU_PACKED_WEIGHTS");
    c->pack = !(pack && strcmp(pack, "0") == 0);
    c->be.iface = &cpu_iface;
    c->be.ctx = c;
    cllm_log(CLLM_LOG_INFO, "cpu: %d threads, %s matmul kernels%s", (int)n_threads,
             cllm_cpu_matmul_isa(),
             cllm_cpu_matmul_bf16_activations() ? " (BF16 weights take BF16 activations)" : "");
    *out = &c->be;
    return CLLM_OK;
}
