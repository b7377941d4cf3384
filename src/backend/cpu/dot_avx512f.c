/*
 * AVX-512 F kernels for float weights (F32, F16, BF16) with F32 activations (compiled with
 * -mavx512f -mavx512bw -mavx512vl on top of dot_avx2.c's flags; called only after a run-time
 * CPU check). The same arithmetic as dot_avx2.c's float kernels, in 16 lanes rather than 8:
 * on server cores with two 512-bit FMA units (Intel Xeon Skylake-SP to Ice Lake, which have
 * AVX-512 but not its BF16 extension) that is twice the FMAs a cycle, and a BF16 model on the
 * CPU multiplies its weights here. The drivers over rows and tokens are dot_avx2.c's
 * (float_rows.h). On a Zen 4, whose FMA units are 256 bits wide, each 512-bit
 * FMA takes both: the same peak as AVX2, in half the instructions. The AVX-512 BF16 family
 * replaces the BF16 kernel with vdpbf16ps (dot_avx512.c); quantized weights keep their own
 * families' kernels.
 *
 * BF16 weights are widened without a shuffle: 64 bytes of a row are 16 words of two BF16
 * each, whose low halves shifted up (vpslld) are the even elements as F32 and whose high
 * halves masked (vpandd) the odd ones, one instruction per 16 weights where vpmovzxwd +
 * vpslld cost two, on the ports the FMAs use. The activations come to match: the driver
 * stores each token's row once per call with each 32-element chunk's even elements before its
 * odd ones (to_pairs, CLLM_ACT_F32_PAIRS). On an Emerald Rapids core that ran the FFN's BF16
 * shapes 1.2x faster (a scratch harness, session 43; docs/measured.md).
 */
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend/cpu/quant_dot.h"

#define INLINE static inline __attribute__((always_inline))
/* Per-row and per-token arrays must become registers: unroll the short constant loops fully. */
#define UNROLL _Pragma("GCC unroll 8")

/* Elements per step: one 512-bit vector of F32. */
#define STEP 16

/* F32 or F16 weight elements [i, i + 16) of a row as F32, elements at or past `valid` read as
 * zeros (and not read at all: a row may end at the end of its mapping). BF16 rows take
 * bf16_pairs_micro (below). */
INLINE __m512 load16f(const uint8_t *w, int64_t i, const enum cllm_dtype type, __mmask16 valid)
{
    if (type == CLLM_DTYPE_F32)
        return _mm512_maskz_loadu_ps(valid, (const float *)(const void *)w + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w + 2 * i));
}

/* cllm_to_pairs_fn: a token's F32 row as even/odd chunks, zero-padded. */
static void to_pairs(const float *x, int64_t K, float *out)
{
    const int64_t chunk = CLLM_BF16_ACT_ALIGN, half = chunk / 2;
    for (int64_t c = 0; c < K; c += chunk)
        for (int64_t i = 0; i < half; i++) {
            out[c + i] = c + 2 * i < K ? x[c + 2 * i] : 0.0f;
            out[c + half + i] = c + 2 * i + 1 < K ? x[c + 2 * i + 1] : 0.0f;
        }
}

/* One step: acc[r][t] gains weight vector wv[r] times token t's activations at element i. */
INLINE void float_step(__m512 acc[8][4], const __m512 *wv, const float *const *x, int64_t i,
                       __mmask16 valid, const int R, const int T)
{
    UNROLL
    for (int t = 0; t < T; t++) {
        const __m512 xv = _mm512_maskz_loadu_ps(valid, x[t] + i);
        UNROLL
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
}

/*
 * BF16 rows against F32 pair rows (to_pairs), R rows times T tokens into acc: per 32-element
 * chunk, lane l adds element 2l's product, then element 2l + 1's (FMA); the last chunk's
 * missing weights are zeros (masked loads, nothing read past the row) against the pair rows'
 * zero padding, which leave the sums as they are.
 */
INLINE void bf16_pairs_micro(const uint8_t *w, size_t row_bytes, int64_t K, const float *const *x,
                             __m512 acc[8][4], const int R, const int T, const bool fetch)
{
    const int64_t chunk = CLLM_BF16_ACT_ALIGN;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t i = 0; i < K; i += chunk) {
        const __mmask32 valid = K - i >= chunk ? ~(__mmask32)0 : ((__mmask32)1 << (K - i)) - 1u;
        __m512i words[8];
        UNROLL
        for (int r = 0; r < R; r++) {
            words[r] = _mm512_maskz_loadu_epi16(valid, w + (size_t)r * row_bytes + 2 * i);
            if (fetch) /* the next block's rows, a line a step */
                _mm_prefetch((const char *)(w + (size_t)(r + R) * row_bytes) + 2 * i, _MM_HINT_T0);
        }
        __m512 wv[8];
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(words[r], 16));
        float_step(acc, wv, x, i, 0xffff, R, T);
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = _mm512_castsi512_ps(_mm512_and_si512(words[r], high));
        float_step(acc, wv, x, i + chunk / 2, 0xffff, R, T);
    }
}

/* F32 or F16 rows against F32 rows, R times T into acc: lane l adds, step by step, element
 * 16s + l's product (FMA); the last step's missing elements are zeros in both operands (masked
 * loads). */
INLINE void wide_micro(const uint8_t *w, size_t row_bytes, int64_t K, const float *const *x,
                       __m512 acc[8][4], const enum cllm_dtype type, const int R, const int T,
                       const bool fetch)
{
    const size_t esize = type == CLLM_DTYPE_F32 ? 4 : 2;
    __m512 wv[8];
    int64_t i = 0;
    for (; i + STEP <= K; i += STEP) {
        UNROLL
        for (int r = 0; r < R; r++) {
            wv[r] = load16f(w + (size_t)r * row_bytes, i, type, 0xffff);
            /* the next block's rows, a line a step (F32: every step; 16-bit: every other) */
            if (fetch && (i * esize) % 64 == 0)
                _mm_prefetch((const char *)(w + (size_t)(r + R) * row_bytes) + i * esize,
                             _MM_HINT_T0);
        }
        float_step(acc, wv, x, i, 0xffff, R, T);
    }
    if (i < K) {
        const __mmask16 m = (__mmask16)((1u << (K - i)) - 1u);
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = load16f(w + (size_t)r * row_bytes, i, type, m);
        float_step(acc, wv, x, i, m, R, T);
    }
}

/*
 * R weight rows times T tokens: R * T accumulators of 16 lanes, filled by one of the above, then
 * each output's 16 lanes summed by one fixed tree. Every output's arithmetic is the same
 * whatever R and T are, so results do not depend on the batch.
 */
INLINE void float_micro(const uint8_t *w, size_t row_bytes, int64_t K, const float *const *x,
                        float *y, int64_t ldy, const enum cllm_dtype type, const int R, const int T,
                        const bool fetch)
{
    __m512 acc[8][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
    for (int t = 0; t < T; t++)
        acc[r][t] = _mm512_setzero_ps();
    if (type == CLLM_DTYPE_BF16)
        bf16_pairs_micro(w, row_bytes, K, x, acc, R, T, fetch);
    else
        wide_micro(w, row_bytes, K, x, acc, type, R, T, fetch);
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
    for (int t = 0; t < T; t++)
        y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#include "backend/cpu/float_rows.h"

/*
 * A tile's tokens in groups of 4, 2 and 1: four and two take six rows a block (24 accumulators,
 * 6 weight vectors and 1 activation vector of the 32 registers), one takes eight. Eight tokens a
 * pass, as the BF16 kernel (dot_avx512.c) takes them, ran at 0.6-0.7x of AVX2 on a Zen 4: their
 * F32 activations of K = 1536 (48 KiB) do not fit its 32 KiB L1, where BF16 ones do. Row blocks
 * of 6 and 8 divide matmul.c's row chunks (multiples of 12, and of 8 for a lone token).
 */
INLINE void float_block(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                        const struct cllm_act_view *a, int nt, float *y, int64_t ldy,
                        const enum cllm_dtype type)
{
    int t0 = 0;
    while (t0 < nt) {
        const float *x[4];
        const int left = nt - t0, n = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int t = 0; t < n; t++)
            x[t] = (const float *)(const void *)(a->base + (size_t)(t0 + t) * a->stride);
        /* the first group reads the rows from memory (weights_cold): it asks for the next row
         * block early; later groups find the rows in the caches */
        const bool fetch = t0 == 0 && a->weights_cold;
        float *yt = y + t0 * ldy;
        if (n == 4)
            float_rows_fetch(w, row_bytes, nr, K, x, yt, ldy, type, 6, 4, fetch);
        else if (n == 2)
            float_rows_fetch(w, row_bytes, nr, K, x, yt, ldy, type, 6, 2, fetch);
        else /* a lone token streams its rows at the memory's speed without help */
            float_rows(w, row_bytes, nr, K, x, yt, ldy, type, 8, 1, false);
        t0 += n;
    }
}

FLOAT_KERNEL(dot_f32, CLLM_DTYPE_F32)
FLOAT_KERNEL(dot_f16, CLLM_DTYPE_F16)
FLOAT_KERNEL(dot_bf16, CLLM_DTYPE_BF16)

void cllm_matmul_kernels_add_avx512(struct cllm_matmul_kernels *k)
{
    k->isa = "avx512";
    k->dot_rows[CLLM_DTYPE_F32] = dot_f32;
    k->dot_rows[CLLM_DTYPE_F16] = dot_f16;
    k->dot_rows[CLLM_DTYPE_BF16] = dot_bf16;
    k->to_pairs = to_pairs;
    k->attend = cllm_attend_avx512f;
    k->silu_mul = cllm_silu_mul_avx512f;
}
