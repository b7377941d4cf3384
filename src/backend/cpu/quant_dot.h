/*
 * Internal contract between the matmul driver (matmul.c) and its kernels (dot_ref.c, the scalar
 * reference; dot_avx2.c; dot_avx512vnni.c; dot_avx512.c): the layout of quantized activations, the
 * kernel signatures and the per-ISA kernel table.
 *
 * Quantized activations are stored in tiles of CLLM_MM_TILE tokens (T), the unit a kernel call
 * works on; the scales and sums of a tile's tokens sit side by side so one vector load fetches
 * them for the whole tile:
 *   int8_t  qs[T][K]             x[k] ~= d[k / B] * qs[k], qs in [-127, 127], round to nearest even
 *   float   d[K / B][T]          block scales: amax / 127 of the block (0 for padding slots)
 *   int16_t sums[K / B][T][B/G]  sums of qs over groups of G consecutive elements
 * each part starting 64-byte aligned. Q8_0-style (legacy weights): B = G = 32. Q8_K-style
 * (K-quant weights): B = 256, G = 16.
 */
#ifndef CLLM_BACKEND_CPU_QUANT_DOT_H
#define CLLM_BACKEND_CPU_QUANT_DOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/attend.h"
#include "tensor/dtype.h"

/* Tokens per kernel call: each weight block is decoded once and used for this many tokens. */
#define CLLM_MM_TILE 8

enum cllm_act_kind {
    CLLM_ACT_F32,  /* F32/F16/BF16 weights: activations stay f32 */
    CLLM_ACT_Q8_0, /* legacy 32-blocks: B = G = 32 */
    CLLM_ACT_Q8_K, /* K-quants: B = 256, G = 16 */
    CLLM_ACT_BF16, /* BF16 weights under kernels with to_bf16 (below): rows of BF16 */
    /* BF16 weights under kernels with to_pairs (below): F32 rows, each 32-element chunk's
     * even elements, then its odd ones */
    CLLM_ACT_F32_PAIRS,
    CLLM_ACT_KIND_COUNT
};

/* BF16 activation rows are zero-padded to a multiple of this many elements (dot_avx512.c's
 * step), so the kernels read whole vectors of them; so are F32 pair rows, whose chunks are as
 * long (dot_avx512f.c). */
#define CLLM_BF16_ACT_ALIGN 32

/* Which activation format a weight dtype is multiplied with by the kernels without to_bf16
 * (cllm_kernels_act_kind below says it for a given kernel family). */
static inline enum cllm_act_kind cllm_act_kind_of(enum cllm_dtype t)
{
    switch (t) {
    case CLLM_DTYPE_Q8_0:
    case CLLM_DTYPE_Q4_0:
    case CLLM_DTYPE_Q4_1:
    case CLLM_DTYPE_Q5_0:
    case CLLM_DTYPE_Q5_1:
        return CLLM_ACT_Q8_0;
    case CLLM_DTYPE_Q4_K:
    case CLLM_DTYPE_Q5_K:
    case CLLM_DTYPE_Q6_K:
        return CLLM_ACT_Q8_K;
    default:
        return CLLM_ACT_F32;
    }
}

/* Elements per scale (B) and per sum (G) of a quantized activation format. */
static inline int64_t cllm_act_block(enum cllm_act_kind k)
{
    return k == CLLM_ACT_Q8_K ? 256 : 32;
}
static inline int64_t cllm_act_group(enum cllm_act_kind k)
{
    return k == CLLM_ACT_Q8_K ? 16 : 32;
}

/* A tile of activations as the kernels see it. Token t's row starts at base + t * stride: K
 * floats for F32, K quants for quantized kinds, whose d[] and sums[] start at base + off_d and
 * base + off_sums. */
struct cllm_act_view {
    const uint8_t *base;
    size_t stride;
    size_t off_d;
    size_t off_sums;
    int64_t step; /* d[] and sums[] step between blocks: CLLM_MM_TILE, or 1 for a lone token */
    /* The call's weight rows are not in the caches yet (its tile is the first to pass over them):
     * kernels for several tokens ask for the weights ahead, as those for one token always do. */
    bool weights_cold;
};

/*
 * y[t * ldy] = dot(weight row w, activation row t) for t < nt (1 <= nt <= CLLM_MM_TILE); K is
 * a multiple of the weight's block size. Each token's result is computed by the same sequence
 * of operations whatever nt is (batch invariance). For quantized types the integer part of each
 * block is exact and the float part is, per block b and per token:
 *     acc = acc + (dx[b] * dw) * (float)isum          (acc starts at 0.0f)
 * (plus acc = acc - (dx * dmin) * (float)msum for Q4_K/Q5_K, acc = acc + (dx * m) * (float)sx
 * for Q4_1/Q5_1), with no FMA contraction, so scalar and AVX2 kernels agree bit for bit.
 */
typedef void (*cllm_dot_fn)(const void *w, int64_t K, const struct cllm_act_view *a, int nt,
                            float *y, int64_t ldy);

/*
 * Float weights (F32/F16/BF16) against f32 activations, a block at a time:
 * y[t * ldy + r] = dot(weight row r, activation row t) for r < nr, t < nt (any nt >= 1: matmul.c
 * hands a float kernel every token of its item at once),
 * row r starting at w + r * row_bytes. Every output is computed in one order (dot_ref.c's
 * dot_float: eight lanes over 8-element steps, a fixed tree, the tail in order) whatever nr, nt
 * or its place in the block, so results do not depend on the batch. The AVX2 kernels use FMA,
 * the scalar ones do not, so they agree to rounding.
 */
typedef void (*cllm_dot_rows_fn)(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                                 const struct cllm_act_view *a, int nt, float *y, int64_t ldy);

/* x[0..K) rounded to BF16 into out[0..Kp), Kp = K rounded up to CLLM_BF16_ACT_ALIGN, the
 * padding zeros. */
typedef void (*cllm_to_bf16_fn)(const float *x, int64_t K, uint16_t *out);

/* x[0..K) as CLLM_ACT_F32_PAIRS: for each chunk c of CLLM_BF16_ACT_ALIGN elements,
 * out[c + i] = x[c + 2i] and out[c + 16 + i] = x[c + 2i + 1] (i < 16), elements past K zero;
 * out has K rounded up to CLLM_BF16_ACT_ALIGN elements. */
typedef void (*cllm_to_pairs_fn)(const float *x, int64_t K, float *out);

/* Quantizes nb consecutive blocks of x (nb * B floats) into qs[nb * B] and, for block b,
 * d[b * step] and sums[b * step * (B / G) + g] (step as in struct cllm_act_tile). Scalar and
 * AVX2 quantizers produce identical bytes. */
typedef void (*cllm_quant_fn)(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums,
                              int64_t step);

struct cllm_matmul_kernels {
    const char *isa; /* "scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16" */
    cllm_quant_fn quant[CLLM_ACT_KIND_COUNT]; /* by enum cllm_act_kind: Q8_0 and Q8_K only */
    cllm_dot_fn dot[CLLM_DTYPE_COUNT]; /* by quantized weight dtype */
    /* By float weight dtype; dot_rows[BF16] reads BF16 activation rows where to_bf16 is set
     * (struct cllm_act_view: stride bytes apart, K rounded up to CLLM_BF16_ACT_ALIGN). */
    cllm_dot_rows_fn dot_rows[CLLM_DTYPE_COUNT];
    /* By quantized weight dtype, optional: a lone token (a call of n_tokens = 1, nt = 1,
     * y[r] for r < nr) against a block of rows, the same bits as dot's row by row. */
    cllm_dot_rows_fn dot_rows1[CLLM_DTYPE_COUNT];
    /* Optional, by K-quant dtype: rows packed 16 at a time (pack_x16.h), nr rows (a multiple of
     * 16, w at a group's first) against a tile of nt tokens, the same bits as dot[] row by row.
     * A family that has one gets such matrices packed at load (cllm_cpu_matmul_packs). */
    cllm_dot_rows_fn dot_x16[CLLM_DTYPE_COUNT];
    cllm_to_bf16_fn to_bf16; /* NULL: every float weight takes F32 activations */
    /* Where to_bf16 is NULL and this is not: dot_rows[BF16] reads F32 pair rows. */
    cllm_to_pairs_fn to_pairs;
    /* The family's kernels beyond matmul (attend.h), chosen with it. */
    cllm_attend_fn attend;
    cllm_silu_mul_fn silu_mul;
};

/* The activation format kernels k multiply weights of type t with. */
static inline enum cllm_act_kind cllm_kernels_act_kind(const struct cllm_matmul_kernels *k,
                                                       enum cllm_dtype t)
{
    if (t == CLLM_DTYPE_BF16 && k->to_bf16)
        return CLLM_ACT_BF16;
    if (t == CLLM_DTYPE_BF16 && k->to_pairs)
        return CLLM_ACT_F32_PAIRS;
    return cllm_act_kind_of(t);
}

/* A tile's pointers: token rows (slots past nt alias slot 0 so SIMD code may read them), and
 * d[b * step + t], sums[(b * step + t) * (B / G) + g]. A call with one token in all
 * (decode) keeps its scales and sums contiguous (step 1); otherwise step is T. */
struct cllm_act_tile {
    const int8_t *qs[CLLM_MM_TILE];
    const float *d;
    const int16_t *sums;
    int64_t step;
    bool weights_cold; /* the view's */
};

static inline void cllm_act_tile_init(struct cllm_act_tile *tk, const struct cllm_act_view *a,
                                      int nt)
{
    for (int t = 0; t < CLLM_MM_TILE; t++)
        tk->qs[t] = (const int8_t *)(a->base + (size_t)(t < nt ? t : 0) * a->stride);
    tk->d = (const float *)(const void *)(a->base + a->off_d);
    tk->sums = (const int16_t *)(const void *)(a->base + a->off_sums);
    tk->step = a->step;
    tk->weights_cold = a->weights_cold;
}

/* The scale d (x ~= d * q) and inverse scale of a block whose largest magnitude is amax. Blocks
 * below 1e-30 (or NaN) become zero, so 127 / amax never overflows. */
static inline float cllm_q8_inv_scale(float amax, float *d)
{
    if (!(amax >= 1e-30f)) {
        *d = 0.0f;
        return 0.0f;
    }
    *d = amax / 127.0f;
    return 127.0f / amax;
}

/* The group sums of nb blocks of B quants, stored as described for cllm_quant_fn. */
static inline void cllm_q8_group_sums(const int8_t *qs, int64_t nb, int B, int G, int16_t *sums,
                                      int64_t step)
{
    for (int64_t b = 0; b < nb; b++) {
        for (int g = 0; g < B / G; g++) {
            int s = 0;
            for (int i = 0; i < G; i++)
                s += qs[b * B + g * G + i];
            sums[b * step * (B / G) + g] = (int16_t)s;
        }
    }
}

/* The 12 scale bytes of Q4_K / Q5_K as 8 six-bit scales sc[] and 8 six-bit minimums m[]
 * (layout in tensor/dequant.c), unpacked four at a time in 32-bit words. */
static inline void cllm_k_scales_unpack(const uint8_t s[12], uint8_t sc[8], uint8_t m[8])
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t v[4] = {
        a & 0x3f3f3f3fu,
        (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u),
        b & 0x3f3f3f3fu,
        ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u),
    };
    memcpy(sc, v, 8);
    memcpy(m, v + 2, 8);
}

const struct cllm_matmul_kernels *cllm_matmul_kernels_scalar(void);
/* The packed kernels' references (dot_ref.c), which families without their own run on
 * matrices packed while another family was active (tests, CLLM_CPU_ISA's choice aside). */
void cllm_dot_q4_k_x16_ref(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                           const struct cllm_act_view *a, int nt, float *y, int64_t ldy);
void cllm_dot_q6_k_x16_ref(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                           const struct cllm_act_view *a, int nt, float *y, int64_t ldy);
#if defined(__x86_64__) || defined(__i386__)
/* Only to be used after a run-time check for AVX2 + FMA + F16C (and AVX-VNNI for the second:
 * dot_avx2.c compiled again, the same bits). */
const struct cllm_matmul_kernels *cllm_matmul_kernels_avx2(void);
const struct cllm_matmul_kernels *cllm_matmul_kernels_avxvnni(void);
/* The AVX2 and AVX-VNNI families' kernels for packed Q4_K rows (packed_avx2.c; none for Q6_K),
 * which the AVX-512 F family keeps and the AVX-512 VNNI one replaces. */
void cllm_dot_q4_k_x16_avx2(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                            const struct cllm_act_view *a, int nt, float *y, int64_t ldy);
void cllm_dot_q4_k_x16_avxvnni(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                               const struct cllm_act_view *a, int nt, float *y, int64_t ldy);
/* Turn a copy of the AVX2 family (or of one these made) into the AVX-512 one (float weights,
 * 16 lanes), the AVX-512 VNNI one (quantized weights) and the AVX-512 BF16 one (BF16 weights):
 * only to be used after a run-time check for AVX-512 F, BW and VL, and VNNI or BF16 for those,
 * as well. */
void cllm_matmul_kernels_add_avx512(struct cllm_matmul_kernels *k);
void cllm_matmul_kernels_add_avx512vnni(struct cllm_matmul_kernels *k);
/* The VNNI family's kernels for packed K-quant rows (packed_avx512vnni.c; called by the above). */
void cllm_matmul_kernels_add_packed_avx512vnni(struct cllm_matmul_kernels *k);
void cllm_matmul_kernels_add_avx512bf16(struct cllm_matmul_kernels *k);
#endif

/* Bytes of one tile of quantized activations (a 64-byte multiple) and the offsets of d[] and
 * sums[] in it; false if K is not a positive multiple of the block size. BF16 activations and
 * F32 pairs: a tile is CLLM_MM_TILE padded rows, with neither d[] nor sums[] (both offsets at
 * its end). */
static inline bool cllm_act_tile_layout(enum cllm_act_kind k, int64_t K, size_t *tile_bytes,
                                        size_t *off_d, size_t *off_sums)
{
    if (k == CLLM_ACT_BF16 || k == CLLM_ACT_F32_PAIRS) {
        if (K <= 0 || K > (int64_t)1 << 40)
            return false;
        const uint64_t row = ((uint64_t)K + CLLM_BF16_ACT_ALIGN - 1) / CLLM_BF16_ACT_ALIGN *
                             CLLM_BF16_ACT_ALIGN * (k == CLLM_ACT_BF16 ? 2u : 4u);
        *tile_bytes = *off_d = *off_sums = (size_t)(CLLM_MM_TILE * row);
        return true;
    }
    const int64_t B = cllm_act_block(k), G = cllm_act_group(k);
    if (K <= 0 || K % B != 0 || K > (int64_t)1 << 40)
        return false;
    const uint64_t T = CLLM_MM_TILE;
    uint64_t od = (T * (uint64_t)K + 63u) & ~(uint64_t)63u;
    uint64_t os = (od + 4u * T * (uint64_t)(K / B) + 63u) & ~(uint64_t)63u;
    uint64_t end = os + 2u * T * (uint64_t)(K / G);
    *off_d = (size_t)od;
    *off_sums = (size_t)os;
    *tile_bytes = (size_t)((end + 63u) & ~(uint64_t)63u);
    return true;
}

#endif
