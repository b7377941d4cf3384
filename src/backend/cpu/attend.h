/*
 * Internal contract between the CPU backend (backend_cpu.c, which splits attention into items
 * and SiLU into rows over its threads) and the per-ISA kernels it calls for them through the
 * kernel family chosen in matmul.c: attend_ref.c (portable), attend_avx2.c and
 * attend_avx512f.c (one driver, attend_simd.h).
 */
#ifndef CLLM_BACKEND_CPU_ATTEND_H
#define CLLM_BACKEND_CPU_ATTEND_H

#include <stdint.h>

/* Query heads per KV head an item may have (Qwen2.5: 6 or 7; 64 leaves room). */
#define CLLM_ATTEND_MAX_GROUP 64

/*
 * One token and one KV head: the `group` query heads that share it attend over positions
 * 0..n_pos-1 of the token's sequence, an online softmax over blocks of positions. Each output's
 * arithmetic depends only on its own token's data (never on the batch or the thread).
 */
struct cllm_attend_item {
    const float *q; /* the group's query heads, head_dim floats each, back to back */
    float *out;     /* the group's outputs, the same layout */
    /* This KV head's K and V rows of slot 0; slot s's are slot_stride floats further per slot.
     * Position p of the sequence sits in slot block_table[p / block_size] * block_size +
     * p % block_size. */
    const float *k, *v;
    int64_t slot_stride;
    const int32_t *block_table;
    int32_t block_size;
    int32_t n_pos; /* >= 1 */
    int32_t group; /* 1..CLLM_ATTEND_MAX_GROUP */
    int32_t head_dim;
    float scale; /* multiplies q.k */
};

/* The slot of the item's position p. */
static inline int64_t cllm_attend_slot(const struct cllm_attend_item *it, int32_t p)
{
    return (int64_t)it->block_table[p / it->block_size] * it->block_size + p % it->block_size;
}

typedef void (*cllm_attend_fn)(const struct cllm_attend_item *it);

/* out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for i < n. */
typedef void (*cllm_silu_mul_fn)(const float *gate, const float *up, int64_t n, float *out);

/* The portable kernels (the scalar family's; the SIMD ones fall back to cllm_attend_ref for a
 * head_dim that is not a whole number of their vectors). */
void cllm_attend_ref(const struct cllm_attend_item *it);
void cllm_attend_avx2(const struct cllm_attend_item *it);
void cllm_silu_mul_avx2(const float *gate, const float *up, int64_t n, float *out);
void cllm_attend_avx512f(const struct cllm_attend_item *it);
void cllm_silu_mul_avx512f(const float *gate, const float *up, int64_t n, float *out);

#endif
