/*
 * The penalties on the device (sample.h: cllm_cuda_penalize), run on the logits before the
 * draw (sample.cu): the host's arithmetic, one block per row.
 */
#include "backend/cuda/vendor.h"

#include <stdint.h>

#include "backend/cuda/sample.h"

#define PENALTY_THREADS 256

/* One logit through the penalties: the host's cllm_penalize, rounding for rounding (no
 * contraction into an FMA). A repetition penalty of 0 is a row's "off", as 1 is. */
static __device__ __forceinline__ float penalized(float l, uint32_t count,
                                                  const struct cllm_sample_row *p)
{
    const float rep = p->repetition_penalty;
    if (rep != 0.0f && rep != 1.0f)
        l = l < 0.0f ? __fmul_rn(l, rep) : __fdiv_rn(l, rep);
    if (count) {
        l = __fsub_rn(l, __fmul_rn(p->frequency_penalty, (float)count));
        l = __fsub_rn(l, p->presence_penalty);
    }
    return l;
}

/* One block per row; the row's tokens are distinct, so each logit has one writer. */
static __global__ void __launch_bounds__(PENALTY_THREADS)
    penalty_kernel(float *__restrict__ logits, int32_t n_vocab,
                   const struct cllm_sample_row *__restrict__ rows,
                   const struct cllm_token_count *__restrict__ counts,
                   const int32_t *__restrict__ prev)
{
    __shared__ int extra_listed;
    const struct cllm_sample_row p = rows[blockIdx.x];
    if (p.n_counts <= 0 && p.unseen_output <= 0)
        return; /* the whole block: no barrier is skipped by some threads only */
    const int32_t extra = p.unseen_output > 0 ? prev[p.unseen_output - 1] : -1;
    float *l = logits + (size_t)blockIdx.x * (size_t)n_vocab;
    const struct cllm_token_count *c = counts + p.counts_at;
    if (threadIdx.x == 0)
        extra_listed = 0;
    __syncthreads();
    for (int32_t i = (int32_t)threadIdx.x; i < p.n_counts; i += PENALTY_THREADS) {
        const int32_t t = c[i].token;
        if (t < 0 || t >= n_vocab)
            continue;
        uint32_t count = c[i].count;
        if (t == extra) {
            extra_listed = 1;
            if (count < 0xffffffffu)
                count++;
        }
        l[t] = penalized(l[t], count, &p);
    }
    __syncthreads();
    if (threadIdx.x == 0 && extra >= 0 && extra < n_vocab && !extra_listed)
        l[extra] = penalized(l[extra], 1, &p);
}

extern "C" cudaError_t cllm_cuda_penalize(float *logits, int32_t n, int32_t n_vocab,
                                          const struct cllm_sample_row *rows_dev,
                                          const struct cllm_token_count *counts_dev,
                                          const int32_t *prev_dev, cudaStream_t stream)
{
    if (n < 0 || n_vocab <= 0 || n_vocab > CLLM_CUDA_SAMPLE_MAX_VOCAB)
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    penalty_kernel<<<(unsigned)n, PENALTY_THREADS, 0, stream>>>(logits, n_vocab, rows_dev,
                                                                counts_dev, prev_dev);
    return cudaGetLastError();
}
