/*
 * The legacy 32-block kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: dot_q8_0 ... dot_q5_1), written once
 * for dot_avx2.c and dot_avx512vnni.c, which include this after defining how a block's
 * integer products are made:
 *   __m256i legacy_prep(__m256i q, type)          a weight vector shared by the tile's tokens
 *   __m256i legacy_lanes(q, prepared, x, type)    8 int32 lanes summing to q . x + (xsum << s)
 *   int legacy_offset_shift(type)                 that s (0: none)
 * Per block: isum = lanes - (xsum << s), then acc += (dx * d) * isum (+ (dx * m) * xsum for
 * Q4_1/Q5_1) in the scalar kernels' order, so results equal dot_ref.c's bit for bit.
 */
#ifndef CLLM_BACKEND_CPU_LEGACY_AVX2_H
#define CLLM_BACKEND_CPU_LEGACY_AVX2_H

#include "backend/cpu/tile_avx2.h"
#include "tensor/quant.h"

/* Block b's activation sums (one per block: Q8_0-style) of the tile's token slots. */
INLINE __m256i tile_sums(const struct cllm_act_tile *tk, int64_t b, const int NT)
{
    const int16_t *p = tk->sums + b * TILE;
    if (NT <= 4)
        return _mm256_zextsi128_si256(
            _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)));
    return _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* 32 bytes, byte j = 0x10 if bit j of the little-endian u32 at p is set, else 0. */
INLINE __m256i q5_high_bits(const uint8_t *p)
{
    /* a broadcast straight from memory (vbroadcastss) keeps the chain short */
    const __m256i all = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)p));
    const __m256i spread =
        _mm256_shuffle_epi8(all, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                                  2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
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

/* The f16 at p, p + stride, p + 2 stride, p + 3 stride, widened. */
INLINE __m128 f16x4(const uint8_t *p, size_t stride)
{
    return _mm_cvtph_ps(f16_gather(p, stride, 4));
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
        __m256i v[4];
        UNROLL
        for (int i = 0; i < 4; i++) {
            const __m256i q = legacy_quants(w + i * bsize, type);
            const __m256i qa = legacy_prep(q, type);
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
        const __m256i qa = legacy_prep(q, type);
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
 * acc += (dx * d) * isum (+ (dx * m) * xsum for Q4_1/Q5_1); the lanes' bounds are beside
 * each legacy_lanes.
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
        if (tk->weights_cold)
            prefetch_block(w, bsize);
        const __m256i q = legacy_quants(w, type);
        const __m256i qa = legacy_prep(q, type);
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

QUANT_KERNEL(dot_q8_0, legacy_tile, CLLM_QK, CLLM_DTYPE_Q8_0)
QUANT_KERNEL(dot_q4_0, legacy_tile, CLLM_QK, CLLM_DTYPE_Q4_0)
QUANT_KERNEL(dot_q4_1, legacy_tile, CLLM_QK, CLLM_DTYPE_Q4_1)
QUANT_KERNEL(dot_q5_0, legacy_tile, CLLM_QK, CLLM_DTYPE_Q5_0)
QUANT_KERNEL(dot_q5_1, legacy_tile, CLLM_QK, CLLM_DTYPE_Q5_1)

#endif
