/*
 * K-quant weights packed 16 rows at a time (Q4_K and Q6_K), the layout the CPU backend copies
 * such a matrix into at load where its kernel family multiplies that layout
 * (cllm_cpu_matmul_packs).
 *
 * Why: a GGUF row keeps each block's bytes together, so a kernel reduces each block of each row
 * across its SIMD lanes (and decodes its packed scales) before the block's float part -- about
 * 50 instructions a Q4_K block, which left one token's matmul compute-bound below the memory's
 * speed on a Zen 4 (docs/open-work.md). Here the SIMD lanes are the rows: one 64-byte load
 * holds four consecutive quant bytes of each of 16 rows, every byte-times-activation sum lands
 * in its row's lane, and no reduction across lanes is left to do. The bytes are the file's,
 * rearranged (the same size), so every integer and float a kernel computes from them is the
 * one the row layout gives: results are bit-identical (quant_dot.h's order).
 *
 * For rows 16g .. 16g + 15 and block b, one record at (g * nb + b) * its size, so a group of
 * rows starts where its first row did in the file's layout (16g * row_bytes).
 */
#ifndef CLLM_BACKEND_CPU_PACK_X16_H
#define CLLM_BACKEND_CPU_PACK_X16_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/dtype.h"
#include "tensor/quant.h"

#define CLLM_PACK_ROWS 16

struct cllm_q4_k_x16 {
    uint16_t d[CLLM_PACK_ROWS];    /* row r's d (F16) */
    uint16_t dmin[CLLM_PACK_ROWS]; /* row r's dmin (F16) */
    /* byte i of row r's 12 packed scale bytes at [i][r] */
    uint8_t scales[CLLM_K_SCALE_SIZE][CLLM_PACK_ROWS];
    /* [8c + q][r]: row r's qs[32c + 4q .. 32c + 4q + 3]: low nibbles are elements 64c + 4q ..
     * + 3 (sub-block 2c), high nibbles 64c + 32 + 4q .. + 3 (sub-block 2c + 1) */
    uint8_t qs[CLLM_QK_K / 2 / 4][CLLM_PACK_ROWS][4];
};
_Static_assert(sizeof(struct cllm_q4_k_x16) == CLLM_PACK_ROWS * sizeof(struct cllm_block_q4_k),
               "a Q4_K record is its 16 blocks' bytes");

/* One step of a Q6_K record: the quants of 16 rows' four consecutive elements l .. l + 3 of
 * the first 32 of a half h of their block (l = 16i + 4v), and of the three sets of four at l +
 * 32, l + 64 and l + 96, which share their ql and qh bytes. */
struct cllm_q6_k_x16_step {
    uint8_t ql_lo[CLLM_PACK_ROWS]
                 [4]; /* row r's ql[64h + l ..]: elements l .. (low nibbles), l + 64 .. (high) */
    uint8_t ql_hi[CLLM_PACK_ROWS]
                 [4];              /* row r's ql[64h + 32 + l ..]: elements l + 32 .., l + 96 .. */
    uint8_t qh[CLLM_PACK_ROWS][4]; /* row r's qh[32h + l ..]: two high bits of each of the four */
};

struct cllm_q6_k_x16 {
    uint16_t d[CLLM_PACK_ROWS];                    /* row r's d (F16) */
    int8_t scales[CLLM_QK_K / 16][CLLM_PACK_ROWS]; /* [j][r]: row r's scale of group j */
    /* [8h + 4i + v]: in the order the kernels read them, so that a matrix is read front to
     * back (the hardware's prefetchers then follow; a first layout, the file's fields side by
     * side, was read from memory at a third of the speed) */
    struct cllm_q6_k_x16_step step[CLLM_QK_K / 16];
};
_Static_assert(sizeof(struct cllm_q6_k_x16) == CLLM_PACK_ROWS * sizeof(struct cllm_block_q6_k),
               "a Q6_K record is its 16 blocks' bytes");

/* Whether rows of dtype t can be packed (Q4_K, Q6_K). */
bool cllm_x16_packs(enum cllm_dtype t);

/* Rows [r0, r1) of a matrix of packable dtype t and K-element rows (r0, r1 multiples of 16)
 * from the file's layout at src into the packed one at dst (both the whole matrix's base). */
void cllm_x16_pack(enum cllm_dtype t, const void *src, int64_t K, int64_t r0, int64_t r1,
                   void *dst);

/* The record holding block b of row `row` of a packed matrix (dtype t, base at base,
 * K-element rows); the row is lane row % 16 of it. */
const void *cllm_x16_record(enum cllm_dtype t, const void *base, int64_t K, int64_t row, int64_t b);

/* Lane r of the record at rec (dtype t) back into one block of the file's layout. */
void cllm_x16_unpack_block(enum cllm_dtype t, const void *rec, int r, void *blk);

/* Row `row` of a packed matrix (dtype t, base src, K-element rows) back in the file's layout:
 * K / 256 blocks into dst. */
void cllm_x16_unpack_row(enum cllm_dtype t, const void *src, int64_t K, int64_t row, void *dst);

#endif
