/*
 * Inside the CUDA backend (not its interface, which is backend_cuda.h): its state and the
 * helpers its files share -- backend_cuda.cu (memory, weights, start-up and lifetime),
 * backend_cuda_ops.cu (the ops, the GEMM's scratch, recorded steps) and backend_cuda_draw.cu
 * (sampling on the device: the draw queue and the penalties). C++ for nvcc (and the emulator),
 * after vendor.h.
 */
#ifndef CLLM_BACKEND_CUDA_BACKEND_CUDA_INTERNAL_H
#define CLLM_BACKEND_CUDA_BACKEND_CUDA_INTERNAL_H

#include "backend/cuda/vendor.h"

#include "backend/backend.h"
#include "backend/cuda/blas.h"
#include "backend/cuda/kernels.h"

extern "C" {
#include "core/log.h"
#include "core/status.h"
}

#define MAX_GRAPHS 256

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

/* What runs the model's GEMMs: ours on tensor cores (gemm.h; the fused variants too), the
 * vendor BLAS (not batch-invariant: CLLM_CUBLAS=1, or a build without MMA whose BLAS passes the
 * start-up probe), or ours on CUDA cores (gemm_simt.h: a build without MMA and without a working
 * BLAS, or CLLM_GEMM_SIMT=1). With either of the last two the fused GEMMs are refused and the
 * model runs the separate kernels. */
enum cuda_gemm { CUDA_GEMM_MMA, CUDA_GEMM_BLAS, CUDA_GEMM_SIMT };

struct cuda {
    struct cllm_backend be;
    struct cllm_backend_iface
        iface; /* bind_iface's (backend_cuda.cu), less the recordings where they are off */
    int device;
    cudaStream_t stream;
    struct cllm_blas blas_api; /* bound at start-up (blas.h) */
    cublasHandle_t blas;       /* NULL without the library */
    void *blas_workspace;
    enum cuda_gemm gemm; /* what runs the model's GEMMs */
    bool attention_simt; /* CLLM_ATTN_SIMT=1: the CUDA-core attention kernel (comparison) */
    bool probing_blas;   /* the start-up probe is running */
    bool blas_bf16_out;  /* the BLAS writes GEMMs in BF16 only (the start-up probe found) ... */
    void *blas_out;      /* ... into this, widened to F32 after */
    size_t blas_out_size;
    void *gemm_scratch; /* slices of the tiled GEMM run in parallel through this (gemm.h) */
    size_t gemm_scratch_size;
    size_t gemm_scratch_wanted;  /* what a recording needed and could not grow to */
    size_t gemm_scratch_refused; /* the smallest size cudaMalloc refused (0: none) */
    void *staging;               /* pinned, STAGING_BYTES */
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

static inline struct cuda *cuda_of(struct cllm_backend *be)
{
    return (struct cuda *)be->ctx;
}

/* Turns a CUDA result into a status, logging what failed. The runtime also keeps a failed
 * call's error as its last error, which the next op's launch check (cudaGetLastError) would
 * report as that op's own failure (a graph that found no room to be instantiated failed the
 * op-by-op step run instead): once reported here it is taken back. An error that sticks (an
 * illegal address) is not lost by this: every later call returns it. */
static inline enum cllm_status check_cuda(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return CLLM_OK;
    (void)cudaGetLastError();
    cllm_log(CLLM_LOG_ERROR, "cuda: %s failed: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? CLLM_ERR_NOMEM : CLLM_ERR_DEVICE;
}

/* The same for the BLAS; a failure the start-up probe tries for is only worth an info line. */
static inline enum cllm_status check_blas(const struct cuda *c, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return CLLM_OK;
    char text[32];
    cllm_log(c->probing_blas ? CLLM_LOG_INFO : CLLM_LOG_ERROR, "cuda: %s failed: %s", what,
             cllm_blas_status(&c->blas_api, s, text, sizeof text));
    return s == CUBLAS_STATUS_ALLOC_FAILED ? CLLM_ERR_NOMEM : CLLM_ERR_DEVICE;
}

/* The engine thread is not the thread that opened the device: make it current first. */
static inline enum cllm_status use_device(struct cuda *c)
{
    return check_cuda(cudaSetDevice(c->device), "cudaSetDevice");
}

#define TRY(call)                                                                                  \
    do {                                                                                           \
        enum cllm_status st_ = (call);                                                             \
        if (st_)                                                                                   \
            return st_;                                                                            \
    } while (0)

/* cudaMalloc and cudaMallocHost, whose refusal the caller handles: the runtime also keeps a
 * failed allocation as its last error, which the next op's launch check (cudaGetLastError)
 * would report as that op's own failure, so it is taken back here. */
static inline cudaError_t device_alloc(void **p, size_t bytes)
{
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
    }
    return e;
}

static inline cudaError_t pinned_alloc(void **p, size_t bytes)
{
    cudaError_t e = cudaMallocHost(p, bytes);
    if (e != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
    }
    return e;
}

/* Replaces the device buffer *p of *size bytes by one of `bytes` (its contents are not kept;
 * if cudaMalloc fails, by none). */
static inline cudaError_t replace_device_buffer(void **p, size_t *size, size_t bytes)
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
static inline enum cllm_status grow_device_buffer(void **p, size_t *size, size_t need,
                                                  const char *what)
{
    return need <= *size ? CLLM_OK : check_cuda(replace_device_buffer(p, size, need), what);
}

/* backend_cuda_ops.cu: the ops and recorded steps of the interface; the recordings dropped
 * (a buffer they point into is replaced, or the backend closes); a GEMM through the BLAS. */
void cllm_backend_cuda_bind_ops(struct cllm_backend_iface *f);
void cllm_backend_cuda_drop_graphs(struct cuda *c);
enum cllm_status cllm_backend_cuda_blas_matmul(struct cuda *c, const void *w, int32_t K, int32_t N,
                                               const void *x, int32_t n, const float *bias,
                                               float *y, int32_t ldy);

/* backend_cuda_draw.cu: sample, wait_draw, resolve_tokens and sync of the interface; the
 * draws' buffers and events freed (the backend closes: after its stream has finished). */
void cllm_backend_cuda_bind_draws(struct cllm_backend_iface *f);
void cllm_backend_cuda_free_draws(struct cuda *c);

#endif
