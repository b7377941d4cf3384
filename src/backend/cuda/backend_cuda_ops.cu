/*
 * The CUDA backend's ops (backend.h): each checks its operands and queues our kernels
 * (kernels.cu, attention.cu, gemm.cu) or the BLAS on the stream; the GEMM's scratch, grown
 * outside recordings; and the recorded steps (graph_begin/graph_end), CUDA graphs replayed by
 * key.
 */
#include "backend/cuda/vendor.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/backend_cuda_internal.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_simt.h"

/* --- ops --- */

static enum cllm_status cu_embed(struct cllm_backend *be, const struct cllm_weight *embd,
                                 const int32_t *tokens, int32_t n, float *out)
{
    struct cuda *c = cuda_of(be);
    if (embd->dtype != CLLM_DTYPE_BF16)
        return CLLM_ERR_INVALID_ARG;
    return check_cuda(cllm_cuda_embed((const __nv_bfloat16 *)embd->data, embd->ne[1],
                                      (int32_t)embd->ne[0], tokens, n, out, c->stream),
                      "embed");
}

static enum cllm_status cu_rmsnorm(struct cllm_backend *be, const float *x,
                                   const struct cllm_weight *w, float eps, int32_t n, int32_t dim,
                                   void *out)
{
    struct cuda *c = cuda_of(be);
    return check_cuda(cllm_cuda_rmsnorm(NULL, x, (const float *)w->data, eps, n, dim,
                                        (__nv_bfloat16 *)out, c->stream),
                      "rmsnorm");
}

static enum cllm_status cu_add_rmsnorm(struct cllm_backend *be, float *res, const float *x,
                                       const struct cllm_weight *w, float eps, int32_t n,
                                       int32_t dim, void *out)
{
    struct cuda *c = cuda_of(be);
    return check_cuda(cllm_cuda_rmsnorm(res, x, (const float *)w->data, eps, n, dim,
                                        (__nv_bfloat16 *)out, c->stream),
                      "add_rmsnorm");
}

/* Grows a device buffer recorded steps point into: outside recordings only (a recording may
 * not allocate; while recording the buffer stays as it is and the caller copes with it).
 * Recorded steps hold the old pointer, so they are dropped and recorded again. */
static enum cllm_status grow_unrecorded(struct cuda *c, void **p, size_t *size, size_t need,
                                        const char *what)
{
    if (need <= *size || c->capturing)
        return CLLM_OK;
    TRY(check_cuda(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize"));
    cllm_backend_cuda_drop_graphs(c);
    return grow_device_buffer(p, size, need, what);
}

/* A new GEMM scratch's counts zeroed (gemm.h), on the stream its GEMMs run on. */
static enum cllm_status zero_gemm_counts(struct cuda *c)
{
    const size_t n = c->gemm_scratch_size < CLLM_CUDA_GEMM_COUNT_BYTES ? c->gemm_scratch_size
                                                                       : CLLM_CUDA_GEMM_COUNT_BYTES;
    return c->gemm_scratch ? check_cuda(cudaMemsetAsync(c->gemm_scratch, 0, n, c->stream),
                                        "cudaMemsetAsync (GEMM scratch)")
                           : CLLM_OK;
}

/* The GEMM's scratch: short of it the GEMM computes the same bits with fewer blocks. A
 * recording cannot grow it, so it notes the need: the next graph_begin grows the scratch and
 * drops the recordings, and the step is recorded again with its parallel slices (measured on
 * an H200: a 1536 x 8960 GEMM over 192 tokens took 488 us without them). */
static enum cllm_status grow_gemm_scratch(struct cuda *c, size_t need)
{
    if (c->gemm_scratch_refused && need >= c->gemm_scratch_refused)
        return CLLM_OK; /* tried: the device had no room for it */
    if (c->capturing && need > c->gemm_scratch_size && need > c->gemm_scratch_wanted)
        c->gemm_scratch_wanted = need;
    const size_t before = c->gemm_scratch_size; /* (a new buffer may reuse the old address) */
    enum cllm_status st = grow_unrecorded(c, &c->gemm_scratch, &c->gemm_scratch_size, need,
                                          "cudaMalloc (GEMM scratch)");
    if (st == CLLM_OK && c->gemm_scratch_size != before)
        return zero_gemm_counts(c);
    if (st != CLLM_ERR_NOMEM)
        return st;
    /* Out of memory (the KV pool took what was free): the same sums in fewer blocks, and no
     * second try at this size, which would cost a sync and the recordings every time. */
    c->gemm_scratch_refused = need;
    cllm_log(CLLM_LOG_WARN,
             "cuda: no room for %zu bytes of GEMM scratch: its slices run one after the other",
             need);
    return CLLM_OK;
}

/* y[t][0..N) = W x_t (+ bias) through the BLAS: W [N][K] and x [n][K] BF16. Column-major,
 * Y^T [N x n] = W [K x N]^T * X^T [K x n]. In F32, or where the BLAS writes BF16 only, in
 * BF16 through c->blas_out (a recording short of it fails, and the model runs its steps
 * unrecorded) and widened. */
enum cllm_status cllm_backend_cuda_blas_matmul(struct cuda *c, const void *w, int32_t K, int32_t N,
                                               const void *x, int32_t n, const float *bias,
                                               float *y, int32_t ldy)
{
    const float alpha = 1.0f, beta = 0.0f;
    const bool bf16 = c->blas_bf16_out;
    if (bf16) {
        size_t need = (size_t)n * (size_t)N * 2;
        TRY(grow_unrecorded(c, &c->blas_out, &c->blas_out_size, need, "cudaMalloc (BLAS output)"));
        if (need > c->blas_out_size)
            return CLLM_ERR_UNSUPPORTED;
    }
    TRY(check_blas(c,
                   c->blas_api.gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, n, K, &alpha, w,
                                       CUDA_R_16BF, K, x, CUDA_R_16BF, K, &beta,
                                       bf16 ? c->blas_out : (void *)y,
                                       bf16 ? CUDA_R_16BF : CUDA_R_32F, bf16 ? N : ldy,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx"));
    if (bf16)
        return check_cuda(cllm_cuda_widen_bias((const __nv_bfloat16 *)c->blas_out, N, y, ldy, bias,
                                               n, N, c->stream),
                          "widen_bias");
    return bias ? check_cuda(cllm_cuda_add_bias(y, ldy, bias, n, N, c->stream), "add_bias")
                : CLLM_OK;
}

static enum cllm_status cu_matmul(struct cllm_backend *be, const struct cllm_weight *w,
                                  const struct cllm_weight *bias, const void *x, int32_t n,
                                  float *y, int32_t ldy)
{
    struct cuda *c = cuda_of(be);
    if (w->dtype != CLLM_DTYPE_BF16 || w->ne[0] > INT32_MAX || w->ne[1] > INT32_MAX ||
        ldy < w->ne[1])
        return CLLM_ERR_INVALID_ARG;
    if (n <= 0)
        return CLLM_OK;
    int K = (int)w->ne[0], N = (int)w->ne[1];
    const float *b = bias ? (const float *)bias->data : NULL;
    if (c->gemm == CUDA_GEMM_SIMT && cllm_cuda_gemm_simt_supported(w->data, x, K))
        return check_cuda(cllm_cuda_gemm_simt((const __nv_bfloat16 *)w->data, b, N, K,
                                              (const __nv_bfloat16 *)x, n, y, ldy, c->stream),
                          "gemm (CUDA cores)");
    if (c->gemm == CUDA_GEMM_MMA && cllm_cuda_gemm_supported(w->data, x, K)) {
        TRY(grow_gemm_scratch(c, cllm_cuda_gemm_scratch_bytes(N, K, n, false)));
        return check_cuda(cllm_cuda_gemm((const __nv_bfloat16 *)w->data, b, N, K,
                                         (const __nv_bfloat16 *)x, n, y, ldy, c->gemm_scratch,
                                         c->gemm_scratch_size, c->stream),
                          "gemm");
    }
    if (!c->blas) {
        cllm_log(CLLM_LOG_ERROR,
                 "cuda: a %dx%d GEMM our kernel cannot take needs cuBLAS, which "
                 "could not be loaded",
                 N, K);
        return CLLM_ERR_UNSUPPORTED;
    }
    return cllm_backend_cuda_blas_matmul(c, w->data, K, N, x, n, b, y, ldy);
}

/* The GEMM's form of a norm the op applies itself (struct cllm_norm_in), or false where the
 * GEMM cannot take it for this step (then the op is unsupported: the model normalizes first). */
static bool gemm_norm(const struct cllm_norm_in *norm, int32_t n, int32_t K,
                      struct cllm_cuda_norm_in *out)
{
    if (!norm || norm->g->dtype != CLLM_DTYPE_F32 || norm->g->ne[0] != K)
        return false;
    out->res = norm->res, out->add = norm->add, out->g = (const float *)norm->g->data;
    out->eps = norm->eps, out->res_out = norm->out;
    return cllm_cuda_gemm_norm_supported(out, n, K);
}

static enum cllm_status cu_matmul_gate_up_silu(struct cllm_backend *be, const struct cllm_weight *w,
                                               const void *x, int32_t n, int32_t dim, void *out,
                                               const struct cllm_norm_in *norm)
{
    struct cuda *c = cuda_of(be);
    if (w->dtype != CLLM_DTYPE_BF16 || dim <= 0 || w->ne[1] != 2 * (int64_t)dim ||
        w->ne[0] > INT32_MAX)
        return CLLM_ERR_INVALID_ARG;
    int K = (int)w->ne[0];
    struct cllm_cuda_norm_in nin;
    if (norm && !gemm_norm(norm, n, K, &nin))
        return CLLM_ERR_UNSUPPORTED;
    if (c->gemm != CUDA_GEMM_MMA || !cllm_cuda_gemm_supported(w->data, norm ? w->data : x, K))
        return CLLM_ERR_UNSUPPORTED;
    if (n <= 0)
        return CLLM_OK;
    TRY(grow_gemm_scratch(c, cllm_cuda_gemm_scratch_bytes(2 * dim, K, n, norm != NULL)));
    return check_cuda(cllm_cuda_gemm_gate_up_silu((const __nv_bfloat16 *)w->data, dim, K,
                                                  (const __nv_bfloat16 *)x, n, (__nv_bfloat16 *)out,
                                                  dim, c->gemm_scratch, c->gemm_scratch_size,
                                                  norm ? &nin : NULL, c->stream),
                      "gemm (gate/up + SiLU)");
}

#define MAX_TUNED_WEIGHTS 128 /* weights of one projection timed in turn, at most */

/* Times our GEMM's ways for the shape of w[0..n_w) (gemm.h) and keeps the fastest per step
 * size. The parallel ways get the scratch they need if the device has it (else they are not
 * timed); the scratch is freed after, so that it is only as large as the chosen ways make it
 * at their first step. */
static enum cllm_status cu_tune_matmul(struct cllm_backend *be, const struct cllm_weight *const *w,
                                       int32_t n_w, const void *x, int32_t n_max, void *y,
                                       int32_t ldy, bool gate_up_silu)
{
    struct cuda *c = cuda_of(be);
    if (n_w < 1 || n_max < 1 || c->capturing)
        return CLLM_ERR_INVALID_ARG;
    const __nv_bfloat16 *data[MAX_TUNED_WEIGHTS];
    n_w = n_w < MAX_TUNED_WEIGHTS ? n_w : MAX_TUNED_WEIGHTS;
    for (int32_t i = 0; i < n_w; i++) {
        if (w[i]->dtype != CLLM_DTYPE_BF16 || w[i]->ne[0] != w[0]->ne[0] ||
            w[i]->ne[1] != w[0]->ne[1] || w[0]->ne[0] > INT32_MAX || w[0]->ne[1] > INT32_MAX)
            return CLLM_ERR_INVALID_ARG;
        data[i] = (const __nv_bfloat16 *)w[i]->data;
    }
    const int32_t K = (int32_t)w[0]->ne[0], N = (int32_t)w[0]->ne[1];
    bool ours = c->gemm == CUDA_GEMM_MMA && c->tune_what;
    for (int32_t i = 0; i < n_w && ours; i++)
        ours = cllm_cuda_gemm_supported(data[i], x, K);
    if (!ours || cllm_cuda_gemm_tuned(N, K, n_max))
        return CLLM_OK; /* the BLAS chooses for itself; nothing is open; or done before */
    TRY(use_device(c));
    TRY(check_cuda(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize"));
    cllm_backend_cuda_drop_graphs(c); /* they may point into the scratch */
    /* short of memory, as much as there is: the parallel ways it cannot hold are not timed */
    for (size_t want = cllm_cuda_gemm_tune_scratch_bytes(N, K, n_max);
         want > c->gemm_scratch_size && want >= ((size_t)1 << 20); want /= 2) {
        if (replace_device_buffer(&c->gemm_scratch, &c->gemm_scratch_size, want) == cudaSuccess)
            break;
    }
    TRY(zero_gemm_counts(c));
    char report[768];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    enum cllm_status st =
        check_cuda(cllm_cuda_gemm_tune(data, n_w, N, K, gate_up_silu, (const __nv_bfloat16 *)x,
                                       n_max, y, ldy, c->gemm_scratch, c->gemm_scratch_size,
                                       c->tune_what, c->stream, report, sizeof report),
                   "GEMM tuning");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (st == CLLM_OK)
        cllm_log(CLLM_LOG_INFO, "cuda: GEMM %s (tuned in %.0f ms)", report,
                 (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6);
    cudaFree(c->gemm_scratch);
    c->gemm_scratch = NULL;
    c->gemm_scratch_size = 0;
    return st;
}

static struct cllm_cuda_batch batch_of(const struct cllm_attn_batch *b)
{
    struct cllm_cuda_batch d = {b->n_tokens,    b->pos,        b->seq,        b->slot,
                                b->block_table, b->max_blocks, b->block_size, b->max_len};
    return d;
}

/* Checks qkv_rope_store's operands and brings c->freqs to the rope's (theta, head_dim). */
static enum cllm_status prepare_rope(struct cuda *c, const struct cllm_rope *rope, int32_t ld,
                                     const struct cllm_weight *bias, int32_t n_head, int32_t n_kv)
{
    int32_t hd = rope->head_dim, half = hd / 2;
    if (hd <= 0 || hd % 2 || half > CLLM_CUDA_MAX_HALF_DIM || n_head < 1 || n_kv < 1 ||
        ld < (n_head + 2 * n_kv) * hd || (bias && bias->ne[0] != (int64_t)(n_head + 2 * n_kv) * hd))
        return CLLM_ERR_INVALID_ARG;
    if (c->freqs_theta != rope->theta || c->freqs_head_dim != hd) {
        /* exactly cpu/ref.c's frequencies: the host's powf, once per (theta, head_dim) */
        for (int32_t i = 0; i < half; i++)
            c->freqs.inv_freq[i] = 1.0f / powf(rope->theta, (float)(2 * i) / (float)hd);
        c->freqs_theta = rope->theta;
        c->freqs_head_dim = hd;
    }
    return CLLM_OK;
}

static enum cllm_status cu_qkv_rope_store(struct cllm_backend *be, const struct cllm_rope *rope,
                                          const struct cllm_attn_batch *b, float *qkv, int32_t ld,
                                          const struct cllm_weight *bias, int32_t n_head,
                                          int32_t n_kv, void *k_cache, void *v_cache)
{
    struct cuda *c = cuda_of(be);
    TRY(prepare_rope(c, rope, ld, bias, n_head, n_kv));
    struct cllm_cuda_batch d = batch_of(b);
    return check_cuda(cllm_cuda_qkv_rope_store(&d, &c->freqs, qkv, ld,
                                               bias ? (const float *)bias->data : NULL, n_head,
                                               n_kv, rope->head_dim, (__nv_bfloat16 *)k_cache,
                                               (__nv_bfloat16 *)v_cache, c->stream),
                      "qkv_rope_store");
}

static enum cllm_status cu_matmul_rope_store(struct cllm_backend *be, const struct cllm_weight *w,
                                             const void *x, const struct cllm_rope *rope,
                                             const struct cllm_attn_batch *b, float *qkv,
                                             int32_t ld, const struct cllm_weight *bias,
                                             int32_t n_head, int32_t n_kv, void *k_cache,
                                             void *v_cache, const struct cllm_norm_in *norm)
{
    struct cuda *c = cuda_of(be);
    TRY(prepare_rope(c, rope, ld, bias, n_head, n_kv));
    if (w->dtype != CLLM_DTYPE_BF16 || w->ne[0] > INT32_MAX ||
        w->ne[1] != (int64_t)(n_head + 2 * n_kv) * rope->head_dim)
        return CLLM_ERR_INVALID_ARG;
    int32_t K = (int32_t)w->ne[0];
    struct cllm_cuda_norm_in nin;
    if (c->gemm != CUDA_GEMM_MMA || (norm && !gemm_norm(norm, b->n_tokens, K, &nin)) ||
        !cllm_cuda_gemm_rope_supported(w->data, norm ? w->data : x, K, b->n_tokens, rope->head_dim))
        return CLLM_ERR_UNSUPPORTED;
    struct cllm_cuda_rope_store r;
    r.pos = b->pos, r.slot = b->slot;
    r.bias = bias ? (const float *)bias->data : NULL;
    r.n_head = n_head, r.n_kv = n_kv, r.head_dim = rope->head_dim;
    r.k_cache = (__nv_bfloat16 *)k_cache, r.v_cache = (__nv_bfloat16 *)v_cache;
    r.freqs = c->freqs;
    const int32_t N = (int32_t)w->ne[1];
    TRY(grow_gemm_scratch(c, cllm_cuda_gemm_scratch_bytes(N, K, b->n_tokens, norm != NULL)));
    return check_cuda(cllm_cuda_gemm_rope_store((const __nv_bfloat16 *)w->data, K,
                                                (const __nv_bfloat16 *)x, b->n_tokens, qkv, ld, &r,
                                                norm ? &nin : NULL, c->gemm_scratch,
                                                c->gemm_scratch_size, c->stream),
                      "gemm (QKV, RoPE, KV store)");
}

static enum cllm_status cu_attention(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                     const float *q, int32_t ldq, const void *k_cache,
                                     const void *v_cache, int32_t n_head, int32_t n_kv,
                                     int32_t head_dim, float scale, void *scratch, void *out)
{
    struct cuda *c = cuda_of(be);
    if (!cllm_cuda_attention_supported(n_head, n_kv, head_dim, c->attention_simt) ||
        ldq < n_head * head_dim)
        return CLLM_ERR_INVALID_ARG;
    struct cllm_cuda_batch d = batch_of(b);
    return check_cuda(cllm_cuda_attention(&d, q, ldq, (const __nv_bfloat16 *)k_cache,
                                          (const __nv_bfloat16 *)v_cache, n_head, n_kv, head_dim,
                                          scale, c->attention_simt, scratch, (__nv_bfloat16 *)out,
                                          c->stream),
                      "attention");
}

static size_t cu_attention_scratch(struct cllm_backend *be, int32_t n_tokens, int32_t n_head,
                                   int32_t head_dim)
{
    (void)be;
    return cllm_cuda_attention_scratch(n_tokens, n_head, head_dim);
}

static enum cllm_status cu_silu_mul(struct cllm_backend *be, const float *gate_up, int32_t n,
                                    int32_t dim, void *out)
{
    struct cuda *c = cuda_of(be);
    return check_cuda(cllm_cuda_silu_mul(gate_up, n, dim, (__nv_bfloat16 *)out, c->stream),
                      "silu_mul");
}

static enum cllm_status cu_gather_rows(struct cllm_backend *be, const float *x, const int32_t *idx,
                                       int32_t n_idx, int32_t dim, float *out)
{
    struct cuda *c = cuda_of(be);
    return check_cuda(cllm_cuda_gather_rows(x, idx, n_idx, dim, out, c->stream), "gather_rows");
}

/* --- recorded steps --- */

void cllm_backend_cuda_drop_graphs(struct cuda *c)
{
    for (int i = 0; i < c->n_graphs; i++)
        cudaGraphExecDestroy(c->graphs[i].exec);
    c->n_graphs = 0;
}

static enum cllm_status cu_graph_begin(struct cllm_backend *be, uint64_t key, bool *replayed)
{
    struct cuda *c = cuda_of(be);
    *replayed = false;
    if (c->capturing)
        return CLLM_ERR_INVALID_ARG;
    TRY(use_device(c));
    if (c->gemm_scratch_wanted > 0) {
        const size_t want = c->gemm_scratch_wanted;
        c->gemm_scratch_wanted = 0;
        TRY(grow_gemm_scratch(c, want));
    }
    for (int i = 0; i < c->n_graphs; i++)
        if (c->graphs[i].key == key) {
            TRY(check_cuda(cudaGraphLaunch(c->graphs[i].exec, c->stream), "cudaGraphLaunch"));
            *replayed = true;
            return CLLM_OK;
        }
    if (c->n_graphs == MAX_GRAPHS)
        cllm_backend_cuda_drop_graphs(
            c); /* shapes seen long ago get recorded again when they come back */
    TRY(check_cuda(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal),
                   "cudaStreamBeginCapture"));
    c->capturing = true;
    return CLLM_OK;
}

static enum cllm_status cu_graph_end(struct cllm_backend *be, uint64_t key)
{
    struct cuda *c = cuda_of(be);
    if (!c->capturing)
        return CLLM_ERR_INVALID_ARG;
    c->capturing = false;
    cudaGraph_t graph = NULL;
    TRY(check_cuda(cudaStreamEndCapture(c->stream, &graph), "cudaStreamEndCapture"));
    cudaGraphExec_t exec = NULL;
    enum cllm_status st = check_cuda(cllm_graph_instantiate(&exec, graph), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
    if (st)
        return st;
    c->graphs[c->n_graphs].key = key;
    c->graphs[c->n_graphs].exec = exec;
    c->n_graphs++;
    return check_cuda(cudaGraphLaunch(exec, c->stream), "cudaGraphLaunch");
}

void cllm_backend_cuda_bind_ops(struct cllm_backend_iface *f)
{
    f->embed = cu_embed;
    f->rmsnorm = cu_rmsnorm;
    f->add_rmsnorm = cu_add_rmsnorm;
    f->matmul = cu_matmul;
    f->qkv_rope_store = cu_qkv_rope_store;
    f->attention = cu_attention;
    f->attention_scratch = cu_attention_scratch;
    f->silu_mul = cu_silu_mul;
    f->matmul_gate_up_silu = cu_matmul_gate_up_silu;
    f->matmul_rope_store = cu_matmul_rope_store;
    f->gather_rows = cu_gather_rows;
    f->graph_begin = cu_graph_begin;
    f->graph_end = cu_graph_end;
    f->tune_matmul = cu_tune_matmul;
}
