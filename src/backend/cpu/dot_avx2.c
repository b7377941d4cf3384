/*
 * AVX2 + FMA + F16C matmul kernels (compiled with -mavx2 -mfma -mf16c; called only after a
 * run-time CPU check). Integer dot products use vpmaddubsw (unsigned weight bytes times signed
 * activation bytes, pairs summed to int16) and vpmaddwd (pairs to int32, times sub-block scales);
 * every partial sum fits its lane (bounds beside each kernel). A weight block is decoded once for
 * up to eight tokens; per block, their int32 lanes are reduced with one vphaddd tree and the
 * float part is done for all of them in one vector, in exactly the scalar kernels' order
 * (quant_dot.h), so results equal dot_ref.c's bit for bit. One token (decode) has its own leaner
 * paths with the same arithmetic. Float weights use FMA (not bit-equal to scalar), several rows
 * and tokens per pass. The tile's reductions and the legacy blocks' kernels are shared with
 * dot_avx512vnni.c (tile_avx2.h, legacy_avx2.h).
 *
 * This file is compiled twice: as the AVX2 family, and with -mavxvnni on top as the AVX-VNNI
 * family (dot_avxvnni.c; CPUs with 256-bit VNNI and no AVX-512: Intel's client cores since
 * Alder Lake, its E-core Xeons). There vpdpwssd adds the int16 pairs' products to an int32
 * accumulator in one instruction where AVX2 needs vpmaddwd and vpaddd, and a legacy block's
 * products are one vpdpbusd instead of vpmaddubsw and vpmaddwd by ones. The integers are the
 * same (no vpmaddubsw here saturates, no vpmaddwd overflows: bounds beside each kernel), so the
 * two families give the same bits.
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/quant_dot.h"
#include "backend/cpu/tile_avx2.h"
#include "core/f16.h"
#include "tensor/quant.h"

#ifdef __AVXVNNI__
#define FAMILY(name) name##_avxvnni
#define FAMILY_ISA "avxvnni"
#else
#define FAMILY(name) name##_avx2
#define FAMILY_ISA "avx2"
#endif

/* acc + the int16 pairs' products a * b, summed in pairs: vpmaddwd and vpaddd, or vpdpwssd. */
INLINE __m256i madd_acc(__m256i acc, __m256i a, __m256i b)
{
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

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

/* --- shared pieces (more in tile_avx2.h) --- */

/* An int16 shuffle control that broadcasts int16 element j of each 128-bit lane. */
INLINE __m256i bcast16_ctl(int j)
{
    return _mm256_set1_epi16((short)(0x0100 + 0x0202 * j));
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
                      int64_t ldy, const int q5, int nt, const int NT)
{
    const size_t bsize = q5 ? sizeof(struct cllm_block_q5_k) : sizeof(struct cllm_block_q4_k);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bsize) {
        if (tk->weights_cold)
            prefetch_block(w, bsize);
        const __m128i scm = k_scales_vec(w + 4); /* sc[0..8), then m[0..8) */
        const uint8_t *qhp = w + 4 + CLLM_K_SCALE_SIZE;
        const uint8_t *qs = qhp + (q5 ? CLLM_QK_K / 8 : 0);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));
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
                sumi[t] = madd_acc(sumi[t], _mm256_maddubs_epi16(lo, loadu256(x)), s_lo);
                PIN(sumi[t]);
                sumi[t] = madd_acc(sumi[t], _mm256_maddubs_epi16(hi, loadu256(x + 32)), s_hi);
                PIN(sumi[t]);
            }
        }
        k_block_float(tk, b, f16_at(w), f16_at(w + 2), 1, mins, sumi, &acc, &acc1, NT);
    }
    store_results(acc, acc1, nt, y, ldy, NT);
}

/* --- Q6_K --- */

/*
 * Bounds: q <= 63: maddubs pairs <= 2 * 63 * 127 = 16002; times |sc| <= 128 over 256 elements:
 * |q . x| <= 256 * 63 * 127 * 128 < 2^28. The offset term 32 * sum_j sc[j] * xsum[j] is at most
 * 32 * 16 * 128 * 2032 < 2^28, so every partial isum stays inside int32.
 */
INLINE void q6k_tile(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, float *y,
                     int64_t ldy, const int unused, int nt, const int NT)
{
    (void)unused;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += sizeof(struct cllm_block_q6_k)) {
        if (tk->weights_cold)
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
                    sumi[t] = madd_acc(sumi[t], _mm256_maddubs_epi16(q, x), s);
                    PIN(sumi[t]);
                }
            }
        }
        k_block_float(tk, b, f16_at(w + CLLM_QK_K / 2 + CLLM_QK_K / 4 + CLLM_QK_K / 16), 0.0f, 0,
                      _mm256_setzero_si256(), sumi, &acc, &acc1, NT);
    }
    store_results(acc, acc1, nt, y, ldy, NT);
}

K_QUANT_KERNELS(q45k_tile, q6k_tile)

/* --- legacy 32-blocks (legacy_avx2.h, with these three) --- */

/* The weight vector legacy_lanes takes besides the quants: |q| for Q8_0 (signed), else q. */
INLINE __m256i legacy_prep(__m256i q, const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q8_0 ? _mm256_abs_epi8(q) : q;
}

/* 8 int32 lanes summing to q . x (before the offset correction). qa = |q| for Q8_0, else q.
 * Bounds: maddubs pairs <= 2 * 128 * 127 = 32512 (Q8_0 via |w| and sign-moved x), so no
 * saturation; block sums < 2^17. */
INLINE __m256i legacy_lanes(__m256i q, __m256i qa, const int8_t *xp, const enum cllm_dtype type)
{
    __m256i x = loadu256(xp);
    if (type == CLLM_DTYPE_Q8_0)
        x = _mm256_sign_epi8(x, q);
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qa, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(qa, x), _mm256_set1_epi16(1));
#endif
}

/* Shift that turns a block's activation sum into the offset term (8 * sx, 16 * sx); 0: none. */
INLINE int legacy_offset_shift(const enum cllm_dtype type)
{
    return type == CLLM_DTYPE_Q4_0 ? 3 : type == CLLM_DTYPE_Q5_0 ? 4 : 0;
}

#include "backend/cpu/legacy_avx2.h"

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
                        float *y, int64_t ldy, const enum cllm_dtype type, const int R, const int T,
                        const bool fetch)
{
    const size_t esize = type == CLLM_DTYPE_F32 ? 4 : 2;
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
            if (fetch && (i * esize) % 64 == 0) { /* the next block's rows: a line each */
                UNROLL
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(w + (size_t)(r + R) * row_bytes) + i * esize,
                                 _MM_HINT_T0);
            }
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

/* R * T <= 12 accumulators plus R weight vectors fit the 16 registers. */
#include "backend/cpu/float_rows.h"

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
        /* the first group asks for the next row block early (dot_avx512.c's BF16 kernel
         * spreads that over every group's pass; these, slower, ran 1536 x 17920 streamed from
         * memory within 3% of 1536 x 4096 in the L3 on a Zen 4, 32 tokens: little to gain) */
        const bool fetch = t0 == 0 && a->weights_cold;
        switch (n) {
        case 1:
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 8, 1, false);
            break;
        case 2:
            float_rows_fetch(w, row_bytes, nr, K, x, yt, ldy, type, 4, 2, fetch);
            break;
        case 3:
            float_rows_fetch(w, row_bytes, nr, K, x, yt, ldy, type, 3, 3, fetch);
            break;
        default:
            float_rows_fetch(w, row_bytes, nr, K, x, yt, ldy, type, 3, 4, fetch);
            break;
        }
    }
}

FLOAT_KERNEL(dot_f32, CLLM_DTYPE_F32)
FLOAT_KERNEL(dot_f16, CLLM_DTYPE_F16)
FLOAT_KERNEL(dot_bf16, CLLM_DTYPE_BF16)

static const struct cllm_matmul_kernels family_kernels = {
    .isa = FAMILY_ISA,
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
    .dot_x16 = {[CLLM_DTYPE_Q4_K] = FAMILY(cllm_dot_q4_k_x16)},
    .attend = cllm_attend_avx2,
    .silu_mul = cllm_silu_mul_avx2,
};

const struct cllm_matmul_kernels *FAMILY(cllm_matmul_kernels)(void)
{
    return &family_kernels;
}
