/*
 * THE device interface. The forward pass (model/model.c) is written once against these ops;
 * each backend (cpu/, later cuda/) implements them. Pointers passed to ops are device
 * pointers obtained from alloc (on the CPU they are host pointers). Ops may run
 * asynchronously until sync. Nothing else crosses this boundary.
 *
 * Shapes: activations are row-major [n_tokens][dim] F32. The KV cache of one layer is
 * [n_slots][n_kv_head][head_dim] F32 with n_slots = n_blocks * block_size: a token's K and V
 * live in the slot its sequence's block table assigns (paged attention).
 */
#ifndef CLLM_BACKEND_BACKEND_H
#define CLLM_BACKEND_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "tensor/tensor.h"

struct cllm_backend;

/* A weight as the backend holds it: the host tensor it came from and the device copy. */
struct cllm_weight {
    const struct cllm_tensor *host; /* borrowed: the mmap'd file tensor */
    const void *data;               /* device pointer to the weight in `dtype` */
    enum cllm_dtype dtype;
    int64_t ne[2];                  /* {row length, rows} (vectors: {n, 1}) */
};

/* Where each token of a step sits: the attention op's view of a batch. */
struct cllm_attn_batch {
    int32_t n_tokens;
    const int32_t *pos;         /* [n_tokens] position of the token in its sequence */
    const int32_t *seq;         /* [n_tokens] index of the token's sequence in block_table */
    const int32_t *slot;        /* [n_tokens] KV slot each token's K/V is written to */
    const int32_t *block_table; /* [n_seqs][max_blocks] block ids of each sequence */
    int32_t max_blocks;
    int32_t block_size;         /* tokens per KV block */
};

/* Rotary embedding as transformers applies it (rotate-half pairs i and i + head_dim/2). */
struct cllm_rope {
    float theta;      /* rope_theta */
    int32_t head_dim; /* rotary dimension (= head_dim for Qwen2) */
};

struct cllm_backend_iface {
    const char *name;
    void (*free)(struct cllm_backend *be);

    /* memory */
    enum cllm_status (*alloc)(struct cllm_backend *be, size_t bytes, void **out);
    void (*dealloc)(struct cllm_backend *be, void *p);
    enum cllm_status (*upload)(struct cllm_backend *be, void *dst, const void *src, size_t n);
    enum cllm_status (*download)(struct cllm_backend *be, void *dst, const void *src, size_t n);
    /* Makes a file tensor usable by the ops (CPU: borrows the mapping in place). */
    enum cllm_status (*weight_init)(struct cllm_backend *be, const struct cllm_tensor *t,
                                    struct cllm_weight *w, char *err, size_t err_len);
    void (*weight_free)(struct cllm_backend *be, struct cllm_weight *w);

    /* ops */
    /* out[i] = row tokens[i] of the embedding matrix, as F32. */
    enum cllm_status (*embed)(struct cllm_backend *be, const struct cllm_weight *embd,
                              const int32_t *tokens, int32_t n, float *out);
    /* out = x / rms(x) * w per row of dim; eps inside the root. */
    enum cllm_status (*rmsnorm)(struct cllm_backend *be, const float *x,
                                const struct cllm_weight *w, float eps, int32_t n, int32_t dim,
                                float *out);
    /* Fused residual step: res += x, then out = rmsnorm(res) * w. */
    enum cllm_status (*add_rmsnorm)(struct cllm_backend *be, float *res, const float *x,
                                    const struct cllm_weight *w, float eps, int32_t n,
                                    int32_t dim, float *out);
    /* res += x. */
    enum cllm_status (*add)(struct cllm_backend *be, float *res, const float *x, int32_t n,
                            int32_t dim);
    /* y[t][0..N) = W x[t] (+ bias) for t < n; x is [n][K], y has row stride ldy. */
    enum cllm_status (*matmul)(struct cllm_backend *be, const struct cllm_weight *w,
                               const struct cllm_weight *bias, const float *x, int32_t n,
                               float *y, int32_t ldy);
    /* Rotates q [n][n_head][hd] and k [n][n_kv][hd] in place at each token's position, then
     * stores k and v [n][n_kv][hd] into the layer's cache at each token's slot. */
    enum cllm_status (*rope_store_kv)(struct cllm_backend *be, const struct cllm_rope *rope,
                                      const struct cllm_attn_batch *b, float *q, float *k,
                                      const float *v, int32_t n_head, int32_t n_kv,
                                      float *k_cache, float *v_cache);
    /* Causal attention of each token over its sequence's positions 0..pos (paged cache).
     * q [n][n_head][hd] -> out [n][n_head][hd]; grouped-query: head h reads kv head
     * h / (n_head / n_kv). scale multiplies q.k. */
    enum cllm_status (*attention)(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                  const float *q, const float *k_cache, const float *v_cache,
                                  int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                                  float *out);
    /* out = silu(gate) * up, elementwise over [n][dim]. */
    enum cllm_status (*silu_mul)(struct cllm_backend *be, const float *gate, const float *up,
                                 int32_t n, int32_t dim, float *out);
    /* out[i] = x[idx[i]] for rows of dim. */
    enum cllm_status (*gather_rows)(struct cllm_backend *be, const float *x, const int32_t *idx,
                                    int32_t n_idx, int32_t dim, float *out);
    /* Waits for every op queued so far. */
    enum cllm_status (*sync)(struct cllm_backend *be);
};

struct cllm_backend {
    const struct cllm_backend_iface *iface;
    void *ctx; /* the backend's own state */
};

enum cllm_backend_kind {
    CLLM_BACKEND_CPU,
    CLLM_BACKEND_CUDA,
};

struct cllm_backend_options {
    enum cllm_backend_kind kind;
    int32_t n_threads; /* CPU: threads in the pool; 0 = physical cores */
};

/* Creates a backend; CLLM_ERR_UNSUPPORTED for one not compiled in. */
enum cllm_status cllm_backend_new(struct cllm_backend **out, const struct cllm_backend_options *o,
                                  char *err, size_t err_len);
void cllm_backend_free(struct cllm_backend *be);

#endif
