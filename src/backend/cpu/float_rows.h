/*
 * The drivers of the float-weight kernels (F32, F16, BF16 weights; F32 activations), written
 * once for dot_avx2.c (8 lanes) and dot_avx512f.c (16), which include this after defining
 *   void float_micro(w, row_bytes, K, x, y, ldy, type, R, T, fetch)
 * (R weight rows times T tokens, every output's arithmetic the same whatever R and T are) and
 * INLINE, and then define
 *   void float_block(w, row_bytes, nr, K, a, nt, y, ldy, type)
 * (a tile's tokens in groups, each group's rows through float_rows) for FLOAT_KERNEL.
 */
#ifndef CLLM_BACKEND_CPU_FLOAT_ROWS_H
#define CLLM_BACKEND_CPU_FLOAT_ROWS_H

/* nr rows against T tokens: blocks of R rows, then single rows. */
INLINE void float_rows(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                       const float *const *x, float *y, int64_t ldy, const enum cllm_dtype type,
                       const int R, const int T, const bool fetch)
{
    int64_t r = 0;
    for (; r + R <= nr; r += R)
        float_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, type, R, T, fetch);
    for (; r < nr; r++)
        float_micro(w + (size_t)r * row_bytes, row_bytes, K, x, y + r, ldy, type, 1, T, false);
}

/* float_rows with fetch a constant in each of its copies (the step loop tests it). */
INLINE void float_rows_fetch(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,
                             const float *const *x, float *y, int64_t ldy,
                             const enum cllm_dtype type, const int R, const int T, bool fetch)
{
    if (fetch)
        float_rows(w, row_bytes, nr, K, x, y, ldy, type, R, T, true);
    else
        float_rows(w, row_bytes, nr, K, x, y, ldy, type, R, T, false);
}

#define FLOAT_KERNEL(name, type)                                                                   \
    static void name(const uint8_t *w, size_t row_bytes, int64_t nr, int64_t K,                    \
                     const struct cllm_act_view *a, int nt, float *y, int64_t ldy)                 \
    {                                                                                              \
        float_block(w, row_bytes, nr, K, a, nt, y, ldy, type);                                     \
    }

#endif
