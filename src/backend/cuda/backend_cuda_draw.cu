/*
 * Sampling on the device (backend.h's sample, wait_draw, resolve_tokens): up to two draws
 * queued, each in its own slot with its own pinned tokens, so the host prepares the next step
 * while the device runs this one; the penalties' counts staged through pinned memory.
 */
#include "backend/cuda/vendor.h"

#include <string.h>

#include "backend/cuda/backend_cuda_internal.h"
#include "backend/cuda/sample.h"

extern "C" {
#include "core/alloc.h"
}

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
    const void *src =
        stage_counts(&c->draws[(c->draw_head + c->n_draws) % 2], counts, (size_t)n_counts);
    if (bytes)
        TRY(check_cuda(
            cudaMemcpyAsync(c->counts_dev, src, bytes, cudaMemcpyHostToDevice, c->stream),
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

static enum cllm_status cu_sync(struct cllm_backend *be)
{
    struct cuda *c = cuda_of(be);
    TRY(use_device(c));
    return finish_draws(c, true);
}

void cllm_backend_cuda_free_draws(struct cuda *c)
{
    free_sample_buffers(c);
    for (int i = 0; i < 2; i++)
        if (c->draws[i].done)
            cudaEventDestroy(c->draws[i].done);
    cudaFree(c->sample_scratch);
    cudaFree(c->counts_dev);
    for (int i = 0; i < 2; i++)
        cudaFreeHost(c->draws[i].counts_host);
}

void cllm_backend_cuda_bind_draws(struct cllm_backend_iface *f)
{
    f->sample = cu_sample;
    f->wait_draw = cu_wait_draw;
    f->resolve_tokens = cu_resolve_tokens;
    f->sync = cu_sync;
}
