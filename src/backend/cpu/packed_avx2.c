/*
 * The AVX2 kernel for Q4_K rows packed 16 at a time (pack_x16.h), compiled with the AVX2
 * family's flags and called only after its run-time check: packed_avx512vnni.c's Q4_K kernel
 * with the instructions AVX2 has. A record's 64-byte vectors are read as two halves of eight
 * rows (lane r of half h is row 8h + r), and where VNNI's vpdpbusd adds four products into a
 * lane, vpmaddubsw adds pairs of them into the lane's two int16 halves. Those int16 sums are
 * added across a whole sub-block (eight steps of four elements) before anything widens them:
 * one vpmaddwd by the rows' scale as an int16 pair (sc, sc) then gives each lane sc * (its
 * sub-block's sum), exact in int32. So per product the row kernels' vpmaddubsw, vpmaddwd and
 * vpaddd (dot_avx2.c) become a vpmaddubsw and a vpaddw, with no reduction across lanes and no
 * scale decoding per row; a row's integer sums are dot_ref.c's and the float part runs in its
 * order on eight rows at once (quant_dot.h), so results are the row kernels' bit for bit.
 * Bounds: a vpmaddubsw pair <= 2 * 15 * 127 = 3810 (activations are in [-127, 127],
 * cllm_q8_inv_scale: no pair saturates), eight of them <= 30480 < 2^15; int32 as in
 * packed_avx512vnni.c.
 * Q6_K has no AVX2 packed kernel: its quants are 6 bits, so two steps' int16 sums are all a
 * lane holds, and the scale's vpmaddwd and vpaddd come back every other product; with the
 * quants' decoding done again for every few tokens, a first version ran a 64-token call 1.5x
 * slower than the row kernel (which decodes once for eight tokens), and a lone token 1.1-1.2x
 * faster: rows it stays.
 * Compiled a second time with -mavxvnni as the AVX-VNNI family's kernel (packed_avxvnni.c):
 * there one vpdpbusd adds a step's four products to each lane's int32 sum (vpmaddubsw and
 * vpaddw here), and a sub-block's sum is multiplied by the rows' scales as int32 (vpmulld), as
 * in packed_avx512vnni.c; the same integers, so the same bits.
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/pack_x16.h"
#include "backend/cpu/quant_dot.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")
/* Tokens one pass over a record takes: two int16 sums a token within a sub-block, with the
 * quant vectors, fill AVX2's 16 registers (3 tokens ran a 64-token call 1.05x slower; Zen 4). */
#define PASS_TOKENS 4
#define HALF_ROWS (CLLM_PACK_ROWS / 2)
/* Keeps a running sum a chain: GCC would otherwise reassociate a sub-block's int16 sums into a
 * tree, computing every product first and keeping them on the stack. */
#define PIN(v) __asm__("" : "+x"(v))

/* Four bytes at p in every int32 lane. */
INLINE __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Half h of a record's 64-byte vector at p: rows 8h .. 8h + 7, four bytes each. */
INLINE __m256i half_at(const void *p, int h)
{
    return _mm256_loadu_si256((const __m256i *)(const void *)((const uint8_t *)p + 32 * h));
}

INLINE __m128i load16(const void *p)
{
    return _mm_loadu_si128((const __m128i *)p);
}

/* Rows 8h .. 8h + 7 of 16 rows' bytes at p (one a row, below 128) as int16 pairs (v, v) in
 * int32 lanes: a scale for vpmaddwd. */
INLINE __m256i dup_pairs(const uint8_t *p, int h)
{
    const __m128i v = load16(p);
    return _mm256_cvtepi8_epi16(h ? _mm_unpackhi_epi8(v, v) : _mm_unpacklo_epi8(v, v));
}

#ifdef __AVXVNNI__
#define DOT_Q4_K_X16 cllm_dot_q4_k_x16_avxvnni

/* A sub-block's running sums after the step whose weights are w (one quant a byte) and whose
 * activations are x's four bytes: sum + each lane's four products, in int32. */
INLINE __m256i step_sum(__m256i sum, __m256i w, const int8_t *x, const int first)
{
    return _mm256_dpbusd_avx_epi32(first ? _mm256_setzero_si256() : sum, w, bcast4(x));
}

/* The scales of rows 8h .. 8h + 7 (one byte a row at p) as step_sum's sums take them. */
INLINE __m256i sub_scales(const uint8_t *p, int h)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p + 8 * h)));
}

/* Each lane's sub-block sum times its row's scale, in int32. */
INLINE __m256i scaled(__m256i sum, __m256i scales)
{
    return _mm256_mullo_epi32(sum, scales);
}
#else
#define DOT_Q4_K_X16 cllm_dot_q4_k_x16_avx2

/* As above, with vpmaddubsw's two int16 pair sums a lane, added in int16 (the bound above). */
INLINE __m256i step_sum(__m256i sum, __m256i w, const int8_t *x, const int first)
{
    const __m256i p = _mm256_maddubs_epi16(w, bcast4(x));
    return first ? p : _mm256_add_epi16(sum, p);
}

INLINE __m256i sub_scales(const uint8_t *p, int h)
{
    return dup_pairs(p, h);
}

INLINE __m256i scaled(__m256i sum, __m256i scales)
{
    return _mm256_madd_epi16(sum, scales);
}
#endif

/* 8 rows' F16 values at p, widened. */
INLINE __m256 f16x8(const uint16_t *p)
{
    return _mm256_cvtph_ps(load16(p));
}

/* Each lane's sum over jj < 8 of its int16 pair pairs[jj] times a token's group sums
 * sums[2jj], sums[2jj + 1]: the minimums' term, with pairs (m, m) of sub-block jj. */
INLINE __m256i pair_sums(const __m256i pairs[8], const int16_t *sums)
{
    __m256i s = _mm256_madd_epi16(pairs[0], bcast4(sums));
    UNROLL
    for (int jj = 1; jj < 8; jj++)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs[jj], bcast4(sums + 2 * jj)));
    return s;
}

/* Block b of tokens t0 .. t0 + NS - 1 of the tile, for one half's pass. The pointers are made
 * opaque to the compiler, which would otherwise broadcast the activations once for both halves
 * and keep the broadcasts, more than the registers hold, on the stack (the kernel ran 1.5x
 * slower): a broadcast from memory costs a load, not an instruction of the arithmetic's. */
INLINE void tokens_at(const struct cllm_act_tile *tk, int t0, int64_t b,
                      const int8_t *xb[PASS_TOKENS], const int NS)
{
    UNROLL
    for (int t = 0; t < NS; t++) {
        xb[t] = tk->qs[t0 + t] + b * CLLM_QK_K;
        __asm__ volatile("" : "+r"(xb[t]));
    }
}

/* The record's 6-bit scales (sc[j] at out[j]) and minimums (m[j] at out[8 + j]), one byte a
 * row: cllm_k_scales_unpack on 16 rows at once, two sub-blocks a vector. */
INLINE void record_scales(const struct cllm_q4_k_x16 *rec, uint8_t out[16][CLLM_PACK_ROWS])
{
    const __m256i s01 = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[0]);
    const __m256i s23 = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[2]);
    const __m256i s45 = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[4]);
    const __m256i s67 = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[6]);
    const __m256i s89 = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[8]);
    const __m256i sab = _mm256_loadu_si256((const __m256i *)(const void *)rec->scales[10]);
    const __m256i m6 = _mm256_set1_epi8(0x3f), m4 = _mm256_set1_epi8(0x0f);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    /* 16-bit shifts: what a byte gets from its neighbour is masked off */
#define HIGH_BITS(s) _mm256_and_si256(_mm256_srli_epi16(s, 2), m30)
    const __m256i v[8] = {
        _mm256_and_si256(s01, m6),                                  /* sc 0, 1 */
        _mm256_and_si256(s23, m6),                                  /* sc 2, 3 */
        _mm256_or_si256(_mm256_and_si256(s89, m4), HIGH_BITS(s01)), /* sc 4, 5 */
        _mm256_or_si256(_mm256_and_si256(sab, m4), HIGH_BITS(s23)), /* sc 6, 7 */
        _mm256_and_si256(s45, m6),                                  /* m 0, 1 */
        _mm256_and_si256(s67, m6),                                  /* m 2, 3 */
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s89, 4), m4), HIGH_BITS(s45)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(sab, 4), m4), HIGH_BITS(s67)),
    };
#undef HIGH_BITS
    UNROLL
    for (int i = 0; i < 8; i++)
        _mm256_storeu_si256((__m256i *)(void *)out[2 * i], v[i]);
}

/*
 * NS tokens (slots t0 .. t0 + NS - 1 of the tile) against a group's 16 Q4_K rows: acc[h][t]
 * (rows 8h ..) gains every block's float part, in block order.
 */
INLINE void q4_k_pass(const struct cllm_q4_k_x16 *rec, int64_t nb, const struct cllm_act_tile *tk,
                      int t0, __m256 acc[2][PASS_TOKENS], const int NS)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, rec++) {
        uint8_t scm[16][CLLM_PACK_ROWS];
        record_scales(rec, scm);
        for (int h = 0; h < 2; h++) {
            const int8_t *xb[PASS_TOKENS];
            tokens_at(tk, t0, b, xb, NS);
            __m256i isum[PASS_TOKENS];
            UNROLL
            for (int c = 0; c < 4; c++) {
                __m256i lo_sum[PASS_TOKENS], hi_sum[PASS_TOKENS];
                UNROLL
                for (int t = 0; t < NS; t++) /* not read: each pass's first step sets them */
                    lo_sum[t] = hi_sum[t] = _mm256_setzero_si256();
                UNROLL
                for (int q = 0; q < 8; q++) {
                    const __m256i v = half_at(rec->qs[8 * c + q], h);
                    const __m256i lo = _mm256_and_si256(v, m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    UNROLL
                    for (int t = 0; t < NS; t++) {
                        const int8_t *x = xb[t] + 64 * c + 4 * q;
                        lo_sum[t] = step_sum(lo_sum[t], lo, x, q == 0);
                        hi_sum[t] = step_sum(hi_sum[t], hi, x + 32, q == 0);
                        PIN(lo_sum[t]);
                        PIN(hi_sum[t]);
                    }
                }
                const __m256i s_lo = sub_scales(scm[2 * c], h);
                const __m256i s_hi = sub_scales(scm[2 * c + 1], h);
                UNROLL
                for (int t = 0; t < NS; t++) {
                    const __m256i s =
                        _mm256_add_epi32(scaled(lo_sum[t], s_lo), scaled(hi_sum[t], s_hi));
                    isum[t] = c ? _mm256_add_epi32(isum[t], s) : s;
                }
            }
            __m256i mins[8];
            UNROLL
            for (int j = 0; j < 8; j++)
                mins[j] = dup_pairs(scm[8 + j], h);
            const __m256 d = f16x8(rec->d + HALF_ROWS * h);
            const __m256 dmin = f16x8(rec->dmin + HALF_ROWS * h);
            UNROLL
            for (int t = 0; t < NS; t++) {
                const int64_t at = b * tk->step + t0 + t;
                const __m256i msum = pair_sums(mins, tk->sums + at * 16);
                const __m256 dx = _mm256_set1_ps(tk->d[at]);
                /* the scalar kernels' float steps, on eight rows */
                acc[h][t] = _mm256_add_ps(
                    acc[h][t], _mm256_mul_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(isum[t])));
                acc[h][t] = _mm256_sub_ps(
                    acc[h][t], _mm256_mul_ps(_mm256_mul_ps(dx, dmin), _mm256_cvtepi32_ps(msum)));
            }
        }
    }
}

/* Tokens t0 .. t0 + NS - 1 of the tile (those below nt stored) against one group of rows. */
INLINE void group_tokens(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, int t0,
                         int nt, float *y, int64_t ldy, const int NS)
{
    __m256 acc[2][PASS_TOKENS];
    UNROLL
    for (int h = 0; h < 2; h++)
        UNROLL
    for (int t = 0; t < NS; t++)
        acc[h][t] = _mm256_setzero_ps();
    q4_k_pass((const struct cllm_q4_k_x16 *)(const void *)w, nb, tk, t0, acc, NS);
    UNROLL
    for (int t = 0; t < NS; t++)
        if (t0 + t < nt)
            UNROLL
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(y + (t0 + t) * ldy + HALF_ROWS * h, acc[h][t]);
}

/* cllm_dot_rows_fn: nr rows (whole groups) against the tile's nt tokens, NS at a time (one at a
 * time for a lone token, whose tile has one slot). */
INLINE void dot_x16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                    const struct cllm_act_view *a, int nt, float *y, int64_t ldy, const int NS)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    const int64_t nb = K / CLLM_QK_K;
    const size_t group_bytes = CLLM_PACK_ROWS * row_bytes;
    for (int64_t r = 0; r < nr; r += CLLM_PACK_ROWS, w += group_bytes, y += CLLM_PACK_ROWS) {
        if (nt == 1) {
            group_tokens(w, nb, &tk, 0, 1, y, ldy, 1);
            continue;
        }
        for (int t0 = 0; t0 < nt; t0 += NS) {
            if (NS > 2 && nt - t0 <= 2)
                group_tokens(w, nb, &tk, t0, nt, y, ldy, 2);
            else
                group_tokens(w, nb, &tk, t0, nt, y, ldy, NS);
        }
    }
}

void DOT_Q4_K_X16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                  const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    dot_x16(w, row_bytes, nr, K, a, nt, y, ldy, PASS_TOKENS);
}
