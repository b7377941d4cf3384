/*
 * Every CPU backend op (except matmul: test_matmul.c) against its scalar reference in
 * cpu/ref.c, on random inputs of awkward sizes, with 1, 2 and 3 threads, under each kernel
 * family whose attention and SiLU differ: results must match the reference (attention within
 * float rounding: it uses a single-pass online softmax; SiLU within a few ulp: the SIMD
 * families' exp is their own) and be identical across thread counts.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ref.h"
#include "core/f16.h"
#include "test.h"

static uint64_t rng = 88172645463325252ULL;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static float *randv(int64_t n, float scale)
{
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = frand() * scale;
    return v;
}

static double max_abs_diff(const float *a, const float *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

static struct cllm_backend *make(int threads)
{
    struct cllm_backend *be;
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        threads, 0,
                                     CLLM_CPU_WEIGHTS_STORED, 0,       false};
    return cllm_backend_new(&be, &o, NULL, 0) == CLLM_OK ? be : NULL;
}

static void vec_weight(struct cllm_tensor *t, struct cllm_weight *w, const float *data, int64_t n)
{
    *t = (struct cllm_tensor){"w", CLLM_DTYPE_F32, 1, {n, 1, 1, 1}, (uint64_t)n * 4, data};
    *w = (struct cllm_weight){t, data, CLLM_DTYPE_F32, {n, 1}, 0};
}

static void test_norms(struct cllm_backend *be, int32_t n, int32_t dim)
{
    float *x = randv((int64_t)n * dim, 3), *g = randv(dim, 1), *res = randv((int64_t)n * dim, 1);
    float *res2 = malloc((size_t)n * dim * 4), *out = malloc((size_t)n * dim * 4),
          *ref = malloc((size_t)n * dim * 4);
    memcpy(res2, res, (size_t)n * dim * 4);
    struct cllm_tensor t;
    struct cllm_weight w;
    vec_weight(&t, &w, g, dim);
    CHECK(be->iface->rmsnorm(be, x, &w, 1e-6f, n, dim, out) == CLLM_OK);
    for (int32_t r = 0; r < n; r++)
        cllm_ref_rmsnorm_row(x + (int64_t)r * dim, g, 1e-6f, dim, ref + (int64_t)r * dim);
    CHECK(memcmp(out, ref, (size_t)n * dim * 4) == 0);
    CHECK(be->iface->add_rmsnorm(be, res, x, &w, 1e-6f, n, dim, out) == CLLM_OK);
    for (int64_t i = 0; i < (int64_t)n * dim; i++)
        res2[i] += x[i];
    for (int32_t r = 0; r < n; r++)
        cllm_ref_rmsnorm_row(res2 + (int64_t)r * dim, g, 1e-6f, dim, ref + (int64_t)r * dim);
    CHECK(memcmp(res, res2, (size_t)n * dim * 4) == 0);
    CHECK(memcmp(out, ref, (size_t)n * dim * 4) == 0);
    /* silu_mul over gate and up side by side in one row, as the model lays them out */
    float *gate_up = randv((int64_t)n * 2 * dim, 4);
    for (int32_t r = 0; r < n; r++) {
        const float *gr = gate_up + (int64_t)r * 2 * dim;
        cllm_ref_silu_mul(gr, gr + dim, dim, ref + (int64_t)r * dim);
    }
    CHECK(be->iface->silu_mul(be, gate_up, n, dim, out) == CLLM_OK);
    double worst = 0; /* the SIMD families' exp is not libm's: within a few ulp */
    for (int64_t i = 0; i < (int64_t)n * dim; i++)
        worst = fmax(worst, fabs((double)out[i] - ref[i]) / (fabs(ref[i]) + 1e-30));
    CHECKF(worst <= 2e-6, "%s: silu_mul off the reference by %g relative", cllm_cpu_matmul_isa(),
           worst);
    free(x), free(g), free(res), free(res2), free(out), free(ref), free(gate_up);
}

static void test_embed(struct cllm_backend *be)
{
    enum { V = 37, D = 96 };
    uint16_t table[V * D];
    for (int i = 0; i < V * D; i++)
        table[i] = cllm_f32_to_bf16(frand());
    struct cllm_tensor t = {"e", CLLM_DTYPE_BF16, 2, {D, V, 1, 1}, sizeof table, table};
    struct cllm_weight w;
    CHECK(be->iface->weight_init(be, &t, &w, NULL, 0) == CLLM_OK);
    int32_t toks[] = {0, 36, 5, 5};
    float out[4 * D];
    CHECK(be->iface->embed(be, &w, toks, 4, out) == CLLM_OK);
    CHECK(out[D + 3] == cllm_bf16_to_f32(table[36 * D + 3]));
    CHECK(out[3 * D + D - 1] == cllm_bf16_to_f32(table[5 * D + D - 1]));
    int32_t bad[] = {37};
    CHECK(be->iface->embed(be, &w, bad, 1, out) == CLLM_ERR_RANGE);
    bad[0] = -1;
    CHECK(be->iface->embed(be, &w, bad, 1, out) == CLLM_ERR_RANGE);
    be->iface->weight_free(be, &w);
    /* A BF16 vector is widened to F32 once. */
    struct cllm_tensor tv = {"v", CLLM_DTYPE_BF16, 1, {D, 1, 1, 1}, D * 2, table};
    CHECK(be->iface->weight_init(be, &tv, &w, NULL, 0) == CLLM_OK);
    CHECK(w.dtype == CLLM_DTYPE_F32 && ((const float *)w.data)[7] == cllm_bf16_to_f32(table[7]));
    be->iface->weight_free(be, &w);
}

/* Two sequences with shuffled block tables; tokens of both interleaved in one batch. */
/* Two sequences of len0 and len1 tokens (at most 96 and 64: several of the kernels' 32-position
 * blocks and a part of one) with shuffled block tables; tokens of both interleaved in one
 * batch. */
static void test_attention(struct cllm_backend *be, int32_t n_head, int32_t n_kv, int32_t hd,
                           int32_t len0, int32_t len1, float **out_attn, float **out_kc)
{
    enum { BS = 4, NB = 48, MAXB = 24 };
    rng = 0x1234567ULL + (uint64_t)n_head * 1000 + (uint64_t)hd; /* same data for each thread count */
    int32_t n = len0 + len1;
    int32_t table[2][MAXB];
    for (int i = 0; i < MAXB; i++) {
        table[0][i] = (i * 5 + 1) % NB; /* disjoint block sets per sequence */
        table[1][i] = (table[0][i] + MAXB) % NB;
    }
    int32_t pos[161], seq[161], slot[161];
    for (int32_t t = 0; t < n; t++) {
        seq[t] = t % 3 == 2 && t / 3 < len1 ? 1 : 0;
    }
    int32_t c0 = 0, c1 = 0;
    for (int32_t t = 0; t < n; t++) {
        if (seq[t] == 1 && c1 >= len1)
            seq[t] = 0;
        if (seq[t] == 0 && c0 >= len0)
            seq[t] = 1;
        pos[t] = seq[t] ? c1++ : c0++;
        slot[t] = table[seq[t]][pos[t] / BS] * BS + pos[t] % BS;
    }
    /* One padding row at the end: it must write nothing to the cache. */
    pos[n] = 0, seq[n] = 0, slot[n] = -1;
    struct cllm_attn_batch b = {n + 1, pos, seq, slot, &table[0][0], MAXB, BS, 64};
    int32_t Q = n_head * hd, KV = n_kv * hd, ld = Q + 2 * KV + 3; /* a row stride with slack */
    int64_t qkv_n = (int64_t)(n + 1) * ld, cache_n = (int64_t)NB * BS * n_kv * hd;
    float *qkv = randv(qkv_n, 1), *bias_v = randv(Q + 2 * KV, 1);
    float *qkv_ref = malloc((size_t)qkv_n * 4);
    memcpy(qkv_ref, qkv, (size_t)qkv_n * 4);
    float *kc = calloc((size_t)cache_n, 4), *vc = calloc((size_t)cache_n, 4);
    struct cllm_rope rope = {1000000.0f, hd};
    struct cllm_tensor bt;
    struct cllm_weight bias;
    vec_weight(&bt, &bias, bias_v, Q + 2 * KV);
    CHECK(be->iface->qkv_rope_store(be, &rope, &b, qkv, ld, &bias, n_head, n_kv, kc, vc) ==
          CLLM_OK);
    /* reference bias + rope + store */
    float cs[256], sn[256];
    float *kc_ref = calloc((size_t)cache_n, 4), *vc_ref = calloc((size_t)cache_n, 4);
    for (int32_t t = 0; t <= n; t++) {
        float *row = qkv_ref + (int64_t)t * ld;
        for (int32_t i = 0; i < Q + 2 * KV; i++)
            row[i] += bias_v[i];
        cllm_ref_rope_cos_sin(&rope, pos[t], cs, sn);
        for (int32_t h = 0; h < n_head + n_kv; h++)
            cllm_ref_rope_apply(row + (int64_t)h * hd, cs, sn, hd);
        if (slot[t] < 0)
            continue;
        memcpy(kc_ref + (int64_t)slot[t] * KV, row + Q, (size_t)KV * 4);
        memcpy(vc_ref + (int64_t)slot[t] * KV, row + Q + KV, (size_t)KV * 4);
    }
    for (int32_t t = 0; t <= n; t++) /* q is rotated in place */
        CHECK(memcmp(qkv + (int64_t)t * ld, qkv_ref + (int64_t)t * ld, (size_t)Q * 4) == 0);
    CHECK(memcmp(kc, kc_ref, (size_t)cache_n * 4) == 0);
    CHECK(memcmp(vc, vc_ref, (size_t)cache_n * 4) == 0);

    b.n_tokens = n;
    int64_t qn = (int64_t)n * Q;
    float *out = malloc((size_t)qn * 4), *ref = malloc((size_t)qn * 4);
    float *q_dense = malloc((size_t)qn * 4);
    for (int32_t t = 0; t < n; t++)
        memcpy(q_dense + (int64_t)t * Q, qkv + (int64_t)t * ld, (size_t)Q * 4);
    float scale = 1.0f / sqrtf((float)hd);
    CHECK(be->iface->attention(be, &b, qkv, ld, kc, vc, n_head, n_kv, hd, scale, NULL, out) == CLLM_OK);
    cllm_ref_attention(&b, q_dense, kc, vc, n_head, n_kv, hd, scale, ref);
    double err = max_abs_diff(out, ref, qn);
    CHECKF(err < 1e-5,
           "%s, %d/%d heads of %d, %d+%d tokens: attention differs from the reference by %g",
           cllm_cpu_matmul_isa(), n_head, n_kv, hd, len0, len1, err);
    /* Each token alone gives the bits it had in the batch: a lone token's items are its KV
     * heads (spread over the threads), a batch's its tokens (all heads of one). */
    float *alone = malloc((size_t)Q * 4);
    for (int32_t t = 0; t < n; t += 7) {
        struct cllm_attn_batch one = {1, &pos[t], &seq[t], &slot[t], &table[0][0], MAXB, BS, 64};
        CHECK(be->iface->attention(be, &one, qkv + (int64_t)t * ld, ld, kc, vc, n_head, n_kv, hd,
                                   scale, NULL, alone) == CLLM_OK);
        CHECKF(memcmp(alone, out + (int64_t)t * Q, (size_t)Q * 4) == 0,
               "%s, %d/%d heads of %d: token %d alone differs from its batch's result",
               cllm_cpu_matmul_isa(), n_head, n_kv, hd, t);
    }
    free(alone);
    CHECK(be->iface->attention(be, &b, qkv, ld, kc, vc, n_head, 5, hd, scale, NULL, out) ==
          CLLM_ERR_INVALID_ARG);
    CHECK(be->iface->attention(be, &b, qkv, ld, kc, vc, n_head, n_kv, hd, scale, NULL, out) == CLLM_OK);
    *out_attn = out;
    *out_kc = kc;
    free(qkv), free(bias_v), free(qkv_ref), free(q_dense), free(vc), free(kc_ref), free(vc_ref),
        free(ref);
}

static bool all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

/* cllm_backend_alloc_zeroed gives zeros, through the CPU backend's own op (calloc) and through
 * the fallback (alloc, then memzero) of a backend without one: each size allocated, dirtied and
 * freed first, so memory handed back again would show what was not cleared. 96 MiB: a
 * mapping of its own (what the KV cache gets), past glibc's largest mmap threshold. */
static void test_alloc_zeroed(struct cllm_backend *be)
{
    struct cllm_backend_iface no_op = *be->iface;
    no_op.alloc_zeroed = NULL;
    struct cllm_backend plain = *be;
    plain.iface = &no_op;
    struct cllm_backend *bes[2] = {be, &plain};
    static const size_t sizes[] = {1, 100, 4096 + 3, (size_t)96 << 20};
    for (int b = 0; b < 2; b++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            void *p = NULL;
            CHECK(bes[b]->iface->alloc(bes[b], sizes[s], &p) == CLLM_OK && p);
            if (p) {
                memset(p, 0xab, sizes[s]);
                bes[b]->iface->dealloc(bes[b], p);
            }
            p = NULL;
            CHECK(cllm_backend_alloc_zeroed(bes[b], sizes[s], &p) == CLLM_OK && p);
            if (p) {
                CHECKF(all_zero(p, sizes[s]), "%s: %zu bytes not zero",
                       b ? "alloc + memzero" : "alloc_zeroed", sizes[s]);
                bes[b]->iface->dealloc(bes[b], p);
            }
        }
    CHECK(be->iface->alloc_zeroed != NULL); /* the CPU's: the KV cache costs nothing at start */
}

/* cpu_copy_budget: a matrix's weight is the backend's own copy (2 MiB aligned from 2 MiB on),
 * byte for byte the file's, its matmul the same bits as on the file's bytes, while the budget
 * lasts, else the file's bytes; a vector stays as it was; freeing the copy leaves the file's bytes
 * alone (ASan: no leak, no double free). Sizes: one under a cache line past a row multiple, and
 * 3 MiB and some (the huge-page path); a budget of 4 KiB takes the first only. */
static void test_copied_weights(int threads, uint64_t budget)
{
    struct cllm_backend *mapped = make(threads), *copying = NULL;
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        threads, 0,
                                     CLLM_CPU_WEIGHTS_STORED, budget,  false};
    CHECK(mapped && cllm_backend_new(&copying, &o, NULL, 0) == CLLM_OK);
    static const int64_t shapes[][2] = {{40, 7}, {1024, 769}}; /* F32 {K, N} */
    for (size_t s = 0; copying && mapped && s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t K = shapes[s][0], N = shapes[s][1], n = 3;
        float *data = randv(K * N, 1), *x = randv(K * n, 1);
        float *y0 = malloc((size_t)(N * n) * 4), *y1 = malloc((size_t)(N * n) * 4);
        const uint64_t bytes = (uint64_t)(K * N) * 4;
        const struct cllm_tensor t = {"m", CLLM_DTYPE_F32, 2, {K, N, 1, 1}, bytes, data};
        const float last = data[K * N - 1];
        struct cllm_weight w0, w1;
        CHECK(mapped->iface->weight_init(mapped, &t, &w0, NULL, 0) == CLLM_OK);
        CHECK(copying->iface->weight_init(copying, &t, &w1, NULL, 0) == CLLM_OK);
        CHECK(w0.data == data);
        const bool copied = bytes <= budget;
        CHECKF(w1.data && (w1.data != data) == copied, "shape %zu: %s", s,
               copied ? "not copied" : "copied past the budget");
        budget -= copied ? bytes : 0;
        if (w1.data) {
            CHECK(memcmp(w1.data, data, t.nbytes) == 0);
            if (copied && t.nbytes >= (2u << 20))
                CHECK((uintptr_t)w1.data % (2u << 20) == 0);
            CHECK(mapped->iface->matmul(mapped, &w0, NULL, x, (int32_t)n, y0, (int32_t)N) ==
                  CLLM_OK);
            CHECK(copying->iface->matmul(copying, &w1, NULL, x, (int32_t)n, y1, (int32_t)N) ==
                  CLLM_OK);
            CHECK(memcmp(y0, y1, (size_t)(N * n) * 4) == 0);
        }
        mapped->iface->weight_free(mapped, &w0);
        copying->iface->weight_free(copying, &w1);
        CHECK(data[K * N - 1] == last); /* still the file's (ASan: not freed) */
        const struct cllm_tensor v = {"v", CLLM_DTYPE_F32, 1, {K, 1, 1, 1}, (uint64_t)K * 4, data};
        CHECK(copying->iface->weight_init(copying, &v, &w1, NULL, 0) == CLLM_OK);
        CHECK(w1.data == data);
        copying->iface->weight_free(copying, &w1);
        free(data);
        free(x);
        free(y0);
        free(y1);
    }
    cllm_backend_free(mapped);
    cllm_backend_free(copying);
}

/* A K-quant matrix (Q4_K, Q6_K) the copying backend packs (pack_x16.h) where the kernel family
 * multiplies it so (Q4_K under the SIMD families, Q6_K under the VNNI ones;
 * CLLM_CPU_PACKED_WEIGHTS=0: never): matmul (a token alone and a part tile) and embed give the
 * same bits as from the file's bytes, which stay the file's; freed without a leak (ASan). */
static void test_packed_weights(enum cllm_dtype type, int threads, bool pack)
{
    setenv("CLLM_CPU_PACKED_WEIGHTS", pack ? "1" : "0", 1);
    struct cllm_backend *mapped = make(threads), *copying = NULL;
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        threads,    0,
                                     CLLM_CPU_WEIGHTS_STORED, UINT64_MAX, false};
    CHECK(mapped && cllm_backend_new(&copying, &o, NULL, 0) == CLLM_OK);
    unsetenv("CLLM_CPU_PACKED_WEIGHTS");
    const bool q4 = type == CLLM_DTYPE_Q4_K;
    enum { K = 512, N = 48 };
    const int bsize = q4 ? 144 : 210, row = K / 256 * bsize;
    uint8_t *data = malloc((size_t)N * row);
    for (int i = 0; i < N * row; i++)
        data[i] = (uint8_t)(frand() * 128.0f + 128.0f);
    for (int b = 0; b < N * K / 256; b++) { /* sane scales: Q4_K's d and dmin, Q6_K's d */
        const uint16_t d = cllm_f32_to_f16(frand() * 0.01f), dmin = cllm_f32_to_f16(0.002f);
        memcpy(data + b * bsize + (q4 ? 0 : 208), &d, 2);
        if (q4)
            memcpy(data + b * bsize + 2, &dmin, 2);
    }
    uint8_t *orig = malloc((size_t)N * row);
    memcpy(orig, data, (size_t)N * row);
    const struct cllm_tensor t = {"m", type, 2, {K, N, 1, 1}, (uint64_t)N * row, data};
    struct cllm_weight w0, w1;
    if (mapped && copying) {
        CHECK(mapped->iface->weight_init(mapped, &t, &w0, NULL, 0) == CLLM_OK);
        CHECK(copying->iface->weight_init(copying, &t, &w1, NULL, 0) == CLLM_OK);
        const bool packs = pack && cllm_cpu_matmul_packs(type, K, N);
        CHECKF(w0.layout == 0 && (w1.layout != 0) == packs, "layout %d, packs %d", w1.layout,
               packs);
        CHECK(w1.data != data && (memcmp(w1.data, data, t.nbytes) != 0) == packs);
        float *x = randv(K * 5, 1), y0[N * 5], y1[N * 5];
        for (int n = 1; n <= 5; n += 4) {
            CHECK(mapped->iface->matmul(mapped, &w0, NULL, x, n, y0, N) == CLLM_OK);
            CHECK(copying->iface->matmul(copying, &w1, NULL, x, n, y1, N) == CLLM_OK);
            CHECKF(memcmp(y0, y1, sizeof(float) * (size_t)(N * n)) == 0,
                   "%d tokens: packed matmul differs", n);
        }
        static const int32_t tokens[] = {0, 17, 47, 5, 16};
        float e0[5 * K], e1[5 * K];
        CHECK(mapped->iface->embed(mapped, &w0, tokens, 5, e0) == CLLM_OK);
        CHECK(copying->iface->embed(copying, &w1, tokens, 5, e1) == CLLM_OK);
        CHECK(memcmp(e0, e1, sizeof e0) == 0);
        mapped->iface->weight_free(mapped, &w0);
        copying->iface->weight_free(copying, &w1);
        free(x);
    }
    CHECK(memcmp(orig, data, (size_t)N * row) == 0); /* the file's bytes, untouched */
    cllm_backend_free(mapped);
    cllm_backend_free(copying);
    free(data);
    free(orig);
}

/* --cpu-weights q6_k: the quantized copy of a float matrix is packed too where the kernels
 * multiply it so, and multiplies to the bits of the same quantization left in the file's layout
 * (CLLM_CPU_PACKED_WEIGHTS=0). */
static void test_quantized_packed(void)
{
    enum { K = 512, N = 32, n = 3 };
    float *data = randv(K * N, 1), *x = randv(K * n, 1), y[2][N * n];
    const struct cllm_tensor t = {"m", CLLM_DTYPE_F32, 2, {K, N, 1, 1}, (uint64_t)K * N * 4, data};
    for (int pack = 0; pack < 2; pack++) {
        setenv("CLLM_CPU_PACKED_WEIGHTS", pack ? "1" : "0", 1);
        struct cllm_backend *be = NULL;
        struct cllm_backend_options o = {CLLM_BACKEND_CPU,      2,          0,
                                         CLLM_CPU_WEIGHTS_Q6_K, UINT64_MAX, false};
        CHECK(cllm_backend_new(&be, &o, NULL, 0) == CLLM_OK);
        unsetenv("CLLM_CPU_PACKED_WEIGHTS");
        struct cllm_weight w;
        if (!be || be->iface->weight_init(be, &t, &w, NULL, 0) != CLLM_OK) {
            CHECK(false);
            cllm_backend_free(be);
            continue;
        }
        CHECK(w.dtype == CLLM_DTYPE_Q6_K);
        CHECK((w.layout != 0) == (pack && cllm_cpu_matmul_packs(CLLM_DTYPE_Q6_K, K, N)));
        CHECK(be->iface->matmul(be, &w, NULL, x, n, y[pack], N) == CLLM_OK);
        be->iface->weight_free(be, &w);
        cllm_backend_free(be);
    }
    CHECK(memcmp(y[0], y[1], sizeof y[0]) == 0);
    free(data);
    free(x);
}

/* e^x and SiLU at the edges of float, through the chosen family's kernel: against a double
 * reference within 2e-6 relative (a few ulp), infinities and NaN where it has them. */
static void test_silu_edges(void)
{
    enum { N = 4099 }; /* not a whole number of vectors */
    static const float edges[] = {0.0f,      -0.0f,  1e-40f,  -1e-40f, 1e-30f, 87.3f,
                                  -87.3f,    87.6f,  -87.6f,  88.7f,   -88.7f, 88.75f,
                                  -88.75f,   100.0f, -100.0f, 3e38f,   -3e38f, INFINITY,
                                  -INFINITY, 0.5f,   -0.5f,   1.0f,    -1.0f,  10.0f};
    float *gate = malloc(N * 4), *up = malloc(N * 4), *out = malloc(N * 4);
    for (int i = 0; i < N; i++) {
        gate[i] =
            i < (int)(sizeof edges / sizeof edges[0]) ? edges[i] : -100.0f + 200.0f * (float)i / N;
        up[i] = i % 3 == 0 ? 1.0f : frand() * 4;
    }
    gate[N - 1] = NAN;
    cllm_cpu_silu_mul(gate, up, N, out);
    double worst = 0;
    for (int i = 0; i < N - 1; i++) {
        const double g = gate[i], r = g / (1.0 + exp(-g)) * up[i];
        if (isnan(r) || isinf(r)) {
            CHECKF(isnan(r) ? isnan(out[i]) : out[i] == (float)r, "silu(%g) = %g, not %g", g,
                   out[i], r);
            continue;
        }
        worst = fmax(worst, fabs(out[i] - r) / (fabs(r) + 1e-30));
        if (fabs(out[i] - r) > 2e-6 * fabs(r) + 1e-35)
            CHECKF(0, "%s: silu(%.9g) * %g = %.9g, not %.9g", cllm_cpu_matmul_isa(), g, up[i],
                   out[i], r);
    }
    CHECK(isnan(out[N - 1]));
    printf("%s: silu_mul within %.3g relative of double\n", cllm_cpu_matmul_isa(), worst);
    free(gate), free(up), free(out);
}

/* Attention under each thread count, identical across them, against the reference. */
static void test_attention_threads(void)
{
    float *first_attn = NULL, *first_kc = NULL;
    for (int threads = 1; threads <= 3; threads++) {
        struct cllm_backend *be = make(threads);
        CHECK(be != NULL);
        if (!be)
            break;
        test_norms(be, 1, 7);
        test_norms(be, 5, 896);
        test_norms(be, 33, 1536); /* big enough to run threaded */
        test_embed(be);
        float *attn, *kc;
        test_attention(be, 12, 2, 128, 21, 9, &attn, &kc);
        if (!first_attn) {
            first_attn = attn;
            first_kc = kc;
        } else {
            /* identical across thread counts */
            CHECK(memcmp(attn, first_attn, (size_t)30 * 12 * 128 * 4) == 0);
            free(attn);
            free(kc);
        }
        /* {query heads, KV heads, head size, tokens of sequence 0, of sequence 1} */
        static const int32_t shapes[][5] = {
            {12, 2, 128, 96, 64}, /* Qwen2.5-1.5B's heads over several blocks */
            {14, 2, 64, 21, 9},   /* Qwen2.5-0.5B's */
            {14, 2, 64, 65, 33},  /* the same over three blocks */
            {9, 1, 32, 40, 7},    /* more heads a group than a pass takes */
            {16, 1, 16, 33, 1},   /* two full passes of eight heads */
            {4, 4, 8, 21, 9},     /* no GQA, tiny head */
            {2, 1, 12, 37, 5},    /* a head no vector divides */
            {72, 8, 16, 21, 9},   /* more query heads than a token's item takes */
        };
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            float *a2, *k2;
            const int32_t *sh = shapes[i];
            test_attention(be, sh[0], sh[1], sh[2], sh[3], sh[4], &a2, &k2);
            free(a2);
            free(k2);
        }
        cllm_backend_free(be);
    }
    free(first_attn);
    free(first_kc);
}

int main(void)
{
    /* The families whose attention and SiLU kernels differ (VNNI and BF16 take AVX-512 F's). */
    static const char *const families[] = {"scalar", "avx2", "avx512"};
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++) {
        if (!cllm_cpu_matmul_use_isa(families[f])) {
            printf("%s: not run (this CPU lacks it)\n", families[f]);
            continue;
        }
        test_silu_edges();
        test_attention_threads();
    }
    CHECK(cllm_cpu_matmul_use_isa(NULL));
    test_copied_weights(1, UINT64_MAX);
    test_copied_weights(2, UINT64_MAX);
    test_copied_weights(2, 4096);
    /* packing under the newest family and under AVX2's and AVX-VNNI's (CPUs without AVX-512),
     * which pack Q4_K only */
    static const char *const packing_families[] = {NULL, "avx2", "avxvnni"};
    for (size_t f = 0; f < sizeof packing_families / sizeof packing_families[0]; f++) {
        if (!cllm_cpu_matmul_use_isa(packing_families[f]))
            continue;
        test_packed_weights(CLLM_DTYPE_Q4_K, 1, true);
        test_packed_weights(CLLM_DTYPE_Q4_K, 3, true);
        test_packed_weights(CLLM_DTYPE_Q4_K, 2, false);
        test_packed_weights(CLLM_DTYPE_Q6_K, 2, true);
        test_quantized_packed();
    }
    CHECK(cllm_cpu_matmul_use_isa(NULL));
    struct cllm_backend *be = make(1);
    CHECK(be != NULL);
    if (be) {
        test_alloc_zeroed(be);
        cllm_backend_free(be);
    }
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        100000, 0,
                                     CLLM_CPU_WEIGHTS_STORED, 0,      false};
    CHECK(cllm_backend_new(&be, &o, NULL, 0) == CLLM_ERR_INVALID_ARG);
    /* Without CUDA compiled in, or without a device, asking for CUDA is a clear error. */
    o.kind = CLLM_BACKEND_CUDA;
    char err[200] = "";
    enum cllm_status st = cllm_backend_new(&be, &o, err, sizeof err);
    if (st == CLLM_OK)
        cllm_backend_free(be); /* a machine with a GPU */
    else
        CHECKF(strstr(err, "CUDA") != NULL, "error: %s", err);
    return test_summary();
}
