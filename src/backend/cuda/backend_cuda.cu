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
 * This file: memory, weights, start-up and lifetime; the ops and recorded steps are in
 * backend_cuda_ops.cu, sampling in backend_cuda_draw.cu, the state they share in
 * backend_cuda_internal.h.
 *
 * Errors: every CUDA and cuBLAS call is checked; a failure is logged with the call that made
 * it and becomes CLLM_ERR_DEVICE (CLLM_ERR_NOMEM when memory ran out), never an abort.
 */
#include "backend/cuda/vendor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/backend_cuda.h"
#include "backend/cuda/backend_cuda_internal.h"
#include "backend/cuda/gemm.h"

extern "C" {
#include "core/f16.h"
#include "tensor/convert.h"
#include "tensor/dtype.h"
}

#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define STAGING_BYTES ((size_t)16 << 20) /* pinned buffer weights are converted through */

bool cllm_cuda_pdl = false; /* vendor.h */

/* --- memory --- */

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

/* --- lifetime --- */

static void cu_free(struct cllm_backend *be)
{
    struct cuda *c = cuda_of(be);
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    cllm_backend_cuda_drop_graphs(c);
    if (c->blas)
        c->blas_api.destroy(c->blas);
    cllm_blas_unload(&c->blas_api);
    cudaFree(c->blas_workspace);
    cudaFreeHost(c->staging);
    cllm_backend_cuda_free_draws(c);
    cudaFree(c->gemm_scratch);
    cudaFree(c->blas_out);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

/* The interface: memory, weights and lifetime here, the ops and recorded steps in
 * backend_cuda_ops.cu, the draws in backend_cuda_draw.cu. */
static void bind_iface(struct cllm_backend_iface *f)
{
    memset(f, 0, sizeof *f);
    f->name = "cuda";
    f->act_dtype = CLLM_DTYPE_BF16;
    f->kv_dtype = CLLM_DTYPE_BF16;
    f->free = cu_free;
    f->alloc = cu_alloc;
    f->dealloc = cu_dealloc;
    f->upload = cu_upload;
    f->download = cu_download;
    f->memzero = cu_memzero;
    f->alloc_zeroed = NULL; /* cudaMemset is fast */
    f->mem_info = cu_mem_info;
    f->weight_init = cu_weight_init;
    f->weight_init_stacked = cu_weight_init_stacked;
    f->weight_free = cu_weight_free;
    f->host_threads = NULL; /* the engine draws on its own host threads */
    f->host_run = NULL;
    cllm_backend_cuda_bind_ops(f);
    cllm_backend_cuda_bind_draws(f);
}

/* Where the BLAS does the model's GEMMs (a build without MMA, CLLM_CUBLAS=1): one small GEMM
 * at start-up, whose exact result is known (small integers: every sum is exact in F32 and in
 * BF16), in F32 output, else in BF16 output (c->blas_bf16_out) - muBLAS's F32 output from BF16
 * is unverified, its BF16 output is what PyTorch uses. *right: one of them was right (else
 * choose_gemm decides); an error only where the probe could not run (memory, the device). */
static enum cllm_status probe_blas(struct cuda *c, bool *right_out, char *err, size_t err_len)
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
        enum cllm_status run =
            cllm_backend_cuda_blas_matmul(c, dw, K, N, dx, n, NULL, (float *)dy, N);
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
        c->blas_bf16_out = false;
    *right_out = right;
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

/* Which GEMM runs the model (struct cuda's gemm), into c->gemm with its description for the
 * start-up line; c->blas is the loaded BLAS or NULL (blas_err: why). A build without MMA takes
 * the BLAS where it passes the probe (probe_blas; CLLM_CUBLAS=1 asks the same of any build),
 * else our GEMM on CUDA cores: a BLAS missing or wrong costs the GPU's speed for prefill, not
 * the GPU. on_cores (the engine's second try after a failed device check) or CLLM_GEMM_SIMT=1
 * take that GEMM on any build. Fails only where a probe could not run at all (the device's
 * error), or where CLLM_CUBLAS=1 asked for a cuBLAS that fails it. */
static enum cllm_status choose_gemm(struct cuda *c, bool on_cores, const char *blas_err,
                                    const char **what, char *err, size_t err_len)
{
#ifdef CLLM_HAVE_MMA
    c->gemm = CUDA_GEMM_MMA;
    *what = "ours, batch-invariant";
    if (!c->blas)
        cllm_log(CLLM_LOG_INFO, "cuda: no cuBLAS (%s): our GEMM only", blas_err);
    if (env_is_one("CLLM_CUBLAS")) {
        if (c->blas)
            c->gemm = CUDA_GEMM_BLAS;
        else
            cllm_log(CLLM_LOG_WARN, "cuda: CLLM_CUBLAS=1 ignored: cuBLAS could not be loaded");
    }
#else
    c->gemm = CUDA_GEMM_BLAS; /* our tensor-core GEMM needs mma.sync */
    if (!c->blas) {
        cllm_log(CLLM_LOG_WARN,
                 "cuda: no vendor BLAS (%s): every GEMM runs on CUDA cores, prefill is slower",
                 blas_err);
        c->gemm = CUDA_GEMM_SIMT;
    }
#endif
    if (on_cores || env_is_one("CLLM_GEMM_SIMT"))
        c->gemm = CUDA_GEMM_SIMT;
    if (c->gemm == CUDA_GEMM_BLAS) {
        bool right = false;
        TRY(probe_blas(c, &right, err, err_len));
        if (!right) {
#ifdef CLLM_HAVE_MMA
            return cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                             "CUDA device %d: cuBLAS fails a small BF16 GEMM, with F32 and with "
                             "BF16 output (see the log; CLLM_CUBLAS=1 asked for it)",
                             c->device);
#else
            cllm_log(CLLM_LOG_ERROR, "cuda: the vendor BLAS fails a small BF16 GEMM, with F32 and "
                                     "with BF16 output: every GEMM runs on CUDA cores instead");
            c->blas_api.destroy(c->blas); /* not even for operands ours refuses */
            c->blas = NULL;
            c->gemm = CUDA_GEMM_SIMT;
#endif
        }
    }
    if (c->gemm == CUDA_GEMM_SIMT)
        *what = "ours on CUDA cores, batch-invariant";
    else if (c->gemm == CUDA_GEMM_BLAS)
        *what = c->blas_bf16_out
                    ? "the vendor BLAS in BF16 (it writes no F32 from BF16; not batch-invariant)"
                    : "the vendor BLAS (not batch-invariant)";
    return CLLM_OK;
}

extern "C" enum cllm_status cllm_backend_cuda_new(struct cllm_backend **out, int32_t device,
                                                  bool gemm_on_cores, char *err, size_t err_len)
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
    bind_iface(&c->iface);
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
    /* cuBLAS, if it is there: only the fallback and the CLLM_CUBLAS=1 comparison need it (and a
     * build without MMA, which has no GEMM of ours on tensor cores). A fixed workspace: it must
     * not allocate while a step is being recorded. */
    char blas_err[256] = "";
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
    }
    const char *gemm = NULL;
    enum cllm_status st = choose_gemm(c, gemm_on_cores, blas_err, &gemm, err, err_len);
    if (st != CLLM_OK) {
        cu_free(&c->be);
        return st;
    }
#ifdef CLLM_HAVE_MMA
    c->attention_simt = env_is_one("CLLM_ATTN_SIMT");
#else
    c->attention_simt = true; /* the tensor-core attention needs mma.sync */
#endif
    char ours[160];
    if (c->gemm == CUDA_GEMM_MMA) {
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
