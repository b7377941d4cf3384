/*
 * Block layouts of ggml's quantized types, byte for byte as they sit in GGUF files
 * (little-endian; the f16 fields are raw IEEE half bits). Every block holds block_size
 * elements in type_size bytes; _Static_assert pins the sizes of dtype.c's traits table
 * (test_dequant checks that table and these structs agree).
 * Legacy blocks (Q4_0 ... Q8_0) hold 32 elements with one f16 scale (and minimum); K-quant
 * super-blocks hold 256 elements split into sub-blocks with their own 6- or 8-bit scales.
 * The element order inside each block is documented where it is decoded, in dequant.c.
 */
#ifndef CLLM_TENSOR_QUANT_H
#define CLLM_TENSOR_QUANT_H

#include <stdint.h>

#define CLLM_QK 32           /* elements per legacy block */
#define CLLM_QK_K 256        /* elements per K-quant super-block */
#define CLLM_K_SCALE_SIZE 12 /* bytes of packed 6-bit scales and minimums in Q4_K / Q5_K */

/* x = d * q, q a signed byte. */
struct cllm_block_q8_0 {
    uint16_t d;         /* f16 scale */
    int8_t qs[CLLM_QK]; /* quants */
};

/* x = d * (q - 8), q a nibble. */
struct cllm_block_q4_0 {
    uint16_t d;              /* f16 scale */
    uint8_t qs[CLLM_QK / 2]; /* nibbles: low = elements 0..15, high = 16..31 */
};

/* x = d * q + m, q a nibble. */
struct cllm_block_q4_1 {
    uint16_t d;              /* f16 scale */
    uint16_t m;              /* f16 minimum */
    uint8_t qs[CLLM_QK / 2]; /* nibbles, as in Q4_0 */
};

/* x = d * (q - 16), q five bits: a nibble plus one high bit. */
struct cllm_block_q5_0 {
    uint16_t d;              /* f16 scale */
    uint8_t qh[4];           /* bit j of this little-endian u32 = 5th bit of element j */
    uint8_t qs[CLLM_QK / 2]; /* low nibbles, as in Q4_0 */
};

/* x = d * q + m, q five bits as in Q5_0. */
struct cllm_block_q5_1 {
    uint16_t d;              /* f16 scale */
    uint16_t m;              /* f16 minimum */
    uint8_t qh[4];           /* 5th bits, as in Q5_0 */
    uint8_t qs[CLLM_QK / 2]; /* low nibbles, as in Q4_0 */
};

/* 8 sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], q a nibble, sc/m 6-bit. */
struct cllm_block_q4_k {
    uint16_t d;                        /* f16 super-block scale of the scales */
    uint16_t dmin;                     /* f16 super-block scale of the minimums */
    uint8_t scales[CLLM_K_SCALE_SIZE]; /* 8 scales + 8 minimums, 6 bits each, packed */
    uint8_t qs[CLLM_QK_K / 2];         /* nibbles, 32 bytes per pair of sub-blocks */
};

/* As Q4_K with a fifth bit per element. */
struct cllm_block_q5_k {
    uint16_t d;                        /* f16 super-block scale of the scales */
    uint16_t dmin;                     /* f16 super-block scale of the minimums */
    uint8_t scales[CLLM_K_SCALE_SIZE]; /* packed as in Q4_K */
    uint8_t qh[CLLM_QK_K / 8];         /* bit j of qh[l] = 5th bit of sub-block j, lane l */
    uint8_t qs[CLLM_QK_K / 2];         /* low nibbles, as in Q4_K */
};

/* 16 sub-blocks of 16: x = d * sc[j] * (q - 32), q six bits, sc a signed byte. */
struct cllm_block_q6_k {
    uint8_t ql[CLLM_QK_K / 2];     /* low 4 bits */
    uint8_t qh[CLLM_QK_K / 4];     /* high 2 bits, four elements per byte */
    int8_t scales[CLLM_QK_K / 16]; /* per sub-block of 16 */
    uint16_t d;                    /* f16 super-block scale (last in this layout) */
};

/* The sizes the traits table in dtype.c declares; a mismatch would misread every file. */
_Static_assert(sizeof(struct cllm_block_q8_0) == 34, "Q8_0 block size");
_Static_assert(sizeof(struct cllm_block_q4_0) == 18, "Q4_0 block size");
_Static_assert(sizeof(struct cllm_block_q4_1) == 20, "Q4_1 block size");
_Static_assert(sizeof(struct cllm_block_q5_0) == 22, "Q5_0 block size");
_Static_assert(sizeof(struct cllm_block_q5_1) == 24, "Q5_1 block size");
_Static_assert(sizeof(struct cllm_block_q4_k) == 144, "Q4_K block size");
_Static_assert(sizeof(struct cllm_block_q5_k) == 176, "Q5_K block size");
_Static_assert(sizeof(struct cllm_block_q6_k) == 210, "Q6_K block size");

#endif
