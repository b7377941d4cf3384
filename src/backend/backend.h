/*
 * THE device interface. The forward pass (model/model.c) is written once against these ops;
 * each backend (cpu/, cuda/) implements them. Pointers passed to ops are device pointers
 * obtained from alloc (on the CPU they are host pointers). Ops may run asynchronously until
 * sync. Nothing else crosses this boundary.
 *
 * Element types. The residual stream, matmul outputs and logits are F32. Two types are the
 * backend's choice, named in its iface so that callers size buffers by them:
 *   act_dtype  the "matmul input" activations: what rmsnorm, add_rmsnorm, attention and
 *              silu_mul write and what matmul reads (CPU: F32; CUDA: BF16, the tensor cores'
 *              input type, so no conversion pass runs before a GEMM);
 *   kv_dtype   the KV cache (CPU: F32; CUDA: BF16, half the bytes that decode reads).
 * Callers never read such buffers themselves; they only pass them between ops.
 *
 * Shapes: activations are row-major [n_tokens][dim]. The KV cache of one layer is
 * [n_slots][n_kv_head][head_dim] kv_dtype with n_slots = n_blocks * block_size: a token's K and
 * V live in the slot its sequence's block table assigns (paged attention). Q, K and V of a
 * step share one F32 buffer [n_tokens][ld] laid out as [q heads | k heads | v heads], so a
 * backend that merges the three projection weights fills it with one GEMM; gate and up share
 * one [n_tokens][2 * n_ff] buffer the same way.
 */
#ifndef CLLM_BACKEND_BACKEND_H
#define CLLM_BACKEND_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* C declarations, also when CUDA C++ (src/backend/cuda) includes them. */
#ifdef __cplusplus
extern "C" {
#endif

#include "cllm.h"
#include "core/token_count.h"
#include "tensor/tensor.h"

struct cllm_backend;

/* A weight as the backend holds it: the host tensor it came from and the device copy. */
struct cllm_weight {
    const struct cllm_tensor *host; /* borrowed: the mmap'd file tensor (the first of a stack) */
    const void *data;               /* device pointer to the weight in `dtype` */
    enum cllm_dtype dtype;
    int64_t ne[2];                  /* {row length, rows} (vectors: {n, 1}) */
    /* How the backend arranged data's bytes: 0, as the file does; else its own (the CPU's:
     * rows packed for its kernels, backend/cpu/pack_x16.h) */
    int layout;
};

/* Where each token of a step sits: the attention op's view of a batch. */
struct cllm_attn_batch {
    int32_t n_tokens;
    const int32_t *pos;         /* [n_tokens] position of the token in its sequence */
    const int32_t *seq;         /* [n_tokens] index of the token's sequence in block_table */
    const int32_t *slot;        /* [n_tokens] KV slot each token's K/V is written to; a negative
                                   slot (a padding row) writes nothing */
    const int32_t *block_table; /* [n_seqs][max_blocks] block ids of each sequence */
    int32_t max_blocks;
    int32_t block_size;         /* tokens per KV block */
    int32_t max_len;            /* host-side bound: every pos[t] < max_len */
};

/* Rotary embedding as transformers applies it (rotate-half pairs i and i + head_dim/2). */
struct cllm_rope {
    float theta;      /* rope_theta */
    int32_t head_dim; /* rotary dimension (= head_dim for Qwen2) */
};

/* How one row of logits becomes a token, for backends that sample on the device. The
 * processors run in transformers' order: the penalties (cllm_penalize's arithmetic),
 * temperature, top-k, top-p, min-p. A row of zeros is greedy without penalties. */
struct cllm_sample_row {
    float temperature; /* 0 = greedy: argmax, lowest index winning ties */
    int32_t top_k;     /* 0 = off */
    float top_p;       /* 1 = off */
    float min_p;       /* 0 = off */
    uint64_t seed;     /* the request's random stream ... */
    uint64_t counter;  /* ... and the draw within it: a draw depends on nothing else */
    /* Penalties, on the tokens the request has seen: entries [counts_at, counts_at +
     * n_counts) of the draw's counts (core/token_count.h), plus, when unseen_output = k + 1 > 0,
     * token k of the previous draw -- generated, but not known on the host yet (run-ahead). */
    float repetition_penalty; /* 0 or 1 = off */
    float presence_penalty;   /* 0 = off */
    float frequency_penalty;  /* 0 = off */
    int32_t counts_at, n_counts;
    int32_t unseen_output;
};

/* What rows[0..n) ask of the penalties, checked as every drawer of rows checks it (a device
 * backend's sample, the model's host imitation): no negative field, counts given when a row
 * lists some. False on a bad row; else *n_counts = how many entries of counts the rows use
 * and *max_unseen = the largest unseen_output (0: no row names the previous draw), for the
 * caller to hold against the draw it has. */
static inline bool cllm_sample_rows_check(const struct cllm_sample_row *rows, int32_t n,
                                          const struct cllm_token_count *counts,
                                          int64_t *n_counts, int32_t *max_unseen)
{
    *n_counts = 0;
    *max_unseen = 0;
    for (int32_t i = 0; i < n; i++) {
        const struct cllm_sample_row *r = &rows[i];
        if (r->counts_at < 0 || r->n_counts < 0 || r->unseen_output < 0 ||
            (r->n_counts > 0 && !counts))
            return false;
        const int64_t end = (int64_t)r->counts_at + r->n_counts;
        if (r->n_counts > 0 && end > *n_counts)
            *n_counts = end;
        if (r->unseen_output > *max_unseen)
            *max_unseen = r->unseen_output;
    }
    return true;
}

/* The RMSNorm before a projection, applied by the projection's op itself where the backend
 * can (matmul_gate_up_silu, matmul_rope_store: one op less per norm): out = res + add, then
 * the op's input rows = rmsnorm(out) * g, the bits add_rmsnorm(res, add, g, eps) would give
 * (add NULL: rmsnorm(res) * g, out not written). res, add, out [n][dim] F32, out another
 * buffer than res (the op still reads res while it writes out): the residual stream moves
 * there. */
struct cllm_norm_in {
    const float *res, *add;
    const struct cllm_weight *g;
    float eps;
    float *out;
};

struct cllm_backend_iface {
    const char *name;
    enum cllm_dtype act_dtype; /* see the top of this file */
    enum cllm_dtype kv_dtype;
    void (*free)(struct cllm_backend *be);

    /* memory */
    enum cllm_status (*alloc)(struct cllm_backend *be, size_t bytes, void **out);
    void (*dealloc)(struct cllm_backend *be, void *p);
    enum cllm_status (*upload)(struct cllm_backend *be, void *dst, const void *src, size_t n);
    enum cllm_status (*download)(struct cllm_backend *be, void *dst, const void *src, size_t n);
    /* Sets n bytes at dst to zero. */
    enum cllm_status (*memzero)(struct cllm_backend *be, void *dst, size_t n);
    /* Optional (NULL: alloc, then memzero): memory that reads as zeros, freed by dealloc,
     * without paying for the zeros up front. Callers use cllm_backend_alloc_zeroed. */
    enum cllm_status (*alloc_zeroed)(struct cllm_backend *be, size_t bytes, void **out);
    /* Optional (NULL: no limit the backend knows of): free and total device memory. */
    enum cllm_status (*mem_info)(struct cllm_backend *be, size_t *free_bytes,
                                 size_t *total_bytes);
    /* Makes a file tensor usable by the ops (CPU: borrows the mapping in place). */
    enum cllm_status (*weight_init)(struct cllm_backend *be, const struct cllm_tensor *t,
                                    struct cllm_weight *w, char *err, size_t err_len);
    /* Optional (NULL: not supported): one weight whose rows are the rows of parts[0], then
     * parts[1], ... (all with the same row length), so that one matmul computes them all. */
    enum cllm_status (*weight_init_stacked)(struct cllm_backend *be,
                                            const struct cllm_tensor *const *parts, int n_parts,
                                            struct cllm_weight *w, char *err, size_t err_len);
    void (*weight_free)(struct cllm_backend *be, struct cllm_weight *w);

    /* ops */
    /* out[i] = row tokens[i] of the embedding matrix, as F32. */
    enum cllm_status (*embed)(struct cllm_backend *be, const struct cllm_weight *embd,
                              const int32_t *tokens, int32_t n, float *out);
    /* out (act_dtype) = x / rms(x) * w per row of dim; eps inside the root. */
    enum cllm_status (*rmsnorm)(struct cllm_backend *be, const float *x,
                                const struct cllm_weight *w, float eps, int32_t n, int32_t dim,
                                void *out);
    /* Fused residual step: res += x, then out (act_dtype) = rmsnorm(res) * w. */
    enum cllm_status (*add_rmsnorm)(struct cllm_backend *be, float *res, const float *x,
                                    const struct cllm_weight *w, float eps, int32_t n,
                                    int32_t dim, void *out);
    /* y[t][0..N) = W x[t] (+ bias) for t < n; x is [n][K] act_dtype, y F32 with row stride
     * ldy. */
    enum cllm_status (*matmul)(struct cllm_backend *be, const struct cllm_weight *w,
                               const struct cllm_weight *bias, const void *x, int32_t n,
                               float *y, int32_t ldy);
    /* qkv is [n][ld] F32 holding q [n_head][hd], k [n_kv][hd], v [n_kv][hd] per row. Adds the
     * stacked bias [q | k | v] if given, rotates q and k at each token's position (q in place,
     * for attention), and stores k and v into the layer's cache at each token's slot. */
    enum cllm_status (*qkv_rope_store)(struct cllm_backend *be, const struct cllm_rope *rope,
                                       const struct cllm_attn_batch *b, float *qkv, int32_t ld,
                                       const struct cllm_weight *bias, int32_t n_head,
                                       int32_t n_kv, void *k_cache, void *v_cache);
    /* Causal attention of each token over its sequence's positions 0..pos (paged cache).
     * q rows [n][ldq] F32 hold [n_head][hd] -> out [n][n_head][hd] act_dtype; grouped-query:
     * head h reads kv head h / (n_head / n_kv). scale multiplies q.k. scratch holds
     * attention_scratch(n, n_head, hd) bytes (device), zero-filled (memzero) before its first
     * use; the op leaves it fit for the next call. */
    enum cllm_status (*attention)(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                  const float *q, int32_t ldq, const void *k_cache,
                                  const void *v_cache, int32_t n_head, int32_t n_kv,
                                  int32_t head_dim, float scale, void *scratch, void *out);
    /* Scratch bytes attention needs for up to n_tokens tokens (0: none). */
    size_t (*attention_scratch)(struct cllm_backend *be, int32_t n_tokens, int32_t n_head,
                                int32_t head_dim);
    /* gate_up is [n][2 * dim] F32 (gate, then up); out [n][dim] act_dtype = silu(gate) * up. */
    enum cllm_status (*silu_mul)(struct cllm_backend *be, const float *gate_up, int32_t n,
                                 int32_t dim, void *out);
    /* Optional (NULL: not fused): out = silu_mul(W x) for the stacked [gate | up] weight W
     * ([2 dim][K]; x [n][K] act_dtype, out [n][dim] act_dtype) -- the same bits as a matmul into
     * an F32 [n][2 dim] buffer and silu_mul of it, in one op and without the buffer. With norm
     * (x then unused), x = the norm's rows (struct cllm_norm_in). Returns
     * CLLM_ERR_UNSUPPORTED, having queued nothing, for operands it cannot fuse. */
    enum cllm_status (*matmul_gate_up_silu)(struct cllm_backend *be, const struct cllm_weight *w,
                                            const void *x, int32_t n, int32_t dim, void *out,
                                            const struct cllm_norm_in *norm);
    /* Optional (NULL: not fused): qkv = W x (x [n][K] act_dtype, n = b->n_tokens, W the stacked
     * [q | k | v] weight, no bias in the product), then qkv_rope_store(rope, b, qkv, ld, bias,
     * n_head, n_kv, k_cache, v_cache) -- the same bits as the two ops, in one. With norm (x
     * then unused), x = the norm's rows (struct cllm_norm_in). Returns CLLM_ERR_UNSUPPORTED,
     * having queued nothing, for steps or operands it cannot fuse. */
    enum cllm_status (*matmul_rope_store)(struct cllm_backend *be, const struct cllm_weight *w,
                                          const void *x, const struct cllm_rope *rope,
                                          const struct cllm_attn_batch *b, float *qkv, int32_t ld,
                                          const struct cllm_weight *bias, int32_t n_head,
                                          int32_t n_kv, void *k_cache, void *v_cache,
                                          const struct cllm_norm_in *norm);
    /* out[i] = x[idx[i]] for F32 rows of dim. */
    enum cllm_status (*gather_rows)(struct cllm_backend *be, const float *x, const int32_t *idx,
                                    int32_t n_idx, int32_t dim, float *out);
    /* Optional (NULL: the caller samples on the host): queues the draw of tokens[i] (host) for
     * each F32 logits row i of [n][n_vocab] (device), as rows[i] says, its penalties over
     * counts (rows and counts: host, read before the call returns; counts may be NULL when
     * no row has any). Rows with penalties are penalized in place. The next sync writes
     * tokens, so the host can work while the device runs; that sync fails with
     * CLLM_ERR_DEVICE if the device drew a token outside the vocabulary. A row naming an
     * output of the previous draw when there is none (or it is gone) is CLLM_ERR_INVALID_ARG. */
    enum cllm_status (*sample)(struct cllm_backend *be, float *logits, int32_t n,
                               int32_t n_vocab, const struct cllm_sample_row *rows,
                               const struct cllm_token_count *counts, int32_t *tokens);
    /* Optional (with sample; NULL: one draw at a time, written by sync): up to two draws may
     * be queued; wait_draw blocks until the oldest one (and everything queued before it) is
     * done and writes its tokens, CLLM_ERR_INVALID_ARG when none is queued. sync writes all. */
    enum cllm_status (*wait_draw)(struct cllm_backend *be);
    /* Optional (with wait_draw): queues tokens[i] = token k of the most recently queued draw
     * for each tokens[i] = -1 - k < 0 (device I32 array of n), so a step can start from
     * tokens the host has not seen yet. k past that draw's rows reads token 0. */
    enum cllm_status (*resolve_tokens)(struct cllm_backend *be, int32_t *tokens, int32_t n);
    /* Optional (NULL: ops always run as issued): replay of recorded op sequences. If a
     * sequence was recorded under key, graph_begin launches it and sets *replayed; the
     * caller then issues nothing. Otherwise it starts recording (*replayed false): the caller
     * issues the ops (with the same pointers and sizes as every later replay will see) and
     * calls graph_end, which stores and launches them. A failed recording is dropped. */
    enum cllm_status (*graph_begin)(struct cllm_backend *be, uint64_t key, bool *replayed);
    enum cllm_status (*graph_end)(struct cllm_backend *be, uint64_t key);
    /* Waits for every op queued so far. */
    enum cllm_status (*sync)(struct cllm_backend *be);
    /* Optional, both or neither (NULL: the caller works alone): host_run calls fn(ctx, ith,
     * nth) for ith < nth = host_threads(be) on the backend's host threads (the caller's is
     * ith 0) and waits. The CPU backend lends the pool its ops run on, idle between steps, so
     * that the engine's host work (drawing tokens) is shared too. Not while an op runs. */
    int32_t (*host_threads)(struct cllm_backend *be);
    void (*host_run)(struct cllm_backend *be, void (*fn)(void *ctx, int ith, int nth), void *ctx);
    /* Optional (NULL: nothing to choose): times the ways the backend has of computing a matmul
     * of the shape of w[0..n_w) (one projection's weights, a layer's each, all of one shape,
     * used in turn as a step uses them) -- all of the ways the same bits -- for steps of 1 to
     * n_max tokens, and keeps the fastest for each step size for every later matmul of that
     * shape (gate_up_silu: as matmul_gate_up_silu computes it, y then act_dtype
     * [n][rows / 2]). x [n_max][K] act_dtype and y [n_max][ldy] are overwritten. Not while
     * recording. */
    enum cllm_status (*tune_matmul)(struct cllm_backend *be, const struct cllm_weight *const *w,
                                    int32_t n_w, const void *x, int32_t n_max, void *y, int32_t ldy,
                                    bool gate_up_silu);
};

struct cllm_backend {
    const struct cllm_backend_iface *iface;
    void *ctx; /* the backend's own state */
};

enum cllm_backend_kind {
    CLLM_BACKEND_CPU,
    CLLM_BACKEND_CUDA,
    CLLM_BACKEND_AUTO, /* the GPU (device 0) when one is compiled in and starts, else the CPU */
};

/* How the CPU backend holds float weight matrices. */
enum cllm_cpu_weights {
    CLLM_CPU_WEIGHTS_STORED, /* as the file stores them: exact (the default) */
    CLLM_CPU_WEIGHTS_Q6_K,   /* F32/F16/BF16 matrices whose rows are whole 256-element blocks,
                                quantized to Q6_K at load (tensor/convert.h): the 8-bit
                                kernels, faster than the float ones, at ~2% error per weight;
                                quantized GGUF weights and other rows stay as stored */
};

struct cllm_backend_options {
    enum cllm_backend_kind kind;
    int32_t n_threads; /* CPU: threads in the pool; 0 = physical cores */
    int32_t device;    /* CUDA: device ordinal */
    enum cllm_cpu_weights cpu_weights; /* CPU: float matrices as stored, or quantized */
    /* CPU: bytes of weight matrices copied out of the mapped files into the process's own
     * memory, in 2 MiB pages where the kernel gives them (cllm_alloc_streamed), matrix by
     * matrix while they fit (0: none): one token's matmuls, which stream every weight from
     * memory, ran 1.04-1.13x faster on this project's VM than from the files' page-cache
     * pages. Costs a copy at load and memory that, unlike the page cache the files stay in,
     * cannot be reclaimed: the engine's serving model takes it within a quarter of the RAM, a
     * short-lived one (the device check's) does not. */
    uint64_t cpu_copy_budget;
    /* GPU: every GEMM on CUDA cores (the CUDA backend's gemm_simt.h) rather than on tensor cores
     * or through the vendor BLAS: the engine's second try on a GPU that failed its device
     * check (engine.h, gemm_on_cores) */
    bool gemm_on_cores;
};

/* Creates a backend; CLLM_ERR_UNSUPPORTED for one not compiled in or without a device. */
enum cllm_status cllm_backend_new(struct cllm_backend **out, const struct cllm_backend_options *o,
                                  char *err, size_t err_len);
void cllm_backend_free(struct cllm_backend *be);
/* Whether CLLM_BACKEND_AUTO may pick something other than the CPU: a GPU backend is compiled
 * in, or a test makes a fake one (fault.h's CLLM_FAULT_FILE with CLLM_FAULT_NAME). */
bool cllm_backend_gpu_possible(void);

/* bytes of zeros from be (its alloc_zeroed, else alloc and memzero), freed by its dealloc. */
enum cllm_status cllm_backend_alloc_zeroed(struct cllm_backend *be, size_t bytes, void **out);

/* Bytes of one element of a float dtype the ops use (F32, F16, BF16); 0 for others. */
size_t cllm_backend_elem_size(enum cllm_dtype t);

#ifdef __cplusplus
}
#endif

#endif
