/*
 * AVX2 + FMA + F16C matmul kernels (compiled with -mavx2 -mfma -mf16c; called only after a
 * run-time CPU check). Integer dot products use vpmaddubsw (unsigned weight bytes times signed
 * activation bytes, pairs summed to int16) and vpmaddwd (pairs to int32, times sub-block scales);
 * every partial sum fits its lane (bounds beside each kernel). Per block, the int32 lanes of up
 * to four tokens are reduced with one vphaddd tree, and the float part of the block is done for
 * the four tokens at once in one SSE vector, in exactly the scalar kernels' order (quant_dot.h),
 * so results equal dot_ref.c's bit for bit. Float weights use FMA (not bit-equal to scalar).
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/quant_dot.h"
#include "core/f16.h"
#include "tensor/quant.h"

#define TILE CLLM_MM_TILE
#define INLINE static inline __attribute__((always_inline))
/* Per-token arrays must become registers: unroll the short constant loops fully. */
#define UNROLL _Pragma("GCC unroll 8")
/* Keeps an accumulator in its register at this point: without it GCC re-associates the integer
 * sums of a block into a tree whose intermediate products do not fit the 16 registers. */
#define PIN(v) __asm__("" : "+x"(v))

/* --- activation quantization: the bytes of dot_ref.c's quant_q8 --- */

INLINE void quant_q8_avx2(const float *x, int64_t nb, int B, int G, int8_t *qs, float *d,
                          int16_t *sums)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * B;
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < B; i += 8)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const __m256 id = _mm256_set1_ps(cllm_q8_inv_scale(_mm_cvtss_f32(m4), &d[b]));
        for (int i = 0; i < B; i += 32) {
            /* x * id rounds to nearest even (MXCSR default) like lrintf; |x * id| <= 127 */
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), id));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), id));
            __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), id));
            __m256i f = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), id));
            /* the packs interleave 128-bit lanes; the permute restores element order */
            __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, c), _mm256_packs_epi32(e, f));
            q = _mm256_permutevar8x32_epi32(q, perm);
            _mm256_storeu_si256((__m256i *)(void *)(qs + b * B + i), q);
        }
    }
    cllm_q8_group_sums(qs, nb * B, G, sums);
}

static void quant_q8_0(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums)
{
    quant_q8_avx2(x, nb, 32, 32, qs, d, sums);
}

static void quant_q8_k(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums)
{
    quant_q8_avx2(x, nb, 256, 16, qs, d, sums);
}

/* --- shared pieces --- */

/* [sum(v0), sum(v1), sum(v2), sum(v3)] of four vectors of 8 int32. */
INLINE __m128i hsum4_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3)
{
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Block b's activation scales of the tile's four token slots. */
INLINE __m128 tile_d(const struct cllm_act_tile *tk, int64_t b)
{
    return _mm_setr_ps(tk->d[0][b], tk->d[1][b], tk->d[2][b], tk->d[3][b]);
}

/* Block b's activation sums (one per block: Q8_0-style) of the four token slots. */
INLINE __m128i tile_sums(const struct cllm_act_tile *tk, int64_t b)
{
    return _mm_setr_epi32(tk->sums[0][b], tk->sums[1][b], tk->sums[2][b], tk->sums[3][b]);
}

INLINE void store_tile(__m128 acc, int nt, float *y, int64_t ldy)
{
    float v[4];
    _mm_storeu_ps(v, acc);
    for (int t = 0; t < nt; t++)
        y[t * ldy] = v[t];
}

INLINE float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

INLINE __m256i loadu256(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

/* An int16 shuffle control that broadcasts int16 element j of each 128-bit lane. */
INLINE __m256i bcast16_ctl(int j)
{
    return _mm256_set1_epi16((short)(0x0100 + 0x0202 * j));
}

/*
 * Runs body(NT) with NT a compile-time constant 1..4, so per-token arrays live in registers.
 * Unused token slots hold zero vectors before the reduction.
 */
#define TILE_DISPATCH(fn, ...)                                                                     \
    switch (nt) {                                                                                  \
    case 1:                                                                                        \
        fn(__VA_ARGS__, 1);                                                                        \
        break;                                                                                     \
    case 2:                                                                                        \
        fn(__VA_ARGS__, 2);                                                                        \
        break;                                                                                     \
    case 3:                                                                                        \
        fn(__VA_ARGS__, 3);                                                                        \
        break;                                                                                     \
    default:                                                                                       \
        fn(__VA_ARGS__, 4);                                                                        \
        break;                                                                                     \
    }

/* --- Q4_K / Q5_K --- */

/* The 5th bit of sub-block j (bit j of each qh byte) moved to bit 4 (value 16). */
INLINE __m256i q5k_bit(__m256i qh, int j)
{
    const __m256i m16 = _mm256_set1_epi8(0x10);
    if (j < 4)
        return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - j), m16);
    if (j > 4)
        return _mm256_and_si256(_mm256_srli_epi16(qh, j - 4), m16);
    return _mm256_and_si256(qh, m16);
}

/*
 * Bounds: q <= 31, |x| <= 127: maddubs pairs <= 7874; times sc <= 63 and summed over 256
 * elements: |isum| < 2^26. msum: m <= 63 times pair sums of bsums (<= 4064), 8 terms: < 2^21.
 */
INLINE void q45k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                      int64_t ldy, const int q5, const int NT)
{
    const size_t bsize = q5 ? sizeof(struct cllm_block_q5_k) : sizeof(struct cllm_block_q4_k);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        uint8_t sc[8], m[8];
        cllm_k_scales_unpack(w + 4, sc, m);
        const uint8_t *qhp = w + 4 + CLLM_K_SCALE_SIZE;
        const uint8_t *qs = qhp + (q5 ? CLLM_QK_K / 8 : 0);
        const __m256i scales = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)sc)));
        const __m128i m8 = _mm_loadl_epi64((const __m128i *)(const void *)m);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        const __m256i qh = q5 ? loadu256(qhp) : _mm256_setzero_si256();
        __m256i sumi[TILE], msum[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            sumi[t] = msum[t] = _mm256_setzero_si256();
        UNROLL
        for (int c = 0; c < 4; c++) {
            const __m256i s_lo = _mm256_shuffle_epi8(scales, bcast16_ctl(2 * c));
            const __m256i s_hi = _mm256_shuffle_epi8(scales, bcast16_ctl(2 * c + 1));
            const __m256i raw = loadu256(qs + 32 * c);
            __m256i lo = _mm256_and_si256(raw, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (q5) {
                lo = _mm256_or_si256(lo, q5k_bit(qh, 2 * c));
                hi = _mm256_or_si256(hi, q5k_bit(qh, 2 * c + 1));
            }
            UNROLL
            for (int t = 0; t < NT; t++) {
                const int8_t *x = tk->qs[t] + b * CLLM_QK_K + 64 * c;
                sumi[t] = _mm256_add_epi32(
                    sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadu256(x)), s_lo));
                PIN(sumi[t]);
                sumi[t] = _mm256_add_epi32(
                    sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadu256(x + 32)), s_hi));
                PIN(sumi[t]);
            }
        }
        UNROLL
        for (int t = 0; t < NT; t++)
            msum[t] = _mm256_madd_epi16(loadu256(tk->sums[t] + b * 16), mins);
        const __m128 isum = _mm_cvtepi32_ps(hsum4_epi32(sumi[0], sumi[1], sumi[2], sumi[3]));
        const __m128 ms = _mm_cvtepi32_ps(hsum4_epi32(msum[0], msum[1], msum[2], msum[3]));
        const __m128 dx = tile_d(tk, b);
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, _mm_set1_ps(f16_at(w))), isum));
        acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, _mm_set1_ps(f16_at(w + 2))), ms));
    }
    store_tile(acc, NT, y, ldy);
}

static void dot_q4_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q45k_tile, w, K / CLLM_QK_K, &tk, y, ldy, 0)
}

static void dot_q5_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q45k_tile, w, K / CLLM_QK_K, &tk, y, ldy, 1)
}

/* --- Q6_K --- */

/*
 * Bounds: q <= 63: maddubs pairs <= 2 * 63 * 127 = 16002; times |sc| <= 128 over 256 elements:
 * |q . x| <= 256 * 63 * 127 * 128 < 2^28. The offset term 32 * sum_j sc[j] * xsum[j] is at most
 * 32 * 16 * 128 * 2032 < 2^28, so every partial isum stays inside int32.
 */
INLINE void q6k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                     int64_t ldy, const int NT)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += sizeof(struct cllm_block_q6_k)) {
        const uint8_t *ql = w, *qhp = w + CLLM_QK_K / 2, *scp = w + CLLM_QK_K / 2 + CLLM_QK_K / 4;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scp));
        __m256i sumi[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            sumi[t] = _mm256_setzero_si256();
        UNROLL
        for (int t = 0; t < NT; t++) {
            const __m256i corr = _mm256_madd_epi16(loadu256(tk->sums[t] + b * 16), sc16);
            sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(corr, 5));
        }
        UNROLL
        for (int h = 0; h < 2; h++) {
            /* scales 8h .. 8h+7 as int16 in both 128-bit lanes */
            const __m256i hsc = _mm256_broadcastsi128_si256(
                h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
            const __m256i l0 = loadu256(ql + 64 * h), l1 = loadu256(ql + 64 * h + 32);
            const __m256i hb = loadu256(qhp + 32 * h);
            UNROLL
            for (int g = 0; g < 4; g++) {
                __m256i q;
                switch (g) {
                case 0:
                    q = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                        _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
                    break;
                case 1:
                    q = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                        _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
                    break;
                case 2:
                    q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                        _mm256_and_si256(hb, m30));
                    break;
                default:
                    q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
                    break;
                }
                /* elements 0-15 of the group use scale 2g of the half, 16-31 scale 2g+1 */
                const __m256i ctl = _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * g)),
                                                     _mm_set1_epi16((short)(0x0100 + 0x0404 * g)));
                const __m256i s = _mm256_shuffle_epi8(hsc, ctl);
                UNROLL
                for (int t = 0; t < NT; t++) {
                    const __m256i x = loadu256(tk->qs[t] + b * CLLM_QK_K + 128 * h + 32 * g);
                    sumi[t] = _mm256_add_epi32(sumi[t],
                                               _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), s));
                    PIN(sumi[t]);
                }
            }
        }
        const __m128 isum = _mm_cvtepi32_ps(hsum4_epi32(sumi[0], sumi[1], sumi[2], sumi[3]));
        const __m128 dx = tile_d(tk, b);
        const float d = f16_at(w + CLLM_QK_K / 2 + CLLM_QK_K / 4 + CLLM_QK_K / 16);
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, _mm_set1_ps(d)), isum));
    }
    store_tile(acc, NT, y, ldy);
}

static void dot_q6_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q6k_tile, w, K / CLLM_QK_K, &tk, y, ldy)
}

/* --- legacy 32-blocks --- */

/* 32 bytes, byte j = 0x10 if bit j of the little-endian u32 at p is set, else 0. */
INLINE __m256i q5_high_bits(const uint8_t *p)
{
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                         3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* 16 bytes of nibbles as 32 bytes in element order (low nibbles first). */
INLINE __m256i nibbles32(const uint8_t *p)
{
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)p);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/*
 * Per block: isum = q . x (Q8_0 signed; others unsigned q, minus off * xsum), then
 * acc += (dx * d) * isum (+ (dx * m) * xsum for Q4_1/Q5_1). Bounds: maddubs pairs <= 2 * 128 *
 * 127 = 32512 (Q8_0 via |w| and sign-moved x), so no saturation; block sums < 2^17.
 */
INLINE void legacy_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                        int64_t ldy, const enum cllm_dtype type, const int NT)
{
    const size_t bsize = type == CLLM_DTYPE_Q8_0   ? sizeof(struct cllm_block_q8_0)
                         : type == CLLM_DTYPE_Q4_0 ? sizeof(struct cllm_block_q4_0)
                         : type == CLLM_DTYPE_Q4_1 ? sizeof(struct cllm_block_q4_1)
                         : type == CLLM_DTYPE_Q5_0 ? sizeof(struct cllm_block_q5_0)
                                                   : sizeof(struct cllm_block_q5_1);
    const int has_min = type == CLLM_DTYPE_Q4_1 || type == CLLM_DTYPE_Q5_1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        __m256i q;
        switch (type) {
        case CLLM_DTYPE_Q8_0:
            q = loadu256(w + 2);
            break;
        case CLLM_DTYPE_Q4_0:
            q = nibbles32(w + 2);
            break;
        case CLLM_DTYPE_Q4_1:
            q = nibbles32(w + 4);
            break;
        case CLLM_DTYPE_Q5_0:
            q = _mm256_or_si256(nibbles32(w + 6), q5_high_bits(w + 2));
            break;
        default:
            q = _mm256_or_si256(nibbles32(w + 8), q5_high_bits(w + 4));
            break;
        }
        const __m256i qa = type == CLLM_DTYPE_Q8_0 ? _mm256_abs_epi8(q) : q;
        __m256i v[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            v[t] = _mm256_setzero_si256();
        UNROLL
        for (int t = 0; t < NT; t++) {
            __m256i x = loadu256(tk->qs[t] + b * CLLM_QK);
            if (type == CLLM_DTYPE_Q8_0)
                x = _mm256_sign_epi8(x, q);
            v[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, x), ones);
        }
        __m128i isum = hsum4_epi32(v[0], v[1], v[2], v[3]);
        const __m128 dx = tile_d(tk, b);
        if (type == CLLM_DTYPE_Q4_0)
            isum = _mm_sub_epi32(isum, _mm_slli_epi32(tile_sums(tk, b), 3));
        else if (type == CLLM_DTYPE_Q5_0)
            isum = _mm_sub_epi32(isum, _mm_slli_epi32(tile_sums(tk, b), 4));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, _mm_set1_ps(f16_at(w))),
                                         _mm_cvtepi32_ps(isum)));
        if (has_min)
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, _mm_set1_ps(f16_at(w + 2))),
                                             _mm_cvtepi32_ps(tile_sums(tk, b))));
    }
    store_tile(acc, NT, y, ldy);
}

#define LEGACY_KERNEL(name, type)                                                                  \
    static void name(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,   \
                     int64_t ldy)                                                                  \
    {                                                                                              \
        struct cllm_act_tile tk;                                                                   \
        cllm_act_tile_init(&tk, a, nt);                                                            \
        TILE_DISPATCH(legacy_tile, w, K / CLLM_QK, &tk, y, ldy, type)                              \
    }
LEGACY_KERNEL(dot_q8_0, CLLM_DTYPE_Q8_0)
LEGACY_KERNEL(dot_q4_0, CLLM_DTYPE_Q4_0)
LEGACY_KERNEL(dot_q4_1, CLLM_DTYPE_Q4_1)
LEGACY_KERNEL(dot_q5_0, CLLM_DTYPE_Q5_0)
LEGACY_KERNEL(dot_q5_1, CLLM_DTYPE_Q5_1)

/* --- float weights --- */

INLINE __m256 load8f(const uint8_t *w, int64_t i, const enum cllm_dtype type)
{
    switch (type) {
    case CLLM_DTYPE_F32:
        return _mm256_loadu_ps((const float *)(const void *)w + i);
    case CLLM_DTYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(w + 2 * i)));
    default: {
        const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(w + 2 * i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    }
}

INLINE float load1f(const uint8_t *w, int64_t i, const enum cllm_dtype type)
{
    uint16_t h;
    float f;
    switch (type) {
    case CLLM_DTYPE_F32:
        memcpy(&f, w + 4 * i, 4);
        return f;
    case CLLM_DTYPE_F16:
        memcpy(&h, w + 2 * i, 2);
        return _cvtsh_ss(h);
    default:
        memcpy(&h, w + 2 * i, 2);
        return cllm_bf16_to_f32(h);
    }
}

/* The order of dot_ref.c's dot_float, with FMA. */
INLINE void float_tile(const uint8_t *w, int64_t K, const struct cllm_act_view *a, float *y,
                       int64_t ldy, const enum cllm_dtype type, const int NT)
{
    const float *x[TILE];
    __m256 A[TILE], B[TILE];
    UNROLL
    for (int t = 0; t < NT; t++) {
        x[t] = (const float *)(const void *)(a->base + (size_t)t * a->stride);
        A[t] = B[t] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
        const __m256 wa = load8f(w, i, type), wb = load8f(w, i + 8, type);
        UNROLL
        for (int t = 0; t < NT; t++) {
            A[t] = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x[t] + i), A[t]);
            B[t] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(x[t] + i + 8), B[t]);
        }
    }
    if (i + 8 <= K) {
        const __m256 wa = load8f(w, i, type);
        UNROLL
        for (int t = 0; t < NT; t++)
            A[t] = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x[t] + i), A[t]);
        i += 8;
    }
    UNROLL
    for (int t = 0; t < NT; t++) {
        const __m256 v = _mm256_add_ps(A[t], B[t]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* [h0 + h2, h1 + h3] */
        __m128 s = _mm_add_ss(p, _mm_movehdup_ps(p));
        for (int64_t k = i; k < K; k++)
            s = _mm_fmadd_ss(_mm_set_ss(load1f(w, k, type)), _mm_set_ss(x[t][k]), s);
        y[t * ldy] = _mm_cvtss_f32(s);
    }
}

#define FLOAT_KERNEL(name, type)                                                                   \
    static void name(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,   \
                     int64_t ldy)                                                                  \
    {                                                                                              \
        TILE_DISPATCH(float_tile, w, K, a, y, ldy, type)                                           \
    }
FLOAT_KERNEL(dot_f32, CLLM_DTYPE_F32)
FLOAT_KERNEL(dot_f16, CLLM_DTYPE_F16)
FLOAT_KERNEL(dot_bf16, CLLM_DTYPE_BF16)

static const struct cllm_matmul_kernels avx2_kernels = {
    .isa = "avx2",
    .quant = {[CLLM_ACT_Q8_0] = quant_q8_0, [CLLM_ACT_Q8_K] = quant_q8_k},
    .dot =
        {
            [CLLM_DTYPE_F32] = dot_f32,   [CLLM_DTYPE_F16] = dot_f16,
            [CLLM_DTYPE_BF16] = dot_bf16, [CLLM_DTYPE_Q8_0] = dot_q8_0,
            [CLLM_DTYPE_Q4_0] = dot_q4_0, [CLLM_DTYPE_Q4_1] = dot_q4_1,
            [CLLM_DTYPE_Q5_0] = dot_q5_0, [CLLM_DTYPE_Q5_1] = dot_q5_1,
            [CLLM_DTYPE_Q4_K] = dot_q4_k, [CLLM_DTYPE_Q5_K] = dot_q5_k,
            [CLLM_DTYPE_Q6_K] = dot_q6_k,
        },
};

const struct cllm_matmul_kernels *cllm_matmul_kernels_avx2(void)
{
    return &avx2_kernels;
}
