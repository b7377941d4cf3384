/*
 * Internal contract between the CPU backend (backend_cpu.c, which splits attention into items
 * and SiLU into rows over its threads) and the per-ISA kernels it calls for them through the
 * kernel family chosen in matmul.c: attend_ref.c (portable), attend_avx2.c and
 * attend_avx512f.c (one driver, attend_simd.h).
 */
#ifndef CLLM_BACKEND_CPU_ATTEND_H
#define CLLM_BACKEND_CPU_ATTEND_H

#include <stdint.h>

/* Query heads an item may have (Qwen2.5: 6 or 7 a KV head, 12 to 64 in all). */
#define CLLM_ATTEND_MAX_GROUP 64

/*
 * One token and n_kv consecutive KV heads: each KV head's `group` query heads attend over
 * positions 0..n_pos-1 of the token's sequence, an online softmax over blocks of positions.
 * Each output's arithmetic depends only on its own token's data and head (never on the batch,
 * the thread, or how many KV heads share the item): an item of all of a token's KV heads reads
 * each slot's K and V rows whole (the cache holds a slot's heads side by side), which memory
 * serves far faster than one head's part of every row; items of one KV head spread a few
 * tokens over more threads.
 */
struct cllm_attend_item {
    const float *q; /* the n_kv * group query heads, head_dim floats each, back to back */
    float *out;     /* their outputs, the same layout */
    /* The first KV head's K and V rows of slot 0: KV head j's are j * head_dim floats further,
     * slot s's slot_stride floats further per slot. Position p of the sequence sits in slot
     * block_table[p / block_size] * block_size + p % block_size. */
    const float *k, *v;
    int64_t slot_stride;
    const int32_t *block_table;
    int32_t block_size;
    int32_t n_pos; /* >= 1 */
    int32_t group; /* query heads a KV head; n_kv * group <= CLLM_ATTEND_MAX_GROUP */
    int32_t n_kv;  /* >= 1 */
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
