/*
 * Portable scalar matmul kernels: the reference the SIMD kernels are tested against, and the
 * kernels that run on CPUs without AVX2. Each kernel multiplies one weight row with a tile of
 * up to CLLM_MM_TILE activation rows; weight blocks are decoded once per tile.
 * The float order of every kernel is the contract of quant_dot.h; the AVX2 kernels follow it
 * operation for operation, so for quantized weights both give the same bits. Expressions are
 * written so that no FMA contraction can apply (C11 mode compiles with -ffp-contract=off).
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/pack_x16.h"
#include "backend/cpu/quant_dot.h"
#include "backend/cpu/ref.h"
#include "core/f16.h"
#include "tensor/quant.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define TILE CLLM_MM_TILE

/* --- activation quantization --- */

static void quant_q8(const float *x, int64_t nb, int B, int G, int8_t *qs, float *d,
                     int16_t *sums, int64_t step)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * B;
        int8_t *qb = qs + b * B;
        float amax = 0.0f;
        for (int i = 0; i < B; i++) {
            float v = fabsf(xb[i]);
            if (v > amax)
                amax = v;
        }
        const float id = cllm_q8_inv_scale(amax, &d[b * step]);
        for (int i = 0; i < B; i++) {
            long q = lrintf(xb[i] * id);
            qb[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
    }
    cllm_q8_group_sums(qs, nb, B, G, sums, step);
}

static void quant_q8_0(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums,
                       int64_t step)
{
    quant_q8(x, nb, 32, 32, qs, d, sums, step);
}

static void quant_q8_k(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums,
                       int64_t step)
{
    quant_q8(x, nb, 256, 16, qs, d, sums, step);
}

/* --- K-quants against Q8_K-style activations --- */

static void store_tile(const float *acc, int nt, float *y, int64_t ldy)
{
    for (int t = 0; t < nt; t++)
        y[t * ldy] = acc[t];
}

/* Q4_K / Q5_K (q5 != 0): per super-block, isum = sum_j sc[j] * (q . x over sub-block j) and
 * msum = sum_j m[j] * (sum of x over sub-block j); acc += (dx*d)*isum, acc -= (dx*dmin)*msum.
 * Block b (at w) of a row, for the tile's nt tokens. */
static void q45_k_block(const uint8_t *w, int64_t b, const struct cllm_act_tile *tk, int nt,
                        float *acc, int q5)
{
    uint16_t dh, mh;
    uint8_t sc[8], m[8], q[CLLM_QK_K];
    memcpy(&dh, w, 2);
    memcpy(&mh, w + 2, 2);
    cllm_k_scales_unpack(w + 4, sc, m);
    const uint8_t *qh = w + 4 + CLLM_K_SCALE_SIZE; /* Q5_K only */
    const uint8_t *qs = qh + (q5 ? CLLM_QK_K / 8 : 0);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 0x0f, hi = qs[32 * c + l] >> 4;
            if (q5) {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            q[64 * c + l] = (uint8_t)lo;
            q[64 * c + 32 + l] = (uint8_t)hi;
        }
    }
    const float d = cllm_f16_to_f32(dh), dmin = cllm_f16_to_f32(mh);
    for (int t = 0; t < nt; t++) {
        const int8_t *x = tk->qs[t] + b * CLLM_QK_K;
        const int16_t *bs = tk->sums + (b * tk->step + t) * 16;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            int32_t s = 0;
            for (int l = 0; l < 32; l++)
                s += q[32 * j + l] * x[32 * j + l];
            isum += sc[j] * s;
            msum += m[j] * (bs[2 * j] + bs[2 * j + 1]);
        }
        const float dx = tk->d[b * tk->step + t];
        acc[t] = acc[t] + (dx * d) * (float)isum;
        acc[t] = acc[t] - (dx * dmin) * (float)msum;
    }
}

static void dot_q45_k(const uint8_t *w, int64_t nb, const struct cllm_act_view *a, int nt,
                      float *y, int64_t ldy, int q5)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    float acc[TILE] = {0};
    const size_t bsize = q5 ? sizeof(struct cllm_block_q5_k) : sizeof(struct cllm_block_q4_k);
    for (int64_t b = 0; b < nb; b++, w += bsize)
        q45_k_block(w, b, &tk, nt, acc, q5);
    store_tile(acc, nt, y, ldy);
}

static void dot_q4_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    dot_q45_k(w, K / CLLM_QK_K, a, nt, y, ldy, 0);
}

static void dot_q5_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    dot_q45_k(w, K / CLLM_QK_K, a, nt, y, ldy, 1);
}

/* Q6_K: isum = sum_j sc[j] * (q . x over 16-element group j) - 32 * sum_j sc[j] * xsum[j], the
 * second term folding the -32 offset in through the activation group sums. Block b (at src) of
 * a row, for the tile's nt tokens. */
static void q6_k_block(const uint8_t *src, int64_t b, const struct cllm_act_tile *tk, int nt,
                       float *acc)
{
    struct cllm_block_q6_k blk;
    memcpy(&blk, src, sizeof blk);
    uint8_t q[CLLM_QK_K];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk.ql + 64 * h, *qh = blk.qh + 32 * h;
        uint8_t *out = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            out[l] = (uint8_t)((ql[l] & 0x0f) | ((qh[l] & 3) << 4));
            out[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4));
            out[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            out[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
    const float d = cllm_f16_to_f32(blk.d);
    for (int t = 0; t < nt; t++) {
        const int8_t *x = tk->qs[t] + b * CLLM_QK_K;
        const int16_t *bs = tk->sums + (b * tk->step + t) * 16;
        int32_t isum = 0, corr = 0;
        for (int j = 0; j < 16; j++) {
            int32_t s = 0;
            for (int l = 0; l < 16; l++)
                s += q[16 * j + l] * x[16 * j + l];
            isum += blk.scales[j] * s;
            corr += blk.scales[j] * bs[j];
        }
        isum -= 32 * corr;
        acc[t] = acc[t] + (tk->d[b * tk->step + t] * d) * (float)isum;
    }
}

static void dot_q6_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    float acc[TILE] = {0};
    const uint8_t *src = w;
    for (int64_t b = 0; b < K / CLLM_QK_K; b++, src += sizeof(struct cllm_block_q6_k))
        q6_k_block(src, b, &tk, nt, acc);
    store_tile(acc, nt, y, ldy);
}

/* K-quant rows packed 16 at a time (pack_x16.h): each row's blocks taken back out of their
 * records one at a time, then the row kernel's arithmetic. The reference of the packed kernels,
 * and what families without one of their own run. */
static void dot_x16_ref(enum cllm_dtype type, const uint8_t *w, size_t row_bytes, int64_t nr,
                        int64_t K, const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    (void)row_bytes; /* w is a group's first row: records follow from K */
    for (int64_t r = 0; r < nr; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < K / CLLM_QK_K; b++) {
            uint8_t blk[sizeof(struct cllm_block_q6_k)];
            cllm_x16_unpack_block(type, cllm_x16_record(type, w, K, r, b),
                                  (int)(r % CLLM_PACK_ROWS), blk);
            if (type == CLLM_DTYPE_Q4_K)
                q45_k_block(blk, b, &tk, nt, acc, 0);
            else
                q6_k_block(blk, b, &tk, nt, acc);
        }
        store_tile(acc, nt, y + r, ldy);
    }
}

void cllm_dot_q4_k_x16_ref(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                           const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    dot_x16_ref(CLLM_DTYPE_Q4_K, w, row_bytes, nr, K, a, nt, y, ldy);
}

void cllm_dot_q6_k_x16_ref(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                           const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    dot_x16_ref(CLLM_DTYPE_Q6_K, w, row_bytes, nr, K, a, nt, y, ldy);
}

/* --- legacy 32-blocks against Q8_0-style activations --- */

/* Decodes one legacy block into q[32] (element order) with its scale, minimum and the offset
 * the integer dot must subtract (x = d * (q - off) + m). */
static void legacy_decode(enum cllm_dtype type, const uint8_t *src, int q[32], float *dw,
                          float *mw, int *off)
{
    uint16_t dh, mh = 0;
    memcpy(&dh, src, 2);
    const uint8_t *qs = src + 2, *qh = NULL;
    *off = 0;
    switch (type) {
    case CLLM_DTYPE_Q8_0:
        for (int j = 0; j < 32; j++)
            q[j] = (int8_t)qs[j];
        break;
    case CLLM_DTYPE_Q4_1:
        memcpy(&mh, src + 2, 2);
        qs = src + 4;
        /* fall through */
    case CLLM_DTYPE_Q4_0:
        for (int j = 0; j < 16; j++) {
            q[j] = qs[j] & 0x0f;
            q[j + 16] = qs[j] >> 4;
        }
        *off = type == CLLM_DTYPE_Q4_0 ? 8 : 0;
        break;
    case CLLM_DTYPE_Q5_1:
        memcpy(&mh, src + 2, 2);
        qh = src + 4;
        qs = src + 8;
        /* fall through */
    default: /* Q5_0 */
        if (!qh) {
            qh = src + 2;
            qs = src + 6;
        }
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 0x0f) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
            q[j + 16] = (qs[j] >> 4) | (((qh[2 + j / 8] >> (j % 8)) & 1) << 4);
        }
        *off = type == CLLM_DTYPE_Q5_0 ? 16 : 0;
        break;
    }
    *dw = cllm_f16_to_f32(dh);
    *mw = cllm_f16_to_f32(mh);
}

static void dot_legacy(enum cllm_dtype type, const uint8_t *w, int64_t K,
                       const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    const size_t bsize = cllm_dtype_traits(type)->type_size;
    const int has_min = type == CLLM_DTYPE_Q4_1 || type == CLLM_DTYPE_Q5_1;
    float acc[TILE] = {0};
    for (int64_t b = 0; b < K / CLLM_QK; b++, w += bsize) {
        int q[32], off;
        float dw, mw;
        legacy_decode(type, w, q, &dw, &mw, &off);
        for (int t = 0; t < nt; t++) {
            const int8_t *x = tk.qs[t] + b * CLLM_QK;
            const int32_t sx = tk.sums[b * tk.step + t];
            int32_t isum = 0;
            for (int j = 0; j < 32; j++)
                isum += q[j] * x[j];
            isum -= off * sx;
            const float dx = tk.d[b * tk.step + t];
            acc[t] = acc[t] + (dx * dw) * (float)isum;
            if (has_min)
                acc[t] = acc[t] + (dx * mw) * (float)sx;
        }
    }
    store_tile(acc, nt, y, ldy);
}

#define LEGACY_KERNEL(name, type)                                                                  \
    static void name(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,   \
                     int64_t ldy)                                                                  \
    {                                                                                              \
        dot_legacy(type, w, K, a, nt, y, ldy);                                                     \
    }
LEGACY_KERNEL(dot_q8_0, CLLM_DTYPE_Q8_0)
LEGACY_KERNEL(dot_q4_0, CLLM_DTYPE_Q4_0)
LEGACY_KERNEL(dot_q4_1, CLLM_DTYPE_Q4_1)
LEGACY_KERNEL(dot_q5_0, CLLM_DTYPE_Q5_0)
LEGACY_KERNEL(dot_q5_1, CLLM_DTYPE_Q5_1)

/* --- float weights against f32 activations --- */

/* Weights i .. i+n-1 of a float row, widened to f32 (exact). */
static void load_float(enum cllm_dtype type, const uint8_t *w, int64_t i, int n, float *out)
{
    for (int l = 0; l < n; l++) {
        uint16_t h;
        switch (type) {
        case CLLM_DTYPE_F32:
            memcpy(&out[l], w + 4 * (i + l), 4);
            break;
        case CLLM_DTYPE_F16:
            memcpy(&h, w + 2 * (i + l), 2);
            out[l] = cllm_f16_to_f32(h);
            break;
        default:
            memcpy(&h, w + 2 * (i + l), 2);
            out[l] = cllm_bf16_to_f32(h);
            break;
        }
    }
}

/*
 * The float order (the AVX2 kernels', with their FMAs as multiply-then-add): eight lanes; each
 * 8-element step i adds w*x of element i + l to lane l; then h[l] = lane[l] + lane[l + 4],
 * s = (h0 + h2) + (h1 + h3), and the last K % 8 products are added to s one by one. One
 * accumulator per lane (not two) leaves the AVX2 kernels registers for several weight rows and
 * tokens at once, which is what makes them fast.
 */
static float dot_float(enum cllm_dtype type, const uint8_t *w, int64_t K, const float *x)
{
    float lane[8] = {0}, wv[8];
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        load_float(type, w, i, 8, wv);
        for (int l = 0; l < 8; l++)
            lane[l] = lane[l] + wv[l] * x[i + l];
    }
    float h[4];
    for (int l = 0; l < 4; l++)
        h[l] = lane[l] + lane[l + 4];
    float s = (h[0] + h[2]) + (h[1] + h[3]);
    for (; i < K; i++) {
        load_float(type, w, i, 1, wv);
        s = s + wv[0] * x[i];
    }
    return s;
}

#define FLOAT_KERNEL(name, type)                                                                   \
    static void name(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,                   \
                     const struct cllm_act_view *a, int nt, float *y, int64_t ldy)                 \
    {                                                                                              \
        for (int t = 0; t < nt; t++) {                                                             \
            const float *x = (const float *)(const void *)(a->base + (size_t)t * a->stride);      \
            for (int64_t r = 0; r < nr; r++)                                                       \
                y[t * ldy + r] = dot_float(type, w + (size_t)r * row_bytes, K, x);                 \
        }                                                                                          \
    }
FLOAT_KERNEL(dot_f32, CLLM_DTYPE_F32)
FLOAT_KERNEL(dot_f16, CLLM_DTYPE_F16)
FLOAT_KERNEL(dot_bf16, CLLM_DTYPE_BF16)

static const struct cllm_matmul_kernels scalar_kernels = {
    .isa = "scalar",
    .quant = {[CLLM_ACT_Q8_0] = quant_q8_0, [CLLM_ACT_Q8_K] = quant_q8_k},
    .dot =
        {
            [CLLM_DTYPE_Q8_0] = dot_q8_0,
            [CLLM_DTYPE_Q4_0] = dot_q4_0,
            [CLLM_DTYPE_Q4_1] = dot_q4_1,
            [CLLM_DTYPE_Q5_0] = dot_q5_0,
            [CLLM_DTYPE_Q5_1] = dot_q5_1,
            [CLLM_DTYPE_Q4_K] = dot_q4_k,
            [CLLM_DTYPE_Q5_K] = dot_q5_k,
            [CLLM_DTYPE_Q6_K] = dot_q6_k,
        },
    .dot_rows =
        {[CLLM_DTYPE_F32] = dot_f32, [CLLM_DTYPE_F16] = dot_f16, [CLLM_DTYPE_BF16] = dot_bf16},
    .attend = cllm_attend_ref,
    .silu_mul = cllm_ref_silu_mul,
};

const struct cllm_matmul_kernels *cllm_matmul_kernels_scalar(void)
{
    return &scalar_kernels;
}
