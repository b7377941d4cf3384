/* Reference ops in plain F32, mirroring transformers' Qwen2 modeling code. */
#include "backend/cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void cllm_ref_rmsnorm_row(const float *x, const float *w, float eps, int32_t dim, float *out)
{
    /* transformers: variance = x.pow(2).mean(-1); x * rsqrt(variance + eps); weight * x */
    float sum = 0.0f;
    for (int32_t i = 0; i < dim; i++)
        sum += x[i] * x[i];
    float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int32_t i = 0; i < dim; i++)
        out[i] = w[i] * (x[i] * scale);
}

void cllm_ref_silu_mul(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void cllm_ref_rope_cos_sin(const struct cllm_rope *rope, int32_t pos, float *cos_out,
                           float *sin_out)
{
    int32_t half = rope->head_dim / 2;
    for (int32_t i = 0; i < half; i++) {
        float exponent = (float)(2 * i) / (float)rope->head_dim;
        float inv_freq = 1.0f / powf(rope->theta, exponent);
        float angle = (float)pos * inv_freq;
        /* The F32 angle is what transformers has; its cos/sin in double, rounded once. */
        cos_out[i] = (float)cos((double)angle);
        sin_out[i] = (float)sin((double)angle);
    }
}

void cllm_ref_rope_apply(float *x, const float *cos, const float *sin, int32_t head_dim)
{
    /* x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) */
    int32_t half = head_dim / 2;
    for (int32_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* Cache row of position p of token t's sequence. */
static int64_t slot_of(const struct cllm_attn_batch *b, int32_t t, int32_t p)
{
    int32_t block = b->block_table[(int64_t)b->seq[t] * b->max_blocks + p / b->block_size];
    return (int64_t)block * b->block_size + p % b->block_size;
}

void cllm_ref_attention_head(const struct cllm_attn_batch *b, int32_t t, int32_t h,
                             const float *q, const float *k_cache, const float *v_cache,
                             int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                             float *out)
{
    int32_t kvh = h / (n_head / n_kv), n_pos = b->pos[t] + 1;
    const float *qh = q + ((int64_t)t * n_head + h) * head_dim;
    float *scores = malloc((size_t)n_pos * sizeof *scores);
    if (!scores)
        return;
    float max = -INFINITY;
    for (int32_t p = 0; p < n_pos; p++) {
        const float *k = k_cache + (slot_of(b, t, p) * n_kv + kvh) * head_dim;
        float s = 0.0f;
        for (int32_t i = 0; i < head_dim; i++)
            s += qh[i] * k[i];
        scores[p] = s * scale;
        if (scores[p] > max)
            max = scores[p];
    }
    float sum = 0.0f;
    for (int32_t p = 0; p < n_pos; p++) {
        scores[p] = expf(scores[p] - max);
        sum += scores[p];
    }
    float *o = out + ((int64_t)t * n_head + h) * head_dim;
    memset(o, 0, (size_t)head_dim * sizeof *o);
    for (int32_t p = 0; p < n_pos; p++) {
        const float *v = v_cache + (slot_of(b, t, p) * n_kv + kvh) * head_dim;
        float wgt = scores[p] / sum;
        for (int32_t i = 0; i < head_dim; i++)
            o[i] += wgt * v[i];
    }
    free(scores);
}

void cllm_ref_attention(const struct cllm_attn_batch *b, const float *q, const float *k_cache,
                        const float *v_cache, int32_t n_head, int32_t n_kv, int32_t head_dim,
                        float scale, float *out)
{
    for (int32_t t = 0; t < b->n_tokens; t++)
        for (int32_t h = 0; h < n_head; h++)
            cllm_ref_attention_head(b, t, h, q, k_cache, v_cache, n_head, n_kv, head_dim, scale,
                                    out);
}
