/*
 * AVX2 + FMA + F16C matmul kernels (compiled with -mavx2 -mfma -mf16c; called only after a
 * run-time CPU check). Integer dot products use vpmaddubsw (unsigned weight bytes times signed
 * activation bytes, pairs summed to int16) and vpmaddwd (pairs to int32, times sub-block scales);
 * every partial sum fits its lane (bounds beside each kernel). A weight block is decoded once for
 * up to eight tokens; per block, their int32 lanes are reduced with one vphaddd tree and the
 * float part is done for all of them in one vector, in exactly the scalar kernels' order
 * (quant_dot.h), so results equal dot_ref.c's bit for bit. One token (decode) has its own leaner
 * paths with the same arithmetic. Float weights use FMA (not bit-equal to scalar), several rows
 * and tokens per pass.
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
                          int16_t *sums, int64_t step)
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
        const __m256 id = _mm256_set1_ps(cllm_q8_inv_scale(_mm_cvtss_f32(m4), &d[b * step]));
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
    cllm_q8_group_sums(qs, nb, B, G, sums, step);
}

static void quant_q8_0(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums,
                       int64_t step)
{
    quant_q8_avx2(x, nb, 32, 32, qs, d, sums, step);
}

static void quant_q8_k(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *sums,
                       int64_t step)
{
    quant_q8_avx2(x, nb, 256, 16, qs, d, sums, step);
}

/* --- shared pieces --- */

/* [sum(v0), sum(v1), sum(v2), sum(v3)] of four vectors of 8 int32. */
INLINE __m128i hsum4_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3)
{
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The sum of the 8 int32 of v. */
INLINE int32_t hsum_epi32(__m256i v)
{
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
    return _mm_cvtsi128_si32(r);
}

/* Per token slot t < NT (NT = 4 or 8): the sum of v[t]; slots past NT are zero. */
INLINE __m256i tile_hsum(const __m256i *v, const int NT)
{
    if (NT <= 4)
        return _mm256_zextsi128_si256(hsum4_epi32(v[0], v[1], v[2], v[3]));
    /* a: per 128-bit lane, partial sums of slots 0-3; b: of slots 4-7 */
    const __m256i a =
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b =
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* Block b's activation scales of the tile's token slots (NT = 4: the upper four are zero). */
INLINE __m256 tile_d(const struct cllm_act_tile *tk, int64_t b, const int NT)
{
    if (NT <= 4)
        return _mm256_zextps128_ps256(_mm_loadu_ps(tk->d + b * TILE));
    return _mm256_loadu_ps(tk->d + b * TILE);
}

/* Block b's activation sums (one per block: Q8_0-style) of the tile's token slots. */
INLINE __m256i tile_sums(const struct cllm_act_tile *tk, int64_t b, const int NT)
{
    const int16_t *p = tk->sums + b * TILE;
    if (NT <= 4)
        return _mm256_zextsi128_si256(
            _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)));
    return _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
}

INLINE void store_tile(__m256 acc, int nt, float *y, int64_t ldy)
{
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int t = 0; t < nt; t++)
        y[t * ldy] = v[t];
}

INLINE float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Decode streams weights from memory: ask for the bytes PREFETCH_AHEAD past the block early. */
#define PREFETCH_AHEAD 768
INLINE void prefetch_block(const uint8_t *w, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)(w + PREFETCH_AHEAD + o), _MM_HINT_T0);
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
 * Runs fn(..., nt, NT) with NT a compile-time constant (1, 4 or 8) no smaller than nt, so
 * per-token arrays live in registers. Slots nt..NT-1 read token 0's quants with the zero scales
 * of the tile's padding, and their results are dropped.
 */
#define TILE_DISPATCH(fn, ...)                                                                     \
    do {                                                                                           \
        if (nt == 1)                                                                               \
            fn(__VA_ARGS__, 1, 1);                                                                 \
        else if (nt <= 4)                                                                          \
            fn(__VA_ARGS__, nt, 4);                                                                \
        else                                                                                       \
            fn(__VA_ARGS__, nt, 8);                                                                \
    } while (0)

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
                      int64_t ldy, const int q5, int nt, const int NT)
{
    const size_t bsize = q5 ? sizeof(struct cllm_block_q5_k) : sizeof(struct cllm_block_q4_k);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        if (NT == 1)
            prefetch_block(w, bsize);
        uint8_t sc[8], m[8];
        cllm_k_scales_unpack(w + 4, sc, m);
        const uint8_t *qhp = w + 4 + CLLM_K_SCALE_SIZE;
        const uint8_t *qs = qhp + (q5 ? CLLM_QK_K / 8 : 0);
        const __m256i scales = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)sc)));
        const __m128i m8 = _mm_loadl_epi64((const __m128i *)(const void *)m);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        const __m256i qh = q5 ? loadu256(qhp) : _mm256_setzero_si256();
        __m256i sumi[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            sumi[t] = _mm256_setzero_si256();
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
        const float d = f16_at(w), dmin = f16_at(w + 2);
        if (NT == 1) {
            /* [isum, msum] in one reduction; then acc += (dx*d)*isum, acc -= (dx*dmin)*msum */
            const __m256i ms = _mm256_madd_epi16(loadu256(tk->sums + b * tk->step * 16), mins);
            const __m256i h = _mm256_hadd_epi32(sumi[0], ms);
            __m128i r = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            r = _mm_hadd_epi32(r, r);
            const __m128 p = _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(tk->d[b * tk->step]),
                                                   _mm_setr_ps(d, dmin, d, dmin)),
                                        _mm_cvtepi32_ps(r));
            acc1 = _mm_add_ss(acc1, p);
            acc1 = _mm_sub_ss(acc1, _mm_movehdup_ps(p));
            continue;
        }
        const __m256 isum = _mm256_cvtepi32_ps(tile_hsum(sumi, NT));
        UNROLL
        for (int t = 0; t < NT; t++)
            sumi[t] = _mm256_madd_epi16(loadu256(tk->sums + (b * TILE + t) * 16), mins);
        const __m256 ms = _mm256_cvtepi32_ps(tile_hsum(sumi, NT));
        const __m256 dx = tile_d(tk, b, NT);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(d)), isum));
        acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(dmin)), ms));
    }
    if (NT == 1)
        y[0] = _mm_cvtss_f32(acc1);
    else
        store_tile(acc, nt, y, ldy);
}

static void dot_q4_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q45k_tile, w, K / CLLM_QK_K, &tk, y, ldy, 0);
}

static void dot_q5_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q45k_tile, w, K / CLLM_QK_K, &tk, y, ldy, 1);
}

/* --- Q6_K --- */

/*
 * Bounds: q <= 63: maddubs pairs <= 2 * 63 * 127 = 16002; times |sc| <= 128 over 256 elements:
 * |q . x| <= 256 * 63 * 127 * 128 < 2^28. The offset term 32 * sum_j sc[j] * xsum[j] is at most
 * 32 * 16 * 128 * 2032 < 2^28, so every partial isum stays inside int32.
 */
INLINE void q6k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                     int64_t ldy, int nt, const int NT)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += sizeof(struct cllm_block_q6_k)) {
        if (NT == 1)
            prefetch_block(w, sizeof(struct cllm_block_q6_k));
        const uint8_t *ql = w, *qhp = w + CLLM_QK_K / 2, *scp = w + CLLM_QK_K / 2 + CLLM_QK_K / 4;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scp));
        __m256i sumi[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            sumi[t] = _mm256_setzero_si256();
        UNROLL
        for (int t = 0; t < NT; t++) {
            const __m256i corr =
                _mm256_madd_epi16(loadu256(tk->sums + (b * tk->step + t) * 16), sc16);
            sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(corr, 5));
        }
        UNROLL
        for (int h = 0; h < 2; h++) {
            /* scales 8h .. 8h+7 as int16 in both 128-bit lanes */
            const __m256i hsc = _mm256_broadcastsi128_si256(
                h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
            UNROLL
            for (int g = 0; g < 4; g++) {
                /* group g: nibbles of ql[64h + 32(g & 1) ..] (high ones for g >= 2), and bits
                 * 2g, 2g+1 of qh[32h ..] */
                const __m256i l = loadu256(ql + 64 * h + 32 * (g & 1));
                const __m256i hb = loadu256(qhp + 32 * h);
                const __m256i lq = g < 2 ? _mm256_and_si256(l, m4)
                                         : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
                const __m256i hq = g == 0   ? _mm256_slli_epi16(hb, 4)
                                   : g == 1 ? _mm256_slli_epi16(hb, 2)
                                   : g == 2 ? hb
                                            : _mm256_srli_epi16(hb, 2);
                const __m256i q = _mm256_or_si256(lq, _mm256_and_si256(hq, m30));
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
        const float d = f16_at(w + CLLM_QK_K / 2 + CLLM_QK_K / 4 + CLLM_QK_K / 16);
        if (NT == 1) {
            const __m128 p = _mm_mul_ss(_mm_mul_ss(_mm_set_ss(tk->d[b * tk->step]), _mm_set_ss(d)),
                                        _mm_cvtsi32_ss(_mm_setzero_ps(), hsum_epi32(sumi[0])));
            acc1 = _mm_add_ss(acc1, p);
            continue;
        }
        const __m256 isum = _mm256_cvtepi32_ps(tile_hsum(sumi, NT));
        const __m256 dx = tile_d(tk, b, NT);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(d)), isum));
    }
    if (NT == 1)
        y[0] = _mm_cvtss_f32(acc1);
    else
        store_tile(acc, nt, y, ldy);
}

static void dot_q6_k(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,
                     int64_t ldy)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    TILE_DISPATCH(q6k_tile, w, K / CLLM_QK_K, &tk, y, ldy);
}

/* --- legacy 32-blocks --- */

/* 32 bytes, byte j = 0x10 if bit j of the little-endian u32 at p is set, else 0. */
INLINE __m256i q5_high_bits(const uint8_t *p)
{
    /* a broadcast straight from memory (vbroadcastss) keeps the chain short */
    const __m256i all = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)p));
    const __m256i spread = _mm256_shuffle_epi8(
        all,
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                         3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* 16 bytes of nibbles as 32 bytes in element order (low nibbles first). */
INLINE __m256i nibbles32(const uint8_t *p)
{
    /* both 128-bit lanes load the 16 bytes; the upper lane shifts its high nibbles down */
    const __m256i v =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}

INLINE size_t legacy_size(const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q8_0   ? sizeof(struct cllm_block_q8_0)
           : type == CLLM_DTYPE_Q4_0 ? sizeof(struct cllm_block_q4_0)
           : type == CLLM_DTYPE_Q4_1 ? sizeof(struct cllm_block_q4_1)
           : type == CLLM_DTYPE_Q5_0 ? sizeof(struct cllm_block_q5_0)
                                     : sizeof(struct cllm_block_q5_1);
}

/* The block's quants in element order: signed bytes for Q8_0, unsigned 0..15 / 0..31 else. */
INLINE __m256i legacy_quants(const uint8_t *w, const enum cllm_dtype type)
{
    switch (type) {
    case CLLM_DTYPE_Q8_0:
        return loadu256(w + 2);
    case CLLM_DTYPE_Q4_0:
        return nibbles32(w + 2);
    case CLLM_DTYPE_Q4_1:
        return nibbles32(w + 4);
    case CLLM_DTYPE_Q5_0:
        return _mm256_or_si256(nibbles32(w + 6), q5_high_bits(w + 2));
    default:
        return _mm256_or_si256(nibbles32(w + 8), q5_high_bits(w + 4));
    }
}

/* 8 int32 lanes summing to q . x (before the offset correction). qa = |q| for Q8_0, else q. */
INLINE __m256i legacy_lanes(__m256i q, __m256i qa, const int8_t *xp, const enum cllm_dtype type)
{
    __m256i x = loadu256(xp);
    if (type == CLLM_DTYPE_Q8_0)
        x = _mm256_sign_epi8(x, q);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(qa, x), _mm256_set1_epi16(1));
}

/* Shift that turns a block's activation sum into the offset term (8 * sx, 16 * sx); 0: none. */
INLINE int legacy_offset_shift(const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q4_0 ? 3 : type == CLLM_DTYPE_Q5_0 ? 4 : 0;
}

/* The f16 at p, p + stride, p + 2 stride, p + 3 stride, widened. Built in registers: a vector
 * load of four 2-byte stores would stall on store forwarding. */
INLINE __m128 f16x4(const uint8_t *p, size_t stride)
{
    uint16_t h[4];
    UNROLL
    for (int i = 0; i < 4; i++)
        memcpy(&h[i], p + i * stride, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0,
                                       0, 0));
}

/*
 * One token (decode): four blocks per step share one reduction; their float terms are then
 * added to acc one block at a time, as the scalar kernel does. Remaining blocks go one by one.
 */
INLINE void legacy_row1(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                        const enum cllm_dtype type, const int64_t step)
{
    const size_t bsize = legacy_size(type);
    const int has_min = type == CLLM_DTYPE_Q4_1 || type == CLLM_DTYPE_Q5_1;
    const int sh = legacy_offset_shift(type);
    const int8_t *x = tk->qs[0];
    const float *dxp = tk->d; /* this token is slot 0 */
    const int16_t *sxp = tk->sums;
    __m128 acc = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        prefetch_block(w, 4 * bsize);
        __m256i v[4];
        UNROLL
        for (int i = 0; i < 4; i++) {
            const __m256i q = legacy_quants(w + i * bsize, type);
            const __m256i qa = type == CLLM_DTYPE_Q8_0 ? _mm256_abs_epi8(q) : q;
            v[i] = legacy_lanes(q, qa, x + (b + i) * CLLM_QK, type);
        }
        __m128i isum = hsum4_epi32(v[0], v[1], v[2], v[3]);
        const __m128i sx =
            step == 1
                ? _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(sxp + b)))
                : _mm_setr_epi32(sxp[b * step], sxp[(b + 1) * step], sxp[(b + 2) * step],
                                 sxp[(b + 3) * step]);
        if (sh)
            isum = _mm_sub_epi32(isum, _mm_sll_epi32(sx, _mm_cvtsi32_si128(sh)));
        const __m128 dx = step == 1 ? _mm_loadu_ps(dxp + b)
                                    : _mm_setr_ps(dxp[b * step], dxp[(b + 1) * step],
                                                  dxp[(b + 2) * step], dxp[(b + 3) * step]);
        const __m128 p = _mm_mul_ps(_mm_mul_ps(dx, f16x4(w, bsize)), _mm_cvtepi32_ps(isum));
        __m128 pm = _mm_setzero_ps();
        if (has_min)
            pm = _mm_mul_ps(_mm_mul_ps(dx, f16x4(w + 2, bsize)), _mm_cvtepi32_ps(sx));
        acc = _mm_add_ss(acc, p);
        if (has_min)
            acc = _mm_add_ss(acc, pm);
        acc = _mm_add_ss(acc, _mm_shuffle_ps(p, p, 1));
        if (has_min)
            acc = _mm_add_ss(acc, _mm_shuffle_ps(pm, pm, 1));
        acc = _mm_add_ss(acc, _mm_shuffle_ps(p, p, 2));
        if (has_min)
            acc = _mm_add_ss(acc, _mm_shuffle_ps(pm, pm, 2));
        acc = _mm_add_ss(acc, _mm_shuffle_ps(p, p, 3));
        if (has_min)
            acc = _mm_add_ss(acc, _mm_shuffle_ps(pm, pm, 3));
        w += 4 * bsize;
    }
    for (; b < nb; b++, w += bsize) {
        const __m256i q = legacy_quants(w, type);
        const __m256i qa = type == CLLM_DTYPE_Q8_0 ? _mm256_abs_epi8(q) : q;
        const int32_t sx = sxp[b * step];
        const int32_t isum =
            hsum_epi32(legacy_lanes(q, qa, x + b * CLLM_QK, type)) - (sh ? sx * (1 << sh) : 0);
        const __m128 dx = _mm_set_ss(dxp[b * step]);
        acc = _mm_add_ss(acc, _mm_mul_ss(_mm_mul_ss(dx, _mm_set_ss(f16_at(w))),
                                         _mm_cvtsi32_ss(_mm_setzero_ps(), isum)));
        if (has_min)
            acc = _mm_add_ss(acc, _mm_mul_ss(_mm_mul_ss(dx, _mm_set_ss(f16_at(w + 2))),
                                             _mm_cvtsi32_ss(_mm_setzero_ps(), sx)));
    }
    y[0] = _mm_cvtss_f32(acc);
}

/*
 * Per block: isum = q . x (Q8_0 signed; others unsigned q, minus off * xsum), then
 * acc += (dx * d) * isum (+ (dx * m) * xsum for Q4_1/Q5_1). Bounds: maddubs pairs <= 2 * 128 *
 * 127 = 32512 (Q8_0 via |w| and sign-moved x), so no saturation; block sums < 2^17.
 */
INLINE void legacy_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                        int64_t ldy, const enum cllm_dtype type, int nt, const int NT)
{
    if (NT == 1) {
        if (tk->step == 1)
            legacy_row1(w, nb, tk, y, type, 1);
        else
            legacy_row1(w, nb, tk, y, type, TILE);
        return;
    }
    const size_t bsize = legacy_size(type);
    const int has_min = type == CLLM_DTYPE_Q4_1 || type == CLLM_DTYPE_Q5_1;
    const int sh = legacy_offset_shift(type);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        const __m256i q = legacy_quants(w, type);
        const __m256i qa = type == CLLM_DTYPE_Q8_0 ? _mm256_abs_epi8(q) : q;
        __m256i v[TILE];
        UNROLL
        for (int t = 0; t < TILE; t++)
            v[t] = _mm256_setzero_si256();
        UNROLL
        for (int t = 0; t < NT; t++)
            v[t] = legacy_lanes(q, qa, tk->qs[t] + b * CLLM_QK, type);
        __m256i isum = tile_hsum(v, NT);
        const __m256 dx = tile_d(tk, b, NT);
        const __m256i sx = sh || has_min ? tile_sums(tk, b, NT) : _mm256_setzero_si256();
        if (sh)
            isum = _mm256_sub_epi32(isum, _mm256_sll_epi32(sx, _mm_cvtsi32_si128(sh)));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(f16_at(w))),
                                               _mm256_cvtepi32_ps(isum)));
        if (has_min)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(f16_at(w + 2))),
                                                   _mm256_cvtepi32_ps(sx)));
    }
    store_tile(acc, nt, y, ldy);
}

#define LEGACY_KERNEL(name, type)                                                                  \
    static void name(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,   \
                     int64_t ldy)                                                                  \
    {                                                                                              \
        struct cllm_act_tile tk;                                                                   \
        cllm_act_tile_init(&tk, a, nt);                                                            \
        TILE_DISPATCH(legacy_tile, w, K / CLLM_QK, &tk, y, ldy, type);                             \
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

/*
 * R weight rows times T tokens in registers: R * T accumulators of eight lanes each, dot_ref.c's
 * dot_float order with FMA. Each 8-element step loads R weight vectors and T activation
 * vectors for R * T FMAs, so the loads no longer outnumber the FMAs (one row against four
 * tokens loaded 10 vectors per 8 FMAs and ran at ~40% of the FMA peak). Every output's
 * arithmetic is the same whatever R and T are.
 */
INLINE void float_micro(const uint8_t *w, size_t row_bytes, int64_t K, const float *const *x,
                        float *y, int64_t ldy, const enum cllm_dtype type, const int R, const int T)
{
    __m256 acc[8][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        if (T == 1) { /* one token: load each row's vector just before its FMA */
            const __m256 xv = _mm256_loadu_ps(x[0] + i);
            UNROLL
            for (int r = 0; r < R; r++)
                acc[r][0] = _mm256_fmadd_ps(load8f(w + (size_t)r * row_bytes, i, type), xv,
                                            acc[r][0]);
        } else {
            __m256 wv[8];
            UNROLL
            for (int r = 0; r < R; r++)
                wv[r] = load8f(w + (size_t)r * row_bytes, i, type);
            UNROLL
            for (int t = 0; t < T; t++) {
                const __m256 xv = _mm256_loadu_ps(x[t] + i);
                UNROLL
                for (int r = 0; r < R; r++)
                    acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
    }
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++) {
            const __m256 v = acc[r][t];
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* [h0 + h2, h1 + h3] */
            __m128 s = _mm_add_ss(p, _mm_movehdup_ps(p));
            const uint8_t *wr = w + (size_t)r * row_bytes;
            for (int64_t k = i; k < K; k++)
                s = _mm_fmadd_ss(_mm_set_ss(load1f(wr, k, type)), _mm_set_ss(x[t][k]), s);
            y[t * ldy + r] = _mm_cvtss_f32(s);
        }
}

/* nr rows against T tokens: blocks of R rows (R * T <= 12 accumulators plus R weight vectors
 * fit the 16 registers), then single rows. */
INLINE void float_rows(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                       const float *const *x, float *y, int64_t ldy, const enum cllm_dtype type,
                       const int R, const int T)
{
    int64_t r = 0;
    for (; r + R <= nr; r += R)
        float_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, type, R, T);
    for (; r < nr; r++)
        float_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, type, 1, T);
}

/* Tokens four at a time: four or three tokens take three rows a block, two take four, one takes
 * eight (a lone token's FMAs need independent accumulators to hide their latency). */
INLINE void float_block(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                        const struct cllm_act_view *a, int nt, float *y, int64_t ldy,
                        const enum cllm_dtype type)
{
    for (int t0 = 0; t0 < nt; t0 += 4) {
        const float *x[4];
        const int n = nt - t0 < 4 ? nt - t0 : 4;
        for (int t = 0; t < n; t++)
            x[t] = (const float *)(const void *)(a->base + (size_t)(t0 + t) * a->stride);
        float *yt = y + t0 * ldy;
        switch (n) {
        case 1:
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 8, 1);
            break;
        case 2:
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 4, 2);
            break;
        case 3:
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 3, 3);
            break;
        default:
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 3, 4);
            break;
        }
    }
}

#define FLOAT_KERNEL(name, type)                                                                   \
    static void name(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,                   \
                     const struct cllm_act_view *a, int nt, float *y, int64_t ldy)                 \
    {                                                                                              \
        float_block(w, row_bytes, nr, K, a, nt, y, ldy, type);                                     \
    }
FLOAT_KERNEL(dot_f32, CLLM_DTYPE_F32)
FLOAT_KERNEL(dot_f16, CLLM_DTYPE_F16)
FLOAT_KERNEL(dot_bf16, CLLM_DTYPE_BF16)

static const struct cllm_matmul_kernels avx2_kernels = {
    .isa = "avx2",
    .quant = {[CLLM_ACT_Q8_0] = quant_q8_0, [CLLM_ACT_Q8_K] = quant_q8_k},
    .dot =
        {
            [CLLM_DTYPE_Q8_0] = dot_q8_0,
            [CLLM_DTYPE_Q4_0] = dot_q4_0, [CLLM_DTYPE_Q4_1] = dot_q4_1,
            [CLLM_DTYPE_Q5_0] = dot_q5_0, [CLLM_DTYPE_Q5_1] = dot_q5_1,
            [CLLM_DTYPE_Q4_K] = dot_q4_k, [CLLM_DTYPE_Q5_K] = dot_q5_k,
            [CLLM_DTYPE_Q6_K] = dot_q6_k,
        },
    .dot_rows = {[CLLM_DTYPE_F32] = dot_f32,
                 [CLLM_DTYPE_F16] = dot_f16,
                 [CLLM_DTYPE_BF16] = dot_bf16},
};

const struct cllm_matmul_kernels *cllm_matmul_kernels_avx2(void)
{
    return &avx2_kernels;
}
