/*
 * Row dequantizers: one row of any supported dtype to F32, bit-exact with ggml's reference
 * dequantizers and gguf-py's numpy ones (tests/fixtures/gen_dequant.py makes the golden data).
 * Bit-exactness holds whatever the evaluation order or FMA contraction: an f16 scale has 11
 * significant bits, sub-scales and quants at most 8 and 6, so every intermediate result is
 * exact in f32 and each output is one rounding of the exact value. We keep ggml's order anyway.
 * Each block is copied into its struct first, so sources need no alignment. Host is assumed
 * little-endian, as GGUF data is.
 */
#include "tensor/dtype.h"

#include <string.h>

#include "core/alloc.h"
#include "core/f16.h"
#include "tensor/quant.h"

/* Plain F32: a byte copy, so NaN payloads survive. */
static void dequant_f32(const uint8_t *src, float *y, int64_t n)
{
    memcpy(y, src, (size_t)n * sizeof(float));
}

/* F16: IEEE half, widened exactly. */
static void dequant_f16(const uint8_t *src, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        y[i] = cllm_f16_to_f32(h);
    }
}

/* BF16: the high 16 bits of an f32. */
static void dequant_bf16(const uint8_t *src, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        y[i] = cllm_bf16_to_f32(h);
    }
}

/* Q8_0: element j = d * qs[j]. */
static void dequant_q8_0(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q8_0), y += CLLM_QK) {
        struct cllm_block_q8_0 b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        for (int j = 0; j < CLLM_QK; j++)
            y[j] = d * (float)b.qs[j];
    }
}

/* Q4_0: byte j holds element j in its low nibble and element j+16 in its high one;
 * x = d * (q - 8). */
static void dequant_q4_0(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q4_0), y += CLLM_QK) {
        struct cllm_block_q4_0 b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        for (int j = 0; j < CLLM_QK / 2; j++) {
            y[j] = d * (float)((b.qs[j] & 0x0f) - 8);
            y[j + CLLM_QK / 2] = d * (float)((b.qs[j] >> 4) - 8);
        }
    }
}

/* Q4_1: nibbles as in Q4_0, unsigned; x = d * q + m. */
static void dequant_q4_1(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q4_1), y += CLLM_QK) {
        struct cllm_block_q4_1 b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        const float m = cllm_f16_to_f32(b.m);
        for (int j = 0; j < CLLM_QK / 2; j++) {
            y[j] = d * (float)(b.qs[j] & 0x0f) + m;
            y[j + CLLM_QK / 2] = d * (float)(b.qs[j] >> 4) + m;
        }
    }
}

/* The 5th bit of element j (0..31) from a Q5 block's qh: bit j of a little-endian u32. */
static inline int q5_high_bit(const uint8_t qh[4], int j)
{
    return (qh[j / 8] >> (j % 8)) & 1;
}

/* Q5_0: low nibbles as in Q4_0, 5th bits in qh; x = d * (q - 16). */
static void dequant_q5_0(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q5_0), y += CLLM_QK) {
        struct cllm_block_q5_0 b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        for (int j = 0; j < CLLM_QK / 2; j++) {
            int q0 = (b.qs[j] & 0x0f) | (q5_high_bit(b.qh, j) << 4);
            int q1 = (b.qs[j] >> 4) | (q5_high_bit(b.qh, j + CLLM_QK / 2) << 4);
            y[j] = d * (float)(q0 - 16);
            y[j + CLLM_QK / 2] = d * (float)(q1 - 16);
        }
    }
}

/* Q5_1: bits as in Q5_0, unsigned; x = d * q + m. */
static void dequant_q5_1(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q5_1), y += CLLM_QK) {
        struct cllm_block_q5_1 b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        const float m = cllm_f16_to_f32(b.m);
        for (int j = 0; j < CLLM_QK / 2; j++) {
            int q0 = (b.qs[j] & 0x0f) | (q5_high_bit(b.qh, j) << 4);
            int q1 = (b.qs[j] >> 4) | (q5_high_bit(b.qh, j + CLLM_QK / 2) << 4);
            y[j] = d * (float)q0 + m;
            y[j + CLLM_QK / 2] = d * (float)q1 + m;
        }
    }
}

/*
 * The 12 scale bytes of Q4_K / Q5_K hold 8 six-bit scales (sc) and 8 six-bit minimums (m):
 *   bytes 0..3   sc[0..3] in bits 0-5, top 2 bits of sc[4..7] in bits 6-7
 *   bytes 4..7   m[0..3]  in bits 0-5, top 2 bits of m[4..7]  in bits 6-7
 *   bytes 8..11  low 4 bits of sc[4..7] in bits 0-3, low 4 bits of m[4..7] in bits 4-7
 */
static void unpack_k_scales(const uint8_t s[CLLM_K_SCALE_SIZE], uint8_t sc[8], uint8_t m[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3f;
        m[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* Q4_K: 8 sub-blocks of 32. Sub-blocks 2c and 2c+1 share qs[32c .. 32c+31]: the low nibbles
 * are sub-block 2c, the high ones 2c+1. x = (d * sc[j]) * q - (dmin * m[j]). */
static void dequant_q4_k(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q4_k), y += CLLM_QK_K) {
        struct cllm_block_q4_k b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        const float dmin = cllm_f16_to_f32(b.dmin);
        uint8_t sc[8], m[8];
        unpack_k_scales(b.scales, sc, m);
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = b.qs + 32 * c;
            float *out = y + 64 * c;
            const float d_lo = d * (float)sc[2 * c], m_lo = dmin * (float)m[2 * c];
            const float d_hi = d * (float)sc[2 * c + 1], m_hi = dmin * (float)m[2 * c + 1];
            for (int l = 0; l < 32; l++) {
                out[l] = d_lo * (float)(q[l] & 0x0f) - m_lo;
                out[l + 32] = d_hi * (float)(q[l] >> 4) - m_hi;
            }
        }
    }
}

/* Q5_K: as Q4_K, plus the 5th bit of lane l of sub-block j in bit j of qh[l]. */
static void dequant_q5_k(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q5_k), y += CLLM_QK_K) {
        struct cllm_block_q5_k b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        const float dmin = cllm_f16_to_f32(b.dmin);
        uint8_t sc[8], m[8];
        unpack_k_scales(b.scales, sc, m);
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = b.qs + 32 * c;
            float *out = y + 64 * c;
            const int j_lo = 2 * c, j_hi = 2 * c + 1;
            const float d_lo = d * (float)sc[j_lo], m_lo = dmin * (float)m[j_lo];
            const float d_hi = d * (float)sc[j_hi], m_hi = dmin * (float)m[j_hi];
            for (int l = 0; l < 32; l++) {
                int q_lo = (q[l] & 0x0f) | (((b.qh[l] >> j_lo) & 1) << 4);
                int q_hi = (q[l] >> 4) | (((b.qh[l] >> j_hi) & 1) << 4);
                out[l] = d_lo * (float)q_lo - m_lo;
                out[l + 32] = d_hi * (float)q_hi - m_hi;
            }
        }
    }
}

/*
 * Q6_K: two halves of 128 elements; half h uses ql[64h ..], qh[32h ..], scales[8h ..].
 * Within a half, lane l (0..31) of its four groups of 32 is:
 *   group 0: low nibble of ql[l],      bits 0-1 of qh[l]
 *   group 1: low nibble of ql[l + 32], bits 2-3 of qh[l]
 *   group 2: high nibble of ql[l],     bits 4-5 of qh[l]
 *   group 3: high nibble of ql[l + 32], bits 6-7 of qh[l]
 * Element e of the block has scale scales[e / 16]; x = (d * sc) * (q - 32).
 */
static void dequant_q6_k(const uint8_t *src, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += sizeof(struct cllm_block_q6_k), y += CLLM_QK_K) {
        struct cllm_block_q6_k b;
        memcpy(&b, src, sizeof b);
        const float d = cllm_f16_to_f32(b.d);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b.ql + 64 * h;
            const uint8_t *qh = b.qh + 32 * h;
            const int8_t *sc = b.scales + 8 * h;
            float *out = y + 128 * h;
            for (int l = 0; l < 32; l++) {
                const int s = l / 16;
                int q0 = (ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4);
                int q1 = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                int q3 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                out[l] = (d * (float)sc[s + 0]) * (float)(q0 - 32);
                out[l + 32] = (d * (float)sc[s + 2]) * (float)(q1 - 32);
                out[l + 64] = (d * (float)sc[s + 4]) * (float)(q2 - 32);
                out[l + 96] = (d * (float)sc[s + 6]) * (float)(q3 - 32);
            }
        }
    }
}

/* Indexed by dtype; each takes the number of blocks (elements, for plain floats). */
static void (*const dequant_blocks[CLLM_DTYPE_COUNT])(const uint8_t *, float *, int64_t) = {
    [CLLM_DTYPE_F32] = dequant_f32,   [CLLM_DTYPE_F16] = dequant_f16,
    [CLLM_DTYPE_BF16] = dequant_bf16, [CLLM_DTYPE_Q8_0] = dequant_q8_0,
    [CLLM_DTYPE_Q4_0] = dequant_q4_0, [CLLM_DTYPE_Q4_1] = dequant_q4_1,
    [CLLM_DTYPE_Q5_0] = dequant_q5_0, [CLLM_DTYPE_Q5_1] = dequant_q5_1,
    [CLLM_DTYPE_Q4_K] = dequant_q4_k, [CLLM_DTYPE_Q5_K] = dequant_q5_k,
    [CLLM_DTYPE_Q6_K] = dequant_q6_k,
};

bool cllm_dequant_row(enum cllm_dtype t, const void *src, float *dst, int64_t n)
{
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(t);
    uint64_t bytes;
    if (!tr || !dequant_blocks[t] || n <= 0 || n % tr->block_size != 0)
        return false;
    /* The row's bytes and floats must be addressable; no real row comes close. */
    if (!cllm_dtype_row_bytes(t, n, &bytes) || bytes > SIZE_MAX ||
        !cllm_mul_u64((uint64_t)n, sizeof(float), &bytes) || bytes > SIZE_MAX)
        return false;
    dequant_blocks[t](src, dst, n / tr->block_size);
    return true;
}
