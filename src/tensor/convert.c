#include "tensor/convert.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/f16.h"
#include "tensor/quant.h"

#define MAX_THREADS 64

/* Writes one dequantized row of cols floats into dst as the target encoding; false if it
 * cannot be encoded. */
typedef bool (*encode_row_fn)(const float *row, int64_t cols, void *dst);

struct convert_job {
    const struct cllm_tensor *t;
    uint64_t row_bytes;     /* source */
    uint64_t dst_row_bytes; /* target */
    encode_row_fn encode;
    int64_t row0, n_rows;
    uint8_t *dst;
    int ith, nth;
    bool ok;
};

static bool encode_bf16(const float *row, int64_t cols, void *dst)
{
    uint16_t *out = dst;
    for (int64_t i = 0; i < cols; i++)
        out[i] = cllm_f32_to_bf16(row[i]);
    return true;
}

/* Packs a block's 6-bit levels L[256] into ql/qh: the layout dequant.c decodes (per half of
 * 128: elements l, l + 32, l + 64, l + 96 share qh[l]; their low nibbles sit in ql[l],
 * ql[l + 32], the high halves of ql[l], ql[l + 32]). */
static void q6_k_pack(struct cllm_block_q6_k *b, const uint8_t *L)
{
    for (int h = 0; h < 2; h++, L += 128)
        for (int l = 0; l < 32; l++) {
            b->ql[64 * h + l] = (uint8_t)((L[l] & 0x0f) | (L[l + 64] & 0x0f) << 4);
            b->ql[64 * h + l + 32] = (uint8_t)((L[l + 32] & 0x0f) | (L[l + 96] & 0x0f) << 4);
            b->qh[32 * h + l] = (uint8_t)(L[l] >> 4 | (L[l + 32] >> 4) << 2 |
                                          (L[l + 64] >> 4) << 4 | (L[l + 96] >> 4) << 6);
        }
}

/* v rounded to the nearest integer, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves no
 * fraction bits (strict IEEE arithmetic, as this project compiles). Inline, unlike roundf. */
static inline float round_nearest(float v)
{
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

bool cllm_quantize_row_q6_k(const float *x, int64_t n, void *dst)
{
    if (n % CLLM_QK_K)
        return false;
    uint8_t *out = dst;
    for (int64_t i = 0; i < n / CLLM_QK_K;
         i++, x += CLLM_QK_K, out += sizeof(struct cllm_block_q6_k)) {
        float sub[CLLM_QK_K / 16], max_sub = 0.0f;
        for (int j = 0; j < CLLM_QK_K / 16; j++) {
            float amax = 0.0f;
            for (int k = 0; k < 16; k++) {
                const float a = fabsf(x[16 * j + k]);
                if (!(a <= FLT_MAX)) /* infinite or NaN */
                    return false;
                amax = a > amax ? a : amax;
            }
            sub[j] = amax / 31.0f;
            max_sub = sub[j] > max_sub ? sub[j] : max_sub;
        }
        struct cllm_block_q6_k b;
        /* d rounded up to an F16, so that every sub-block's scale fits in 127 steps of it
         * (small weights give subnormal F16 scales, whose steps are coarse). */
        const float want = max_sub / 127.0f;
        b.d = cllm_f32_to_f16(want);
        if (cllm_f16_to_f32(b.d) < want)
            b.d++;
        const float d = cllm_f16_to_f32(b.d);
        if (!(d <= FLT_MAX))
            return false;
        uint8_t L[CLLM_QK_K];
        for (int j = 0; j < CLLM_QK_K / 16; j++) {
            /* sub <= 127 d, so r <= 127 but for the division's rounding */
            const float r = d > 0.0f ? round_nearest(sub[j] / d) : 0.0f;
            b.scales[j] = (int8_t)(r < 127.0f ? r : 127.0f);
            /* Quantize against the scale as stored, so decoding meets the nearest level. */
            const float ds = d * (float)b.scales[j];
            float inv = ds > 0.0f ? 1.0f / ds : 0.0f;
            if (!(inv <= FLT_MAX)) /* ds below 1 / FLT_MAX: its elements decode to ~0 anyway */
                inv = 0.0f;
            for (int k = 0; k < 16; k++) {
                /* |x * inv| < 47 (sc >= 1 once ds > 0): clamped, then rounded */
                float v = x[16 * j + k] * inv;
                v = v < -32.0f ? -32.0f : v > 31.0f ? 31.0f : v;
                L[16 * j + k] = (uint8_t)((int)round_nearest(v) + 32);
            }
        }
        q6_k_pack(&b, L);
        memcpy(out, &b, sizeof b);
    }
    return true;
}

static void *convert_task(void *arg)
{
    struct convert_job *j = arg;
    int64_t cols = j->t->ne[0];
    int64_t start = j->n_rows * j->ith / j->nth, end = j->n_rows * (j->ith + 1) / j->nth;
    float *row = malloc((size_t)cols * sizeof *row);
    j->ok = row != NULL;
    for (int64_t r = start; j->ok && r < end; r++) {
        const char *src = (const char *)j->t->data + (uint64_t)(j->row0 + r) * j->row_bytes;
        j->ok = cllm_dequant_row(j->t->dtype, src, row, cols) &&
                j->encode(row, cols, j->dst + (uint64_t)r * j->dst_row_bytes);
    }
    free(row);
    return NULL;
}

static bool convert_rows(const struct cllm_tensor *t, int64_t row0, int64_t n_rows,
                         uint64_t dst_row_bytes, encode_row_fn encode, void *dst, int n_threads)
{
    struct convert_job jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    uint64_t row_bytes;
    int64_t rows = cllm_tensor_nrows(t);
    if (row0 < 0 || n_rows < 0 || row0 > rows || n_rows > rows - row0 ||
        !cllm_dtype_row_bytes(t->dtype, t->ne[0], &row_bytes))
        return false;
    int nth = n_threads < 1 ? 1 : n_threads > MAX_THREADS ? MAX_THREADS : n_threads;
    if (n_rows < nth)
        nth = n_rows > 0 ? (int)n_rows : 1;
    bool started[MAX_THREADS] = {false};
    for (int i = 0; i < nth; i++) {
        jobs[i] = (struct convert_job){t,   row_bytes, dst_row_bytes, encode, row0, n_rows,
                                       dst, i,         nth,           false};
        /* Thread 0's share runs here; a thread that cannot start runs here too. */
        if (i > 0)
            started[i] = pthread_create(&threads[i], NULL, convert_task, &jobs[i]) == 0;
    }
    convert_task(&jobs[0]);
    bool ok = jobs[0].ok;
    for (int i = 1; i < nth; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        else
            convert_task(&jobs[i]);
        ok = ok && jobs[i].ok;
    }
    return ok;
}

bool cllm_convert_rows_bf16(const struct cllm_tensor *t, int64_t row0, int64_t n_rows,
                            uint16_t *dst, int n_threads)
{
    return convert_rows(t, row0, n_rows, (uint64_t)t->ne[0] * sizeof *dst, encode_bf16, dst,
                        n_threads);
}

bool cllm_convert_rows_q6_k(const struct cllm_tensor *t, int64_t row0, int64_t n_rows, void *dst,
                            int n_threads)
{
    uint64_t dst_row_bytes;
    if (t->ne[0] <= 0 || t->ne[0] % CLLM_QK_K ||
        !cllm_dtype_row_bytes(CLLM_DTYPE_Q6_K, t->ne[0], &dst_row_bytes))
        return false;
    return convert_rows(t, row0, n_rows, dst_row_bytes, cllm_quantize_row_q6_k, dst, n_threads);
}
