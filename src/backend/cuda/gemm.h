/*
 * The batch-invariant GEMM of the CUDA backend: y[t] = W x[t] (+ bias) with BF16 W [N][K] and
 * x [n][K], F32 accumulation and output. cuBLAS picks its kernel (tile, split-K) from the whole
 * shape, so a token's result changes with how many other tokens share its step, and a greedy
 * answer with what else is in the batch (DESIGN.md forbids that). Here every element is
 * computed one way, whatever n is:
 *
 *   y[t][i] = ((P_0 + P_1) + ... + P_{S-1}) + bias[i]
 *   P_s     = the chain of tensor-core steps over the 32-element K chunks of slice s, in order,
 *             starting from zero; S = cllm_cuda_gemm_slices(N, K), a function of the weight's
 *             shape only.
 *
 * Two kernels implement that one formula: a "skinny" one for decode steps (n <= 32; one warp
 * per 16 rows x slice, streaming W with 16-byte loads, slices reduced in shared memory --
 * or, where a row tile's slices are spread over several blocks, by the last of them) and a
 * tiled one for larger steps (128 rows x 64 tokens per block, or another shape: below, through
 * shared memory; slices one after the other in the block, or in parallel blocks summed by a
 * second kernel in order).
 */
#ifndef CLLM_BACKEND_CUDA_GEMM_H
#define CLLM_BACKEND_CUDA_GEMM_H

#include "backend/cuda/vendor.h"

#include <stddef.h>
#include <stdint.h>

/* Steps with at most this many tokens take the skinny kernel. */
#define CLLM_CUDA_GEMM_SKINNY_MAX 32

/* The tiled kernel's block shape, W rows x tokens: "128x64" (the default, measured on an H200 in
 * session 22), "256x64" or "128x128" (warps of 64 x 32 rather than 32 x 32: more MMAs per
 * shared-memory load), "256x128" (warps of 64 x 64, twice the multiply-adds per byte loaded of
 * 128x64; for blocks that compute one slice: a weight of one slice, or slices in parallel
 * blocks -- other steps run in 128x64 blocks); none but 128x64 measured on a GPU yet. For the
 * steps no tuned plan (below) covers (the backend takes CLLM_GEMM_TILE, which also keeps
 * tuning to it); the bits are the same whichever runs.
 * cudaErrorInvalidValue for an unknown name, or the runtime's error raising the shared-memory
 * limit. */
cudaError_t cllm_cuda_gemm_use_tiling(const char *name);
const char *cllm_cuda_gemm_tiling(void);

/* For comparisons on a GPU (the backend takes CLLM_GEMM_AHEAD=always|never): whether the
 * skinny kernel requests W a group of chunks ahead -- 1 always, -1 never, 0 (the default) in
 * blocks of 4 slices or more. Same bits either way. */
void cllm_cuda_gemm_force_ahead(int mode);

/* For comparisons on a GPU (the backend takes CLLM_GEMM_SPLIT=1|2|4): how many blocks share a
 * row tile's slices in decode steps where the scratch holds their sums (the tile's last block
 * to finish adds them up in slice order: same bits); 1 (the default) is one block a tile.
 * Taken only where the slices divide evenly and the row tiles are few (below). */
void cllm_cuda_gemm_force_split(int parts);

/* Start-up tuning. Each GEMM may run several ways -- the tiled kernel's block shape, its slices
 * in series or in parallel blocks, the skinny kernel's W prefetch -- that compute the same
 * bits (the formula above fixes every sum) at speeds that depend on the GPU, the weight's
 * shape and the step's size. cllm_cuda_gemm_tune times them for weights [N][K] on the device
 * (w[0..n_w): the layers' weights of one projection, used in turn as a step uses them, so
 * that each launch streams its weight from memory rather than from L2), for step sizes from
 * 1 up to n_max in buckets (1-8, 9-16, 17-32 tokens: the skinny
 * kernel's tiles; then 33-64, 65-128, ... powers of two), and keeps the fastest per bucket
 * for every later GEMM of that shape (cllm_cuda_gemm, _gate_up_silu, _rope_store) in this
 * process; untuned shapes and buckets run the default way (the process's tiling, parallel
 * slices when the tiles leave SMs idle, prefetch in blocks of 4+ slices). `what` says which
 * choices are open: */
#define CLLM_CUDA_GEMM_TUNE_TILING 1u /* the tiled kernel's shape (else the process's tiling) */
#define CLLM_CUDA_GEMM_TUNE_AHEAD 2u  /* the skinny prefetch (else the default rule) */
#define CLLM_CUDA_GEMM_TUNE_SPLIT 4u  /* blocks a skinny row tile (else the default, one) */
/* Whether slices run in parallel is always open. x [n_max][K] and y ([n_max][ldy] F32, or
 * paired: the stacked [gate | up] weight, N = 2F, and y the BF16 [n_max][ldy >= F] output)
 * are overwritten; scratch (scratch_bytes, may be short of
 * cllm_cuda_gemm_tune_scratch_bytes: parallel ways it cannot hold are not timed) too. Must not
 * be called while the stream is being recorded. report (may be NULL) gets one line: each
 * bucket's winner, its time per GEMM and the default way's. */
cudaError_t cllm_cuda_gemm_tune(const __nv_bfloat16 *const *w, int32_t n_w, int32_t N, int32_t K,
                                int paired, const __nv_bfloat16 *x, int32_t n_max, void *y,
                                int32_t ldy, void *scratch, size_t scratch_bytes, unsigned what,
                                cudaStream_t stream, char *report, size_t report_len);
size_t cllm_cuda_gemm_tune_scratch_bytes(int32_t N, int32_t K, int32_t n_max);
/* Drops every tuned way (tests: back to the defaults). */
void cllm_cuda_gemm_forget_plans(void);
/* Has this process tuned [N][K] for every step size up to n_max? (A second model of the same
 * shapes, or a second look at one, need not time them again.) */
int cllm_cuda_gemm_tuned(int32_t N, int32_t K, int32_t n_max);
/* The way a GEMM of this shape runs a step of n tokens, in words ("ahead", "not ahead",
 * "ahead, 2 blocks a tile", "128x64", "256x64 parallel"): for logs and tests. */
void cllm_cuda_gemm_way(int32_t N, int32_t K, int32_t n, char *out, size_t len);

/* K slices of a weight [N][K] (>= 1): enough warps to keep the memory system busy when one
 * token streams W, never slices shorter than 4 chunks. */
int32_t cllm_cuda_gemm_slices(int32_t N, int32_t K);

/* Can cllm_cuda_gemm take these operands? K a multiple of 8 and w, x 16-byte aligned (each
 * lane loads 8 BF16 at a time). */
int cllm_cuda_gemm_supported(const void *w, const void *x, int32_t K);

/* Device scratch with which cllm_cuda_gemm runs the slices of an [N][K] weight over n tokens
 * in parallel blocks (0: it never does for this shape, nor with the norm inside: norm_inside,
 * a GEMM given a cllm_cuda_norm_in). Without it the same sums run one after the other in each
 * block: same bits, fewer blocks busy. Its first CLLM_CUDA_GEMM_COUNT_BYTES (counts of the
 * blocks done with a row tile) must be zero when a scratch is first used; the GEMMs leave them
 * zero. */
size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n, bool norm_inside);
#define CLLM_CUDA_GEMM_COUNT_BYTES 16384

/* y[t][i] = sum_k w[i][k] x[t][k] (+ bias[i]) for t < n, i < N; y rows of stride ldy >= N.
 * scratch (device, may be NULL) is used if it holds cllm_cuda_gemm_scratch_bytes. */
cudaError_t cllm_cuda_gemm(const __nv_bfloat16 *w, const float *bias, int32_t N, int32_t K,
                           const __nv_bfloat16 *x, int32_t n, float *y, int32_t ldy, void *scratch,
                           size_t scratch_bytes, cudaStream_t stream);

/* The RMSNorm before a projection, done by the projection's own blocks in decode steps (the
 * gate/up and QKV GEMMs take one; NULL: x as given): x = rmsnorm(res + add) * g with the
 * rmsnorm kernel's bits (kernels.h; add NULL: rmsnorm(res) * g), and res_out = res + add
 * (another buffer than res: the other blocks still read res; not written when add is NULL).
 * Every block normalizes the rows itself, from L2, while its first weights stream in: one
 * kernel less, and its launch and drain, per norm. res, add, res_out [n][K] F32; g [K]. */
struct cllm_cuda_norm_in {
    const float *res, *add, *g;
    float eps;
    float *res_out;
};

/* Can the GEMMs take this norm for an n-token step of rows of K? Steps of
 * CLLM_CUDA_GEMM_NORM_MAX tokens or fewer (K small enough for their rows in shared memory),
 * res_out apart from res where there is a residual to add, every operand 16-byte aligned (the
 * norm loads 4 floats at a time). */
#define CLLM_CUDA_GEMM_NORM_MAX 8
int cllm_cuda_gemm_norm_supported(const struct cllm_cuda_norm_in *norm, int32_t n, int32_t K);

/* out[t][f] = bf16(silu(g) * u) with g, u rows f and F + f of y = W x[t], W the stacked
 * [gate | up] weight [2F][K] (no bias): cllm_cuda_gemm's sums for that weight (its slices) and
 * the silu_mul kernel's arithmetic, the same bits as the two, without the F32 [n][2F] buffer
 * between them. out rows of stride ldo >= F. scratch as cllm_cuda_gemm's for (2F, K, n). With
 * norm (x then unused), the norm first (above). */
cudaError_t cllm_cuda_gemm_gate_up_silu(const __nv_bfloat16 *w, int32_t F, int32_t K,
                                        const __nv_bfloat16 *x, int32_t n, __nv_bfloat16 *out,
                                        int32_t ldo, void *scratch, size_t scratch_bytes,
                                        const struct cllm_cuda_norm_in *norm, cudaStream_t stream);

struct cllm_cuda_rope_store; /* kernels.h */

/* Can cllm_cuda_gemm_rope_store take these? The operands cllm_cuda_gemm takes, a step the
 * skinny kernel runs (1 <= n <= CLLM_CUDA_GEMM_SKINNY_MAX), head_dim a multiple of 16. */
int cllm_cuda_gemm_rope_supported(const void *w, const void *x, int32_t K, int32_t n,
                                  int32_t head_dim);

/* The stacked QKV projection y = W x (no bias in the sum; W [N][K], N = (n_head + 2 n_kv)
 * head_dim) followed by what cllm_cuda_qkv_rope_store does to y -- bias, RoPE of q and k, K
 * and V into the cache -- in one kernel, with the same bits: one launch less per layer in
 * decode steps. With norm (x then unused), the norm first (above). scratch as cllm_cuda_gemm's
 * for (N, K, n). */
cudaError_t cllm_cuda_gemm_rope_store(const __nv_bfloat16 *w, int32_t K, const __nv_bfloat16 *x,
                                      int32_t n, float *y, int32_t ldy,
                                      const struct cllm_cuda_rope_store *r,
                                      const struct cllm_cuda_norm_in *norm, void *scratch,
                                      size_t scratch_bytes, cudaStream_t stream);

#endif
