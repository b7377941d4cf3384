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

/* Weight elements [i, i + 16) of a row as F32, elements at or past `valid` read as zeros (and
 * not read at all: a row may end at the end of its mapping). */
INLINE __m512 load16f(const uint8_t *w, int64_t i, const enum cllm_dtype type, __mmask16 valid)
{
    switch (type) {
    case CLLM_DTYPE_F32:
        return _mm512_maskz_loadu_ps(valid, (const float *)(const void *)w + i);
    case CLLM_DTYPE_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w + 2 * i));
    default: /* BF16: the upper half of an F32 */
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, w + 2 * i)), 16));
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
 * R weight rows times T tokens: R * T accumulators of 16 lanes. Lane l of an output adds, step
 * by step, element 16s + l's product (FMA); the last step's missing elements are zeros in both
 * operands (masked loads), which leave the sums as they are; the 16 lanes are then summed by one
 * fixed tree. Every output's arithmetic is the same whatever R and T are, so results do not
 * depend on the batch.
 */
INLINE void float_micro(const uint8_t *w, size_t row_bytes, int64_t K, const float *const *x,
                        float *y, int64_t ldy, const enum cllm_dtype type, const int R, const int T,
                        const bool fetch)
{
    const size_t esize = type == CLLM_DTYPE_F32 ? 4 : 2;
    __m512 acc[8][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
    for (int t = 0; t < T; t++)
        acc[r][t] = _mm512_setzero_ps();
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
    k->attend = cllm_attend_avx512f;
    k->silu_mul = cllm_silu_mul_avx512f;
}
