/*
 * AVX-512 VNNI kernels for K-quant rows packed 16 at a time (pack_x16.h: Q4_K and Q6_K),
 * compiled with the VNNI family's flags and called only after its run-time check.
 *
 * Lane r of every vector is row r of the group. A record's 64-byte vector holds four
 * consecutive quant bytes of each row, so one vpdpbusd against four activation bytes broadcast
 * adds each row's four products into its own lane: a sub-block's sum is 4 (Q6_K's groups of 16)
 * or 8 (Q4_K's sub-blocks of 32) of them, then one vpmulld by the rows' scales; Q4_K's
 * minimums' term and Q6_K's offset term are one vpdpwssd per two sub-blocks (the rows' two
 * scales as an int16 pair against the token's two group sums). Each lane then holds its row's
 * exact integer sums, and the float part runs on 16 rows at once in the scalar kernels' order
 * (quant_dot.h). So a row's result is the one dot_ref.c's row kernel gives, bit for bit, with
 * no reduction across lanes and no scale decoding per row (the file's row layout costs both,
 * ~50 instructions a row's Q4_K block in dot_avx512vnni.c; here ~15).
 * Bounds (all exact in int32): Q4_K: a sub-block's sum <= 32 * 15 * 127 = 60960, times a scale
 * <= 63 over 8 sub-blocks < 2^25, the minimums' term <= 8 * 63 * 32 * 127 < 2^21. Q6_K: a
 * group's sum <= 16 * 63 * 127 = 128016, times |scale| <= 128 over 16 groups < 2^29, the
 * offset term 32 * 16 * 128 * 16 * 127 < 2^28.
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/pack_x16.h"
#include "backend/cpu/quant_dot.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")
/* Tokens one pass over a record takes: their sums stay in registers (Q4_K: 3 vectors a token;
 * Q6_K: 5, a few spilled). Q6_K's at 2 tokens a pass ran a 64-token call 1.2x slower (Zen 4):
 * each pass decodes the record's quants again. */
#define PASS_TOKENS 4

/* Four bytes at p in every int32 lane. */
INLINE __m512i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 16 rows' F16 values at p, widened. */
INLINE __m512 f16x16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* Each lane's sum over jj < 8 of its int16 pair pairs[jj] times a token's group sums
 * sums[2jj], sums[2jj + 1]: Q4_K's minimums' term and Q6_K's offset term. */
INLINE __m512i pair_sums(const __m512i pairs[8], const int16_t *sums)
{
    __m512i s = _mm512_setzero_si512();
    UNROLL
    for (int jj = 0; jj < 8; jj++)
        s = _mm512_dpwssd_epi32(s, pairs[jj], bcast4(sums + 2 * jj));
    return s;
}

/* The record's 6-bit scales sc[j] as int32 lanes (row r in lane r), and its minimums m[j] as
 * int16 pairs (m, m) per lane, for vpdpwssd against a token's two group sums of sub-block j:
 * cllm_k_scales_unpack on 16 rows at once, four sub-blocks a vector (128-bit part j). */
INLINE void record_scales(const struct cllm_q4_k_x16 *rec, __m512i sc[8], __m512i mins[8])
{
    const __m512i s0 = _mm512_loadu_si512(rec->scales[0]);
    const __m512i s1 = _mm512_loadu_si512(rec->scales[4]);
    const __m512i s2 = _mm512_loadu_si512(rec->scales[8]);
    const __m512i m6 = _mm512_set1_epi8(0x3f), m4 = _mm512_set1_epi8(0x0f);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    /* 16-bit shifts: what a byte gets from its neighbour is masked off */
    const __m512i sc03 = _mm512_and_si512(s0, m6);
    const __m512i sc47 =
        _mm512_or_si512(_mm512_and_si512(s2, m4), _mm512_and_si512(_mm512_srli_epi16(s0, 2), m30));
    const __m512i m03 = _mm512_and_si512(s1, m6);
    const __m512i m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(s2, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi16(s1, 2), m30));
#define SCALES_PART(j)                                                                             \
    do {                                                                                           \
        sc[j] = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(sc03, j));                          \
        sc[4 + j] = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(sc47, j));                      \
        const __m512i lo = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(m03, j));                \
        const __m512i hi = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(m47, j));                \
        mins[j] = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));                                  \
        mins[4 + j] = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));                              \
    } while (0)
    SCALES_PART(0);
    SCALES_PART(1);
    SCALES_PART(2);
    SCALES_PART(3);
#undef SCALES_PART
}

/*
 * NS tokens (slots t0 .. t0 + NS - 1 of the tile) against a group's 16 Q4_K rows: acc[t] gains
 * every block's float part, in block order.
 */
INLINE void q4_k_pass(const struct cllm_q4_k_x16 *rec, int64_t nb, const struct cllm_act_tile *tk,
                      int t0, __m512 *acc, const int NS)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, rec++) {
        __m512i sc[8], mins[8];
        record_scales(rec, sc, mins);
        __m512i isum[PASS_TOKENS];
        UNROLL
        for (int t = 0; t < NS; t++)
            isum[t] = _mm512_setzero_si512();
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m512i lo_sum[PASS_TOKENS], hi_sum[PASS_TOKENS];
            UNROLL
            for (int t = 0; t < NS; t++)
                lo_sum[t] = hi_sum[t] = _mm512_setzero_si512();
            UNROLL
            for (int q = 0; q < 8; q++) {
                const __m512i v = _mm512_loadu_si512(rec->qs[8 * c + q]);
                const __m512i lo = _mm512_and_si512(v, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                UNROLL
                for (int t = 0; t < NS; t++) {
                    const int8_t *x = tk->qs[t0 + t] + b * CLLM_QK_K + 64 * c + 4 * q;
                    lo_sum[t] = _mm512_dpbusd_epi32(lo_sum[t], lo, bcast4(x));
                    hi_sum[t] = _mm512_dpbusd_epi32(hi_sum[t], hi, bcast4(x + 32));
                }
            }
            UNROLL
            for (int t = 0; t < NS; t++)
                isum[t] = _mm512_add_epi32(
                    isum[t], _mm512_add_epi32(_mm512_mullo_epi32(lo_sum[t], sc[2 * c]),
                                              _mm512_mullo_epi32(hi_sum[t], sc[2 * c + 1])));
        }
        const __m512 d = f16x16(rec->d), dmin = f16x16(rec->dmin);
        UNROLL
        for (int t = 0; t < NS; t++) {
            const __m512i msum = pair_sums(mins, tk->sums + (b * tk->step + t0 + t) * 16);
            const __m512 dx = _mm512_set1_ps(tk->d[b * tk->step + t0 + t]);
            acc[t] = _mm512_add_ps(
                acc[t], _mm512_mul_ps(_mm512_mul_ps(dx, d), _mm512_cvtepi32_ps(isum[t])));
            acc[t] = _mm512_sub_ps(
                acc[t], _mm512_mul_ps(_mm512_mul_ps(dx, dmin), _mm512_cvtepi32_ps(msum)));
        }
    }
}

/* The rows' Q6_K scales of group j, as int32 lanes. */
INLINE __m512i q6_scale(const struct cllm_q6_k_x16 *rec, int j)
{
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)rec->scales[j]));
}

/* As q4_k_pass, for Q6_K rows (four sums a token). Step 8h + 4i + v of a
 * record gives four quant vectors: the low nibbles of ql_lo and ql_hi (groups 8h + i and
 * 8h + 2 + i) and their high nibbles (8h + 4 + i, 8h + 6 + i), each with two bits of qh on top. */
INLINE void q6_k_pass(const struct cllm_q6_k_x16 *rec, int64_t nb, const struct cllm_act_tile *tk,
                      int t0, __m512 *acc, const int NS)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(0x03);
    const __m512i m30 = _mm512_set1_epi8(0x30), low16 = _mm512_set1_epi32(0xffff);
    for (int64_t b = 0; b < nb; b++, rec++) {
        __m512i isum[PASS_TOKENS];
        UNROLL
        for (int t = 0; t < NS; t++)
            isum[t] = _mm512_setzero_si512();
        UNROLL
        for (int h = 0; h < 2; h++)
            UNROLL
        for (int i = 0; i < 2; i++) {
            __m512i s[PASS_TOKENS][4];
            UNROLL
            for (int t = 0; t < NS; t++)
                s[t][0] = s[t][1] = s[t][2] = s[t][3] = _mm512_setzero_si512();
            UNROLL
            for (int v = 0; v < 4; v++) {
                const struct cllm_q6_k_x16_step *st = &rec->step[8 * h + 4 * i + v];
                const __m512i lo = _mm512_loadu_si512(st->ql_lo),
                              hi = _mm512_loadu_si512(st->ql_hi);
                const __m512i H = _mm512_loadu_si512(st->qh);
                /* 16-bit shifts: what crosses a byte is masked off */
                __m512i q[4];
                q[0] = _mm512_or_si512(_mm512_and_si512(lo, m4),
                                       _mm512_slli_epi16(_mm512_and_si512(H, m3), 4));
                q[1] = _mm512_or_si512(_mm512_and_si512(hi, m4),
                                       _mm512_and_si512(_mm512_slli_epi16(H, 2), m30));
                q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4),
                                       _mm512_and_si512(H, m30));
                q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hi, 4), m4),
                                       _mm512_and_si512(_mm512_srli_epi16(H, 2), m30));
                UNROLL
                for (int t = 0; t < NS; t++) {
                    const int8_t *x = tk->qs[t0 + t] + b * CLLM_QK_K + 128 * h + 16 * i + 4 * v;
                    UNROLL
                    for (int k = 0; k < 4; k++) /* elements 32k on */
                        s[t][k] = _mm512_dpbusd_epi32(s[t][k], q[k], bcast4(x + 32 * k));
                }
            }
            UNROLL
            for (int k = 0; k < 4; k++) {
                const __m512i sc = q6_scale(rec, 8 * h + 2 * k + i);
                UNROLL
                for (int t = 0; t < NS; t++)
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t][k], sc));
            }
        }
        /* isum -= 32 * sum_j sc[j] * xsum[j] (the quants are stored offset by 32) */
        __m512i pairs[8];
        UNROLL
        for (int jj = 0; jj < 8; jj++)
            pairs[jj] = _mm512_or_si512(_mm512_and_si512(q6_scale(rec, 2 * jj), low16),
                                        _mm512_slli_epi32(q6_scale(rec, 2 * jj + 1), 16));
        const __m512 d = f16x16(rec->d);
        UNROLL
        for (int t = 0; t < NS; t++) {
            const __m512i corr = pair_sums(pairs, tk->sums + (b * tk->step + t0 + t) * 16);
            const __m512i is = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(corr, 5));
            const __m512 dx = _mm512_set1_ps(tk->d[b * tk->step + t0 + t]);
            acc[t] =
                _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(dx, d), _mm512_cvtepi32_ps(is)));
        }
    }
}

/* Tokens t0 .. t0 + NS - 1 of the tile (those below nt stored) against one group of rows. */
INLINE void group_tokens(const uint8_t *w, int64_t nb, const struct cllm_act_tile *tk, int t0,
                         int nt, float *y, int64_t ldy, const enum cllm_dtype type, const int NS)
{
    __m512 acc[PASS_TOKENS];
    UNROLL
    for (int t = 0; t < NS; t++)
        acc[t] = _mm512_setzero_ps();
    if (type == CLLM_DTYPE_Q4_K)
        q4_k_pass((const struct cllm_q4_k_x16 *)(const void *)w, nb, tk, t0, acc, NS);
    else
        q6_k_pass((const struct cllm_q6_k_x16 *)(const void *)w, nb, tk, t0, acc, NS);
    UNROLL
    for (int t = 0; t < NS; t++)
        if (t0 + t < nt)
            _mm512_storeu_ps(y + (t0 + t) * ldy, acc[t]);
}

/* cllm_dot_rows_fn: nr rows (whole groups) against the tile's nt tokens, four at a time (one at
 * a time for a lone token, whose tile has one slot). */
INLINE void dot_x16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                    const struct cllm_act_view *a, int nt, float *y, int64_t ldy,
                    const enum cllm_dtype type)
{
    struct cllm_act_tile tk;
    cllm_act_tile_init(&tk, a, nt);
    const int64_t nb = K / CLLM_QK_K;
    const size_t group_bytes = CLLM_PACK_ROWS * row_bytes;
    for (int64_t r = 0; r < nr; r += CLLM_PACK_ROWS, w += group_bytes, y += CLLM_PACK_ROWS) {
        if (nt == 1) {
            group_tokens(w, nb, &tk, 0, 1, y, ldy, type, 1);
            continue;
        }
        for (int t0 = 0; t0 < nt; t0 += PASS_TOKENS) {
            if (nt - t0 <= 2)
                group_tokens(w, nb, &tk, t0, nt, y, ldy, type, 2);
            else
                group_tokens(w, nb, &tk, t0, nt, y, ldy, type, PASS_TOKENS);
        }
    }
}

static void dot_q4_k_x16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                         const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    dot_x16(w, row_bytes, nr, K, a, nt, y, ldy, CLLM_DTYPE_Q4_K);
}

static void dot_q6_k_x16(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                         const struct cllm_act_view *a, int nt, float *y, int64_t ldy)
{
    dot_x16(w, row_bytes, nr, K, a, nt, y, ldy, CLLM_DTYPE_Q6_K);
}

void cllm_matmul_kernels_add_packed_avx512vnni(struct cllm_matmul_kernels *k)
{
    k->dot_x16[CLLM_DTYPE_Q4_K] = dot_q4_k_x16;
    k->dot_x16[CLLM_DTYPE_Q6_K] = dot_q6_k_x16;
}
