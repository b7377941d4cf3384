/*
 * AVX-512 BF16 kernels for BF16 weights (compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512bf16 on top of dot_avx2.c's flags; called only after a run-time CPU check): the
 * activations are rounded to BF16 once per matmul (to_bf16, below) and each vdpbf16ps then
 * multiplies 32 weight and activation pairs into 16 float lanes: twice the products of an FMA
 * on F32, and no widening of the weights. This is what transformers does in BF16 (its GEMMs
 * take BF16 activations too); the AVX2 and scalar kernels keep F32 activations, so on a CPU
 * with this extension a BF16 model's logits move by about the activations' rounding
 * (~2^-9 of each) against those (tests/backend/test_matmul.c bounds both).
 * Every other weight type keeps dot_avx2.c's kernels.
 */
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend/cpu/quant_dot.h"

#define INLINE static inline __attribute__((always_inline))
/* Per-row and per-token arrays must become registers: unroll the short constant loops fully. */
#define UNROLL _Pragma("GCC unroll 8")

/* Elements per step: one 512-bit vector of BF16. */
#define STEP 32

_Static_assert(CLLM_BF16_ACT_ALIGN == STEP, "activation rows are padded to whole steps");

/*
 * x[0..K) rounded to BF16 (to nearest even, as vcvtne2ps2bf16 does: subnormal floats become
 * zero of their sign, NaN stays NaN), then zeros up to a multiple of STEP.
 */
static void to_bf16(const float *x, int64_t K, uint16_t *out)
{
    int64_t i = 0;
    for (; i + STEP <= K; i += STEP) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512((void *)(out + i), (__m512i)v);
    }
    if (i < K) {
        const int64_t n = K - i;
        const __mmask16 lo = (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u);
        const __mmask16 hi = (__mmask16)(n <= 16 ? 0u : (1u << (n - 16)) - 1u);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16),
                                               _mm512_maskz_loadu_ps(lo, x + i));
        _mm512_storeu_si512((void *)(out + i), (__m512i)v);
    }
}

INLINE __m512bh load_bh(const void *p)
{
    return (__m512bh)_mm512_loadu_si512(p);
}

/* One step: acc[r][t] gains the products of weight vector wv[r] and token t's activations at
 * element i. */
INLINE void bf16_step(__m512 acc[6][8], const __m512bh *wv, const uint16_t *const *x, int64_t i,
                      const int R, const int T)
{
    UNROLL
    for (int t = 0; t < T; t++) {
        const __m512bh xv = load_bh(x[t] + i);
        UNROLL
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
}

/*
 * The next block of rows, asked for into the caches while a block's micro calls compute: rows
 * rows from next, row_bytes apart. Every `every` steps (the number of calls a block) a call
 * asks for the line at offset `off` (in elements) in each of those rows and moves `off` on by
 * a step; the calls continue where the one before stopped, so each offset is asked for once,
 * in order, spread over all the block's calls (with one call: a line of each row a step, at
 * the offset it loads, one block ahead). Tried on a Zen 4 (session 37): the block's bytes in
 * address order, a line or more a step, cost 8-token calls ~10%; the calls taking every
 * `every`-th offset in turn (strided) left 32-token calls no faster than token groups outer.
 */
struct fetch_cursor {
    const char *next;
    size_t row_bytes;
    int64_t off;
    int rows, every;
};

/*
 * R weight rows times T tokens: R * T accumulators of 16 lanes. Lane l of an output adds, step
 * by step, the pair (2l, 2l + 1) of each 32 elements (vdpbf16ps: the odd product, then the even
 * one, each rounded); the last step's missing elements are zeros in both operands (masked
 * weight loads, padded activations); the 16 lanes are then summed by one fixed tree. Every
 * output's arithmetic is the same whatever R and T are, so results do not depend on the batch.
 * fc (may be NULL where fetch is false): the next block's lines this call asks for (above).
 */
INLINE void bf16_micro(const uint8_t *w, size_t row_bytes, int64_t K, const uint16_t *const *x,
                       float *y, int64_t ldy, const int R, const int T, const bool fetch,
                       struct fetch_cursor *fc)
{
    __m512 acc[6][8];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
    for (int t = 0; t < T; t++)
        acc[r][t] = _mm512_setzero_ps();
    const uint16_t *wr[6];
    UNROLL
    for (int r = 0; r < R; r++)
        wr[r] = (const uint16_t *)(const void *)(w + (size_t)r * row_bytes);
    const char *next = fetch ? fc->next : NULL;
    const size_t next_bytes = fetch ? fc->row_bytes : 0;
    const int next_rows = fetch ? fc->rows : 0, every = fetch ? fc->every : 0;
    int64_t off = fetch ? fc->off : 0;
    int wait = 0;
    int64_t i = 0;
    __m512bh wv[6];
    for (; i + STEP <= K; i += STEP) {
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = load_bh(wr[r] + i);
        if (fetch && --wait < 0) {
            if (off < K)
                for (int r = 0; r < next_rows; r++)
                    _mm_prefetch(next + (size_t)r * next_bytes + 2 * off, _MM_HINT_T0);
            off += STEP;
            wait = every - 1;
        }
        bf16_step(acc, wv, x, i, R, T);
    }
    if (fetch)
        fc->off = off;
    if (i < K) { /* a weight row may end anywhere: no load past its last element */
        const __mmask32 m = (__mmask32)((1ull << (K - i)) - 1u);
        UNROLL
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, wr[r] + i);
        bf16_step(acc, wv, x, i, R, T);
    }
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
    for (int t = 0; t < T; t++)
        y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* nr rows against T tokens: blocks of R rows, then single rows. */
INLINE void bf16_rows(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                      const uint16_t *const *x, float *y, int64_t ldy, const int R, const int T,
                      const bool fetch, struct fetch_cursor *fc)
{
    int64_t r = 0;
    for (; r + R <= nr; r += R)
        bf16_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, R, T, fetch, fc);
    for (; r < nr; r++)
        bf16_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, 1, T, false, NULL);
}

/* The size of the next group of tokens, `left` of them still to do: 8, 4, 2 or 1. */
static inline int group_tokens(int left)
{
    return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* Rows a micro call of a group of n tokens takes in a call of several tokens (a compile-time
 * constant in bf16_group's cases, which unroll on it). */
static inline int group_rows(int n)
{
    return n == 8 ? 3 : 6;
}

/* One group of n tokens (8, 4, 2 or 1) against nr rows, group_rows(n) rows a micro call. */
INLINE void bf16_group(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                       const uint16_t *const *x, float *y, int64_t ldy, int n, const bool fetch,
                       struct fetch_cursor *fc)
{
    switch (n) {
    case 8:
        bf16_rows(w, row_bytes, nr, K, x, y, ldy, group_rows(8), 8, fetch, fc);
        break;
    case 4:
        bf16_rows(w, row_bytes, nr, K, x, y, ldy, group_rows(4), 4, fetch, fc);
        break;
    case 2:
        bf16_rows(w, row_bytes, nr, K, x, y, ldy, group_rows(2), 2, fetch, fc);
        break;
    default:
        bf16_rows(w, row_bytes, nr, K, x, y, ldy, group_rows(1), 1, fetch, fc);
        break;
    }
}

/*
 * nr rows against nt tokens (token t's BF16 row at base + t * stride), rows outer: a block of
 * rows at a time against every group of the tokens (8, 4, 2, 1) while the block is in L1/L2,
 * the activations in L2. Eight tokens take three rows a micro call (24 accumulators, 3 weight
 * vectors and 1 activation vector of the 32 registers), fewer take six. Where the rows are not
 * in the caches yet (cold), the next block's bytes are asked for during the block's micro
 * calls, spread evenly over all of them, so the memory streams the weights while every group
 * computes. Token groups outer, as this kernel was before, streamed them during the first
 * group's pass alone, which then waited on the memory (41% of this kernel's time in decode
 * steps of 32 tokens, perf) while the other groups' passes left it idle.
 */
static void bf16_pass(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                      const uint8_t *base, size_t stride, int nt, float *y, int64_t ldy, bool cold)
{
    /* rows a block: what every group's rows a micro call divide (3 for eights, 6 for others) */
    const int block_rows = nt % 8 == 0 ? 3 : 6;
    int calls = 0; /* micro calls a block, over all groups */
    for (int left = nt; left > 0;) {
        const int n = group_tokens(left);
        calls += block_rows / group_rows(n);
        left -= n;
    }
    for (int64_t r0 = 0; r0 < nr; r0 += block_rows) {
        const int64_t rows = nr - r0 < block_rows ? nr - r0 : block_rows;
        const uint8_t *wb = w + (size_t)r0 * row_bytes;
        /* the next block, where it is a whole one of this call's */
        const bool ahead = cold && r0 + 2 * block_rows <= nr;
        struct fetch_cursor fc = {(const char *)wb + (size_t)block_rows * row_bytes, row_bytes, 0,
                                  block_rows, calls};
        for (int t0 = 0; t0 < nt;) {
            const uint16_t *x[CLLM_MM_TILE];
            const int n = group_tokens(nt - t0);
            for (int t = 0; t < n; t++)
                x[t] = (const uint16_t *)(const void *)(base + (size_t)(t0 + t) * stride);
            float *yt = y + t0 * ldy + r0;
            if (ahead)
                bf16_group(wb, row_bytes, rows, K, x, yt, ldy, n, true, &fc);
            else
                bf16_group(wb, row_bytes, rows, K, x, yt, ldy, n, false, NULL);
            t0 += n;
        }
    }
}

/* Activation bytes of one pass of dot_bf16: what stays in a 1 MiB L2 beside a block of rows. */
#define PASS_ACT_BYTES (640u << 10)

/*
 * A lone token takes four rows a micro call (its accumulators' latency hidden by the weights
 * streaming in) and streams its rows at the memory's speed without help. More tokens go in
 * passes of whole eights whose activations fit PASS_ACT_BYTES: every token of matmul.c's items
 * (up to 64) for K = 1536, 32 at a time for K = 8960 (64 of those, 1.1 MiB, in one pass had
 * made a 512-token prefill of the 8960 x 1536 matrix ~8% slower on a Zen 4); only the first
 * pass reads the rows from memory (weights_cold), the item's rows (12 of K = 8960) still in L2
 * for the next. Row blocks of 3, 4 and 6 divide matmul.c's row chunks (multiples of 12, and of
 * 8 for a lone token).
 */
static void dot_bf16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                     const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    if (nt == 1) {
        const uint16_t *x[1] = {(const uint16_t *)(const void *)a->base};
        bf16_rows(w, row_bytes, nr, K, x, y, ldy, 4, 1, false, NULL);
        return;
    }
    int64_t pass = (int64_t)(PASS_ACT_BYTES / a->stride) / 8 * 8;
    if (pass < 8)
        pass = 8;
    for (int64_t t0 = 0; t0 < nt; t0 += pass) {
        const int n = (int)(nt - t0 < pass ? nt - t0 : pass);
        bf16_pass(w, row_bytes, nr, K, a->base + (size_t)t0 * a->stride, a->stride, n, y + t0 * ldy,
                  ldy, t0 == 0 && a->weights_cold);
    }
}

void cllm_matmul_kernels_add_avx512bf16(struct cllm_matmul_kernels *k)
{
    k->isa = "avx512bf16";
    k->to_bf16 = to_bf16;
    k->dot_rows[CLLM_DTYPE_BF16] = dot_bf16;
}
