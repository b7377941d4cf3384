/*
 * Pieces shared by the kernels of dot_avx2.c and dot_avx512vnni.c (both compiled with at least
 * the AVX2 flags; include only from such files): the tile of up to CLLM_MM_TILE tokens a
 * quantized kernel works on, its per-token reductions, a K-quant block's float part and the
 * stores.
 */
#ifndef CLLM_BACKEND_CPU_TILE_AVX2_H
#define CLLM_BACKEND_CPU_TILE_AVX2_H

#include <immintrin.h>
#include <string.h>

#include "backend/cpu/quant_dot.h"
#include "tensor/quant.h"

#define TILE CLLM_MM_TILE
#define INLINE static inline __attribute__((always_inline))
/* Per-token arrays must become registers: unroll the short constant loops fully. */
#define UNROLL _Pragma("GCC unroll 8")
/* Keeps an accumulator in its register at this point: without it GCC re-associates the integer
 * sums of a block into a tree whose intermediate products do not fit the 16 registers. */
#define PIN(v) __asm__("" : "+x"(v))

/* The n (4 or 8) f16 at p, p + stride, ..., as the low int16 lanes (the rest zero), to be
 * widened by the caller. Built in registers: a vector load of n 2-byte stores would stall on
 * store forwarding. */
INLINE __m128i f16_gather(const uint8_t *p, size_t stride, const int n)
{
    uint16_t h[8] = {0};
    UNROLL
    for (int i = 0; i < n; i++)
        memcpy(&h[i], p + i * stride, 2);
    return _mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4],
                          (short)h[5], (short)h[6], (short)h[7]);
}

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

INLINE void store_tile(__m256 acc, int nt, float *y, int64_t ldy)
{
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int t = 0; t < nt; t++)
        y[t * ldy] = v[t];
}

/* A row's results: the tile's acc, or one token's (NT = 1) in the first lane of acc1. */
INLINE void store_results(__m256 acc, __m128 acc1, int nt, float *y, int64_t ldy, const int NT)
{
    if (NT == 1)
        y[0] = _mm_cvtss_f32(acc1);
    else
        store_tile(acc, nt, y, ldy);
}

INLINE float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Weights streamed from memory (a tile's first pass over a row chunk in a call of several
 * tokens): ask for the bytes PREFETCH_AHEAD past the block early. A lone token's rows do not
 * since session 34: one sequential stream, which the hardware prefetchers follow; asking ran
 * K-quants 10% and Q8_0 1.2x slower on 1 thread of a Zen 4, and 0-3% on 2. */
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

/*
 * A Q4_K / Q5_K block's 12 scale bytes at s as 16 bytes: the 8 six-bit scales, then the 8
 * six-bit minimums (quant_dot.h's cllm_k_scales_unpack, in registers: bytes written and read
 * back would stall on store forwarding in every block). Reads 16 bytes at s: a block's quants
 * follow its scales.
 */
INLINE __m128i k_scales_vec(const uint8_t *s)
{
    /* words a, b, c of s; v = [a & 3f.., (c & 0f..) | ((a >> 2) & 30..), b & 3f..,
     * ((c >> 4) & 0f..) | ((b >> 2) & 30..)] as in cllm_k_scales_unpack */
    const __m128i x = _mm_loadu_si128((const __m128i *)(const void *)s);
    const __m128i acbc = _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 1, 2, 0));
    const __m128i aabb = _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i lo =
        _mm_and_si128(_mm_srlv_epi32(acbc, _mm_setr_epi32(0, 0, 0, 4)),
                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi =
        _mm_and_si128(_mm_srli_epi32(aabb, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/*
 * The float part of K-quant block b for the tile, in the scalar kernels' order (quant_dot.h):
 * acc += (dx * d) * isum, and for Q4_K / Q5_K (mins: the 6-bit minimum of each group of 16's
 * sub-block, as int16) acc -= (dx * dmin) * msum, msum the token's group sums times those.
 * isum is the sum of each token's 8 int32 lanes (lanes[] is overwritten). One token (NT = 1)
 * adds to the first lane of acc1 instead.
 */
INLINE void k_block_float(const struct cllm_act_tile *tk, int64_t b, float d, float dmin,
                          const int with_min, __m256i mins, __m256i *lanes, __m256 *acc,
                          __m128 *acc1, const int NT)
{
    if (NT == 1 && !with_min) {
        const __m128 p = _mm_mul_ss(_mm_mul_ss(_mm_set_ss(tk->d[b * tk->step]), _mm_set_ss(d)),
                                    _mm_cvtsi32_ss(_mm_setzero_ps(), hsum_epi32(lanes[0])));
        *acc1 = _mm_add_ss(*acc1, p);
        return;
    }
    if (NT == 1) {
        /* [isum, msum] in one reduction; then acc += (dx*d)*isum, acc -= (dx*dmin)*msum */
        const __m256i ms = _mm256_madd_epi16(loadu256(tk->sums + b * tk->step * 16), mins);
        const __m256i h = _mm256_hadd_epi32(lanes[0], ms);
        __m128i r = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        r = _mm_hadd_epi32(r, r);
        const __m128 p =
            _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(tk->d[b * tk->step]), _mm_setr_ps(d, dmin, d, dmin)),
                       _mm_cvtepi32_ps(r));
        *acc1 = _mm_add_ss(*acc1, p);
        *acc1 = _mm_sub_ss(*acc1, _mm_movehdup_ps(p));
        return;
    }
    const __m256 isum = _mm256_cvtepi32_ps(tile_hsum(lanes, NT));
    const __m256 dx = tile_d(tk, b, NT);
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(d)), isum));
    if (!with_min)
        return;
    UNROLL
    for (int t = 0; t < NT; t++)
        lanes[t] = _mm256_madd_epi16(loadu256(tk->sums + (b * TILE + t) * 16), mins);
    const __m256 ms = _mm256_cvtepi32_ps(tile_hsum(lanes, NT));
    *acc = _mm256_sub_ps(*acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(dmin)), ms));
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

/* A quantized-weight kernel (cllm_dot_fn) that runs tile(w, K / block, tile, y, ldy,
 * variant, nt, NT) on the call's tokens (block: the weight's block size). */
#define QUANT_KERNEL(name, tile, block, variant)                                                   \
    static void name(const void *w, int64_t K, const struct cllm_act_view *a, int nt, float *y,    \
                     int64_t ldy)                                                                  \
    {                                                                                              \
        struct cllm_act_tile tk;                                                                   \
        cllm_act_tile_init(&tk, a, nt);                                                            \
        TILE_DISPATCH(tile, w, K / (block), &tk, y, ldy, variant);                                 \
    }

/* dot_q4_k, dot_q5_k and dot_q6_k from a file's tile functions: q45k (variant: 1 for Q5_K)
 * and q6k (variant unused). */
#define K_QUANT_KERNELS(q45k, q6k)                                                                 \
    QUANT_KERNEL(dot_q4_k, q45k, CLLM_QK_K, 0)                                                     \
    QUANT_KERNEL(dot_q5_k, q45k, CLLM_QK_K, 1)                                                     \
    QUANT_KERNEL(dot_q6_k, q6k, CLLM_QK_K, 0)

#endif
