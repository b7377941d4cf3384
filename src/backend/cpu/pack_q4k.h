/*
 * Q4_K weights packed 16 rows at a time, the layout the CPU backend copies a Q4_K matrix into at
 * load where its kernel family multiplies that layout (cllm_cpu_matmul_packs).
 *
 * Why: a GGUF row keeps each block's 144 bytes together, so a kernel reduces each block of each
 * row across its SIMD lanes (and decodes its packed 6-bit scales) before the block's float part
 * -- about 50 instructions a block, which left one token's matmul compute-bound below the
 * memory's speed on a Zen 4 (README "Not done yet"). Here the SIMD lanes are the rows: one
 * 64-byte load holds four consecutive quants of each of 16 rows, every byte-times-activation sum
 * lands in its row's lane, and no reduction across lanes is left to do. The bytes are the
 * file's, rearranged (the same size), so every integer and float a kernel computes from them is
 * the one the row layout gives: results are bit-identical (quant_dot.h's order).
 *
 * For rows 16g .. 16g + 15 and block b, one record at (g * nb + b) * sizeof record, so a group of
 * rows starts where its first row did in the file's layout (16g * row_bytes).
 */
#ifndef CLLM_BACKEND_CPU_PACK_Q4K_H
#define CLLM_BACKEND_CPU_PACK_Q4K_H

#include <stdbool.h>
#include <stdint.h>

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
               "a record is its 16 blocks' bytes");

/* Rows [r0, r1) of a Q4_K matrix of K-element rows (r0, r1 multiples of 16) from the file's
 * layout at src into the packed one at dst (both the whole matrix's base). */
void cllm_q4_k_x16_pack(const void *src, int64_t K, int64_t r0, int64_t r1, void *dst);

/* Lane r of the record at rec back into one block of the file's layout. */
void cllm_q4_k_x16_unpack_block(const void *rec, int r, void *blk);

/* Row `row` of a packed Q4_K matrix (base src, K-element rows) back in the file's layout:
 * K / 256 blocks into dst. */
void cllm_q4_k_x16_unpack_row(const void *src, int64_t K, int64_t row, void *dst);

#endif
