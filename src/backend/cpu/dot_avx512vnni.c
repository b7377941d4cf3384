/*
 * AVX-512 VNNI kernels for 8-bit-activation weights: the K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M
 * GGUFs and --cpu-weights q6_k hold) and the legacy 32-blocks (Q8_0, Q4_0 ...), compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512vnni on top of dot_avx2.c's flags and called only
 * after a run-time CPU check.
 *
 * dot_avx2.c spends three instructions on 32 products per token: vpmaddubsw (byte pairs to
 * int16), vpmaddwd (pairs to int32, times the sub-block scale) and vpaddd. vpdpbusd sums four
 * weight-times-activation bytes into each int32 lane instead. K-quants: 128 products take two
 * 512-bit vpdpbusd, whose lanes (at most 4 * 63 * 127 = 32004) fit an int16, one vpackssdw of
 * both and one vpdpwssd that multiplies the packed lanes by their sub-blocks' scales and adds
 * them to the token's accumulator. Legacy blocks: one 256-bit vpdpbusd per block (Q8_0's
 * signed quants offset to unsigned, the offset taken back out with the block's activation
 * sum). Every sum is an exact integer (bounds beside each kernel), so a block's integer dot
 * product is the one the scalar kernel computes; the float part is dot_avx2.c's, in the scalar
 * kernels' order (quant_dot.h). Results therefore equal dot_ref.c's bit for bit, and each
 * token's are the same alone or in a batch. Float weights keep AVX2's kernels (or
 * dot_avx512.c's).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/quant_dot.h"
#include "backend/cpu/tile_avx2.h"
#include "tensor/quant.h"

INLINE __m512i loadu512(const void *p)
{
    return _mm512_loadu_si512(p);
}

/* 32 bytes at p in both 256-bit halves. */
INLINE __m512i bcast256(const uint8_t *p)
{
    return _mm512_broadcast_i64x4(loadu256(p));
}

/* A shift count per int16 lane: lo in the lower 256 bits, hi in the upper. */
INLINE __m512i halves_epi16(short lo, short hi)
{
    return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}

/* The four-product sums of q (unsigned bytes) and x (signed bytes) in 16 int32 lanes. */
INLINE __m512i dot_lanes(__m512i q, const int8_t *x)
{
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, loadu512(x));
}

/*
 * acc + each lane of a and b times its scale: a and b (lanes inside int16) are packed to one
 * vector of int16, whose 128-bit part k holds lanes 4k..4k+3 of a, then of b, and vpdpwssd
 * multiplies them by scales (below) and adds neighbours into acc: one multiply for both.
 */
INLINE __m512i add_scaled(__m512i acc, __m512i a, __m512i b, __m512i scales)
{
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(a, b), scales);
}

/* add_scaled's scales: int16 element of part k that multiplies a lane of a takes src16's
 * element first_a + k / div, of b first_b + k / div (div: parts per sub-block scale). */
INLINE __m512i pair_scales(__m512i src16, int first_a, int first_b, int div)
{
    short idx[32];
    for (int e = 0; e < 32; e++)
        idx[e] = (short)(((e % 8) < 4 ? first_a : first_b) + (e / 8) / div);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(idx), src16);
}

/* The 16 int32 lanes of v folded to 8 (same total). */
INLINE __m256i fold256(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* --- Q4_K / Q5_K --- */

/*
 * A block's four 64-byte steps c: bytes 32c.. of qs, low nibbles (sub-block 2c, scale sc[2c])
 * in the lower half and high nibbles (sub-block 2c + 1) in the upper, matching 64 consecutive
 * activations. Bounds: q <= 31, |x| <= 127: a vpdpbusd lane <= 4 * 31 * 127 = 15748; times
 * sc <= 63 over 256 elements: |isum| < 2^26. msum as in dot_avx2.c (< 2^21).
 */
INLINE void q45k_block(const uint8_t *w, const struct cllm_act_tile *tk, int64_t b, const int q5,
                       __m256i *lanes, __m256i *mins, const int NT)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i nibble_shift = halves_epi16(0, 4);
    const __m128i scm = k_scales_vec(w + 4); /* sc[0..8), then m[0..8) */
    const uint8_t *qhp = w + 4 + CLLM_K_SCALE_SIZE;
    const uint8_t *qs = qhp + (q5 ? CLLM_QK_K / 8 : 0);
    /* int16 element j: sc[j] for j < 8 (the minimums above are unused here) */
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scm));
    *mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));
    const __m512i qh = q5 ? bcast256(qhp) : _mm512_setzero_si512();
    __m512i sumi[TILE];
    UNROLL
    for (int t = 0; t < TILE; t++)
        sumi[t] = _mm512_setzero_si512();
    UNROLL
    for (int pc = 0; pc < 2; pc++) {
        __m512i q[2];
        UNROLL
        for (int i = 0; i < 2; i++) {
            const int c = 2 * pc + i;
            q[i] = _mm512_and_si512(_mm512_srlv_epi16(bcast256(qs + 32 * c), nibble_shift), m4);
            if (q5) {
                /* the 5th bit of sub-block j is bit j of each qh byte */
                const __m512i sel =
                    _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                       _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                q[i] = _mm512_mask_add_epi8(q[i], _mm512_test_epi8_mask(qh, sel), q[i], bit4);
            }
        }
        /* steps 2pc, 2pc+1: sub-blocks 4pc, 4pc+1 and 4pc+2, 4pc+3 */
        const __m512i s = pair_scales(sc16, 4 * pc, 4 * pc + 2, 2);
        UNROLL
        for (int t = 0; t < NT; t++) {
            const int8_t *x = tk->qs[t] + b * CLLM_QK_K + 128 * pc;
            sumi[t] = add_scaled(sumi[t], dot_lanes(q[0], x), dot_lanes(q[1], x + 64), s);
        }
    }
    UNROLL
    for (int t = 0; t < NT; t++)
        lanes[t] = fold256(sumi[t]);
}

INLINE void q45k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                      int64_t ldy, const int q5, int nt, const int NT)
{
    const size_t bsize = q5 ? sizeof(struct cllm_block_q5_k) : sizeof(struct cllm_block_q4_k);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        if (tk->weights_cold)
            prefetch_block(w, bsize);
        __m256i lanes[TILE], mins;
        q45k_block(w, tk, b, q5, lanes, &mins, NT);
        k_block_float(tk, b, f16_at(w), f16_at(w + 2), 1, mins, lanes, &acc, &acc1, NT);
    }
    store_results(acc, acc1, nt, y, ldy, NT);
}

/* --- Q6_K --- */

/*
 * A block is two halves h of 128 elements, each two 64-byte steps p: ql[64h..64h+64) with
 * low nibbles (p = 0) or high ones (p = 1), bits 2p.. and 2p+2.. of qh[32h..32h+32) on top,
 * which gives elements 128h + 64p .. + 64 in order; 16 elements share a scale. Bounds: q <= 63:
 * a vpdpbusd lane <= 4 * 63 * 127 = 32004 (inside int16); times |sc| <= 128 over 256
 * elements, and the offset term, as in dot_avx2.c: every partial isum inside int32.
 */
INLINE void q6k_block(const uint8_t *w, const struct cllm_act_tile *tk, int64_t b, __m256i *lanes,
                      const int NT)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i high_lo = halves_epi16(4, 2), high_hi = halves_epi16(0, 2);
    const uint8_t *ql = w, *qhp = w + CLLM_QK_K / 2, *scp = w + CLLM_QK_K / 2 + CLLM_QK_K / 4;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scp));
    __m512i sumi[TILE];
    UNROLL
    for (int t = 0; t < TILE; t++)
        sumi[t] = _mm512_setzero_si512();
    UNROLL
    for (int h = 0; h < 2; h++) {
        const __m512i l = loadu512(ql + 64 * h), hb = bcast256(qhp + 32 * h);
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l, m4),
                                           _mm512_and_si512(_mm512_sllv_epi16(hb, high_lo), m30));
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(hb, high_hi), m30));
        /* sub-blocks 8h..8h+3 (p = 0) and 8h+4..8h+7 (p = 1) */
        const __m512i s = pair_scales(_mm512_castsi256_si512(sc16), 8 * h, 8 * h + 4, 1);
        UNROLL
        for (int t = 0; t < NT; t++) {
            const int8_t *x = tk->qs[t] + b * CLLM_QK_K + 128 * h;
            sumi[t] = add_scaled(sumi[t], dot_lanes(q0, x), dot_lanes(q1, x + 64), s);
        }
    }
    /* isum = q . x - 32 * sum_j sc[j] * xsum[j] (the quants are stored offset by 32) */
    UNROLL
    for (int t = 0; t < NT; t++) {
        const __m256i corr = _mm256_madd_epi16(loadu256(tk->sums + (b * tk->step + t) * 16), sc16);
        lanes[t] = _mm256_sub_epi32(fold256(sumi[t]), _mm256_slli_epi32(corr, 5));
    }
}

/* A Q6_K block's scale d. */
INLINE const uint8_t *q6k_d(const uint8_t *w)
{
    return w + CLLM_QK_K / 2 + CLLM_QK_K / 4 + CLLM_QK_K / 16;
}

INLINE void q6k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                     int64_t ldy, const int unused, int nt, const int NT)
{
    (void)unused;
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += sizeof(struct cllm_block_q6_k)) {
        if (tk->weights_cold)
            prefetch_block(w, sizeof(struct cllm_block_q6_k));
        __m256i lanes[TILE];
        q6k_block(w, tk, b, lanes, NT);
        k_block_float(tk, b, f16_at(q6k_d(w)), 0.0f, 0, _mm256_setzero_si256(), lanes, &acc, &acc1,
                      NT);
    }
    store_results(acc, acc1, nt, y, ldy, NT);
}

K_QUANT_KERNELS(q45k_tile, q6k_tile)

/* --- one token against eight rows at once --- */

/* The f16 at p and at each of the 7 places stride bytes after it, widened. */
INLINE __m256 f16x8(const uint8_t *p, size_t stride)
{
    return _mm256_cvtph_ps(f16_gather(p, stride, 8));
}

/* Bytes of 8 rows up to which k_rows8 takes them together: its float part reads each block's
 * scales back from the 8 rows, in L1 if they fit (8 rows of 8960 Q6_K weights, 57 KiB, ran
 * 1.2x slower than row by row on 1 thread of a Zen 4; the 1.5B's K = 1536 rows, 7-10 KiB,
 * faster). Blocks a row then has at most: ROWS_MAX_BLOCKS (its lanes: 2 x 4 KiB). */
#define ROWS_GROUP_BYTES (16u << 10)
#define ROWS_MAX_BLOCKS (ROWS_GROUP_BYTES / 8 / sizeof(struct cllm_block_q4_k) + 1)

/*
 * A lone token against 8 rows row_bytes apart (8 * row_bytes <= ROWS_GROUP_BYTES). Each row's
 * blocks go through their integer part as in the one-row kernel, in memory order (a whole row, then
 * the next: the order the hardware's prefetchers follow; reading the 8 rows' block b at once, or a
 * row's 16 blocks at a time, ran 1.5-3x slower on a Zen 4), their lanes kept; then, block by block,
 * the float part of all 8 rows at once, row r in lane r: acc += (dx * d) * isum (and acc -= (dx *
 * dmin) * msum for Q4_K / Q5_K), the scalar order, so each row's result is the one-row kernel's.
 * What the rows share: one transposing reduction tree for 8 rows' lanes instead of 8, and the float
 * part.
 */
INLINE void k_rows8(const uint8_t *w, size_t row_bytes, int64_t nb, const struct cllm_act_tile *tk,
                    float *y, const enum cllm_dtype type)
{
    const size_t bsize = type == CLLM_DTYPE_Q6_K   ? sizeof(struct cllm_block_q6_k)
                         : type == CLLM_DTYPE_Q5_K ? sizeof(struct cllm_block_q5_k)
                                                   : sizeof(struct cllm_block_q4_k);
    const int with_min = type != CLLM_DTYPE_Q6_K;
    __m256i lanes[ROWS_MAX_BLOCKS][8], mlanes[ROWS_MAX_BLOCKS][8]; /* mlanes: Q4_K, Q5_K */
    for (int r = 0; r < 8; r++) {
        const uint8_t *wr = w + r * row_bytes;
        for (int64_t b = 0; b < nb; b++, wr += bsize) {
            if (type == CLLM_DTYPE_Q6_K) {
                q6k_block(wr, tk, b, &lanes[b][r], 1);
            } else {
                __m256i mins;
                q45k_block(wr, tk, b, type == CLLM_DTYPE_Q5_K, &lanes[b][r], &mins, 1);
                mlanes[b][r] = _mm256_madd_epi16(loadu256(tk->sums + b * tk->step * 16), mins);
            }
        }
    }
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * bsize;
        const __m256 dx = _mm256_set1_ps(tk->d[b * tk->step]);
        const __m256 d = f16x8(type == CLLM_DTYPE_Q6_K ? q6k_d(wb) : wb, row_bytes);
        const __m256 isum = _mm256_cvtepi32_ps(tile_hsum(lanes[b], 8));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, d), isum));
        if (with_min) {
            const __m256 dmin = f16x8(wb + 2, row_bytes);
            const __m256 msum = _mm256_cvtepi32_ps(tile_hsum(mlanes[b], 8));
            acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, dmin), msum));
        }
    }
    _mm256_storeu_ps(y, acc);
}

/* cllm_dot_rows_fn for a lone token (nt = 1): rows 8 at a time, the rest one by one. */
INLINE void k_rows(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                   const struct cllm_act_view *a, float *y, const enum cllm_dtype type,
                   cllm_dot_fn one_row)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, 1);
    int64_t r = 0;
    if (8 * row_bytes <= ROWS_GROUP_BYTES)
        for (; r + 8 <= nr; r += 8)
            k_rows8(w + (size_t)r * row_bytes, row_bytes, K / CLLM_QK_K, &tk, y + r, type);
    for (; r < nr; r++)
        one_row(w + (size_t)r * row_bytes, K, a, 1, y + r, 1);
}

#define K_ROWS_KERNEL(name, type, one_row)                                                         \
    static void name(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,                    \
                     const struct cllm_act_view *a, int nt, float *y, int64_t ldy)                 \
    {                                                                                              \
        (void)nt;                                                                                  \
        (void)ldy;                                                                                 \
        k_rows(w, row_bytes, nr, K, a, y, type, one_row);                                          \
    }
K_ROWS_KERNEL(dot_rows1_q4_k, CLLM_DTYPE_Q4_K, dot_q4_k)
K_ROWS_KERNEL(dot_rows1_q5_k, CLLM_DTYPE_Q5_K, dot_q5_k)
K_ROWS_KERNEL(dot_rows1_q6_k, CLLM_DTYPE_Q6_K, dot_q6_k)

/* --- legacy 32-blocks (legacy_avx2.h, with these three) --- */

/* vpdpbusd takes unsigned weight bytes: Q8_0's signed quants become q + 128 (q ^ 0x80), whose
 * extra 128 * xsum legacy_offset_shift takes back out. */
INLINE __m256i legacy_prep(__m256i q, const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q8_0 ? _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)) : q;
}

/* 8 int32 lanes summing to qu . x, qu = legacy_prep's. Bounds: qu <= 255, |x| <= 127: a block's
 * sum < 2^20. */
INLINE __m256i legacy_lanes(__m256i q, __m256i qu, const int8_t *xp, const enum cllm_dtype type)
{
    (void)q;
    (void)type;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), qu, loadu256(xp));
}

/* Shift that turns a block's activation sum into the offset term (128 * sx for Q8_0's, 8 * sx,
 * 16 * sx); 0: none. */
INLINE int legacy_offset_shift(const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q8_0   ? 7
           : type == CLLM_DTYPE_Q4_0 ? 3
           : type == CLLM_DTYPE_Q5_0 ? 4
                                     : 0;
}

#include "backend/cpu/legacy_avx2.h"

void cllm_matmul_kernels_add_avx512vnni(struct cllm_matmul_kernels *k)
{
    k->isa = "avx512vnni";
    k->dot[CLLM_DTYPE_Q8_0] = dot_q8_0;
    k->dot[CLLM_DTYPE_Q4_0] = dot_q4_0;
    k->dot[CLLM_DTYPE_Q4_1] = dot_q4_1;
    k->dot[CLLM_DTYPE_Q5_0] = dot_q5_0;
    k->dot[CLLM_DTYPE_Q5_1] = dot_q5_1;
    k->dot[CLLM_DTYPE_Q4_K] = dot_q4_k;
    k->dot[CLLM_DTYPE_Q5_K] = dot_q5_k;
    k->dot[CLLM_DTYPE_Q6_K] = dot_q6_k;
    k->dot_rows1[CLLM_DTYPE_Q4_K] = dot_rows1_q4_k;
    k->dot_rows1[CLLM_DTYPE_Q5_K] = dot_rows1_q5_k;
    k->dot_rows1[CLLM_DTYPE_Q6_K] = dot_rows1_q6_k;
    cllm_matmul_kernels_add_packed_avx512vnni(k);
}
