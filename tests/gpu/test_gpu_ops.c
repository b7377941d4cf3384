/*
 * Every CUDA backend op against the CPU backend (the reference the CPU tests pin to
 * transformers), on random inputs of awkward sizes, plus the CUDA-only paths: stacked
 * weights, recorded steps (graph_begin/graph_end) replayed over new data, padding rows,
 * split attention over long contexts and its batch invariance, and bad arguments.
 *
 * Bounds. Inputs are drawn as BF16 values, so both backends see the same numbers; what the
 * CUDA backend stores as BF16 (act buffers, the KV cache) may differ from the CPU's F32 result
 * by its rounding (2^-8 relative) plus summation order; F32 outputs (GEMM, RoPE'd q) differ by
 * summation order only (norm-wise 1e-5, far above F32 accumulation over K <= 8960).
 *
 * Without a CUDA device it prints why and exits 77 (skipped).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/ref.h"
#include "core/f16.h"
#include "core/status.h"
#include "sampling/sampling.h"
#include "test.h"
#ifdef CLLM_EMULATED
#include "emu/emu_hooks.h"
#endif

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) /* uniform in [-1, 1), rounded to BF16 */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    float f = (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
    return cllm_bf16_to_f32(cllm_f32_to_bf16(f));
}

static float *randv(int64_t n, float scale)
{
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(frand() * scale));
    return v;
}

/* x rounded to BF16 (malloc'd bits). */
static uint16_t *bf16_of(const float *x, int64_t n)
{
    uint16_t *b = malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        b[i] = cllm_f32_to_bf16(x[i]);
    return b;
}

static struct cllm_backend *cpu, *gpu;
static const struct cllm_backend_iface *G;
/* What runs the matmuls, as the backend chooses (backend_cuda.cu, choose_gemm) from the build
 * and the environment. Our tensor-core GEMM (gemm.cu): its fused variants exist and it is
 * batch-invariant. Our GEMM on CUDA cores (gemm_simt.cu: CLLM_GEMM_SIMT=1, or a build without
 * tensor-core MMA and without a working BLAS, EMU_NO_BLAS=1 here): batch-invariant, no fused
 * variants. The vendor BLAS (CLLM_CUBLAS=1, or a build without MMA whose BLAS works): neither.
 * Without fused variants the fused ops must be refused, so that the model takes the unfused
 * kernels. (CLLM_EXPECT_NO_MMA: the MUSA configuration under the emulator.) */
static bool fused_gemm, invariant_gemm;
/* Relative error a GEMM output may carry: F32 summation order, or the rounding to BF16 of a
 * BLAS that writes BF16 only (the emulated one with EMU_BLAS_NO_F32_OUT=1). */
static double gemm_rel = 1e-5;

/* Device buffers: one helper per direction. */
static void *dev_upload(const void *src, size_t bytes)
{
    void *p = NULL;
    CHECK(G->alloc(gpu, bytes, &p) == CLLM_OK);
    CHECK(G->upload(gpu, p, src, bytes) == CLLM_OK);
    return p;
}

static void *dev_poisoned(size_t bytes)
{
    unsigned char *junk = malloc(bytes);
    memset(junk, 0xff, bytes); /* NaN as F32 and as BF16 */
    void *p = dev_upload(junk, bytes);
    free(junk);
    return p;
}

/* n floats at device address p of backend be, once the work queued before has run. */
static float *download_f32_on(struct cllm_backend *be, const void *p, int64_t n)
{
    float *h = malloc((size_t)n * sizeof *h);
    CHECK(be->iface->download(be, h, p, (size_t)n * sizeof *h) == CLLM_OK);
    CHECK(be->iface->sync(be) == CLLM_OK);
    return h;
}

static float *download_f32(const void *p, int64_t n)
{
    return download_f32_on(gpu, p, n);
}

static float *download_bf16(const void *p, int64_t n)
{
    uint16_t *b = malloc((size_t)n * 2);
    float *h = malloc((size_t)n * sizeof *h);
    CHECK(G->download(gpu, b, p, (size_t)n * 2) == CLLM_OK);
    CHECK(G->sync(gpu) == CLLM_OK);
    for (int64_t i = 0; i < n; i++)
        h[i] = cllm_bf16_to_f32(b[i]);
    free(b);
    return h;
}

/* ||got - want|| / ||want|| <= bound. */
static void check_norm(const char *what, const float *got, const float *want, int64_t n,
                       double bound)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    double r = sqrt(num / (den > 0 ? den : 1));
    CHECKF(r <= bound, "%s: relative error %.3g > %.3g", what, r, bound);
}

/* A host tensor of BF16 values and its weights on both backends. */
struct wpair {
    struct cllm_tensor t;
    uint16_t *bits;
    float *f32;
    struct cllm_weight c, g;
};

static void make_weight(struct wpair *w, int64_t cols, int64_t rows, float scale)
{
    int64_t n = cols * rows;
    w->f32 = randv(n, scale);
    w->bits = malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        w->bits[i] = cllm_f32_to_bf16(w->f32[i]);
    w->t = (struct cllm_tensor){
        "w", CLLM_DTYPE_BF16, rows > 1 ? 2 : 1, {cols, rows, 1, 1}, (uint64_t)n * 2, w->bits};
    CHECK(cpu->iface->weight_init(cpu, &w->t, &w->c, NULL, 0) == CLLM_OK);
    CHECK(G->weight_init(gpu, &w->t, &w->g, NULL, 0) == CLLM_OK);
}

static void free_weight(struct wpair *w)
{
    cpu->iface->weight_free(cpu, &w->c);
    G->weight_free(gpu, &w->g);
    free(w->f32), free(w->bits);
}

/* A buffer larger than any device (1 TiB) is out of memory, and the ops after it (every test
 * main runs next) do not fail for it: CUDA keeps a failed cudaMalloc as its last error, which
 * an op's launch check would report as its own (left there, the first GEMM fails). On a GPU
 * too, where the emulator's refusals of test_out_of_memory cannot be had. */
static void test_alloc_too_large(void)
{
    void *p = (void *)&p;
    CHECKF(G->alloc(gpu, (size_t)1 << 40, &p) == CLLM_ERR_NOMEM && p == NULL,
           "1 TiB of device memory: not refused as out of memory");
}

static void test_embed_norm_silu(int32_t n, int32_t dim)
{
    struct wpair emb, g;
    make_weight(&emb, dim, 1000, 1.0f);
    make_weight(&g, dim, 1, 1.0f);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int32_t i = 0; i < n; i++)
        tok[i] = (int32_t)((uint32_t)(i * 7919 + 13) % 1000u);
    float *x_ref = malloc((size_t)n * dim * 4);
    CHECK(cpu->iface->embed(cpu, &emb.c, tok, n, x_ref) == CLLM_OK);
    void *tok_d = dev_upload(tok, (size_t)n * 4), *x_d = dev_poisoned((size_t)n * dim * 4);
    CHECK(G->embed(gpu, &emb.g, tok_d, n, x_d) == CLLM_OK);
    float *x = download_f32(x_d, (int64_t)n * dim);
    CHECK(memcmp(x, x_ref, (size_t)n * dim * 4) == 0);

    /* rmsnorm, then add_rmsnorm with a residual */
    float *out_ref = malloc((size_t)n * dim * 4), *res = randv((int64_t)n * dim, 2.0f);
    void *out_d = dev_poisoned((size_t)n * dim * 2), *res_d = dev_upload(res, (size_t)n * dim * 4);
    CHECK(cpu->iface->rmsnorm(cpu, x_ref, &g.c, 1e-6f, n, dim, out_ref) == CLLM_OK);
    CHECK(G->rmsnorm(gpu, x_d, &g.g, 1e-6f, n, dim, out_d) == CLLM_OK);
    float *out = download_bf16(out_d, (int64_t)n * dim);
    test_check_close("rmsnorm", out, out_ref, (int64_t)n * dim, 1.0 / 128, 1e-6);
    free(out);
    CHECK(cpu->iface->add_rmsnorm(cpu, res, x_ref, &g.c, 1e-6f, n, dim, out_ref) == CLLM_OK);
    CHECK(G->add_rmsnorm(gpu, res_d, x_d, &g.g, 1e-6f, n, dim, out_d) == CLLM_OK);
    float *res_g = download_f32(res_d, (int64_t)n * dim);
    CHECK(memcmp(res_g, res, (size_t)n * dim * 4) == 0); /* F32 adds: identical */
    out = download_bf16(out_d, (int64_t)n * dim);
    test_check_close("add_rmsnorm", out, out_ref, (int64_t)n * dim, 1.0 / 128, 1e-6);

    /* silu_mul over [gate | up] rows */
    float *gu = randv((int64_t)n * 2 * dim, 4.0f);
    void *gu_d = dev_upload(gu, (size_t)n * 2 * dim * 4);
    CHECK(cpu->iface->silu_mul(cpu, gu, n, dim, out_ref) == CLLM_OK);
    CHECK(G->silu_mul(gpu, gu_d, n, dim, out_d) == CLLM_OK);
    free(out);
    out = download_bf16(out_d, (int64_t)n * dim);
    test_check_close("silu_mul", out, out_ref, (int64_t)n * dim, 1.0 / 128, 1e-6);

    /* gather_rows: exact */
    int32_t idx[3] = {n - 1, 0, n / 2};
    void *idx_d = dev_upload(idx, sizeof idx), *gat_d = dev_poisoned((size_t)3 * dim * 4);
    CHECK(G->gather_rows(gpu, res_d, idx_d, 3, dim, gat_d) == CLLM_OK);
    float *gat = download_f32(gat_d, 3 * (int64_t)dim);
    for (int i = 0; i < 3; i++)
        CHECK(memcmp(gat + (int64_t)i * dim, res + (int64_t)idx[i] * dim, (size_t)dim * 4) == 0);

    void *bufs[] = {tok_d, x_d, out_d, res_d, gu_d, idx_d, gat_d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        G->dealloc(gpu, bufs[i]);
    free(tok), free(x_ref), free(x), free(out_ref), free(res), free(out), free(res_g), free(gu),
        free(gat);
    free_weight(&emb), free_weight(&g);
}

/* y = W x (+ bias) into a column slice of a wider y, for several batch sizes; reference in
 * double on the host. Also a stacked weight equals its parts. */
static void test_matmul(int32_t K, int32_t N, int32_t n)
{
    struct wpair w, w2, b;
    make_weight(&w, K, N, 0.05f);
    make_weight(&w2, K, 17, 0.05f);
    make_weight(&b, N, 1, 1.0f);
    float *x = randv((int64_t)n * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n * K);
    int32_t ldy = N + 17 + 5;
    float *ref = malloc((size_t)n * ldy * 4);
    for (int32_t t = 0; t < n; t++)
        for (int32_t r = 0; r < N + 17; r++) {
            const float *row = r < N ? w.f32 + (int64_t)r * K : w2.f32 + (int64_t)(r - N) * K;
            double s = r < N ? b.f32[r] : 0.0;
            for (int32_t k = 0; k < K; k++)
                s += (double)row[k] * x[(int64_t)t * K + k];
            ref[(int64_t)t * ldy + r] = (float)s;
        }
    void *x_d = dev_upload(xb, (size_t)n * K * 2), *y_d = dev_poisoned((size_t)n * ldy * 4);
    CHECK(G->matmul(gpu, &w.g, &b.g, x_d, n, y_d, ldy) == CLLM_OK);
    CHECK(G->matmul(gpu, &w2.g, NULL, x_d, n, (float *)y_d + N, ldy) == CLLM_OK);
    float *y = download_f32(y_d, (int64_t)n * ldy);
    float *got = malloc((size_t)n * (N + 17) * 4), *want = malloc((size_t)n * (N + 17) * 4);
    for (int32_t t = 0; t < n; t++) {
        memcpy(got + (int64_t)t * (N + 17), y + (int64_t)t * ldy, (size_t)(N + 17) * 4);
        memcpy(want + (int64_t)t * (N + 17), ref + (int64_t)t * ldy, (size_t)(N + 17) * 4);
        for (int32_t c = N + 17; c < ldy; c++) /* columns beyond the slices: untouched */
            CHECK(isnan(y[(int64_t)t * ldy + c]));
    }
    char what[64];
    snprintf(what, sizeof what, "matmul %dx%d, %d rows", (int)N, (int)K, (int)n);
    check_norm(what, got, want, (int64_t)n * (N + 17), gemm_rel);

    /* stacked [w; w2] gives the same bits as the two GEMMs */
    const struct cllm_tensor *parts[] = {&w.t, &w2.t};
    struct cllm_weight st;
    CHECK(G->weight_init_stacked(gpu, parts, 2, &st, NULL, 0) == CLLM_OK);
    CHECK(st.ne[0] == K && st.ne[1] == N + 17 && st.dtype == CLLM_DTYPE_BF16);
    void *y2_d = dev_poisoned((size_t)n * ldy * 4);
    CHECK(G->matmul(gpu, &st, NULL, x_d, n, y2_d, ldy) == CLLM_OK);
    float *y2 = download_f32(y2_d, (int64_t)n * ldy);
    for (int32_t t = 0; t < n; t++)
        for (int32_t r = 0; r < N + 17; r++) {
            double want_r = ref[(int64_t)t * ldy + r] - (r < N ? b.f32[r] : 0.0f);
            double d = fabs(y2[(int64_t)t * ldy + r] - want_r);
            if (d > 1e-3 + (gemm_rel > 1e-3 ? gemm_rel : 1e-3) * fabs(want_r)) {
                CHECKF(0, "stacked matmul row %d col %d: %g vs %g", (int)t, (int)r,
                       y2[(int64_t)t * ldy + r], want_r);
                t = n;
                break;
            }
        }
    /* bad arguments are refused, not run */
    CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, y_d, N - 1) == CLLM_ERR_INVALID_ARG);
    CHECK(G->matmul(gpu, &b.g, NULL, x_d, n, y_d, ldy) == CLLM_ERR_INVALID_ARG); /* a vector */
    G->weight_free(gpu, &st);
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d), G->dealloc(gpu, y2_d);
    free(x), free(xb), free(ref), free(y), free(y2), free(got), free(want);
    free_weight(&w), free_weight(&w2), free_weight(&b);
}

/* Batch invariance of the GEMM: each token's row of y is bit-identical whatever else shares
 * its step (subsets of 1 to 300 tokens, in a scrambled order), across the skinny and the tiled
 * kernel (DESIGN.md: a prompt's greedy output must not depend on the batch). */
static void test_matmul_invariance(int32_t K, int32_t N)
{
    const int32_t n_max = 300;
    struct wpair w, b;
    make_weight(&w, K, N, 0.05f);
    make_weight(&b, N, 1, 1.0f);
    float *x = randv((int64_t)n_max * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n_max * K);
    uint16_t *xs = malloc((size_t)n_max * K * 2);
    void *x_d = dev_upload(xb, (size_t)n_max * K * 2), *y_d = dev_poisoned((size_t)n_max * N * 4);
    CHECK(G->matmul(gpu, &w.g, &b.g, x_d, n_max, y_d, N) == CLLM_OK);
    float *y_all = download_f32(y_d, (int64_t)n_max * N);
    const int32_t sizes[] = {1, 2, 7, 8, 9, 16, 17, 24, 32, 33, 64, 65, 128, 200};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int32_t n = sizes[si], differ = 0;
        int32_t *pick = malloc((size_t)n * 4);
        for (int32_t i = 0; i < n; i++) {
            pick[i] = (int32_t)(((int64_t)i * 37 + n * 11) % n_max);
            memcpy(xs + (int64_t)i * K, xb + (int64_t)pick[i] * K, (size_t)K * 2);
        }
        void *xs_d = dev_upload(xs, (size_t)n * K * 2), *ys_d = dev_poisoned((size_t)n * N * 4);
        CHECK(G->matmul(gpu, &w.g, &b.g, xs_d, n, ys_d, N) == CLLM_OK);
        float *ys = download_f32(ys_d, (int64_t)n * N);
        for (int32_t i = 0; i < n; i++)
            differ += memcmp(ys + (int64_t)i * N, y_all + (int64_t)pick[i] * N, (size_t)N * 4) != 0;
        CHECKF(differ == 0, "matmul %dx%d: %d of %d tokens differ from a step of %d", (int)N,
               (int)K, (int)differ, (int)n, (int)n_max);
        G->dealloc(gpu, xs_d), G->dealloc(gpu, ys_d);
        free(pick), free(ys);
    }
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d);
    free(x), free(xb), free(xs), free(y_all);
    free_weight(&w), free_weight(&b);
}

/* The gate/up projection with SiLU in its epilogue (matmul_gate_up_silu) equals matmul into
 * F32 + silu_mul bit for bit (skinny and tiled kernels, parallel slices); without our GEMM it
 * is refused, and a weight that is not [2 dim][K] is a bad argument. */
static void test_matmul_gate_up_silu(int32_t K, int32_t F)
{
    struct wpair w;
    make_weight(&w, K, 2 * F, 0.05f);
    const int32_t sizes[] = {1, 7, 33, 64, 300};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int32_t n = sizes[si];
        float *x = randv((int64_t)n * K, 1.0f);
        uint16_t *xb = bf16_of(x, (int64_t)n * K);
        void *x_d = dev_upload(xb, (size_t)n * K * 2), *gu_d = dev_poisoned((size_t)n * 2 * F * 4);
        void *ref_d = dev_poisoned((size_t)n * F * 2), *out_d = dev_poisoned((size_t)n * F * 2);
        CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, gu_d, 2 * F) == CLLM_OK);
        CHECK(G->silu_mul(gpu, gu_d, n, F, ref_d) == CLLM_OK);
        enum cllm_status st = G->matmul_gate_up_silu
                                  ? G->matmul_gate_up_silu(gpu, &w.g, x_d, n, F, out_d, NULL)
                                  : CLLM_ERR_UNSUPPORTED;
        CHECKF(st == (fused_gemm ? CLLM_OK : CLLM_ERR_UNSUPPORTED),
               "matmul_gate_up_silu, %d rows: %s", (int)n, cllm_status_str(st));
        uint16_t *ref = malloc((size_t)n * F * 2), *out = malloc((size_t)n * F * 2);
        CHECK(G->download(gpu, ref, ref_d, (size_t)n * F * 2) == CLLM_OK);
        CHECK(G->download(gpu, out, out_d, (size_t)n * F * 2) == CLLM_OK);
        CHECK(G->sync(gpu) == CLLM_OK);
        CHECKF(st != CLLM_OK || memcmp(ref, out, (size_t)n * F * 2) == 0,
               "matmul_gate_up_silu 2x%dx%d, %d rows: not the bits of matmul + silu_mul", (int)F,
               (int)K, (int)n);
        if (G->matmul_gate_up_silu && si == 0) /* dim must be half the weight's rows */
            CHECK(G->matmul_gate_up_silu(gpu, &w.g, x_d, n, F + 1, out_d, NULL) ==
                  CLLM_ERR_INVALID_ARG);
        G->dealloc(gpu, x_d), G->dealloc(gpu, gu_d), G->dealloc(gpu, ref_d), G->dealloc(gpu, out_d);
        free(x), free(xb), free(ref), free(out);
    }
    free_weight(&w);
}

/* Start-up tuning (tune_matmul): the matmuls of a tuned shape give the bits they gave before
 * (every way the tuner may pick computes one formula), as F32 products and through the SiLU
 * epilogue, at every kind of step (skinny, tiled, parallel slices); a tuning while a step is
 * recorded, or for no tokens, is refused. Without our GEMM there is nothing to tune. */
static void test_tune_matmul(int32_t K, int32_t F, int32_t n_max)
{
    if (!G->tune_matmul)
        return;
    const int32_t N = 2 * F, sizes[] = {1, 12, 32, 33, n_max};
    const size_t n_sizes = sizeof sizes / sizeof sizes[0];
    struct wpair w, w2, other; /* two layers' weights, timed in turn; one of another shape */
    make_weight(&w, K, N, 0.05f);
    make_weight(&w2, K, N, 0.05f);
    make_weight(&other, K, N + 16, 0.05f);
    const struct cllm_weight *ws[] = {&w.g, &w2.g};
    float *x = randv((int64_t)n_max * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n_max * K);
    void *x_d = dev_upload(xb, (size_t)n_max * K * 2);
    void *y_d = dev_poisoned((size_t)n_max * N * 4), *ff_d = dev_poisoned((size_t)n_max * F * 2);
    float *before[5];
    uint16_t *ff_before[5];
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) { /* tune both ways of using the weight, then compare */
            void *xt = dev_upload(xb, (size_t)n_max * K * 2);
            CHECK(G->tune_matmul(gpu, ws, 2, xt, n_max, y_d, N, false) == CLLM_OK);
            if (G->matmul_gate_up_silu)
                CHECK(G->tune_matmul(gpu, ws, 2, xt, n_max, ff_d, F, true) == CLLM_OK);
            G->dealloc(gpu, xt);
        }
        for (size_t si = 0; si < n_sizes; si++) {
            const int32_t n = sizes[si];
            CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, y_d, N) == CLLM_OK);
            float *y = download_f32(y_d, (int64_t)n * N);
            uint16_t *ff = calloc((size_t)n * F, 2);
            if (G->matmul_gate_up_silu &&
                G->matmul_gate_up_silu(gpu, &w.g, x_d, n, F, ff_d, NULL) == CLLM_OK) {
                CHECK(G->download(gpu, ff, ff_d, (size_t)n * F * 2) == CLLM_OK);
                CHECK(G->sync(gpu) == CLLM_OK);
            }
            if (pass == 0) {
                before[si] = y, ff_before[si] = ff;
                continue;
            }
            CHECKF(memcmp(y, before[si], (size_t)n * N * 4) == 0,
                   "matmul %dx%d, %d rows: other bits once tuned", (int)N, (int)K, (int)n);
            CHECKF(memcmp(ff, ff_before[si], (size_t)n * F * 2) == 0,
                   "matmul_gate_up_silu 2x%dx%d, %d rows: other bits once tuned", (int)F, (int)K,
                   (int)n);
            free(y), free(ff), free(before[si]), free(ff_before[si]);
        }
    }
    CHECK(G->tune_matmul(gpu, ws, 2, x_d, 0, y_d, N, false) == CLLM_ERR_INVALID_ARG);
    CHECK(G->tune_matmul(gpu, ws, 0, x_d, n_max, y_d, N, false) == CLLM_ERR_INVALID_ARG);
    const struct cllm_weight *mixed[] = {&w.g, &other.g}; /* not one shape */
    CHECK(G->tune_matmul(gpu, mixed, 2, x_d, n_max, y_d, N, false) == CLLM_ERR_INVALID_ARG);
    if (G->graph_begin) {
        bool replayed = true;
        CHECK(G->graph_begin(gpu, 0x7e57u, &replayed) == CLLM_OK && !replayed);
        CHECK(G->tune_matmul(gpu, ws, 2, x_d, n_max, y_d, N, false) == CLLM_ERR_INVALID_ARG);
        CHECK(G->matmul(gpu, &w.g, NULL, x_d, 1, y_d, N) == CLLM_OK);
        CHECK(G->graph_end(gpu, 0x7e57u) == CLLM_OK);
        CHECK(G->sync(gpu) == CLLM_OK);
    }
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d), G->dealloc(gpu, ff_d);
    free(x), free(xb);
    free_weight(&w), free_weight(&w2), free_weight(&other);
}

/* The QKV projection with bias, RoPE and the KV store in its epilogue (matmul_rope_store)
 * equals matmul + qkv_rope_store bit for bit (q, k in the qkv rows; both caches), a padding
 * row included; a step too large for it, or any step without our GEMM, is refused with
 * nothing queued. */
static void test_matmul_rope_store(int32_t n_head, int32_t n_kv, int32_t hd, int32_t K)
{
    const int32_t N = (n_head + 2 * n_kv) * hd, KV = n_kv * hd, n_slots = 64;
    struct wpair w, b;
    make_weight(&w, K, N, 0.05f);
    make_weight(&b, N, 1, 0.5f);
    struct cllm_rope rope = {1000000.0f, hd};
    const int32_t sizes[] = {1, 5, 32, 33};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int32_t n = sizes[si];
        int32_t *pos = malloc((size_t)n * 4), *slot = malloc((size_t)n * 4);
        for (int32_t t = 0; t < n; t++)
            pos[t] = 11 * t + 2, slot[t] = t == n / 2 && n > 1 ? -1 : (t * 5 + 3) % n_slots;
        void *pos_d = dev_upload(pos, (size_t)n * 4), *slot_d = dev_upload(slot, (size_t)n * 4);
        struct cllm_attn_batch ab = {n, pos_d, pos_d, slot_d, NULL, 0, 16, 0};
        float *x = randv((int64_t)n * K, 1.0f);
        uint16_t *xb = bf16_of(x, (int64_t)n * K);
        void *x_d = dev_upload(xb, (size_t)n * K * 2);
        void *y_d = dev_poisoned((size_t)n * N * 4), *y2_d = dev_poisoned((size_t)n * N * 4);
        void *k_d = dev_poisoned((size_t)n_slots * KV * 2),
             *v_d = dev_poisoned((size_t)n_slots * KV * 2);
        void *k2_d = dev_poisoned((size_t)n_slots * KV * 2),
             *v2_d = dev_poisoned((size_t)n_slots * KV * 2);
        CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, y_d, N) == CLLM_OK);
        CHECK(G->qkv_rope_store(gpu, &rope, &ab, y_d, N, &b.g, n_head, n_kv, k_d, v_d) == CLLM_OK);
        enum cllm_status st = G->matmul_rope_store
                                  ? G->matmul_rope_store(gpu, &w.g, x_d, &rope, &ab, y2_d, N, &b.g,
                                                         n_head, n_kv, k2_d, v2_d, NULL)
                                  : CLLM_ERR_UNSUPPORTED;
        if (n > 32 || !fused_gemm) {
            CHECKF(st == CLLM_ERR_UNSUPPORTED, "matmul_rope_store took a %d-token step", (int)n);
        } else {
            CHECKF(st == CLLM_OK, "matmul_rope_store, %d tokens: %s", (int)n, cllm_status_str(st));
            float *y = download_f32(y_d, (int64_t)n * N), *y2 = download_f32(y2_d, (int64_t)n * N);
            float *k = download_bf16(k_d, (int64_t)n_slots * KV),
                  *k2 = download_bf16(k2_d, (int64_t)n_slots * KV);
            float *v = download_bf16(v_d, (int64_t)n_slots * KV),
                  *v2 = download_bf16(v2_d, (int64_t)n_slots * KV);
            CHECKF(memcmp(y, y2, (size_t)n * N * 4) == 0,
                   "matmul_rope_store %d/%d heads, %d tokens: qkv rows differ", (int)n_head,
                   (int)n_kv, (int)n);
            CHECKF(memcmp(k, k2, (size_t)n_slots * KV * 4) == 0 &&
                       memcmp(v, v2, (size_t)n_slots * KV * 4) == 0,
                   "matmul_rope_store %d/%d heads, %d tokens: caches differ", (int)n_head,
                   (int)n_kv, (int)n);
            free(y), free(y2), free(k), free(k2), free(v), free(v2);
        }
        void *bufs[] = {pos_d, slot_d, x_d, y_d, y2_d, k_d, v_d, k2_d, v2_d};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            G->dealloc(gpu, bufs[i]);
        free(pos), free(slot), free(x), free(xb);
    }
    free_weight(&w), free_weight(&b);
}

/* A projection that applies its norm itself (struct cllm_norm_in; matmul_gate_up_silu,
 * matmul_rope_store) equals add_rmsnorm (rmsnorm where nothing is added) and then the
 * projection, bit for bit; the residual it moves to `out` is what add_rmsnorm leaves in place,
 * and `res` is not written. A step it cannot take is refused with nothing queued. */
static void test_norm_in_ops(int32_t K, int32_t F)
{
    if (!G->matmul_gate_up_silu || !G->matmul_rope_store)
        return;
    const int32_t n_head = 4, n_kv = 2, hd = 64, NQ = (n_head + 2 * n_kv) * hd, n_slots = 32;
    struct wpair wg, wq, bq, g;
    make_weight(&wg, K, 2 * F, 0.05f);
    make_weight(&wq, K, NQ, 0.05f);
    make_weight(&bq, NQ, 1, 0.5f);
    make_weight(&g, K, 1, 1.0f);
    struct cllm_rope rope = {1000000.0f, hd};
    if (!fused_gemm) { /* the vendor BLAS takes no norm: refused, the model normalizes first */
        float *r = randv(K, 1.0f);
        void *r_d = dev_upload(r, (size_t)K * 4), *o_d = dev_poisoned((size_t)K * 4);
        struct cllm_norm_in nin = {r_d, r_d, &g.g, 1e-6f, o_d};
        CHECK(G->matmul_gate_up_silu(gpu, &wg.g, NULL, 1, F, o_d, &nin) == CLLM_ERR_UNSUPPORTED);
        G->dealloc(gpu, r_d), G->dealloc(gpu, o_d);
        free(r);
        free_weight(&wg), free_weight(&wq), free_weight(&bq), free_weight(&g);
        return;
    }
    const int32_t sizes[] = {1, 4, 8, 9};
    int fused = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int32_t n = sizes[si];
        int32_t *pos = malloc((size_t)n * 4), *slot = malloc((size_t)n * 4);
        for (int32_t t = 0; t < n; t++)
            pos[t] = 9 * t + 4, slot[t] = (t * 7 + 2) % n_slots;
        void *pos_d = dev_upload(pos, (size_t)n * 4), *slot_d = dev_upload(slot, (size_t)n * 4);
        struct cllm_attn_batch ab = {n, pos_d, pos_d, slot_d, NULL, 0, 16, 0};
        float *res = randv((int64_t)n * K, 2.0f), *add = randv((int64_t)n * K, 1.0f);
        for (int with_add = 0; with_add < 2; with_add++) {
            const size_t rb = (size_t)n * K * 4;
            void *res_d = dev_upload(res, rb), *res2_d = dev_upload(res, rb);
            void *add_d = dev_upload(add, rb), *out_d = dev_poisoned(rb);
            void *xn_d = dev_poisoned((size_t)n * K * 2);
            void *ff_d = dev_poisoned((size_t)n * F * 2), *ff2_d = dev_poisoned((size_t)n * F * 2);
            void *q_d = dev_poisoned((size_t)n * NQ * 4), *q2_d = dev_poisoned((size_t)n * NQ * 4);
            void *c[4];
            for (int i = 0; i < 4; i++)
                c[i] = dev_poisoned((size_t)n_slots * n_kv * hd * 2);
            /* the reference: the norm op (res += add in place), then each projection */
            CHECK((with_add ? G->add_rmsnorm(gpu, res_d, add_d, &g.g, 1e-6f, n, K, xn_d)
                            : G->rmsnorm(gpu, res_d, &g.g, 1e-6f, n, K, xn_d)) == CLLM_OK);
            CHECK(G->matmul_gate_up_silu(gpu, &wg.g, xn_d, n, F, ff_d, NULL) == CLLM_OK);
            CHECK(G->matmul_rope_store(gpu, &wq.g, xn_d, &rope, &ab, q_d, NQ, &bq.g, n_head, n_kv,
                                       c[0], c[1], NULL) == CLLM_OK);
            struct cllm_norm_in nin = {res2_d, with_add ? add_d : NULL, &g.g, 1e-6f, out_d};
            enum cllm_status s1 = G->matmul_gate_up_silu(gpu, &wg.g, NULL, n, F, ff2_d, &nin);
            enum cllm_status s2 = G->matmul_rope_store(gpu, &wq.g, NULL, &rope, &ab, q2_d, NQ,
                                                       &bq.g, n_head, n_kv, c[2], c[3], &nin);
            CHECKF(s1 == s2 && (s1 == CLLM_OK || s1 == CLLM_ERR_UNSUPPORTED),
                   "norm in the projections, %d rows: %s / %s", (int)n, cllm_status_str(s1),
                   cllm_status_str(s2));
            if (n > 8)
                CHECKF(s1 == CLLM_ERR_UNSUPPORTED, "a %d-row step took its norm in the GEMM",
                       (int)n);
            if (s1 == CLLM_OK && s2 == CLLM_OK) {
                fused++;
                uint16_t *a = malloc((size_t)n * F * 2), *b = malloc((size_t)n * F * 2);
                CHECK(G->download(gpu, a, ff_d, (size_t)n * F * 2) == CLLM_OK);
                CHECK(G->download(gpu, b, ff2_d, (size_t)n * F * 2) == CLLM_OK);
                CHECK(G->sync(gpu) == CLLM_OK);
                CHECKF(memcmp(a, b, (size_t)n * F * 2) == 0,
                       "gate/up with its norm, %d rows, add %d: not the bits of the norm + gate/up",
                       (int)n, with_add);
                free(a), free(b);
                float *q = download_f32(q_d, (int64_t)n * NQ),
                      *q2 = download_f32(q2_d, (int64_t)n * NQ);
                float *kc[4];
                for (int i = 0; i < 4; i++)
                    kc[i] = download_bf16(c[i], (int64_t)n_slots * n_kv * hd);
                CHECKF(memcmp(q, q2, (size_t)n * NQ * 4) == 0 &&
                           memcmp(kc[0], kc[2], (size_t)n_slots * n_kv * hd * 4) == 0 &&
                           memcmp(kc[1], kc[3], (size_t)n_slots * n_kv * hd * 4) == 0,
                       "QKV with its norm, %d rows, add %d: not the bits of the norm + QKV", (int)n,
                       with_add);
                float *moved = download_f32(out_d, (int64_t)n * K);
                float *kept = download_f32(res2_d, (int64_t)n * K);
                float *ref = download_f32(res_d, (int64_t)n * K);
                CHECKF(memcmp(kept, res, rb) == 0, "norm in the projections, %d rows: res written",
                       (int)n);
                if (with_add)
                    CHECKF(memcmp(moved, ref, rb) == 0,
                           "norm in the projections, %d rows: out is not add_rmsnorm's res + add",
                           (int)n);
                free(q), free(q2), free(moved), free(kept), free(ref);
                for (int i = 0; i < 4; i++)
                    free(kc[i]);
            }
            void *bufs[] = {res_d, res2_d, add_d, out_d, xn_d, ff_d, ff2_d,
                            q_d,   q2_d,   c[0],  c[1],  c[2], c[3]};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                G->dealloc(gpu, bufs[i]);
        }
        G->dealloc(gpu, pos_d), G->dealloc(gpu, slot_d);
        free(pos), free(slot), free(res), free(add);
    }
    CHECKF(fused == 6, "the projections took their norm in %d of 6 steps", fused);
    free_weight(&wg), free_weight(&wq), free_weight(&bq), free_weight(&g);
}

/* Sequences of the given lengths, all their tokens in one step, over shuffled blocks: bias +
 * RoPE + KV store, then attention; a padding row at the end writes nothing. The last token
 * of each sequence is then run alone, and must give the same bits (batch invariance). */
static void test_attention(int32_t n_head, int32_t n_kv, int32_t hd, const int32_t *lens,
                           int32_t n_seqs)
{
    enum { BS = 16 };
    int32_t n = 0, max_len = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        n += lens[s];
        max_len = lens[s] > max_len ? lens[s] : max_len;
    }
    int32_t max_blocks = (max_len + BS - 1) / BS, nb = max_blocks * n_seqs + 3;
    int32_t *table = malloc((size_t)n_seqs * max_blocks * 4);
    int32_t *perm = malloc((size_t)nb * 4);
    for (int32_t i = 0; i < nb; i++)
        perm[i] = i;
    for (int32_t i = nb - 1; i > 0; i--) { /* shuffled, disjoint blocks */
        int32_t j = (int32_t)((uint32_t)(frand() * 1e6f + 1e6f) % (uint32_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j], perm[j] = tmp;
    }
    for (int32_t i = 0; i < n_seqs * max_blocks; i++)
        table[i] = perm[i];
    int32_t T = n + 1; /* + a padding row */
    int32_t *pos = malloc((size_t)T * 4), *seq = malloc((size_t)T * 4),
            *slot = malloc((size_t)T * 4);
    for (int32_t s = 0, t = 0; s < n_seqs; s++)
        for (int32_t p = 0; p < lens[s]; p++, t++) {
            pos[t] = p, seq[t] = s;
            slot[t] = table[s * max_blocks + p / BS] * BS + p % BS;
        }
    pos[n] = 0, seq[n] = 0, slot[n] = -1;
    int32_t Q = n_head * hd, KV = n_kv * hd, ld = Q + 2 * KV;
    int64_t cache_n = (int64_t)nb * BS * KV;
    float *qkv = randv((int64_t)T * ld, 2.0f), *bias = randv(ld, 0.5f);
    struct wpair bw;
    bw.t = (struct cllm_tensor){"b", CLLM_DTYPE_F32, 1, {ld, 1, 1, 1}, (uint64_t)ld * 4, bias};
    CHECK(cpu->iface->weight_init(cpu, &bw.t, &bw.c, NULL, 0) == CLLM_OK);
    CHECK(G->weight_init(gpu, &bw.t, &bw.g, NULL, 0) == CLLM_OK);
    struct cllm_rope rope = {1000000.0f, hd};

    /* CPU reference */
    float *qkv_c = malloc((size_t)T * ld * 4), *kc = calloc((size_t)cache_n, 4),
          *vc = calloc((size_t)cache_n, 4);
    memcpy(qkv_c, qkv, (size_t)T * ld * 4);
    struct cllm_attn_batch bc = {T, pos, seq, slot, table, max_blocks, BS, max_len};
    CHECK(cpu->iface->qkv_rope_store(cpu, &rope, &bc, qkv_c, ld, &bw.c, n_head, n_kv, kc, vc) ==
          CLLM_OK);
    /* The CPU cache holds F32; the GPU's holds the same values rounded to BF16. */
    for (int64_t i = 0; i < cache_n; i++) {
        kc[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(kc[i]));
        vc[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(vc[i]));
    }
    bc.n_tokens = n;
    /* The tensor-core kernel (unless CLLM_ATTN_SIMT=1) takes Q as BF16, as transformers' BF16
     * model has it, and rounds each softmax weight to BF16 for its P V MMA (relative error
     * <= 2^-9, and it divides by the sum of the rounded weights): its output may move by up
     * to 2^-9 max |v| beyond the BF16 output's own rounding. */
    const char *simt_env = getenv("CLLM_ATTN_SIMT");
    bool mma = !(simt_env && strcmp(simt_env, "1") == 0);
    float *q_ref = malloc((size_t)n * ld * 4), vmax = 0.0f;
    memcpy(q_ref, qkv_c, (size_t)n * ld * 4);
    for (int64_t i = 0; mma && i < (int64_t)n * ld; i++)
        if (i % ld < Q)
            q_ref[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(q_ref[i]));
    for (int64_t i = 0; i < cache_n; i++)
        vmax = fabsf(vc[i]) > vmax ? fabsf(vc[i]) : vmax;
    float *att_c = malloc((size_t)n * Q * 4);
    CHECK(cpu->iface->attention(cpu, &bc, q_ref, ld, kc, vc, n_head, n_kv, hd,
                                1.0f / sqrtf((float)hd), NULL, att_c) == CLLM_OK);

    /* GPU */
    void *pos_d = dev_upload(pos, (size_t)T * 4), *seq_d = dev_upload(seq, (size_t)T * 4),
         *slot_d = dev_upload(slot, (size_t)T * 4),
         *table_d = dev_upload(table, (size_t)n_seqs * max_blocks * 4);
    void *qkv_d = dev_upload(qkv, (size_t)T * ld * 4);
    /* The cache starts as a 0x3f3f pattern: slots nobody wrote must keep it. */
    uint16_t *pattern = malloc((size_t)cache_n * 2);
    for (int64_t i = 0; i < cache_n; i++)
        pattern[i] = 0x3f3f;
    void *kc_d = dev_upload(pattern, (size_t)cache_n * 2),
         *vc_d = dev_upload(pattern, (size_t)cache_n * 2);
    struct cllm_attn_batch bg = {T, pos_d, seq_d, slot_d, table_d, max_blocks, BS, max_len};
    CHECK(G->qkv_rope_store(gpu, &rope, &bg, qkv_d, ld, &bw.g, n_head, n_kv, kc_d, vc_d) ==
          CLLM_OK);
    float *qkv_g = download_f32(qkv_d, (int64_t)T * ld);
    for (int32_t t = 0; t < T; t++)
        test_check_close("rope q", qkv_g + (int64_t)t * ld, qkv_c + (int64_t)t * ld, Q, 1e-6, 1e-6);
    float *kc_g = download_bf16(kc_d, cache_n), *vc_g = download_bf16(vc_d, cache_n);
    bool *written = calloc((size_t)nb * BS, 1);
    for (int32_t t = 0; t < n; t++)
        written[slot[t]] = true;
    int64_t bad_untouched = 0;
    for (int64_t s = 0; s < (int64_t)nb * BS; s++) {
        if (written[s]) {
            test_check_close("k cache", kc_g + s * KV, kc + s * KV, KV, 1.0 / 128, 1e-6);
            test_check_close("v cache", vc_g + s * KV, vc + s * KV, KV, 0.0, 0.0);
        } else {
            for (int32_t i = 0; i < KV; i++)
                bad_untouched += kc_g[s * KV + i] != cllm_bf16_to_f32(0x3f3f) ||
                                 vc_g[s * KV + i] != cllm_bf16_to_f32(0x3f3f);
        }
    }
    CHECKF(bad_untouched == 0, "%lld cache values outside the step's slots changed",
           (long long)bad_untouched);
    /* attention reads the GPU's own cache; the reference read the same values */
    size_t scratch_bytes = G->attention_scratch(gpu, n, n_head, hd);
    void *scratch = NULL, *att_d = dev_poisoned((size_t)n * Q * 2);
    CHECK(G->alloc(gpu, scratch_bytes, &scratch) == CLLM_OK);
    CHECK(G->memzero(gpu, scratch, scratch_bytes) == CLLM_OK); /* as backend.h asks */
    bg.n_tokens = n;
    CHECK(G->attention(gpu, &bg, qkv_d, ld, kc_d, vc_d, n_head, n_kv, hd, 1.0f / sqrtf((float)hd),
                       scratch, att_d) == CLLM_OK);
    float *att_g = download_bf16(att_d, (int64_t)n * Q);
    char what[96];
    snprintf(what, sizeof what, "attention %d/%d heads, hd %d, longest %d", (int)n_head, (int)n_kv,
             (int)hd, (int)max_len);
    test_check_close(what, att_g, att_c, (int64_t)n * Q, 1.0 / 64, 2e-3 + (mma ? vmax / 512 : 0.0));

    /* batch invariance: each sequence's last token alone (its q row moved to row 0) */
    for (int32_t s = 0, t_last = -1; s < n_seqs; s++) {
        t_last += lens[s];
        struct cllm_attn_batch one = {1,
                                      (int32_t *)pos_d + t_last,
                                      (int32_t *)seq_d + t_last,
                                      (int32_t *)slot_d + t_last,
                                      table_d,
                                      max_blocks,
                                      BS,
                                      lens[s]};
        void *one_d = dev_poisoned((size_t)Q * 2);
        CHECK(G->attention(gpu, &one, (float *)qkv_d + (int64_t)t_last * ld, ld, kc_d, vc_d, n_head,
                           n_kv, hd, 1.0f / sqrtf((float)hd), scratch, one_d) == CLLM_OK);
        float *one_g = download_bf16(one_d, Q);
        CHECKF(memcmp(one_g, att_g + (int64_t)t_last * Q, (size_t)Q * 4) == 0,
               "sequence %d (%d tokens): alone != batched", (int)s, (int)lens[s]);
        free(one_g);
        G->dealloc(gpu, one_d);
    }
    /* ... and every token in reverse order: each query tile is then one token, where the
     * step above shared tiles between up to 64 / group tokens. The tensor cores must give each
     * row the same bits whatever the other rows of its MMA hold. */
    {
        int32_t *rpos = malloc((size_t)n * 4), *rseq = malloc((size_t)n * 4),
                *rslot = malloc((size_t)n * 4);
        float *rq = malloc((size_t)n * ld * 4);
        for (int32_t i = 0; i < n; i++) {
            int32_t t = n - 1 - i;
            rpos[i] = pos[t], rseq[i] = seq[t], rslot[i] = slot[t];
            memcpy(rq + (int64_t)i * ld, qkv_g + (int64_t)t * ld, (size_t)ld * 4);
        }
        void *rpos_d = dev_upload(rpos, (size_t)n * 4), *rseq_d = dev_upload(rseq, (size_t)n * 4),
             *rslot_d = dev_upload(rslot, (size_t)n * 4),
             *rq_d = dev_upload(rq, (size_t)n * ld * 4);
        void *rev_d = dev_poisoned((size_t)n * Q * 2);
        struct cllm_attn_batch rb = {n, rpos_d, rseq_d, rslot_d, table_d, max_blocks, BS, max_len};
        CHECK(G->attention(gpu, &rb, rq_d, ld, kc_d, vc_d, n_head, n_kv, hd,
                           1.0f / sqrtf((float)hd), scratch, rev_d) == CLLM_OK);
        float *rev = download_bf16(rev_d, (int64_t)n * Q);
        int32_t changed = 0;
        for (int32_t i = 0; i < n; i++)
            changed +=
                memcmp(rev + (int64_t)i * Q, att_g + (int64_t)(n - 1 - i) * Q, (size_t)Q * 4) != 0;
        CHECKF(changed == 0, "attention %d/%d heads: %d of %d tokens changed bits in reverse order",
               (int)n_head, (int)n_kv, (int)changed, (int)n);
        void *rbufs[] = {rpos_d, rseq_d, rslot_d, rq_d, rev_d};
        for (size_t i = 0; i < sizeof rbufs / sizeof rbufs[0]; i++)
            G->dealloc(gpu, rbufs[i]);
        free(rpos), free(rseq), free(rslot), free(rq), free(rev);
    }
    CHECK(G->attention(gpu, &bg, qkv_d, ld, kc_d, vc_d, n_head, n_kv, 96, 0.1f, scratch, att_d) ==
          CLLM_ERR_INVALID_ARG);

    void *bufs[] = {pos_d, seq_d, slot_d, table_d, qkv_d, kc_d, vc_d, scratch, att_d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        G->dealloc(gpu, bufs[i]);
    cpu->iface->weight_free(cpu, &bw.c);
    G->weight_free(gpu, &bw.g);
    free(table), free(perm), free(pos), free(seq), free(slot), free(qkv), free(bias), free(qkv_c),
        free(kc), free(vc), free(att_c), free(q_ref), free(qkv_g), free(kc_g), free(vc_g),
        free(written), free(att_g), free(pattern);
}

/* A recorded sequence (add_rmsnorm then matmul) replayed over new inputs at the same
 * addresses gives what running the ops directly gives. */
static void test_graph(void)
{
    enum { n = 5, K = 256, N = 384 };
    if (!G->graph_begin || !G->graph_end) {
        CHECKF(false, "the backend records no steps (a MUSA build needs CLLM_MUSA_GRAPHS=1 here)");
        return;
    }
    struct wpair w, g;
    make_weight(&w, K, N, 0.05f);
    make_weight(&g, K, 1, 1.0f);
    void *res_d = NULL, *x_d = NULL, *xn_d = NULL, *y_d = NULL;
    CHECK(G->alloc(gpu, n * K * 4, &res_d) == CLLM_OK &&
          G->alloc(gpu, n * K * 4, &x_d) == CLLM_OK && G->alloc(gpu, n * K * 2, &xn_d) == CLLM_OK &&
          G->alloc(gpu, n * N * 4, &y_d) == CLLM_OK);
    float *want = NULL;
    for (int round = 0; round < 3; round++) {
        float *res = randv(n * K, 1.0f), *x = randv(n * K, 1.0f);
        /* direct */
        CHECK(G->upload(gpu, res_d, res, n * K * 4) == CLLM_OK);
        CHECK(G->upload(gpu, x_d, x, n * K * 4) == CLLM_OK);
        CHECK(G->add_rmsnorm(gpu, res_d, x_d, &g.g, 1e-6f, n, K, xn_d) == CLLM_OK);
        CHECK(G->matmul(gpu, &w.g, NULL, xn_d, n, y_d, N) == CLLM_OK);
        free(want);
        want = download_f32(y_d, n * N);
        /* recorded (round 0) or replayed (rounds 1, 2) */
        CHECK(G->upload(gpu, res_d, res, n * K * 4) == CLLM_OK);
        CHECK(G->upload(gpu, x_d, x, n * K * 4) == CLLM_OK);
        CHECK(G->memzero(gpu, y_d, n * N * 4) == CLLM_OK);
        bool replayed = true;
        CHECK(G->graph_begin(gpu, 42, &replayed) == CLLM_OK);
        CHECK(replayed == (round > 0));
        if (!replayed) {
            CHECK(G->add_rmsnorm(gpu, res_d, x_d, &g.g, 1e-6f, n, K, xn_d) == CLLM_OK);
            CHECK(G->matmul(gpu, &w.g, NULL, xn_d, n, y_d, N) == CLLM_OK);
            CHECK(G->graph_end(gpu, 42) == CLLM_OK);
        }
        float *got = download_f32(y_d, n * N);
        CHECKF(memcmp(got, want, n * N * 4) == 0, "round %d: recorded step differs", round);
        free(got), free(res), free(x);
    }
    CHECK(G->graph_end(gpu, 42) == CLLM_ERR_INVALID_ARG); /* not recording */
    free(want);
    G->dealloc(gpu, res_d), G->dealloc(gpu, x_d), G->dealloc(gpu, xn_d), G->dealloc(gpu, y_d);
    free_weight(&w), free_weight(&g);
}

/* A step recorded before the GEMM's scratch has grown (a fresh backend: no eager GEMM yet)
 * records the GEMM without its parallel slices; the next graph_begin grows the scratch and
 * records the step again (not replayed), after which it is replayed. The bits are the same
 * throughout. (Our GEMM's alone: a BLAS writing BF16 cannot record before its buffer grows.) */
static void test_graph_short_scratch(const struct cllm_backend_options *og)
{
    enum { n = 40, K = 1024, N = 384 }; /* several slices, more tokens than the skinny kernel's */
    if (!fused_gemm)
        return;
    struct cllm_backend *fresh = NULL, *saved = gpu;
    char err[256] = "";
    if (cllm_backend_new(&fresh, og, err, sizeof err) != CLLM_OK) {
        CHECKF(false, "a second backend: %s", err);
        return;
    }
    gpu = fresh; /* make_weight and download_f32 use it */
    struct wpair w;
    make_weight(&w, K, N, 0.05f);
    float *x = randv(n * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n * K);
    void *x_d = NULL, *y_d = NULL;
    CHECK(G->alloc(gpu, n * K * 2, &x_d) == CLLM_OK && G->alloc(gpu, n * N * 4, &y_d) == CLLM_OK);
    CHECK(G->upload(gpu, x_d, xb, (size_t)n * K * 2) == CLLM_OK);
    float *first = NULL;
    for (int round = 0; round < 3; round++) {
        CHECK(G->memzero(gpu, y_d, n * N * 4) == CLLM_OK);
        bool replayed = true;
        CHECK(G->graph_begin(gpu, 99, &replayed) == CLLM_OK);
        /* round 1 records again: the scratch was short in round 0 */
        CHECKF(replayed == (round == 2), "round %d: %s", round,
               replayed ? "replayed" : "recorded again");
        if (!replayed) {
            CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, y_d, N) == CLLM_OK);
            CHECK(G->graph_end(gpu, 99) == CLLM_OK);
        }
        float *got = download_f32(y_d, n * N);
        if (!first)
            first = got;
        else {
            CHECKF(memcmp(got, first, n * N * 4) == 0, "round %d: the step's bits changed", round);
            free(got);
        }
    }
    CHECK(G->matmul(gpu, &w.g, NULL, x_d, n, y_d, N) == CLLM_OK); /* eager, scratch grown */
    float *eager = download_f32(y_d, n * N);
    CHECKF(memcmp(eager, first, n * N * 4) == 0, "the eager GEMM differs from the recorded one");
    free(eager), free(first), free(x), free(xb);
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d);
    free_weight(&w);
    cllm_backend_free(fresh);
    gpu = saved;
}

static void fill_i32(int32_t *p, int32_t n, int32_t v)
{
    for (int32_t i = 0; i < n; i++)
        p[i] = v;
}

#ifdef CLLM_EMULATED
/* y = W x over n tokens on backend `be` (the weight be's), downloaded. */
static float *matmul_on(struct cllm_backend *be, const struct cllm_weight *w, const void *x_d,
                        int32_t n, void *y_d, int32_t N)
{
    CHECKF(be->iface->matmul(be, w, NULL, x_d, n, y_d, N) == CLLM_OK, "a %d-token GEMM failed",
           (int)n);
    return download_f32_on(be, y_d, (int64_t)n * N);
}

/* Out of device memory, where only the emulator can make it happen on demand: it refuses every
 * allocation from a given size on (emu_refuse_device_bytes), as a full device would. A GEMM
 * without room for its scratch computes the same bits in fewer blocks, eagerly and recorded (decode
 * steps split over blocks under CLLM_GEMM_SPLIT=2|4, prefill steps' parallel slices); an allocation
 * or a draw that finds no room fails as out of memory, queuing nothing, and so does a
 * recording whose graph finds none; and nothing after them fails for it (CUDA keeps a failed
 * call's error as its last error, which the next op's launch check would report as its
 * own). */
static void test_out_of_memory(const struct cllm_backend_options *og)
{
    enum { n = 40, K = 1024, N = 384, V = 300, R = 3 }; /* the shape of test_graph_short_scratch */
    if (!fused_gemm)
        return;
    struct wpair w;
    make_weight(&w, K, N, 0.05f);
    float *x = randv(n * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n * K);
    void *x_d = dev_upload(xb, (size_t)n * K * 2), *y_d = NULL;
    CHECK(G->alloc(gpu, n * N * 4, &y_d) == CLLM_OK);
    float *want = matmul_on(gpu, &w.g, x_d, n, y_d, N),
          *want1 = matmul_on(gpu, &w.g, x_d, 1, y_d, N);
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d);

    struct cllm_backend *fresh = NULL;
    char err[256] = "";
    if (cllm_backend_new(&fresh, og, err, sizeof err) != CLLM_OK) {
        CHECKF(false, "a second backend: %s", err);
        return;
    }
    const struct cllm_backend_iface *F = fresh->iface;
    struct cllm_weight wf;
    CHECK(F->weight_init(fresh, &w.t, &wf, NULL, 0) == CLLM_OK);
    void *xf = NULL, *yf = NULL;
    CHECK(F->alloc(fresh, n * K * 2, &xf) == CLLM_OK && F->alloc(fresh, n * N * 4, &yf) == CLLM_OK);
    CHECK(F->upload(fresh, xf, xb, (size_t)n * K * 2) == CLLM_OK);

    /* no room for any scratch (it is at least CLLM_CUDA_GEMM_COUNT_BYTES) */
    emu_refuse_device_bytes(16384);
    const long refused = emu_refused_allocations();
    float *got = matmul_on(fresh, &wf, xf, n, yf, N);
    CHECKF(emu_refused_allocations() > refused, "the GEMM asked for no scratch");
    CHECKF(memcmp(got, want, n * N * 4) == 0, "%d tokens without the scratch: other bits", (int)n);
    free(got);
    got = matmul_on(fresh, &wf, xf, 1, yf, N);
    CHECKF(memcmp(got, want1, N * 4) == 0, "1 token without the scratch: other bits");
    free(got);
    for (int round = 0; round < 2; round++) { /* recorded, then replayed: no scratch to wait for */
        bool replayed = true;
        CHECK(F->memzero(fresh, yf, n * N * 4) == CLLM_OK);
        CHECK(F->graph_begin(fresh, 98, &replayed) == CLLM_OK);
        CHECKF(replayed == (round == 1), "round %d: %s", round,
               replayed ? "replayed" : "recorded again");
        if (!replayed)
            CHECK(F->matmul(fresh, &wf, NULL, xf, n, yf, N) == CLLM_OK &&
                  F->graph_end(fresh, 98) == CLLM_OK);
        got = download_f32_on(fresh, yf, n * N);
        CHECKF(memcmp(got, want, n * N * 4) == 0, "round %d without the scratch: other bits",
               round);
        free(got);
    }

    /* a buffer, then a draw's buffers, with no room: out of memory, and the GEMM after each
     * runs (it allocates nothing: its scratch was refused before) */
    void *big = (void *)&big;
    CHECK(F->alloc(fresh, 1 << 20, &big) == CLLM_ERR_NOMEM && big == NULL);
    got = matmul_on(fresh, &wf, xf, n, yf, N);
    CHECKF(memcmp(got, want, n * N * 4) == 0, "the GEMM after a refused buffer: other bits");
    free(got);
    float *logits = randv(R * V, 1.0f);
    float *l_d = NULL;
    emu_refuse_device_bytes(0);
    CHECK(F->alloc(fresh, R * V * 4, (void **)&l_d) == CLLM_OK);
    CHECK(F->upload(fresh, l_d, logits, R * V * 4) == CLLM_OK);
    struct cllm_sample_row rows[R];
    memset(rows, 0, sizeof rows);
    int32_t tok[R];
    fill_i32(tok, R, -7);
    emu_refuse_device_bytes(1);
    CHECK(F->sample(fresh, l_d, R, V, rows, NULL, tok) == CLLM_ERR_NOMEM);
    CHECK(F->wait_draw(fresh) == CLLM_ERR_INVALID_ARG); /* nothing queued */
    CHECK(tok[0] == -7);
    got = matmul_on(fresh, &wf, xf, n, yf, N);
    CHECKF(memcmp(got, want, n * N * 4) == 0, "the GEMM after a refused draw: other bits");
    free(got);
    /* a step recorded with no room to instantiate its graph (the emulator counts 1 KiB a
     * node): out of memory, nothing of it kept; the op after it runs (the model runs such a
     * step op by op), and with room again the same key records anew */
    emu_refuse_device_bytes(1024);
    bool replayed = true;
    CHECK(F->graph_begin(fresh, 97, &replayed) == CLLM_OK && !replayed);
    CHECK(F->matmul(fresh, &wf, NULL, xf, n, yf, N) == CLLM_OK);
    CHECK(F->graph_end(fresh, 97) == CLLM_ERR_NOMEM);
    got = matmul_on(fresh, &wf, xf, n, yf, N);
    CHECKF(memcmp(got, want, n * N * 4) == 0, "the GEMM after a refused graph: other bits");
    free(got);
    emu_refuse_device_bytes(0);
    replayed = true;
    CHECK(F->memzero(fresh, yf, n * N * 4) == CLLM_OK);
    CHECK(F->graph_begin(fresh, 97, &replayed) == CLLM_OK && !replayed);
    CHECK(F->matmul(fresh, &wf, NULL, xf, n, yf, N) == CLLM_OK &&
          F->graph_end(fresh, 97) == CLLM_OK);
    got = download_f32_on(fresh, yf, n * N);
    CHECKF(memcmp(got, want, n * N * 4) == 0, "recorded once there is room: other bits");
    free(got);
    /* room again: the draw goes through */
    CHECK(F->sample(fresh, l_d, R, V, rows, NULL, tok) == CLLM_OK);
    CHECK(F->wait_draw(fresh) == CLLM_OK);
    for (int r = 0; r < R; r++)
        CHECKF(tok[r] == test_argmax(logits + r * V, V), "row %d: token %d", r, (int)tok[r]);

    F->dealloc(fresh, xf), F->dealloc(fresh, yf), F->dealloc(fresh, l_d);
    F->weight_free(fresh, &wf);
    cllm_backend_free(fresh);
    free(logits), free(want), free(want1), free(x), free(xb);
    free_weight(&w);
}
#endif

/* The device sampler's queue (run-ahead): two draws in flight, each written by its own wait in
 * order and a third refused; references in a step's tokens resolved on the device from the
 * newest draw; sync writing every draw; buffers growing under a draw in flight keeping its
 * tokens; no draw or resolve while a step is recorded. Greedy rows: the tokens are argmaxes. */
static void test_draws(void)
{
    enum { V = 300, R = 6 };
    float *logits = randv(R * V, 1.0f);
    int32_t want[R];
    for (int r = 0; r < R; r++)
        want[r] = test_argmax(logits + r * V, V);
    float *l_d = dev_upload(logits, R * V * 4);
    struct cllm_sample_row rows[R];
    memset(rows, 0, sizeof rows);
    int32_t a[R], b[R], c[R];
    fill_i32(a, R, -7), fill_i32(b, R, -7), fill_i32(c, R, -7);
    CHECK(G->sample(gpu, l_d, 2, V, rows, NULL, a) == CLLM_OK);
    CHECK(G->sample(gpu, l_d + 2 * V, 3, V, rows, NULL, b) == CLLM_OK);
    CHECK(G->sample(gpu, l_d, 1, V, rows, NULL, c) == CLLM_ERR_INVALID_ARG); /* a third */
    /* -1 - k: token k of the newest draw (b, with a still queued); past its 3 rows: token 0 */
    int32_t refs[5] = {-1, 42, -3, -2, -4}, got[5];
    int32_t *t_d = dev_upload(refs, sizeof refs);
    CHECK(G->resolve_tokens(gpu, t_d, 5) == CLLM_OK);
    CHECK(G->wait_draw(gpu) == CLLM_OK);
    CHECKF(a[0] == want[0] && a[1] == want[1] && a[2] == -7, "first draw: %d %d %d", (int)a[0],
           (int)a[1], (int)a[2]);
    CHECKF(b[0] == -7, "the second draw was written by the first one's wait");
    CHECK(G->wait_draw(gpu) == CLLM_OK);
    CHECKF(b[0] == want[2] && b[1] == want[3] && b[2] == want[4] && b[3] == -7,
           "second draw: %d %d %d %d", (int)b[0], (int)b[1], (int)b[2], (int)b[3]);
    CHECK(G->wait_draw(gpu) == CLLM_ERR_INVALID_ARG); /* none left */
    CHECK(G->download(gpu, got, t_d, sizeof got) == CLLM_OK && G->sync(gpu) == CLLM_OK);
    CHECKF(got[0] == want[2] && got[1] == 42 && got[2] == want[4] && got[3] == want[3] &&
               got[4] == 0,
           "resolved tokens: %d %d %d %d %d", (int)got[0], (int)got[1], (int)got[2], (int)got[3],
           (int)got[4]);
    /* sync writes both */
    fill_i32(a, R, -7), fill_i32(b, R, -7);
    CHECK(G->sample(gpu, l_d + 4 * V, 2, V, rows, NULL, a) == CLLM_OK);
    CHECK(G->sample(gpu, l_d, 1, V, rows, NULL, b) == CLLM_OK);
    CHECK(G->sync(gpu) == CLLM_OK);
    CHECK(a[0] == want[4] && a[1] == want[5] && b[0] == want[0]);
    CHECK(G->wait_draw(gpu) == CLLM_ERR_INVALID_ARG);
    /* the buffers grow (6 rows > 3) while a draw is in flight */
    fill_i32(a, R, -7), fill_i32(b, R, -7);
    CHECK(G->sample(gpu, l_d + 5 * V, 1, V, rows, NULL, a) == CLLM_OK);
    CHECK(G->sample(gpu, l_d, R, V, rows, NULL, b) == CLLM_OK);
    CHECK(G->wait_draw(gpu) == CLLM_OK && a[0] == want[5]);
    CHECK(G->wait_draw(gpu) == CLLM_OK && memcmp(b, want, sizeof want) == 0);
    /* not while recording */
    bool replayed = true;
    CHECK(G->graph_begin(gpu, 77, &replayed) == CLLM_OK && !replayed);
    CHECK(G->sample(gpu, l_d, 1, V, rows, NULL, c) == CLLM_ERR_INVALID_ARG);
    CHECK(G->resolve_tokens(gpu, t_d, 5) == CLLM_ERR_INVALID_ARG);
    CHECK(G->memzero(gpu, t_d, sizeof refs) == CLLM_OK);
    CHECK(G->graph_end(gpu, 77) == CLLM_OK && G->sync(gpu) == CLLM_OK);
    CHECK(c[0] == -7);
    G->dealloc(gpu, l_d), G->dealloc(gpu, t_d);
    free(logits);
}

/* Penalties through the backend's draw: the rows' counts and a token of the previous draw
 * (unseen_output) reach the device, also when the buffers grow under that draw (its device
 * tokens carried over); the penalized greedy tokens are those of the host's cllm_penalize;
 * rows that ask for what is not there are refused, queuing nothing. */
static void test_draw_penalties(void)
{
    enum { V = 300, R = 16, H = R / 2 }; /* 8, then 16 rows: the buffers grow twice */
    float *logits = randv(R * V, 1.0f);
    float *l_d = dev_upload(logits, R * V * 4);
    struct cllm_sample_row rows[R];
    memset(rows, 0, sizeof rows);
    int32_t first[H], got[R], top[R], want[R];
    for (int r = 0; r < R; r++)
        top[r] = test_argmax(logits + r * V, V);
    fill_i32(first, H, -7);
    CHECK(G->sample(gpu, l_d, H, V, rows, NULL, first) == CLLM_OK); /* first[r] = top[r] */
    /* Strong penalties sink a token: even rows' own top token is in the prompt (counts);
     * odd rows below H count their own top token as the previous draw's, odd rows from H on
     * that of row r - H, besides their own in the prompt. */
    struct cllm_token_count counts[R];
    int32_t n_counts = 0;
    for (int r = 0; r < R; r++) {
        const bool listed = r % 2 == 0 || r >= H;
        rows[r] = (struct cllm_sample_row){.repetition_penalty = 8.0f,
                                           .presence_penalty = 2.0f,
                                           .frequency_penalty = 3.0f,
                                           .counts_at = n_counts,
                                           .n_counts = listed,
                                           .unseen_output = r % 2 ? 1 + r % H : 0};
        if (listed)
            counts[n_counts++] = (struct cllm_token_count){top[r], 0};
        float *row = logits + r * V;
        cllm_penalize(row, V, &counts[rows[r].counts_at], (size_t)rows[r].n_counts,
                      r % 2 ? top[r % H] : -1, 8.0f, 2.0f, 3.0f);
        want[r] = test_argmax(row, V);
        if (r < H)
            CHECK(want[r] != top[r]); /* sunk: the test can tell */
    }
    fill_i32(got, R, -7);
    CHECK(G->sample(gpu, l_d, R, V, rows, counts, got) == CLLM_OK);
    CHECK(G->wait_draw(gpu) == CLLM_OK && memcmp(first, top, sizeof first) == 0);
    CHECK(G->wait_draw(gpu) == CLLM_OK);
    for (int r = 0; r < R; r++)
        CHECKF(got[r] == want[r], "row %d: penalized greedy token %d, want %d", r, (int)got[r],
               (int)want[r]);
    /* refused: the previous draw had R rows; counts missing; negative fields */
    rows[0].unseen_output = R + 1;
    CHECK(G->sample(gpu, l_d, 1, V, rows, counts, got) == CLLM_ERR_INVALID_ARG);
    rows[0].unseen_output = 0;
    CHECK(G->sample(gpu, l_d, 1, V, rows, NULL, got) == CLLM_ERR_INVALID_ARG);
    rows[0].counts_at = -1;
    CHECK(G->sample(gpu, l_d, 1, V, rows, counts, got) == CLLM_ERR_INVALID_ARG);
    CHECK(G->wait_draw(gpu) == CLLM_ERR_INVALID_ARG); /* none of them was queued */
    G->dealloc(gpu, l_d);
    free(logits);
}

static bool env_is(const char *name, const char *value)
{
    const char *v = getenv(name);
    return v && !strcmp(v, value);
}

#ifdef CLLM_EMULATED
/* A second backend started with the emulated BLAS's fault `fault` set (tests/emu/blas_emu.cpp):
 * refused with `refusal` in its error where that is given; else started, and its GEMM right
 * (against the exact product) and batch-invariant (tokens alone against the same tokens in a
 * step of 9), with the fault still set: so the faulty BLAS is not what computes it. */
static void check_blas_fault(const struct cllm_backend_options *og, const char *fault,
                             const char *refusal)
{
    enum { K = 72, N = 40, n = 9 };
    struct cllm_backend *be = NULL, *saved = gpu;
    char err[256] = "";
    const bool was_set = env_is(fault, "1"); /* the whole test's setting, kept after */
    setenv(fault, "1", 1);
    enum cllm_status st = cllm_backend_new(&be, og, err, sizeof err);
    if (refusal || st != CLLM_OK) {
        CHECKF(refusal ? st == CLLM_ERR_DEVICE && strstr(err, refusal) : st == CLLM_OK,
               "%s=1: %s (%s)", fault, st == CLLM_OK ? "started" : "refused", err);
        if (st == CLLM_OK)
            cllm_backend_free(be);
        if (!was_set)
            unsetenv(fault);
        return;
    }
    gpu = be; /* make_weight and dev_upload use it */
    struct wpair w;
    make_weight(&w, K, N, 0.05f);
    float *x = randv(n * K, 1.0f);
    uint16_t *xb = bf16_of(x, (int64_t)n * K);
    void *x_d = dev_upload(xb, (size_t)n * K * 2), *y_d = dev_poisoned((size_t)n * N * 4);
    float *all = matmul_on(be, &w.g, x_d, n, y_d, N);
    int bad = 0, differ = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < N; r++) {
            double exact = 0.0, mag = 0.0;
            for (int k = 0; k < K; k++) {
                const double p = (double)w.f32[r * K + k] * x[t * K + k];
                exact += p, mag += fabs(p);
            }
            bad += !(fabs(all[t * N + r] - exact) <= 1e-5 * mag + 1e-30);
        }
    for (int t = 0; t < n; t += 4) {
        float *one = matmul_on(be, &w.g, (const char *)x_d + (size_t)t * K * 2, 1, y_d, N);
        differ += memcmp(one, all + t * N, N * 4) != 0;
        free(one);
    }
    CHECKF(bad == 0 && differ == 0,
           "%s=1: the GEMM has %d elements off the exact product, %d tokens alone differ", fault,
           bad, differ);
    if (!was_set)
        unsetenv(fault);
    free(all), free(x), free(xb);
    G->dealloc(gpu, x_d), G->dealloc(gpu, y_d);
    free_weight(&w);
    cllm_backend_free(be);
    gpu = saved;
}

/* What runs the GEMMs where the vendor BLAS is missing or computes wrongly. Without MMA (the
 * MUSA configuration) our GEMM on CUDA cores, the GPU kept; with MMA our tensor-core GEMM,
 * except where CLLM_CUBLAS=1 asks for a BLAS that is wrong: that is refused. */
static void test_blas_fallbacks(const struct cllm_backend_options *og)
{
    check_blas_fault(og, "EMU_NO_BLAS", NULL);
#ifdef CLLM_EXPECT_NO_MMA
    check_blas_fault(og, "EMU_BLAS_WRONG", NULL);
#else
    const bool asked = env_is("CLLM_CUBLAS", "1");
    if (!asked) /* the BLAS is not used */
        check_blas_fault(og, "EMU_BLAS_WRONG", NULL);
    if (!env_is("CLLM_GEMM_SIMT", "1")) { /* (which would take precedence) */
        setenv("CLLM_CUBLAS", "1", 1);
        check_blas_fault(og, "EMU_BLAS_WRONG", "cuBLAS fails a small BF16 GEMM");
        if (!asked)
            unsetenv("CLLM_CUBLAS");
    }
#endif
}
#else
static void test_blas_fallbacks(const struct cllm_backend_options *og)
{
    (void)og;
}
#endif

int main(void)
{
    struct cllm_backend_options oc = {CLLM_BACKEND_CPU, 0, 0, CLLM_CPU_WEIGHTS_STORED, 0, false},
                                og = {CLLM_BACKEND_CUDA, 0, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    char err[256] = "";
    if (cllm_backend_new(&gpu, &og, err, sizeof err) != CLLM_OK) {
        printf("skipped: %s\n", err);
        return 77;
    }
    G = gpu->iface;
    const bool simt = env_is("CLLM_GEMM_SIMT", "1");
#ifdef CLLM_EXPECT_NO_MMA
    /* Without MMA the BLAS does every GEMM where it works, else our GEMM on CUDA cores */
    invariant_gemm = simt || env_is("EMU_NO_BLAS", "1");
    if (!invariant_gemm && env_is("EMU_BLAS_NO_F32_OUT", "1"))
        gemm_rel = 1.0 / 256; /* 2^-9 per element, doubled */
#else
    fused_gemm = !simt && !env_is("CLLM_CUBLAS", "1");
    invariant_gemm = simt || fused_gemm;
#endif
    printf("GEMMs: %s\n", fused_gemm       ? "ours on tensor cores"
                          : invariant_gemm ? "ours on CUDA cores"
                                           : "the vendor BLAS (no batch-invariance check)");
    if (cllm_backend_new(&cpu, &oc, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    test_blas_fallbacks(&og);
    size_t free_b = 0, total_b = 0;
    CHECK(G->mem_info(gpu, &free_b, &total_b) == CLLM_OK && free_b > 0 && free_b <= total_b);

    test_draws();
    test_draw_penalties();
    test_alloc_too_large();
#ifdef CLLM_SMALL_SHAPES
    /* The same paths through the backend at small shapes: under the CPU's CUDA emulator
     * (tests/emu, test_emu_backend), which runs them in a minute (the kernels' own checks at
     * the model's shapes are in test_emu_kernels), and on a GPU under compute-sanitizer
     * (test_gpu_ops_small, tests/gpu/sanitize), which slows every access it checks. */
    test_embed_norm_silu(3, 264);
    int32_t shapes[][3] = {{264, 100, 1}, {256, 136, 7}, {520, 72, 40}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        test_matmul(shapes[i][0], shapes[i][1], shapes[i][2]);
    if (invariant_gemm)
        test_matmul_invariance(264, 48);
    test_matmul_gate_up_silu(264, 52);
    test_tune_matmul(264, 40, 40);
    test_matmul_rope_store(4, 2, 64, 264);
    test_norm_in_ops(264, 40);
    int32_t lens_a[] = {1, 17, 40};
    int32_t lens_b[] = {300, 2, 40};
    test_attention(4, 2, 64, lens_a, 3);
    test_attention(2, 2, 64, lens_b, 3);
#else
    test_embed_norm_silu(1, 1536);
    test_embed_norm_silu(37, 896);
    test_embed_norm_silu(300, 8960);
    int32_t shapes[][3] = {{1536, 1536, 1}, {1536, 2048, 7}, {8960, 1536, 64}, {1536, 17920, 300}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        test_matmul(shapes[i][0], shapes[i][1], shapes[i][2]);
    if (invariant_gemm) {
        test_matmul_invariance(1536, 2048); /* QKV of Qwen2.5-1.5B: many slices */
        test_matmul_invariance(8960, 1536); /* down projection */
        test_matmul_invariance(1536, 8960); /* one slice */
    }
    test_matmul_gate_up_silu(1536, 8960);
    test_tune_matmul(1536, 8960, 300);        /* gate/up of Qwen2.5-1.5B, every bucket to 300 */
    test_matmul_rope_store(12, 2, 128, 1536); /* Qwen2.5-1.5B */
    test_matmul_rope_store(14, 2, 64, 896);   /* Qwen2.5-0.5B */
    test_norm_in_ops(1536, 8960);             /* Qwen2.5-1.5B's width */
    int32_t lens_a[] = {1, 17, 300};
    int32_t lens_b[] = {5000, 2, 700};     /* 5000: split over several blocks */
    test_attention(12, 2, 128, lens_a, 3); /* Qwen2.5-1.5B */
    test_attention(14, 2, 64, lens_a, 3);  /* Qwen2.5-0.5B */
    test_attention(28, 4, 128, lens_b, 3); /* Qwen2.5-7B */
    test_attention(4, 4, 64, lens_b, 3);   /* no grouping */
#endif
    test_graph();
    test_graph_short_scratch(&og);
#ifdef CLLM_EMULATED
    test_out_of_memory(&og);
#endif

    cllm_backend_free(cpu);
    cllm_backend_free(gpu);
    return test_summary();
}
