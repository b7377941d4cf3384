/*
 * The CPU matmul (backend/cpu/matmul.h) on random weights of every dtype at awkward sizes, under
 * each SIMD kernel family this CPU runs (AVX2; AVX-512 VNNI, quantized weights; AVX-512 BF16,
 * whose BF16 weights take BF16 activations): SIMD against scalar kernels (bit-equal for
 * quantized weights, by design; to rounding for float weights), both against a double-precision
 * reference on the dequantized weights and the activations as the kernels see them (8-bit
 * quantized or rounded to BF16: only rounding differs) and, looser, against the unrounded
 * activations; identical bits for 1, 2 and 3 threads and for a token alone or inside a batch;
 * the activation quantizer and the BF16 rounding themselves; K-quant rows packed 16 at a time
 * against the file's layout; and the error returns.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/matmul.h"
#include "backend/cpu/pack_x16.h"
#include "backend/cpu/quant_dot.h"
#include "core/f16.h"
#include "tensor/quant.h"
#include "test.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Uniform in [-1, 1). */
static float rng_f(void)
{
    return (float)((double)(rng_u64() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Roughly normal (sum of uniforms), with occasional outliers as real activations have. */
static float rng_act(void)
{
    float v = (rng_f() + rng_f() + rng_f() + rng_f()) * 0.9f;
    if (rng_u64() % 97 == 0)
        v *= 12.0f;
    return v;
}

static void put_f16(uint8_t *p, float f)
{
    uint16_t h = cllm_f32_to_f16(f);
    memcpy(p, &h, 2);
}

/* A sane block scale: magnitude 1e-3 .. 3e-2, either sign. */
static float rng_scale(void)
{
    float m = 1e-3f + 3e-2f * (float)(rng_u64() % 1000) / 1000.0f;
    return rng_u64() & 1 ? m : -m;
}

struct wmat {
    enum cllm_dtype type;
    int64_t K, N;
    uint8_t *data;
    double *deq; /* [N][K] dequantized with cllm_dequant_row */
    struct cllm_tensor t;
};

/* Random weights: random bytes for quantized blocks (every bit pattern of quants, 6-bit scales
 * and high bits), with the f16 scale fields overwritten by sane values. */
static void wmat_init(struct wmat *m, enum cllm_dtype type, int64_t K, int64_t N)
{
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(type);
    uint64_t row_bytes;
    cllm_dtype_row_bytes(type, K, &row_bytes);
    m->type = type;
    m->K = K;
    m->N = N;
    m->data = malloc(row_bytes * N);
    m->deq = malloc(sizeof(double) * K * N);
    for (uint64_t i = 0; i < row_bytes * N; i++)
        m->data[i] = (uint8_t)rng_u64();
    if (type == CLLM_DTYPE_F32) {
        for (int64_t i = 0; i < K * N; i++) {
            float f = rng_f();
            memcpy(m->data + 4 * i, &f, 4);
        }
    } else if (type == CLLM_DTYPE_F16 || type == CLLM_DTYPE_BF16) {
        for (int64_t i = 0; i < K * N; i++) {
            const float f = rng_f();
            uint16_t h = type == CLLM_DTYPE_F16 ? cllm_f32_to_f16(f) : cllm_f32_to_bf16(f);
            memcpy(m->data + 2 * i, &h, 2);
        }
    } else {
        const int64_t nblocks = K / tr->block_size * N;
        for (int64_t b = 0; b < nblocks; b++) {
            uint8_t *blk = m->data + b * tr->type_size;
            switch (type) {
            case CLLM_DTYPE_Q6_K:
                put_f16(blk + offsetof(struct cllm_block_q6_k, d), rng_scale());
                break;
            case CLLM_DTYPE_Q4_K:
            case CLLM_DTYPE_Q5_K:
                /* dmin >= 0 as ggml's quantizers make it, scaled so mins and scales balance */
                put_f16(blk, rng_scale() * 0.1f);
                put_f16(blk + 2, fabsf(rng_scale()) * 0.1f);
                break;
            case CLLM_DTYPE_Q4_1:
            case CLLM_DTYPE_Q5_1:
                put_f16(blk, rng_scale());
                put_f16(blk + 2, rng_scale() * 8.0f);
                break;
            default:
                put_f16(blk, rng_scale());
                break;
            }
        }
    }
    float *row = malloc(sizeof(float) * K);
    for (int64_t n = 0; n < N; n++) {
        cllm_dequant_row(type, m->data + n * row_bytes, row, K);
        for (int64_t k = 0; k < K; k++)
            m->deq[n * K + k] = row[k];
    }
    free(row);
    m->t = (struct cllm_tensor){"w", type, 2, {K, N, 1, 1}, row_bytes * N, m->data};
}

static void wmat_free(struct wmat *m)
{
    free(m->data);
    free(m->deq);
}

/* y = matmul with a fresh scratch buffer (offset by 3 bytes: any alignment must work). */
static enum cllm_status run_mm(struct cllm_threadpool *tp, const struct wmat *m, const float *x,
                               int64_t nt, float *y, int64_t ldy)
{
    size_t ss = cllm_cpu_matmul_scratch_size(m->type, m->K, nt);
    uint8_t *scratch = malloc(ss + 3);
    enum cllm_status st = cllm_cpu_matmul(tp, &m->t, x, nt, y, ldy, scratch + 3, ss);
    free(scratch);
    return st;
}

/* What vcvtne2ps2bf16 makes of f: subnormal floats become a zero of their sign, the rest
 * rounds to nearest even. */
static uint16_t bf16_daz(float f)
{
    return fabsf(f) < 0x1p-126f ? (uint16_t)(signbit(f) ? 0x8000u : 0u) : cllm_f32_to_bf16(f);
}

/* Half the BF16 spacing at f (8 significant bits), f's own magnitude where it is flushed. */
static double bf16_half_step(float f)
{
    int e;
    if (f == 0.0f)
        return 0.0;
    if (fabsf(f) < 0x1p-126f)
        return fabsf(f);
    frexp(f, &e); /* |f| in [2^(e-1), 2^e) */
    return ldexp(1.0, e - 9);
}

/* The activation format the kernels now in use multiply weights of type with. */
static enum cllm_act_kind active_act_kind(enum cllm_dtype type)
{
    return type == CLLM_DTYPE_BF16 && cllm_cpu_matmul_bf16_activations() ? CLLM_ACT_BF16
                                                                         : cllm_act_kind_of(type);
}

/* The activations as kernels of activation kind `kind` see them (8-bit quantized, or rounded to
 * BF16) in double, and the half rounding step of each element (0 for F32). */
static void act_reference(enum cllm_act_kind kind, const float *x, int64_t nt, int64_t K,
                          double *xq, double *half_step)
{
    if (kind == CLLM_ACT_BF16) {
        for (int64_t i = 0; i < nt * K; i++) {
            xq[i] = cllm_bf16_to_f32(bf16_daz(x[i]));
            half_step[i] = bf16_half_step(x[i]);
        }
        return;
    }
    if (kind == CLLM_ACT_F32) {
        for (int64_t i = 0; i < nt * K; i++) {
            xq[i] = x[i];
            half_step[i] = 0.0;
        }
        return;
    }
    const int64_t B = cllm_act_block(kind), G = cllm_act_group(kind);
    int8_t *qs = malloc(K);
    float *d = malloc(sizeof(float) * (K / B));
    int16_t *sums = malloc(sizeof(int16_t) * (K / G));
    for (int64_t t = 0; t < nt; t++) {
        cllm_matmul_kernels_scalar()->quant[kind](x + t * K, K / B, qs, d, sums, 1);
        for (int64_t k = 0; k < K; k++) {
            xq[t * K + k] = (double)d[k / B] * qs[k];
            half_step[t * K + k] = 0.5 * d[k / B];
        }
    }
    free(qs);
    free(d);
    free(sums);
}

/* Elements per float rounding chain link: 8 for float weights (K / 8 steps per lane, then a
 * fixed tree; the BF16 kernels' K / 16 roundings a lane fit the same bound). */
static int64_t block_of(enum cllm_dtype type)
{
    enum cllm_act_kind kind = cllm_act_kind_of(type);
    return kind == CLLM_ACT_F32 ? 8 : cllm_act_block(kind);
}

/* Worst normalized errors seen, per dtype, for the report (of the kernel family under test). */
static double worst_q[CLLM_DTYPE_COUNT], worst_x[CLLM_DTYPE_COUNT];
/* Over all shapes of a dtype: squared errors against the unquantized activations, squared
 * reference values and the predicted squared errors (see main). */
static double sum_err2[CLLM_DTYPE_COUNT], sum_ref2[CLLM_DTYPE_COUNT], sum_pred2[CLLM_DTYPE_COUNT];

/*
 * One shape under the kernel family in use: checks (a) to (d) of the file comment. Bounds
 * (u = 2^-24):
 *  - against the quantized-activation reference: the float part adds one term per block (two
 *    for types with minimums) in order, each term after 3 roundings; m terms summed in order
 *    err by at most (m + 3) u sum |term|. A term is at most a few times its block's sum |w * xq|
 *    (the K-quant scale and minimum terms may partly cancel: we allow 4x), so
 *    |y - ref| <= (2 K / B + 8) * 2^-22 * sum |w * xq|. Float weights: the same form with
 *    B = 8 (K / 8 steps per lane, then a fixed tree).
 *  - against the unquantized activations, additionally sum |w| * |x - xq| <= sum |w| * d / 2:
 *    round-to-nearest moves each activation by at most half its block's step (BF16: half its
 *    spacing). SIMD against scalar where their activations differ (BF16): the sum of both
 *    bounds and that rounding.
 */
static void check_shape(struct cllm_threadpool *tp2, struct cllm_threadpool *tp3,
                        enum cllm_dtype type, int64_t K, int64_t N, int64_t nt)
{
    const char *tn = cllm_dtype_name(type);
    struct wmat m;
    wmat_init(&m, type, K, N);
    const int64_t ldy = N + 3;
    float *x = malloc(sizeof(float) * nt * K);
    for (int64_t i = 0; i < nt * K; i++)
        x[i] = rng_act();
    if (nt > 2) /* an all-zero token and a tiny one */
        for (int64_t k = 0; k < K; k++) {
            x[1 * K + k] = 0.0f;
            x[2 * K + k] *= 1e-20f;
        }
    const size_t ysz = sizeof(float) * nt * ldy;
    float *y_simd = malloc(ysz), *y_ref = malloc(ysz), *y2 = malloc(ysz), *y3 = malloc(ysz);
    float *y1 = malloc(sizeof(float) * ldy);
    for (int64_t i = 0; i < nt * ldy; i++)
        y_simd[i] = y_ref[i] = y2[i] = y3[i] = -777.0f;

    const char *isa = cllm_cpu_matmul_isa();
    cllm_cpu_matmul_use_isa("scalar");
    CHECKF(run_mm(NULL, &m, x, nt, y_ref, ldy) == CLLM_OK, "%s scalar", tn);
    CHECK(cllm_cpu_matmul_use_isa(isa));
    CHECKF(run_mm(NULL, &m, x, nt, y_simd, ldy) == CLLM_OK, "%s", tn);
    CHECK(run_mm(tp2, &m, x, nt, y2, ldy) == CLLM_OK);
    CHECK(run_mm(tp3, &m, x, nt, y3, ldy) == CLLM_OK);

    /* (c) thread counts: identical bits, padding columns untouched */
    CHECKF(memcmp(y_simd, y2, ysz) == 0, "%s K=%lld N=%lld nt=%lld: 1 vs 2 threads", tn,
           (long long)K, (long long)N, (long long)nt);
    CHECKF(memcmp(y_simd, y3, ysz) == 0, "%s K=%lld N=%lld nt=%lld: 1 vs 3 threads", tn,
           (long long)K, (long long)N, (long long)nt);
    int pad_ok = 1;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t n = N; n < ldy; n++)
            pad_ok &= y_simd[t * ldy + n] == -777.0f && y_ref[t * ldy + n] == -777.0f;
    CHECKF(pad_ok, "%s: wrote past N", tn);

    /* (d) batch invariance: each token alone gives the bits it got inside the batch */
    int alone_ok = 1;
    for (int64_t t = 0; t < nt; t++) {
        CHECK(run_mm(tp2, &m, x + t * K, 1, y1, ldy) == CLLM_OK);
        alone_ok &= memcmp(y1, y_simd + t * ldy, sizeof(float) * N) == 0;
    }
    CHECKF(alone_ok, "%s K=%lld N=%lld nt=%lld: token alone differs from batch", tn, (long long)K,
           (long long)N, (long long)nt);
    if (nt > 5) { /* a sub-batch starting off the tile grid */
        float *ys = malloc(sizeof(float) * 5 * ldy);
        CHECK(run_mm(tp3, &m, x + 3 * K, 5, ys, ldy) == CLLM_OK);
        int sub_ok = 1;
        for (int64_t t = 0; t < 5; t++)
            sub_ok &= memcmp(ys + t * ldy, y_simd + (t + 3) * ldy, sizeof(float) * N) == 0;
        CHECKF(sub_ok, "%s: tokens 3..7 as their own batch differ", tn);
        free(ys);
    }

    /* (b) against double-precision references: the activations as the SIMD kernels see them
     * (xq) and as the scalar ones do (xr; the same but for BF16 under AVX-512 BF16) */
    const size_t dsz = sizeof(double) * nt * K;
    double *xq = malloc(dsz), *hs = malloc(dsz), *xr = malloc(dsz), *hr = malloc(dsz);
    const enum cllm_act_kind kind = active_act_kind(type);
    act_reference(kind, x, nt, K, xq, hs);
    act_reference(cllm_act_kind_of(type), x, nt, K, xr, hr);
    const bool quantized = kind == CLLM_ACT_Q8_0 || kind == CLLM_ACT_Q8_K;
    const bool same_acts = kind == cllm_act_kind_of(type);
    const double u4 = ldexp(1.0, -22);
    const double chain = 2.0 * (double)K / (double)block_of(type) + 8.0;
    int ok_a = 1, ok_q = 1, ok_x = 1;
    double err2 = 0.0, ref2 = 0.0, pred2 = 0.0;
    for (int64_t t = 0; t < nt; t++) {
        for (int64_t n = 0; n < N; n++) {
            const double *w = m.deq + n * K;
            double rq = 0, rr = 0, rx = 0, sabs = 0, sabs_r = 0, qerr = 0;
            for (int64_t k = 0; k < K; k++) {
                pred2 += w[k] * w[k] * hs[t * K + k] * hs[t * K + k] / 3.0;
                rq += w[k] * xq[t * K + k];
                rr += w[k] * xr[t * K + k];
                rx += w[k] * (double)x[t * K + k];
                sabs += fabs(w[k] * xq[t * K + k]);
                sabs_r += fabs(w[k] * xr[t * K + k]);
                qerr += fabs(w[k]) * hs[t * K + k];
            }
            const double tol = chain * u4 * sabs + 1e-30, tol_r = chain * u4 * sabs_r + 1e-30;
            const double ys = y_simd[t * ldy + n], yr = y_ref[t * ldy + n];
            /* (a) SIMD against scalar */
            if (quantized)
                ok_a &= memcmp(&y_simd[t * ldy + n], &y_ref[t * ldy + n], sizeof(float)) == 0;
            else
                ok_a &= fabs(ys - yr) <= (same_acts ? tol : tol + tol_r + qerr * (1.0 + 1e-6));
            ok_q &= fabs(ys - rq) <= tol && fabs(yr - rr) <= tol_r;
            ok_x &= fabs(ys - rx) <= tol + qerr * (1.0 + 1e-6);
            double nq = fabs(ys - rq) / (sabs + 1e-30), nx = fabs(ys - rx) / (tol + qerr);
            if (nq > worst_q[type])
                worst_q[type] = nq;
            if (nx > worst_x[type])
                worst_x[type] = nx;
            err2 += (ys - rx) * (ys - rx);
            ref2 += rx * rx;
        }
    }
    CHECKF(ok_a, "%s K=%lld N=%lld nt=%lld: %s vs scalar", tn, (long long)K, (long long)N,
           (long long)nt, isa);
    CHECKF(ok_q, "%s K=%lld N=%lld nt=%lld: %s vs its activations' reference", tn, (long long)K,
           (long long)N, (long long)nt, isa);
    CHECKF(ok_x, "%s K=%lld N=%lld nt=%lld: vs unquantized activations", tn, (long long)K,
           (long long)N, (long long)nt);
    sum_err2[type] += err2;
    sum_ref2[type] += ref2;
    sum_pred2[type] += pred2;

    free(xq);
    free(hs);
    free(xr);
    free(hr);
    free(x);
    free(y_simd);
    free(y_ref);
    free(y1);
    free(y2);
    free(y3);
    wmat_free(&m);
}

/* The quantizer: values within half a step, |q| <= 127, sums right, AVX2 bytes == scalar. */
static void test_quantizer(bool avx2)
{
    for (int kind = CLLM_ACT_Q8_0; kind <= CLLM_ACT_Q8_K; kind++) {
        const int64_t B = cllm_act_block(kind), G = cllm_act_group(kind), K = 4 * 256;
        float x[4 * 256];
        int8_t qs[4 * 256], qs2[4 * 256];
        float d[32], d2[32];
        int16_t sums[64], sums2[64];
        for (int64_t i = 0; i < K; i++)
            x[i] = rng_act() * (i < K / 2 ? 1.0f : 1e3f);
        for (int64_t i = 0; i < B; i++) /* one all-zero block */
            x[i] = 0.0f;
        x[B] = 0.0f; /* a zero inside a live block */
        cllm_matmul_kernels_scalar()->quant[kind](x, K / B, qs, d, sums, 1);
        int ok_step = 1, ok_range = 1, ok_sum = 1;
        for (int64_t i = 0; i < K; i++) {
            ok_step &= fabs((double)d[i / B] * qs[i] - x[i]) <= 0.5 * d[i / B] * (1 + 1e-6);
            ok_range &= qs[i] != -128;
        }
        for (int64_t g = 0; g < K / G; g++) {
            int s = 0;
            for (int64_t i = 0; i < G; i++)
                s += qs[g * G + i];
            ok_sum &= s == sums[g];
        }
        CHECK(d[0] == 0.0f && qs[0] == 0 && qs[B - 1] == 0);
        CHECKF(ok_step, "act kind %d: quantization error above half a step", kind);
        CHECK(ok_range);
        CHECK(ok_sum);
        /* the block's largest magnitude maps to +-127 */
        CHECK(d[1] > 0.0f);
#if defined(__x86_64__) || defined(__i386__)
        if (avx2) {
            cllm_matmul_kernels_avx2()->quant[kind](x, K / B, qs2, d2, sums2, 1);
            CHECKF(memcmp(qs, qs2, K) == 0 && memcmp(d, d2, sizeof(float) * (K / B)) == 0 &&
                       memcmp(sums, sums2, sizeof(int16_t) * (K / G)) == 0,
                   "act kind %d: avx2 quantizer differs from scalar", kind);
        }
#endif
    }
}

static void test_errors(void)
{
    struct wmat m;
    wmat_init(&m, CLLM_DTYPE_Q4_K, 256, 4);
    static float x[(CLLM_MM_TILE + 1) * 256];
    float y[(CLLM_MM_TILE + 1) * 8];
    for (int i = 0; i < (CLLM_MM_TILE + 1) * 8; i++)
        y[i] = 5.0f;
    size_t ss = cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q4_K, 256, CLLM_MM_TILE);
    uint8_t *scratch = malloc(ss);
    struct cllm_tensor t = m.t;
    CHECK(ss > 0);
    CHECK(cllm_cpu_matmul(NULL, &t, x, 2, y, 4, scratch, ss) == CLLM_OK);
    CHECK(cllm_cpu_matmul(NULL, NULL, x, 2, y, 4, scratch, ss) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul(NULL, &t, NULL, 2, y, 4, scratch, ss) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul(NULL, &t, x, 2, NULL, 4, scratch, ss) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul(NULL, &t, x, -1, y, 4, scratch, ss) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul(NULL, &t, x, 2, y, 3, scratch, ss) == CLLM_ERR_INVALID_ARG); /* ldy < N */
    CHECK(cllm_cpu_matmul(NULL, &t, x, 2, y, 4, scratch, ss - 1) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul(NULL, &t, x, 2, y, 4, NULL, ss) == CLLM_ERR_INVALID_ARG);
    /* scratch for one tile of tokens is too little for one more */
    CHECK(cllm_cpu_matmul(NULL, &t, x, CLLM_MM_TILE + 1, y, 4, scratch,
                          cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q4_K, 256, CLLM_MM_TILE)) ==
          CLLM_ERR_INVALID_ARG);
    /* n_tokens = 0: nothing to do, nothing written */
    float y0 = 9.0f;
    CHECK(cllm_cpu_matmul(NULL, &t, x, 0, &y0, 4, NULL, 0) == CLLM_OK && y0 == 9.0f);
    t.ne[0] = 128; /* K not a multiple of 256 */
    t.ne[1] = 8;
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q4_K, 128, 1) == 0);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q8_0, 33, 1) == 0);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q8_0, 32, 0) == 0);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_F32, 7, 3) == 0);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_COUNT, 256, 1) == 0);
    CHECK(cllm_cpu_matmul_scratch_size(CLLM_DTYPE_Q4_K, 256, INT64_MAX / 2) == 0);
    t = m.t;
    t.ne[1] = 5; /* more rows than the data holds */
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    t = m.t;
    t.ne[2] = 2; /* not a matrix */
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    t = m.t;
    t.dtype = CLLM_DTYPE_COUNT;
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    t = m.t;
    t.data = NULL;
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    t = m.t;
    t.ne[0] = 0;
    CHECK(cllm_cpu_matmul(NULL, &t, x, 1, y, 8, scratch, ss) == CLLM_ERR_INVALID_ARG);
    /* float weights need no scratch */
    struct wmat f;
    wmat_init(&f, CLLM_DTYPE_F32, 7, 3);
    CHECK(cllm_cpu_matmul(NULL, &f.t, x, 2, y, 3, NULL, 0) == CLLM_OK);
    wmat_free(&f);
    free(scratch);
    wmat_free(&m);
}

/*
 * Packed K-quant rows at the integer sums' bounds: every quant at its largest (or smallest)
 * value, every scale at its largest magnitude, and activations that quantize to +127 or -127
 * everywhere, so every lane's partial sums are as large as they get (the AVX2 kernel adds
 * int16 pairs across a sub-block: one step more and they would wrap). The packed matmul under
 * every SIMD family must still give the scalar row kernel's bits (exact integer sums).
 */
static void test_packed_extremes(enum cllm_dtype type, const char *const *simd, const bool *has,
                                 int n_simd)
{
    const int64_t K = 512, N = 32;
    const int nt = 5;
    /* fill: 0 = quants and scales at their largest, 1 = quants 0 (Q6_K: -32) and Q6_K's
     * scales at -128 */
    for (int fill = 0; fill < 2; fill++)
        for (int sign = -1; sign <= 1; sign += 2) {
            struct wmat m;
            wmat_init(&m, type, K, N);
            const struct cllm_dtype_traits *tr = cllm_dtype_traits(type);
            const uint8_t q = fill == 0 ? 0xff : 0x00;
            for (int64_t b = 0; b < K / CLLM_QK_K * N; b++) {
                uint8_t *blk = m.data + b * tr->type_size;
                if (type == CLLM_DTYPE_Q4_K) {
                    struct cllm_block_q4_k *k4 = (struct cllm_block_q4_k *)(void *)blk;
                    memset(k4->scales, 0xff, sizeof k4->scales); /* sc = m = 63 */
                    memset(k4->qs, q, sizeof k4->qs);
                    put_f16(blk + offsetof(struct cllm_block_q4_k, d), 1e-3f);
                    put_f16(blk + offsetof(struct cllm_block_q4_k, dmin), 1e-3f);
                } else {
                    struct cllm_block_q6_k *k6 = (struct cllm_block_q6_k *)(void *)blk;
                    memset(k6->ql, q, sizeof k6->ql);
                    memset(k6->qh, q, sizeof k6->qh);
                    memset(k6->scales, fill == 0 ? 0x7f : 0x80, sizeof k6->scales);
                    put_f16(blk + offsetof(struct cllm_block_q6_k, d), 1e-3f);
                }
            }
            uint8_t *packed = malloc(m.t.nbytes);
            cllm_x16_pack(type, m.data, K, 0, N, packed);
            struct wmat pm = m;
            pm.t.data = packed;
            float x[5 * 512], want[5 * 32], got[5 * 32];
            for (int64_t i = 0; i < nt * K; i++)
                x[i] = (float)sign * (1.0f + (float)(i % 3) * 1e-7f); /* all quantize to 127 */
            CHECK(cllm_cpu_matmul_use_isa("scalar"));
            CHECK(run_mm(NULL, &m, x, nt, want, N) == CLLM_OK);
            for (int f = 0; f < n_simd; f++) {
                if (!has[f])
                    continue;
                CHECK(cllm_cpu_matmul_use_isa(simd[f]));
                for (int n = 1; n <= nt; n += nt - 1) { /* a lone token, a tile */
                    size_t ss = cllm_cpu_matmul_scratch_size(type, K, n);
                    uint8_t *scratch = malloc(ss);
                    memset(got, 0xff, sizeof got);
                    CHECK(cllm_cpu_matmul_packed(NULL, &pm.t, x, n, got, N, scratch, ss) ==
                          CLLM_OK);
                    free(scratch);
                    CHECKF(memcmp(got, want, sizeof(float) * (size_t)(n * N)) == 0,
                           "%s packed %s at the bounds (fill %d, sign %d, %d tokens): %g, not %g",
                           simd[f], cllm_dtype_name(type), fill, sign, n, (double)got[0],
                           (double)want[0]);
                }
            }
            free(packed);
            wmat_free(&m);
        }
    CHECK(cllm_cpu_matmul_use_isa(NULL));
}

/*
 * K-quant rows packed 16 at a time (pack_x16.h: Q4_K and Q6_K): every row unpacks to its file
 * bytes, and the packed matmul gives the unpacked one's bits (the scalar family's, 1 thread)
 * under every family this CPU runs (their own kernels where they have one, else the reference),
 * on 1-3 threads, for a token alone and tiles of every size (a part tile of 1, 2, 3 and 5
 * tokens), rows long enough to be read from L2; and cllm_cpu_matmul_packs offers it only where
 * it should.
 */
static void test_packed(enum cllm_dtype type, struct cllm_threadpool *tp2,
                        struct cllm_threadpool *tp3, const char *const *simd, const bool *has,
                        int n_simd)
{
    static const int64_t Ks[] = {256, 1024, 35 * 256}, Ns[] = {16, 48, 160};
    static const int64_t nts[] = {1, 2, 3, 8, 9, 13, 40};
    for (size_t ki = 0; ki < 3; ki++)
        for (size_t ni = 0; ni < 3; ni++) {
            const int64_t K = Ks[ki], N = Ns[ni];
            if (K * N > 1024 * 160) /* the long rows: one shape is enough */
                continue;
            struct wmat m;
            wmat_init(&m, type, K, N);
            const uint64_t bytes = m.t.nbytes, row_bytes = bytes / (uint64_t)N;
            uint8_t *packed = malloc(bytes), *row = malloc(row_bytes);
            cllm_x16_pack(type, m.data, K, 0, N, packed);
            CHECK(memcmp(packed, m.data, bytes) != 0 || N == 0);
            int bad_rows = 0;
            for (int64_t r = 0; r < N; r++) {
                cllm_x16_unpack_row(type, packed, K, r, row);
                bad_rows += memcmp(row, m.data + r * row_bytes, row_bytes) != 0;
            }
            CHECKF(bad_rows == 0, "K %lld N %lld: %d rows unpack differently", (long long)K,
                   (long long)N, bad_rows);
            struct wmat pm = m;
            pm.t.data = packed;
            for (size_t ti = 0; ti < sizeof nts / sizeof nts[0]; ti++) {
                const int64_t nt = nts[ti];
                float *x = malloc(sizeof(float) * (size_t)(nt * K));
                float *want = malloc(sizeof(float) * (size_t)(nt * N));
                float *got = malloc(sizeof(float) * (size_t)(nt * N));
                for (int64_t i = 0; i < nt * K; i++)
                    x[i] = rng_act();
                CHECK(cllm_cpu_matmul_use_isa("scalar"));
                CHECK(run_mm(NULL, &m, x, nt, want, N) == CLLM_OK);
                for (int f = -1; f < n_simd; f++) {
                    if (f >= 0 && !has[f])
                        continue;
                    CHECK(cllm_cpu_matmul_use_isa(f < 0 ? "scalar" : simd[f]));
                    struct cllm_threadpool *pools[] = {NULL, tp2, tp3};
                    for (int p = 0; p < 3; p++) {
                        size_t ss = cllm_cpu_matmul_scratch_size(type, K, nt);
                        uint8_t *scratch = malloc(ss + 3);
                        memset(got, 0xff, sizeof(float) * (size_t)(nt * N));
                        CHECK(cllm_cpu_matmul_packed(pools[p], &pm.t, x, nt, got, N, scratch + 3,
                                                     ss) == CLLM_OK);
                        free(scratch);
                        CHECKF(memcmp(got, want, sizeof(float) * (size_t)(nt * N)) == 0,
                               "%s packed %s K %lld N %lld, %lld tokens, %d threads: not the "
                               "unpacked bits",
                               cllm_cpu_matmul_isa(), cllm_dtype_name(type), (long long)K,
                               (long long)N, (long long)nt, p + 1);
                    }
                }
                free(x);
                free(want);
                free(got);
            }
            free(packed);
            free(row);
            wmat_free(&m);
        }
    /* who packs: Q4_K under the SIMD families (AVX2 and those built on it), Q6_K under the
     * AVX-512 VNNI ones, whole groups of rows */
    for (int f = -1; f < n_simd; f++) {
        if (f >= 0 && !has[f])
            continue;
        CHECK(cllm_cpu_matmul_use_isa(f < 0 ? "scalar" : simd[f]));
        const bool vnni =
            f >= 0 && (strcmp(simd[f], "avx512vnni") == 0 || strcmp(simd[f], "avx512bf16") == 0);
        CHECK(cllm_cpu_matmul_packs(type, 1536, 8960) == (type == CLLM_DTYPE_Q4_K ? f >= 0 : vnni));
        CHECK(!cllm_cpu_matmul_packs(type, 1536, 8961));
        CHECK(!cllm_cpu_matmul_packs(type, 1000, 16));
        CHECK(!cllm_cpu_matmul_packs(CLLM_DTYPE_Q5_K, 1536, 8960));
        CHECK(!cllm_cpu_matmul_packs(CLLM_DTYPE_Q8_0, 1536, 8960));
    }
    CHECK(cllm_cpu_matmul_use_isa(NULL));
    /* a packed matmul of another dtype, or of rows that are not whole groups, is refused */
    struct wmat m;
    wmat_init(&m, type, 256, 17);
    static float x[256];
    float y[17];
    size_t ss = cllm_cpu_matmul_scratch_size(type, 256, 1);
    uint8_t *scratch = malloc(ss);
    CHECK(cllm_cpu_matmul_packed(NULL, &m.t, x, 1, y, 17, scratch, ss) == CLLM_ERR_INVALID_ARG);
    m.t.ne[1] = 16;
    CHECK(cllm_cpu_matmul_packed(NULL, &m.t, x, 1, y, 17, scratch, ss) == CLLM_OK);
    m.t.dtype = CLLM_DTYPE_Q5_K;
    CHECK(cllm_cpu_matmul_packed(NULL, &m.t, x, 1, y, 17, scratch, ss) == CLLM_ERR_INVALID_ARG);
    free(scratch);
    wmat_free(&m);
}

/* Float weights whose last row ends where the mapping does, a page nothing may read after it:
 * under every family this CPU runs, the kernels' masked tails must not touch it (a read past a
 * row there faults), and give the bits they give from an ordinary buffer. K: every tail of the
 * 16- and 32-element steps AVX-512's kernels take, and none. */
static void test_rows_at_mapping_end(const char *const *simd, const bool *has, int n_simd)
{
    static const enum cllm_dtype types[] = {CLLM_DTYPE_F32, CLLM_DTYPE_F16, CLLM_DTYPE_BF16};
    static const int64_t Ks[] = {1, 15, 17, 31, 33, 45, 64, 1000};
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
            const int64_t K = Ks[ki], N = 13, nt = 5;
            struct wmat m;
            wmat_init(&m, types[ti], K, N);
            const size_t bytes = m.t.nbytes, span = (bytes + page - 1) / page * page;
            uint8_t *map =
                mmap(NULL, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            CHECK(map != MAP_FAILED);
            if (map == MAP_FAILED) {
                wmat_free(&m);
                continue;
            }
            CHECK(mprotect(map + span, page, PROT_NONE) == 0);
            struct wmat at_end = m;
            at_end.data = map + span - bytes;
            memcpy(at_end.data, m.data, bytes);
            at_end.t.data = at_end.data;
            float x[5 * 1000], want[5 * 13], got[5 * 13];
            for (int64_t i = 0; i < nt * K; i++)
                x[i] = rng_act();
            for (int f = -1; f < n_simd; f++) {
                if (f >= 0 && !has[f])
                    continue;
                CHECK(cllm_cpu_matmul_use_isa(f < 0 ? "scalar" : simd[f]));
                for (int64_t n = 1; n <= nt; n += nt - 1) {
                    CHECK(run_mm(NULL, &m, x, n, want, N) == CLLM_OK);
                    CHECK(run_mm(NULL, &at_end, x, n, got, N) == CLLM_OK);
                    CHECKF(memcmp(got, want, sizeof(float) * (size_t)(n * N)) == 0,
                           "%s %s K %lld, %lld tokens: rows at the mapping's end differ",
                           cllm_cpu_matmul_isa(), cllm_dtype_name(types[ti]), (long long)K,
                           (long long)n);
                }
            }
            munmap(map, span + page);
            wmat_free(&m);
        }
    CHECK(cllm_cpu_matmul_use_isa(NULL));
}

/* The AVX-512 BF16 family's activation rounding: each element as vcvtne2ps2bf16 rounds it
 * (bf16_daz), zeros up to the padded length, nothing written past it; every length of the
 * 32-element steps and their tails. */
static void test_to_bf16(void)
{
#if defined(__x86_64__) || defined(__i386__)
    struct cllm_matmul_kernels k = *cllm_matmul_kernels_avx2();
    cllm_matmul_kernels_add_avx512bf16(&k);
    enum { MAX_K = 100, PAD = 128 };
    float x[MAX_K];
    uint16_t out[PAD + 8];
    int ok_val = 1, ok_pad = 1, ok_past = 1, ok_nan = 1;
    for (int K = 1; K <= MAX_K; K++) {
        for (int i = 0; i < K; i++)
            x[i] = rng_act() * (i % 5 == 0 ? 1e-3f : 1.0f);
        x[0] = 0x1p-130f;      /* subnormal: flushed */
        x[K - 1] = -0x1.01p0f; /* a tie, rounded to even */
        if (K > 3) {
            x[1] = -0.0f;
            x[2] = __builtin_nanf("");
            x[3] = 3.4e38f; /* rounds up to infinity */
        }
        memset(out, 0xee, sizeof out);
        k.to_bf16(x, K, out);
        const int Kp = (K + CLLM_BF16_ACT_ALIGN - 1) / CLLM_BF16_ACT_ALIGN * CLLM_BF16_ACT_ALIGN;
        for (int i = 0; i < K; i++) {
            if (x[i] != x[i])
                ok_nan &= (out[i] & 0x7f80u) == 0x7f80u && (out[i] & 0x7fu) != 0;
            else
                ok_val &= out[i] == bf16_daz(x[i]);
        }
        for (int i = K; i < Kp; i++)
            ok_pad &= out[i] == 0;
        for (int i = Kp; i < PAD + 8; i++)
            ok_past &= out[i] == 0xeeeeu;
    }
    CHECKF(ok_val, "to_bf16: an element differs from round-to-nearest-even (subnormals flushed)");
    CHECK(ok_nan);
    CHECKF(ok_pad, "to_bf16: padding not zero");
    CHECKF(ok_past, "to_bf16: wrote past the padded row");
#endif
}

int main(void)
{
    const char *best = cllm_cpu_matmul_isa();
    /* the SIMD families, slowest first; each runs every dtype (most share the one before's
     * kernels, which costs little) */
    enum { N_SIMD = 5 };
    static const char *const simd[N_SIMD] = {"avx2", "avxvnni", "avx512", "avx512vnni",
                                             "avx512bf16"};
    bool has[N_SIMD];
    for (int f = 0; f < N_SIMD; f++)
        has[f] = cllm_cpu_matmul_use_isa(simd[f]);
    const bool avx2 = has[0], bf16_kernels = has[4];
    CHECK(cllm_cpu_matmul_use_isa(NULL) && strcmp(cllm_cpu_matmul_isa(), best) == 0);
    /* the default family is the newest this CPU runs but AVX-512 BF16's where its dot products
     * do not outrun FMAs (matmul.c: on Intel's cores); then the one before it */
    const bool bf16_acts = strcmp(best, "avx512bf16") == 0;
    int newest = N_SIMD - 1;
    while (newest >= 0 && !has[newest])
        newest--;
    CHECKF(newest < 0 ? strcmp(best, "scalar") == 0
                      : strcmp(best, simd[newest]) == 0 ||
                            (bf16_kernels && strcmp(best, "avx512vnni") == 0),
           "default family %s", best);
    printf("matmul kernels: %s%s%s%s%s%s\n", best,
           avx2 ? "" : " (no AVX2 on this CPU: SIMD-vs-scalar checks compare scalar with itself)",
           has[1] ? "" : " (no AVX-VNNI on this CPU: its kernels are not run)",
           has[2] ? "" : " (no AVX-512 on this CPU: its float kernels are not run)",
           has[3] ? "" : " (no AVX-512 VNNI on this CPU: its kernels are not run)",
           bf16_kernels ? "" : " (no AVX-512 BF16 on this CPU: its kernels are not run)");
    CHECK(cllm_cpu_matmul_use_isa("scalar") && strcmp(cllm_cpu_matmul_isa(), "scalar") == 0);
    CHECK(!cllm_cpu_matmul_bf16_activations());
    CHECK(!cllm_cpu_matmul_use_isa("avx1024") && strcmp(cllm_cpu_matmul_isa(), "scalar") == 0);
    CHECK(cllm_cpu_matmul_use_isa(NULL));
    CHECK(cllm_cpu_matmul_bf16_activations() == bf16_acts);

    struct cllm_threadpool *tp2 = NULL, *tp3 = NULL;
    CHECK(cllm_threadpool_new(&tp2, 2) == CLLM_OK);
    CHECK(cllm_threadpool_new(&tp3, 3) == CLLM_OK);

    test_quantizer(avx2);
    if (bf16_kernels)
        test_to_bf16();

    static const enum cllm_dtype types[] = {
        CLLM_DTYPE_F32,  CLLM_DTYPE_F16,  CLLM_DTYPE_BF16, CLLM_DTYPE_Q8_0,
        CLLM_DTYPE_Q4_0, CLLM_DTYPE_Q4_1, CLLM_DTYPE_Q5_0, CLLM_DTYPE_Q5_1,
        CLLM_DTYPE_Q4_K, CLLM_DTYPE_Q5_K, CLLM_DTYPE_Q6_K,
    };
    static const int64_t Ns[] = {1, 3, 17, 257};
    /* 16: whole eights (the AVX-512 BF16 kernel's 3-row blocks) against 17 rows, a part block;
     * 33 (below): a group of each size, 6-row blocks, the next block asked for ahead */
    static const int64_t nts[] = {1, 2, 5, 16};
    /* Every dtype under each family this CPU runs (scalar against itself where none). */
    for (int pass = 0; pass < N_SIMD; pass++) {
        if (pass > 0 && !has[pass])
            continue;
        CHECK(cllm_cpu_matmul_use_isa(has[pass] ? simd[pass] : NULL));
        memset(worst_q, 0, sizeof worst_q);
        memset(worst_x, 0, sizeof worst_x);
        memset(sum_err2, 0, sizeof sum_err2);
        memset(sum_ref2, 0, sizeof sum_ref2);
        memset(sum_pred2, 0, sizeof sum_pred2);
        for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
            const enum cllm_dtype type = types[i];
            const int64_t bs = cllm_dtype_traits(type)->block_size;
            /* one block; several blocks (float: every tail length of the 32-, 16- and
             * 8-element steps, and a whole number of 32-element steps; K-quants: rows longer
             * than a lone token's 8-row kernels take, which then go row by row) */
            const int64_t Ks[] = {bs,
                                  bs == 256  ? 1024
                                  : bs == 32 ? 352
                                             : 45,
                                  bs == 1     ? 1000
                                  : bs == 256 ? 49 * 256
                                              : 0,
                                  bs == 1 ? 64 : 0};
            for (size_t ki = 0; ki < 4 && Ks[ki]; ki++) {
                for (size_t ni = 0; ni < 4; ni++)
                    check_shape(tp2, tp3, type, Ks[ki], Ns[ni], 33);
                for (size_t ti = 0; ti < 4; ti++)
                    check_shape(tp2, tp3, type, Ks[ki], 17, nts[ti]);
            }
            /* more tokens than one pass of the AVX-512 BF16 kernel takes (dot_avx512.c: 32 of
             * K = 8960 fit its 640 KiB) */
            if (type == CLLM_DTYPE_BF16)
                check_shape(tp2, tp3, type, 8960, 17, 40);
        }
        /* Normalized RMS error from the activations' rounding, over thousands of outputs per
         * dtype. Rounding to a step d moves an activation by an error spread evenly over
         * [-d/2, d/2] (variance d^2 / 12), independently per element, so the expected squared
         * error of a dot product is sum w^2 d^2 / 12. We allow 1.5 times the predicted RMS;
         * F32 activations have only rounding (1e-6). */
        for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
            const enum cllm_dtype t = types[i];
            const double rms = sqrt(sum_err2[t] / sum_ref2[t]);
            const double pred = sqrt(sum_pred2[t] / sum_ref2[t]);
            printf("%-10s %-5s worst |y - ref(xq)| / sum|w xq| = %.2e, worst |y - ref(x)| / "
                   "bound = %.3f, rms error vs unrounded = %.2e (predicted %.2e)\n",
                   cllm_cpu_matmul_isa(), cllm_dtype_name(t), worst_q[t], worst_x[t], rms, pred);
            CHECKF(rms <= 1.5 * pred + 1e-6, "%s %s: rms error %.3g, predicted %.3g",
                   cllm_cpu_matmul_isa(), cllm_dtype_name(t), rms, pred);
        }
    }
    CHECK(cllm_cpu_matmul_use_isa(NULL));

    test_packed(CLLM_DTYPE_Q4_K, tp2, tp3, simd, has, N_SIMD);
    test_packed(CLLM_DTYPE_Q6_K, tp2, tp3, simd, has, N_SIMD);
    test_packed_extremes(CLLM_DTYPE_Q4_K, simd, has, N_SIMD);
    test_packed_extremes(CLLM_DTYPE_Q6_K, simd, has, N_SIMD);
    test_rows_at_mapping_end(simd, has, N_SIMD);
    test_errors();
    cllm_threadpool_free(tp2);
    cllm_threadpool_free(tp3);
    return test_summary();
}
