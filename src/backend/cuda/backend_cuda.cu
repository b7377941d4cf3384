/*
 * CUDA implementation of backend.h, on one GPU and one stream.
 *
 * Weights: every matrix is stored as BF16 (BF16 sources are copied as they are; F16, F32 and
 * quantized GGUF types are widened on the host and rounded to BF16 once, at load), vectors
 * (norms, biases) as F32. Activations that feed a GEMM are BF16 (act_dtype), the residual
 * stream and GEMM outputs F32, the KV cache BF16.
 *
 * GEMMs (BF16 inputs, F32 accumulate and output) go to our batch-invariant kernel (gemm.cu),
 * so that a token's result never depends on the rest of its step; cuBLAS takes the operands that
 * kernel refuses (K not a multiple of 8, a vendor without MMA) and every GEMM when CLLM_CUBLAS=1
 * is set, for comparison. The other ops are our kernels (kernels.cu, attention.cu, sample.cu).
 * Every op only queues work on the stream, so a whole decode step can be recorded once into a CUDA
 * graph and replayed (graph_begin/graph_end).
 *
 * Errors: every CUDA and cuBLAS call is checked; a failure is logged with the call that made
 * it and becomes CLLM_ERR_DEVICE (CLLM_ERR_NOMEM when memory ran out), never an abort.
 */
#include "backend/cuda/vendor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/cuda/backend_cuda.h"
#include "backend/cuda/blas.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/sample.h"

extern "C" {
#include "core/alloc.h"
#include "core/f16.h"
#include "core/log.h"
#include "core/status.h"
#include "tensor/convert.h"
#include "tensor/dtype.h"
}

#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define STAGING_BYTES ((size_t)16 << 20) /* pinned buffer weights are converted through */
#define MAX_GRAPHS 256

bool cllm_cuda_pdl = false; /* vendor.h */

struct graph_entry {
    uint64_t key;
    cudaGraphExec_t exec;
};

/* One device draw of tokens (cu_sample), queued until its wait. */
struct draw {
    int32_t *tokens_dev, *tokens_host; /* tokens_host is pinned */
    cudaEvent_t done;                  /* recorded when tokens_host is written */
    int32_t *dst;                      /* the caller's array its wait fills */
    int32_t n, vocab;
    bool delivered;          /* dst written already (the buffers grew under it) ... */
    enum cllm_status status; /* ... with this outcome */
    /* pinned staging of the draw's penalty counts: a pageable upload of ~1 MB could make the
     * host wait for the queued step (no run-ahead); the slot is free, so nothing reads it */
    struct cllm_token_count *counts_host;
    size_t counts_cap;
};

struct cuda {
    struct cllm_backend be;
    struct cllm_backend_iface iface; /* cuda_iface, less the recordings where they are off */
    int device;
    cudaStream_t stream;
    struct cllm_blas blas_api; /* bound at start-up (blas.h) */
    cublasHandle_t blas;       /* NULL without the library */
    void *blas_workspace;
    bool cublas_only;    /* every GEMM through the BLAS (not batch-invariant): CLLM_CUBLAS=1, or a
                            build without MMA */
    bool attention_simt; /* CLLM_ATTN_SIMT=1: the CUDA-core attention kernel (comparison) */
    bool probing_blas;   /* the start-up probe is running */
    bool blas_bf16_out;  /* the BLAS writes GEMMs in BF16 only (the start-up probe found) ... */
    void *blas_out;      /* ... into this, widened to F32 after */
    size_t blas_out_size;
    void *gemm_scratch; /* slices of the tiled GEMM run in parallel through this (gemm.h) */
    size_t gemm_scratch_size;
    size_t gemm_scratch_wanted; /* what a recording needed and could not grow to */
    size_t gemm_scratch_refused; /* the smallest size cudaMalloc refused (0: none) */
    void *staging; /* pinned, STAGING_BYTES */
    /* device sampling: up to two draws queued, each in its own slot, oldest first */
    struct cllm_sample_row *rows_dev;
    struct draw draws[2];
    int32_t n_draws, draw_head, last_draw; /* last_draw: slot of the newest draw, -1: none */
    int32_t sample_cap;
    void *sample_scratch;
    size_t sample_scratch_size;
    void *counts_dev; /* the penalties' token counts of the newest draw */
    size_t counts_size;
    /* RoPE frequencies of the last (theta, head_dim) asked for */
    struct cllm_cuda_rope_freqs freqs;
    float freqs_theta;
    int32_t freqs_head_dim;
    /* recorded steps */
    struct graph_entry graphs[MAX_GRAPHS];
    int n_graphs;
    bool capturing;
    unsigned tune_what; /* the GEMM choices tune_matmul may make (gemm.h); 0: none */
};

static struct cuda *cuda_of(struct cllm_backend *be)
{
    return (struct cuda *)be->ctx;
}

/* Turns a CUDA result into a status, logging what failed. The runtime also keeps a failed
 * call's error as its last error, which the next op's launch check (cudaGetLastError) would
 * report as that op's own failure (a graph that found no room to be instantiated failed the
 * op-by-op step run instead): once reported here it is taken back. An error that sticks (an
 * illegal address) is not lost by this: every later call returns it. */
static enum cllm_status check_cuda(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return CLLM_OK;
    (void)cudaGetLastError();
    cllm_log(CLLM_LOG_ERROR, "cuda: %s failed: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? CLLM_ERR_NOMEM : CLLM_ERR_DEVICE;
}

/* The same for the BLAS; a failure the start-up probe tries for is only worth an info line. */
static enum cllm_status check_blas(const struct cuda *c, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return CLLM_OK;
    char text[32];
    cllm_log(c->probing_blas ? CLLM_LOG_INFO : CLLM_LOG_ERROR, "cuda: %s failed: %s", what,
             cllm_blas_status(&c->blas_api, s, text, sizeof text));
    return s == CUBLAS_STATUS_ALLOC_FAILED ? CLLM_ERR_NOMEM : CLLM_ERR_DEVICE;
}

/* The engine thread is not the thread that opened the device: make it current first. */
static enum cllm_status use_device(struct cuda *c)
{
    return check_cuda(cudaSetDevice(c->device), "cudaSetDevice");
}

#define TRY(call)                                                                                  \
    do {                                                                                           \
        enum cllm_status st_ = (call);                                                             \
        if (st_)                                                                                   \
            return st_;                                                                            \
    } while (0)

/* --- memory --- */

/* cudaMalloc and cudaMallocHost, whose refusal the caller handles: the runtime also keeps a
 * failed allocation as its last error, which the next op's launch check (cudaGetLastError)
 * would report as that op's own failure, so it is taken back here. */
static cudaError_t device_alloc(void **p, size_t bytes)
{
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
    }
    return e;
}

static cudaError_t pinned_alloc(void **p, size_t bytes)
{
    cudaError_t e = cudaMallocHost(p, bytes);
    if (e != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
    }
    return e;
}

static enum cllm_status cu_alloc(struct cllm_backend *be, size_t bytes, void **out)
{
    *out = NULL;
    TRY(use_device(cuda_of(be)));
    return check_cuda(device_alloc(out, bytes ? bytes : 256), "cudaMalloc");
}

static void cu_dealloc(struct cllm_backend *be, void *p)
{
    (void)be;
    if (p)
        cudaFree(p);
}

/* Queues a copy of n bytes on the stream. */
static enum cllm_status copy_async(struct cllm_backend *be, void *dst, const void *src, size_t n,
                                   cudaMemcpyKind kind, const char *what)
{
    struct cuda *c = cuda_of(be);
    if (!n)
        return CLLM_OK;
    TRY(use_device(c));
    return check_cuda(cudaMemcpyAsync(dst, src, n, kind, c->stream), what);
}

static enum cllm_status cu_upload(struct cllm_backend *be, void *dst, const void *src, size_t n)
{
    return copy_async(be, dst, src, n, cudaMemcpyHostToDevice, "upload");
}

static enum cllm_status cu_download(struct cllm_backend *be, void *dst, const void *src, size_t n)
{
    return copy_async(be, dst, src, n, cudaMemcpyDeviceToHost, "download");
}

static enum cllm_status cu_memzero(struct cllm_backend *be, void *dst, size_t n)
{
    struct cuda *c = cuda_of(be);
    if (!n)
        return CLLM_OK;
    TRY(use_device(c));
    return check_cuda(cudaMemsetAsync(dst, 0, n, c->stream), "cudaMemsetAsync");
}

static enum cllm_status cu_mem_info(struct cllm_backend *be, size_t *free_bytes,
                                    size_t *total_bytes)
{
    TRY(use_device(cuda_of(be)));
    return check_cuda(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}

/* --- weights --- */

/* Copies n bytes from the host to the device on the backend's stream and waits for them: the
 * source may be reused at once and every later kernel sees the bytes. Not cudaMemcpy: it runs
 * on the legacy stream, which our non-blocking stream is not ordered after, and from pageable
 * memory it may return before the bytes have landed (CUDA's API synchronization behavior) -
 * the first kernels could read a weight still being written (the emulator's race check,
 * tests/emu/emu.cpp, reported exactly that). */
static enum cllm_status upload_now(struct cuda *c, void *dst, const void *src, size_t n,
                                   const char *what)
{
    TRY(check_cuda(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream), what));
    return check_cuda(cudaStreamSynchronize(c->stream), what);
}

/* Copies rows [0, rows) of t, as BF16, to dst (device): BF16 files as they are, other types
 * widened and rounded on all cores, a staging buffer at a time. */
static enum cllm_status upload_bf16_rows(struct cuda *c, const struct cllm_tensor *t,
                                         __nv_bfloat16 *dst, char *err, size_t err_len)
{
    int64_t cols = t->ne[0], rows = cllm_tensor_nrows(t);
    if (t->dtype == CLLM_DTYPE_BF16) /* the file's bytes are the device's */
        return upload_now(c, dst, t->data, (size_t)(cols * rows) * 2, "weight upload");
    int64_t per_chunk = (int64_t)(STAGING_BYTES / ((size_t)cols * 2));
    if (per_chunk < 1)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "tensor %s: rows of %lld are too long",
                         t->name, (long long)cols);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus < 1 ? 1 : cpus > 16 ? 16 : (int)cpus;
    uint16_t *stage = (uint16_t *)c->staging;
    for (int64_t r0 = 0; r0 < rows; r0 += per_chunk) {
        int64_t n = rows - r0 < per_chunk ? rows - r0 : per_chunk;
        if (!cllm_convert_rows_bf16(t, r0, n, stage, threads))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "tensor %s: cannot convert %s", t->name,
                             cllm_dtype_name(t->dtype));
        TRY(upload_now(c, dst + r0 * cols, stage, (size_t)(n * cols) * 2, "weight upload"));
    }
    return CLLM_OK;
}

/* Copies a vector, as F32, to dst (device). */
static enum cllm_status upload_f32_vector(struct cuda *c, const struct cllm_tensor *t, float *dst,
                                          char *err, size_t err_len)
{
    float *f = (float *)malloc((size_t)t->ne[0] * sizeof(float));
    if (!f)
        return CLLM_ERR_NOMEM;
    enum cllm_status st = CLLM_OK;
    if (!cllm_dequant_row(t->dtype, t->data, f, t->ne[0]))
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "tensor %s: cannot convert %s", t->name,
                       cllm_dtype_name(t->dtype));
    else
        st = upload_now(c, dst, f, (size_t)t->ne[0] * sizeof(float), "vector upload");
    free(f);
    return st;
}

static enum cllm_status cu_weight_init_stacked(struct cllm_backend *be,
                                               const struct cllm_tensor *const *parts, int n_parts,
                                               struct cllm_weight *w, char *err, size_t err_len)
{
    struct cuda *c = cuda_of(be);
    memset(w, 0, sizeof *w);
    if (n_parts < 1)
        return CLLM_ERR_INVALID_ARG;
    TRY(use_device(c));
    int dims = parts[0]->n_dims;
    int64_t cols = parts[0]->ne[0], rows = 0;
    for (int i = 0; i < n_parts; i++) {
        const struct cllm_tensor *t = parts[i];
        if (t->n_dims > 2 || t->n_dims != dims || (dims == 2 && t->ne[0] != cols))
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "tensor %s: cannot stack it with %s", t->name, parts[0]->name);
        rows += dims == 2 ? t->ne[1] : t->ne[0];
    }
    void *data = NULL;
    size_t bytes = dims == 2 ? (size_t)(rows * cols) * 2 : (size_t)rows * sizeof(float);
    TRY(check_cuda(device_alloc(&data, bytes ? bytes : 256), "cudaMalloc (weights)"));
    enum cllm_status st = CLLM_OK;
    for (int i = 0, at = 0; st == CLLM_OK && i < n_parts; i++) {
        const struct cllm_tensor *t = parts[i];
        if (dims == 2) {
            st = upload_bf16_rows(c, t, (__nv_bfloat16 *)data + (int64_t)at * cols, err, err_len);
            at += (int)t->ne[1];
        } else {
            st = upload_f32_vector(c, t, (float *)data + at, err, err_len);
            at += (int)t->ne[0];
        }
    }
    if (st) {
        cudaFree(data);
        return st;
    }
    w->host = parts[0];
    w->data = data;
    w->dtype = dims == 2 ? CLLM_DTYPE_BF16 : CLLM_DTYPE_F32;
    w->ne[0] = dims == 2 ? cols : rows;
    w->ne[1] = dims == 2 ? rows : 1;
    return CLLM_OK;
}

static enum cllm_status cu_weight_init(struct cllm_backend *be, const struct cllm_tensor *t,
                                       struct cllm_weight *w, char *err, size_t err_len)
{
    return cu_weight_init_stacked(be, &t, 1, w, err, err_len);
}

static void cu_weight_free(struct cllm_backend *be, struct cllm_weight *w)
{
    (void)be;
    if (w->data)
        cudaFree((void *)w->data);
    memset(w, 0, sizeof *w);
}

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

static void drop_graphs(struct cuda *c);

/* Replaces the device buffer *p of *size bytes by one of `bytes` (its contents are not kept;
 * if cudaMalloc fails, by none). */
static cudaError_t replace_device_buffer(void **p, size_t *size, size_t bytes)
{
    cudaFree(*p);
    *p = NULL;
    *size = 0;
    cudaError_t e = device_alloc(p, bytes);
    if (e == cudaSuccess)
        *size = bytes;
    return e;
}

/* Replaces the device buffer *p of *size bytes by one of need bytes if it is smaller. */
static enum cllm_status grow_device_buffer(void **p, size_t *size, size_t need, const char *what)
{
    return need <= *size ? CLLM_OK : check_cuda(replace_device_buffer(p, size, need), what);
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
    drop_graphs(c);
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
static enum cllm_status blas_matmul(struct cuda *c, const void *w, int32_t K, int32_t N,
                                    const void *x, int32_t n, const float *bias, float *y,
                                    int32_t ldy)
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
    if (!c->cublas_only && cllm_cuda_gemm_supported(w->data, x, K)) {
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
    return blas_matmul(c, w->data, K, N, x, n, b, y, ldy);
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
    if (c->cublas_only || !cllm_cuda_gemm_supported(w->data, norm ? w->data : x, K))
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
    bool ours = !c->cublas_only && c->tune_what;
    for (int32_t i = 0; i < n_w && ours; i++)
        ours = cllm_cuda_gemm_supported(data[i], x, K);
    if (!ours || cllm_cuda_gemm_tuned(N, K, n_max))
        return CLLM_OK; /* the BLAS chooses for itself; nothing is open; or done before */
    TRY(use_device(c));
    TRY(check_cuda(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize"));
    drop_graphs(c); /* they may point into the scratch */
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
    if (c->cublas_only || (norm && !gemm_norm(norm, b->n_tokens, K, &nin)) ||
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

/* --- sampling --- */

static void free_sample_buffers(struct cuda *c)
{
    cudaFree(c->rows_dev);
    c->rows_dev = NULL;
    for (int i = 0; i < 2; i++) {
        cudaFree(c->draws[i].tokens_dev);
        cudaFreeHost(c->draws[i].tokens_host);
        c->draws[i].tokens_dev = c->draws[i].tokens_host = NULL;
    }
    c->sample_cap = 0;
    c->last_draw = -1; /* its tokens are gone */
}

/* Writes a draw's tokens (on the host by now) to its caller's array. */
static enum cllm_status deliver_draw(struct draw *d)
{
    d->delivered = true;
    d->status = CLLM_OK;
    memcpy(d->dst, d->tokens_host, (size_t)d->n * sizeof(int32_t));
    for (int32_t i = 0; i < d->n; i++)
        if (d->dst[i] < 0 || d->dst[i] >= d->vocab) {
            cllm_log(CLLM_LOG_ERROR, "cuda: the sampler returned token %d of %d", (int)d->dst[i],
                     (int)d->vocab);
            d->status = CLLM_ERR_DEVICE;
            break;
        }
    return d->status;
}

/* Waits for the whole stream and writes the tokens of every draw queued; they stay queued
 * (wait_draw still takes them in order) unless `pop`. */
static enum cllm_status finish_draws(struct cuda *c, bool pop)
{
    enum cllm_status st = check_cuda(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    if (st) {
        c->n_draws = 0; /* a failed sync leaves the callers' tokens unwritten */
        return st;
    }
    for (int32_t i = 0; i < c->n_draws; i++) {
        struct draw *d = &c->draws[(c->draw_head + i) % 2];
        enum cllm_status ds = d->delivered ? d->status : deliver_draw(d);
        if (!st)
            st = ds;
    }
    if (pop)
        c->n_draws = 0;
    return st;
}

/* Buffers for draws of n rows. Growing them first finishes the draws in flight; the newest
 * draw's tokens are carried over, for the next step to read (resolve_tokens, a penalty's
 * unseen output). */
static enum cllm_status sample_buffers(struct cuda *c, int32_t n, int32_t n_vocab)
{
    if (n > c->sample_cap) {
        if (c->n_draws > 0 && finish_draws(c, false) != CLLM_OK && c->n_draws == 0)
            return CLLM_ERR_DEVICE; /* the stream failed: nothing can be queued */
        const int32_t kept_slot = c->last_draw;
        int32_t *kept = NULL, kept_n = 0;
        if (kept_slot >= 0) {
            kept = c->draws[kept_slot].tokens_dev;
            kept_n = c->draws[kept_slot].n;
            c->draws[kept_slot].tokens_dev = NULL;
        }
        free_sample_buffers(c);
        enum cllm_status st =
            check_cuda(device_alloc((void **)&c->rows_dev, (size_t)n * sizeof *c->rows_dev),
                       "cudaMalloc (sampling)");
        for (int i = 0; i < 2 && !st; i++) {
            struct draw *d = &c->draws[i];
            st = check_cuda(device_alloc((void **)&d->tokens_dev, (size_t)n * sizeof(int32_t)),
                            "cudaMalloc (sampling)");
            if (!st)
                st = check_cuda(pinned_alloc((void **)&d->tokens_host, (size_t)n * sizeof(int32_t)),
                                "cudaMallocHost (sampling)");
            if (!st && !d->done)
                st = check_cuda(cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming),
                                "cudaEventCreate (sampling)");
        }
        if (!st && kept) {
            st = check_cuda(cudaMemcpyAsync(c->draws[kept_slot].tokens_dev, kept,
                                            (size_t)kept_n * sizeof(int32_t),
                                            cudaMemcpyDeviceToDevice, c->stream),
                            "copy (sampled tokens)");
            if (!st)
                st = check_cuda(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
        }
        cudaFree(kept);
        if (st) {
            free_sample_buffers(c);
            return st;
        }
        c->sample_cap = n;
        c->last_draw = kept_slot;
    }
    return grow_device_buffer(&c->sample_scratch, &c->sample_scratch_size,
                              cllm_cuda_sample_scratch_bytes(n, n_vocab), "cudaMalloc (sampling)");
}

/* Where the n counts go up from: the free draw slot d's pinned buffer (grown; a copy made),
 * or the caller's own array when pinned memory runs out. */
static const void *stage_counts(struct draw *d, const struct cllm_token_count *counts, size_t n)
{
    if (n > d->counts_cap) {
        const size_t cap = cllm_grow_cap(d->counts_cap, n, 16384);
        cudaFreeHost(d->counts_host);
        d->counts_host = NULL;
        d->counts_cap = 0;
        if (pinned_alloc((void **)&d->counts_host, cap * sizeof *counts) != cudaSuccess)
            return counts;
        d->counts_cap = cap;
    }
    if (n)
        memcpy(d->counts_host, counts, n * sizeof *counts);
    return d->counts_host;
}

/* The penalties' part of a draw: checks rows against counts and the previous draw, uploads
 * the counts and queues the penalty kernel (nothing when no row has penalties). rows_dev
 * holds rows already. */
static enum cllm_status queue_penalties(struct cuda *c, float *logits, int32_t n, int32_t n_vocab,
                                        const struct cllm_sample_row *rows,
                                        const struct cllm_token_count *counts)
{
    int64_t n_counts;
    int32_t max_unseen;
    if (!cllm_sample_rows_check(rows, n, counts, &n_counts, &max_unseen))
        return CLLM_ERR_INVALID_ARG;
    if (n_counts == 0 && max_unseen == 0)
        return CLLM_OK; /* no row has penalties */
    const int32_t *prev = NULL;
    if (max_unseen > 0) {
        if (c->last_draw < 0 || max_unseen > c->draws[c->last_draw].n)
            return CLLM_ERR_INVALID_ARG;
        prev = c->draws[c->last_draw].tokens_dev;
    }
    const size_t bytes = (size_t)n_counts * sizeof *counts;
    TRY(grow_device_buffer(&c->counts_dev, &c->counts_size, bytes, "cudaMalloc (penalties)"));
    const void *src = stage_counts(&c->draws[(c->draw_head + c->n_draws) % 2], counts,
                                   (size_t)n_counts);
    if (bytes)
        TRY(check_cuda(cudaMemcpyAsync(c->counts_dev, src, bytes, cudaMemcpyHostToDevice, c->stream),
                       "upload (penalties)"));
    return check_cuda(cllm_cuda_penalize(logits, n, n_vocab, c->rows_dev,
                                         (const struct cllm_token_count *)c->counts_dev, prev,
                                         c->stream),
                      "penalties");
}

static enum cllm_status cu_sample(struct cllm_backend *be, float *logits, int32_t n,
                                  int32_t n_vocab, const struct cllm_sample_row *rows,
                                  const struct cllm_token_count *counts, int32_t *tokens)
{
    struct cuda *c = cuda_of(be);
    if (n <= 0)
        return CLLM_OK;
    if (c->capturing || n_vocab <= 0 || c->n_draws == 2)
        return CLLM_ERR_INVALID_ARG;
    TRY(use_device(c));
    TRY(sample_buffers(c, n, n_vocab));
    /* rows_dev is shared: this upload runs after the previous draw's kernel read it */
    TRY(check_cuda(cudaMemcpyAsync(c->rows_dev, rows, (size_t)n * sizeof *rows,
                                   cudaMemcpyHostToDevice, c->stream),
                   "upload (sampling rows)"));
    TRY(queue_penalties(c, logits, n, n_vocab, rows, counts));
    const int32_t slot = (c->draw_head + c->n_draws) % 2;
    struct draw *d = &c->draws[slot];
    TRY(check_cuda(cllm_cuda_sample(logits, n, n_vocab, c->rows_dev, d->tokens_dev,
                                    c->sample_scratch, c->sample_scratch_size, c->stream),
                   "sample"));
    TRY(check_cuda(cudaMemcpyAsync(d->tokens_host, d->tokens_dev, (size_t)n * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, c->stream),
                   "download (tokens)"));
    TRY(check_cuda(cudaEventRecord(d->done, c->stream), "cudaEventRecord (tokens)"));
    d->dst = tokens, d->n = n, d->vocab = n_vocab, d->delivered = false;
    c->n_draws++;
    c->last_draw = slot;
    return CLLM_OK;
}

static enum cllm_status cu_wait_draw(struct cllm_backend *be)
{
    struct cuda *c = cuda_of(be);
    if (c->n_draws == 0)
        return CLLM_ERR_INVALID_ARG;
    TRY(use_device(c));
    struct draw *d = &c->draws[c->draw_head];
    if (!d->delivered) {
        enum cllm_status st =
            check_cuda(cudaEventSynchronize(d->done), "cudaEventSynchronize (tokens)");
        if (st) {
            c->n_draws = 0; /* a failed wait leaves the callers' tokens unwritten */
            return st;
        }
        deliver_draw(d);
    }
    c->draw_head = (c->draw_head + 1) % 2;
    c->n_draws--;
    return d->status;
}

static enum cllm_status cu_resolve_tokens(struct cllm_backend *be, int32_t *tokens, int32_t n)
{
    struct cuda *c = cuda_of(be);
    if (c->capturing || c->last_draw < 0)
        return CLLM_ERR_INVALID_ARG;
    TRY(use_device(c));
    const struct draw *d = &c->draws[c->last_draw];
    return check_cuda(cllm_cuda_resolve_tokens(tokens, n, d->tokens_dev, d->n, c->stream),
                      "resolve tokens");
}

/* --- recorded steps --- */

static void drop_graphs(struct cuda *c)
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
        drop_graphs(c); /* shapes seen long ago get recorded again when they come back */
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
    enum cllm_status st = check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
    if (st)
        return st;
    c->graphs[c->n_graphs].key = key;
    c->graphs[c->n_graphs].exec = exec;
    c->n_graphs++;
    return check_cuda(cudaGraphLaunch(exec, c->stream), "cudaGraphLaunch");
}

static enum cllm_status cu_sync(struct cllm_backend *be)
{
    struct cuda *c = cuda_of(be);
    TRY(use_device(c));
    return finish_draws(c, true);
}

/* --- lifetime --- */

static void cu_free(struct cllm_backend *be)
{
    struct cuda *c = cuda_of(be);
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    drop_graphs(c);
    if (c->blas)
        c->blas_api.destroy(c->blas);
    cllm_blas_unload(&c->blas_api);
    cudaFree(c->blas_workspace);
    cudaFreeHost(c->staging);
    free_sample_buffers(c);
    for (int i = 0; i < 2; i++)
        if (c->draws[i].done)
            cudaEventDestroy(c->draws[i].done);
    cudaFree(c->sample_scratch);
    cudaFree(c->counts_dev);
    for (int i = 0; i < 2; i++)
        cudaFreeHost(c->draws[i].counts_host);
    cudaFree(c->gemm_scratch);
    cudaFree(c->blas_out);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

static const struct cllm_backend_iface cuda_iface = {
    /* .name = */ "cuda",
    /* .act_dtype = */ CLLM_DTYPE_BF16,
    /* .kv_dtype = */ CLLM_DTYPE_BF16,
    /* .free = */ cu_free,
    /* .alloc = */ cu_alloc,
    /* .dealloc = */ cu_dealloc,
    /* .upload = */ cu_upload,
    /* .download = */ cu_download,
    /* .memzero = */ cu_memzero,
    /* .alloc_zeroed = */ NULL, /* cudaMemset is fast */
    /* .mem_info = */ cu_mem_info,
    /* .weight_init = */ cu_weight_init,
    /* .weight_init_stacked = */ cu_weight_init_stacked,
    /* .weight_free = */ cu_weight_free,
    /* .embed = */ cu_embed,
    /* .rmsnorm = */ cu_rmsnorm,
    /* .add_rmsnorm = */ cu_add_rmsnorm,
    /* .matmul = */ cu_matmul,
    /* .qkv_rope_store = */ cu_qkv_rope_store,
    /* .attention = */ cu_attention,
    /* .attention_scratch = */ cu_attention_scratch,
    /* .silu_mul = */ cu_silu_mul,
    /* .matmul_gate_up_silu = */ cu_matmul_gate_up_silu,
    /* .matmul_rope_store = */ cu_matmul_rope_store,
    /* .gather_rows = */ cu_gather_rows,
    /* .sample = */ cu_sample,
    /* .wait_draw = */ cu_wait_draw,
    /* .resolve_tokens = */ cu_resolve_tokens,
    /* .graph_begin = */ cu_graph_begin,
    /* .graph_end = */ cu_graph_end,
    /* .sync = */ cu_sync,
    /* .host_threads = */ NULL, /* the engine draws on its own host threads */
    /* .host_run = */ NULL,
    /* .tune_matmul = */ cu_tune_matmul,
};

/* Where the BLAS does the model's GEMMs (a build without MMA, CLLM_CUBLAS=1): one small GEMM
 * at start-up, whose exact result is known (small integers: every sum is exact in F32 and in
 * BF16), in F32 output, else in BF16 output (c->blas_bf16_out) - muBLAS's F32 output from BF16
 * is unverified, its BF16 output is what PyTorch uses. Neither right: the device is refused. */
static enum cllm_status probe_blas(struct cuda *c, char *err, size_t err_len)
{
    enum { K = 16, N = 8, n = 3 };
    uint16_t w[N * K], x[n * K];
    float want[n * N], got[n * N];
    for (int i = 0; i < N * K; i++)
        w[i] = cllm_f32_to_bf16((float)(i * 7 % 5 - 2));
    for (int i = 0; i < n * K; i++)
        x[i] = cllm_f32_to_bf16((float)(i * 3 % 7 - 3));
    for (int t = 0; t < n; t++)
        for (int r = 0; r < N; r++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++)
                s += cllm_bf16_to_f32(w[r * K + k]) * cllm_bf16_to_f32(x[t * K + k]);
            want[t * N + r] = s;
        }
    void *dw = NULL, *dx = NULL, *dy = NULL;
    enum cllm_status st = check_cuda(device_alloc(&dw, sizeof w), "cudaMalloc (BLAS probe)");
    if (!st)
        st = check_cuda(device_alloc(&dx, sizeof x), "cudaMalloc (BLAS probe)");
    if (!st)
        st = check_cuda(device_alloc(&dy, sizeof got), "cudaMalloc (BLAS probe)");
    if (!st)
        st = upload_now(c, dw, w, sizeof w, "BLAS probe upload");
    if (!st)
        st = upload_now(c, dx, x, sizeof x, "BLAS probe upload");
    bool right = false;
    c->probing_blas = true;
    for (int mode = 0; !st && !right && mode < 2; mode++) {
        c->blas_bf16_out = mode == 1;
        enum cllm_status run = blas_matmul(c, dw, K, N, dx, n, NULL, (float *)dy, N);
        if (!run)
            run = check_cuda(cudaStreamSynchronize(c->stream), "BLAS probe");
        if (!run)
            run = check_cuda(cudaMemcpy(got, dy, sizeof got, cudaMemcpyDeviceToHost),
                             "BLAS probe download");
        right = !run;
        for (int i = 0; right && i < n * N; i++)
            right = got[i] == want[i]; /* not memcmp: a zero's sign may differ */
        if (!right)
            cllm_log(mode ? CLLM_LOG_ERROR : CLLM_LOG_INFO,
                     "cuda: the BLAS %s a BF16 GEMM with %s output",
                     run ? "cannot run" : "miscomputes", mode ? "BF16" : "F32");
    }
    c->probing_blas = false;
    cudaFree(dw), cudaFree(dx), cudaFree(dy);
    if (st)
        return cllm_fail(err, err_len, st, "CUDA device %d: the BLAS probe failed", c->device);
    if (!right)
        return cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                         "CUDA device %d: the vendor BLAS fails a small BF16 GEMM, with F32 and "
                         "with BF16 output (see the log)",
                         c->device);
    return CLLM_OK;
}

/* A switch for comparisons (CLLM_CUBLAS, CLLM_ATTN_SIMT, CLLM_NO_PDL): on when set to "1". */
static bool env_is_one(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "1") == 0;
}

/* The tiled GEMM's block shape from CLLM_GEMM_TILE and the skinny one's prefetch and split
 * from CLLM_GEMM_AHEAD and CLLM_GEMM_SPLIT (gemm.h: same bits, another speed), for comparisons
 * on a GPU; a value it does not know is ignored with a warning. Returns the choices left to
 * tune_matmul: those the environment did not fix, none under CLLM_GEMM_TUNE=0. */
static unsigned choose_gemm_variants(void)
{
    unsigned open =
        CLLM_CUDA_GEMM_TUNE_TILING | CLLM_CUDA_GEMM_TUNE_AHEAD | CLLM_CUDA_GEMM_TUNE_SPLIT;
    const char *split = getenv("CLLM_GEMM_SPLIT"); /* blocks a skinny row tile */
    if (split && *split) {
        if (strcmp(split, "1") == 0 || strcmp(split, "2") == 0 || strcmp(split, "4") == 0) {
            cllm_cuda_gemm_force_split(split[0] - '0');
            open &= ~CLLM_CUDA_GEMM_TUNE_SPLIT;
        } else
            cllm_log(CLLM_LOG_WARN, "cuda: CLLM_GEMM_SPLIT=%s ignored: not 1, 2 or 4", split);
    }
    const char *ahead = getenv("CLLM_GEMM_AHEAD"); /* the skinny kernel's prefetch, likewise */
    if (ahead && *ahead) {
        if (strcmp(ahead, "always") == 0 || strcmp(ahead, "never") == 0) {
            cllm_cuda_gemm_force_ahead(ahead[0] == 'a' ? 1 : -1);
            open &= ~CLLM_CUDA_GEMM_TUNE_AHEAD;
        } else
            cllm_log(CLLM_LOG_WARN, "cuda: CLLM_GEMM_AHEAD=%s ignored: not always or never", ahead);
    }
    const char *tile = getenv("CLLM_GEMM_TILE");
    if (tile && *tile) {
        cudaError_t e = cllm_cuda_gemm_use_tiling(tile);
        if (e == cudaSuccess)
            open &= ~CLLM_CUDA_GEMM_TUNE_TILING;
        else if (e == cudaErrorInvalidValue)
            cllm_log(CLLM_LOG_WARN,
                     "cuda: CLLM_GEMM_TILE=%s ignored: not one of 128x64, 256x64, 128x128, 256x128",
                     tile);
        else {
            (void)cudaGetLastError();
            cllm_log(CLLM_LOG_WARN, "cuda: CLLM_GEMM_TILE=%s ignored: %s", tile,
                     cudaGetErrorString(e));
        }
    }
    /* CLLM_GEMM_TUNE=0: every GEMM the default way (for comparisons) */
    const char *tune = getenv("CLLM_GEMM_TUNE");
    return tune && strcmp(tune, "0") == 0 ? 0u : open;
}

extern "C" enum cllm_status cllm_backend_cuda_new(struct cllm_backend **out, int32_t device,
                                                  char *err, size_t err_len)
{
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "no CUDA device: %s",
                         e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    if (device < 0 || device >= count)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "CUDA device %d does not exist (%d found)", (int)device, count);
    struct cuda *c = (struct cuda *)calloc(1, sizeof *c);
    if (!c)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    c->device = device;
    c->last_draw = -1;
    c->iface = cuda_iface;
#ifdef CLLM_GRAPHS_OPT_IN
    if (!env_is_one(CLLM_GRAPHS_OPT_IN)) {
        c->iface.graph_begin = NULL; /* the model then runs every step op by op */
        c->iface.graph_end = NULL;
        cllm_log(CLLM_LOG_INFO, "cuda: steps are not recorded (set %s=1 to record them)",
                 CLLM_GRAPHS_OPT_IN);
    }
#endif
    c->be.iface = &c->iface;
    c->be.ctx = c;
    const char *step = "cudaSetDevice";
    e = cudaSetDevice(device);
    if (e == cudaSuccess)
        step = "cudaStreamCreate", e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        step = "cudaMalloc (BLAS workspace)",
        e = device_alloc(&c->blas_workspace, BLAS_WORKSPACE_BYTES);
    if (e == cudaSuccess)
        step = "cudaMallocHost (staging)", e = pinned_alloc(&c->staging, STAGING_BYTES);
    if (e != cudaSuccess) {
        cllm_fail(err, err_len, CLLM_ERR_DEVICE, "CUDA device %d: %s failed: %s", (int)device, step,
                  cudaGetErrorString(e));
        cu_free(&c->be);
        return CLLM_ERR_DEVICE;
    }
    /* cuBLAS, if it is there: only the fallback and the CLLM_CUBLAS=1 comparison need it. A
     * fixed workspace: it must not allocate while a step is being recorded. */
    char blas_err[256];
    if (cllm_blas_load(&c->blas_api, blas_err, sizeof blas_err)) {
        cublasStatus_t s = c->blas_api.create(&c->blas);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = c->blas_api.set_stream(c->blas, c->stream);
        if (s == CUBLAS_STATUS_SUCCESS && c->blas_api.set_workspace)
            s = c->blas_api.set_workspace(c->blas, c->blas_workspace, BLAS_WORKSPACE_BYTES);
        if (s != CUBLAS_STATUS_SUCCESS) {
            cllm_fail(err, err_len, CLLM_ERR_DEVICE, "CUDA device %d: cuBLAS: %s", (int)device,
                      cllm_blas_status(&c->blas_api, s, blas_err, sizeof blas_err));
            cu_free(&c->be);
            return CLLM_ERR_DEVICE;
        }
    } else {
#ifndef CLLM_HAVE_MMA
        /* without tensor-core MMA our GEMM is not built: the BLAS does every GEMM */
        cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                  "CUDA device %d: this build needs the vendor BLAS: %s", (int)device, blas_err);
        cu_free(&c->be);
        return CLLM_ERR_DEVICE;
#else
        cllm_log(CLLM_LOG_INFO, "cuda: no cuBLAS (%s): our GEMM only", blas_err);
#endif
    }
    c->cublas_only = env_is_one("CLLM_CUBLAS");
    if (c->cublas_only && !c->blas) {
        cllm_log(CLLM_LOG_WARN, "cuda: CLLM_CUBLAS=1 ignored: cuBLAS could not be loaded");
        c->cublas_only = false;
    }
    const char *gemm =
        c->cublas_only ? "cuBLAS (CLLM_CUBLAS=1, not batch-invariant)" : "ours, batch-invariant";
    c->attention_simt = env_is_one("CLLM_ATTN_SIMT");
#ifndef CLLM_HAVE_MMA
    /* our GEMM and the tensor-core attention need mma.sync */
    c->cublas_only = true;
    gemm = "the vendor BLAS (not batch-invariant)";
    c->attention_simt = true;
#endif
    if (c->cublas_only && probe_blas(c, err, err_len) != CLLM_OK) {
        cu_free(&c->be);
        return CLLM_ERR_DEVICE;
    }
    if (c->blas_bf16_out)
        gemm = "the vendor BLAS in BF16 (it writes no F32 from BF16; not batch-invariant)";
    char ours[96];
    if (!c->cublas_only) {
        c->tune_what = choose_gemm_variants();
        snprintf(ours, sizeof ours, "%s, %s%s", gemm,
                 c->tune_what & CLLM_CUDA_GEMM_TUNE_TILING ? "tiles tuned at start, default "
                                                           : "tiles ",
                 cllm_cuda_gemm_tiling());
        gemm = ours;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        cllm_cuda_pdl = prop.major >= 9 && !env_is_one("CLLM_NO_PDL");
        cllm_log(CLLM_LOG_INFO,
                 "cuda: device %d: %s, %d SMs, %.1f GiB, compute %d.%d, GEMM: %s, attention: %s, "
                 "programmatic dependent launch: %s",
                 (int)device, prop.name, prop.multiProcessorCount,
                 (double)prop.totalGlobalMem / (1 << 30), prop.major, prop.minor, gemm,
                 c->attention_simt ? "CUDA cores" : "tensor cores", cllm_cuda_pdl ? "on" : "off");
    }
    *out = &c->be;
    return CLLM_OK;
}
