/* Packing K-quant rows 16 at a time and back (pack_x16.h). */
#include "backend/cpu/pack_x16.h"

#include <stdint.h>
#include <string.h>

bool cllm_x16_packs(enum cllm_dtype t)
{
    return t == CLLM_DTYPE_Q4_K || t == CLLM_DTYPE_Q6_K;
}

/* Bytes of a record (16 blocks) of packable dtype t. */
static size_t record_size(enum cllm_dtype t)
{
    return t == CLLM_DTYPE_Q4_K ? sizeof(struct cllm_q4_k_x16) : sizeof(struct cllm_q6_k_x16);
}

/* n bytes between a block's field (blk) and its row's place in a record (rec): into the record
 * when to_record, else back. n is a constant at each call, so the copy is one move. */
static inline void move(uint8_t *blk, uint8_t *rec, size_t n, bool to_record)
{
    if (to_record)
        memcpy(rec, blk, n);
    else
        memcpy(blk, rec, n);
}

/* A Q4_K block (blk) and lane r of a record (rec), one way or the other. */
static void move_q4_k(uint8_t *blk, uint8_t *rec, int r, bool to_record)
{
    struct cllm_q4_k_x16 *R = (struct cllm_q4_k_x16 *)(void *)rec;
    struct cllm_block_q4_k *B = (struct cllm_block_q4_k *)(void *)blk;
    move((uint8_t *)&B->d, (uint8_t *)&R->d[r], 2, to_record);
    move((uint8_t *)&B->dmin, (uint8_t *)&R->dmin[r], 2, to_record);
    for (int i = 0; i < CLLM_K_SCALE_SIZE; i++)
        move(&B->scales[i], &R->scales[i][r], 1, to_record);
    for (int v = 0; v < CLLM_QK_K / 2 / 4; v++)
        move(&B->qs[4 * v], R->qs[v][r], 4, to_record);
}

/* A Q6_K block (blk) and lane r of a record (rec), one way or the other. */
static void move_q6_k(uint8_t *blk, uint8_t *rec, int r, bool to_record)
{
    struct cllm_q6_k_x16 *R = (struct cllm_q6_k_x16 *)(void *)rec;
    struct cllm_block_q6_k *B = (struct cllm_block_q6_k *)(void *)blk;
    move((uint8_t *)&B->d, (uint8_t *)&R->d[r], 2, to_record);
    for (int j = 0; j < CLLM_QK_K / 16; j++)
        move((uint8_t *)&B->scales[j], (uint8_t *)&R->scales[j][r], 1, to_record);
    for (int h = 0; h < 2; h++)
        for (int l4 = 0; l4 < 8; l4++) { /* l = 4 * l4 = 16i + 4v: step 8h + l4 */
            struct cllm_q6_k_x16_step *s = &R->step[8 * h + l4];
            move(&B->ql[64 * h + 4 * l4], s->ql_lo[r], 4, to_record);
            move(&B->ql[64 * h + 32 + 4 * l4], s->ql_hi[r], 4, to_record);
            move(&B->qh[32 * h + 4 * l4], s->qh[r], 4, to_record);
        }
}

static void move_block(enum cllm_dtype t, uint8_t *blk, uint8_t *rec, int r, bool to_record)
{
    if (t == CLLM_DTYPE_Q4_K)
        move_q4_k(blk, rec, r, to_record);
    else
        move_q6_k(blk, rec, r, to_record);
}

void cllm_x16_pack(enum cllm_dtype t, const void *src, int64_t K, int64_t r0, int64_t r1, void *dst)
{
    const int64_t nb = K / CLLM_QK_K;
    const size_t rs = record_size(t), bs = rs / CLLM_PACK_ROWS;
    for (int64_t g = r0 / CLLM_PACK_ROWS; g < r1 / CLLM_PACK_ROWS; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < CLLM_PACK_ROWS; r++) {
                uint8_t blk[sizeof(struct cllm_block_q6_k)];
                memcpy(blk, (const uint8_t *)src + (size_t)((g * CLLM_PACK_ROWS + r) * nb + b) * bs,
                       bs);
                move_block(t, blk, (uint8_t *)dst + (size_t)(g * nb + b) * rs, r, true);
            }
}

void cllm_x16_unpack_block(enum cllm_dtype t, const void *rec, int r, void *blk)
{
    /* unpacking only reads the record: its const is cast away for move_block's one signature */
    move_block(t, blk, (uint8_t *)(uintptr_t)rec, r, false);
}

const void *cllm_x16_record(enum cllm_dtype t, const void *base, int64_t K, int64_t row, int64_t b)
{
    const int64_t nb = K / CLLM_QK_K;
    return (const uint8_t *)base + (size_t)(row / CLLM_PACK_ROWS * nb + b) * record_size(t);
}

void cllm_x16_unpack_row(enum cllm_dtype t, const void *src, int64_t K, int64_t row, void *dst)
{
    const size_t bs = record_size(t) / CLLM_PACK_ROWS;
    for (int64_t b = 0; b < K / CLLM_QK_K; b++)
        cllm_x16_unpack_block(t, cllm_x16_record(t, src, K, row, b), (int)(row % CLLM_PACK_ROWS),
                              (uint8_t *)dst + (size_t)b * bs);
}
