/* Packing Q4_K rows 16 at a time and back (pack_q4k.h). */
#include "backend/cpu/pack_q4k.h"

#include <string.h>

/* Block blk (file layout) into lane r of record rec. */
static void pack_block(const struct cllm_block_q4_k *blk, struct cllm_q4_k_x16 *rec, int r)
{
    rec->d[r] = blk->d;
    rec->dmin[r] = blk->dmin;
    for (int i = 0; i < CLLM_K_SCALE_SIZE; i++)
        rec->scales[i][r] = blk->scales[i];
    for (int v = 0; v < CLLM_QK_K / 2 / 4; v++)
        memcpy(rec->qs[v][r], blk->qs + 4 * v, 4);
}

void cllm_q4_k_x16_unpack_block(const void *record, int r, void *block)
{
    const struct cllm_q4_k_x16 *rec = record;
    struct cllm_block_q4_k *blk = block;
    blk->d = rec->d[r];
    blk->dmin = rec->dmin[r];
    for (int i = 0; i < CLLM_K_SCALE_SIZE; i++)
        blk->scales[i] = rec->scales[i][r];
    for (int v = 0; v < CLLM_QK_K / 2 / 4; v++)
        memcpy(blk->qs + 4 * v, rec->qs[v][r], 4);
}

void cllm_q4_k_x16_pack(const void *src, int64_t K, int64_t r0, int64_t r1, void *dst)
{
    const int64_t nb = K / CLLM_QK_K;
    const struct cllm_block_q4_k *in = src;
    struct cllm_q4_k_x16 *out = dst;
    for (int64_t g = r0 / CLLM_PACK_ROWS; g < r1 / CLLM_PACK_ROWS; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < CLLM_PACK_ROWS; r++)
                pack_block(&in[(g * CLLM_PACK_ROWS + r) * nb + b], &out[g * nb + b], r);
}

void cllm_q4_k_x16_unpack_row(const void *src, int64_t K, int64_t row, void *dst)
{
    const int64_t nb = K / CLLM_QK_K, g = row / CLLM_PACK_ROWS;
    const struct cllm_q4_k_x16 *in = src;
    struct cllm_block_q4_k *out = dst;
    for (int64_t b = 0; b < nb; b++)
        cllm_q4_k_x16_unpack_block(&in[g * nb + b], (int)(row % CLLM_PACK_ROWS), &out[b]);
}
