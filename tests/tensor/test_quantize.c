/*
 * Quantizing float rows to Q6_K at load (tensor/convert.c, what --cpu-weights q6_k runs):
 * decoded by dequant.c (bit-exact with gguf-py), every element is within the bound the header
 * promises and the row's error is what 6 bits allow; zeros stay zeros, scales reach their
 * extremes; rows that Q6_K cannot hold are refused; converting a tensor on several threads
 * from any row equals quantizing its rows one by one. Rows sit in buffers of exactly their
 * bytes, so ASan catches a write past a row.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/f16.h"
#include "tensor/convert.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"
#include "test.h"

#define QK CLLM_QK_K
#define BLOCK_BYTES sizeof(struct cllm_block_q6_k)

static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static double uniform(void) /* [0, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static float gaussian(void)
{
    double u = uniform(), v = uniform();
    return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

/* Quantizes x (n floats), decodes it, and checks each element against the promised bound;
 * returns the relative RMS error (0 for an all-zero row). */
static double round_trip(const float *x, int64_t n, const char *what)
{
    uint8_t *q = malloc((size_t)(n / QK) * BLOCK_BYTES);
    float *y = malloc((size_t)n * sizeof *y);
    CHECKF(cllm_quantize_row_q6_k(x, n, q), "%s", what);
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q6_K, q, y, n));
    double err2 = 0.0, sum2 = 0.0;
    int bad = 0;
    for (int64_t b = 0; b < n / QK; b++) {
        struct cllm_block_q6_k blk;
        memcpy(&blk, q + b * BLOCK_BYTES, sizeof blk);
        const float d = cllm_f16_to_f32(blk.d); /* the block's scale as stored */
        for (int j = 0; j < QK / 16; j++) {
            float amax = 0.0f;
            for (int k = 0; k < 16; k++)
                amax = fmaxf(amax, fabsf(x[b * QK + 16 * j + k]));
            /* the header's bound, with slack for float rounding */
            const float bound = fmaxf(amax / 62.0f + d / 4.0f, 15.5f * d) * 1.0001f;
            for (int k = 0; k < 16; k++) {
                const int64_t i = b * QK + 16 * j + k;
                const float e = fabsf(y[i] - x[i]);
                if (!(e <= bound) && bad++ < 5)
                    fprintf(stderr, "%s: element %lld: %g decoded as %g (bound %g)\n", what,
                            (long long)i, (double)x[i], (double)y[i], (double)bound);
                err2 += (double)e * e;
                sum2 += (double)x[i] * x[i];
            }
        }
    }
    CHECKF(bad == 0, "%s: %d elements past the bound", what, bad);
    free(q);
    free(y);
    return sum2 > 0.0 ? sqrt(err2 / sum2) : 0.0;
}

static void test_round_trip(void)
{
    enum { N = 16 * QK };
    float *x = malloc(N * sizeof *x);

    /* weights as trained models have them: gaussian, a few outliers per block */
    for (int i = 0; i < N; i++)
        x[i] = 0.02f * gaussian() * (i % 97 == 0 ? 8.0f : 1.0f);
    double rel = round_trip(x, N, "gaussian with outliers");
    printf("gaussian with outliers: relative RMS error %.4f\n", rel);
    /* 6-bit levels over each 16's amax (~2.3 sigma): steps of ~0.075 sigma, an RMS error of
     * step / sqrt(12) ~ 2.2%, more where an outlier widens a sub-block (BF16 alone: ~0.2%;
     * one scale for all 256 values: ~4%) */
    CHECKF(rel < 0.03, "relative RMS error %.4f", rel);

    /* BF16 values, as LLaMA-Factory exports them */
    for (int i = 0; i < N; i++)
        x[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(0.05f * gaussian()));
    rel = round_trip(x, N, "bf16 gaussian");
    printf("bf16 gaussian: relative RMS error %.4f\n", rel);
    CHECKF(rel < 0.03, "relative RMS error %.4f", rel);

    /* scales at their extremes: sub-blocks from 1e-6 to 1 of the block's largest, a zero
     * sub-block and a zero block; one sign per sub-block, alternating signs */
    for (int i = 0; i < N; i++) {
        const int sub = (i % QK) / 16;
        const float mag = powf(10.0f, -(float)(sub % 7)) * (float)(1 + i % 5);
        x[i] = (sub == 3 || i / QK == 2) ? 0.0f : (sub & 1 ? mag : (i & 1 ? -mag : mag));
    }
    round_trip(x, N, "scales from 1 to 1e-6");
    {
        uint8_t q[BLOCK_BYTES];
        float y[QK];
        CHECK(cllm_quantize_row_q6_k(x + 2 * QK, QK, q));
        CHECK(cllm_dequant_row(CLLM_DTYPE_Q6_K, q, y, QK));
        int zeros = 0;
        for (int k = 0; k < QK; k++)
            zeros += y[k] == 0.0f;
        CHECKF(zeros == QK, "a zero block decodes to %d zeros of %d", zeros, QK);
    }

    /* the largest and smallest magnitudes a block's F16 scale allows, and subnormals */
    for (int i = 0; i < QK; i++)
        x[i] = (i & 1 ? -1.0f : 1.0f) * 1.0e8f * (float)(1 + i % 2);
    round_trip(x, QK, "large");
    for (int i = 0; i < QK; i++)
        x[i] = (i & 1 ? -1.0f : 1.0f) * 1.0e-38f * (float)(1 + i % 3);
    round_trip(x, QK, "subnormal");
    free(x);
}

static void test_refusals(void)
{
    float x[QK];
    uint8_t q[2 * BLOCK_BYTES];
    for (int i = 0; i < QK; i++)
        x[i] = 0.01f * (float)i;
    CHECK(cllm_quantize_row_q6_k(x, QK, q));
    CHECK(!cllm_quantize_row_q6_k(x, QK - 32, q)); /* not whole blocks */
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3; b++) {
        x[77] = bad[b];
        CHECKF(!cllm_quantize_row_q6_k(x, QK, q), "value %g", (double)bad[b]);
    }
    /* a scale past the F16 range: amax / 31 / 127 > 65504 */
    x[77] = 3.0e8f;
    CHECK(!cllm_quantize_row_q6_k(x, QK, q));
}

/* A [rows][K] F32 or BF16 tensor converted on 1, 3 and 7 threads from row0 equals quantizing
 * its rows one at a time; rows out of range and a K of partial blocks are refused. */
static void test_convert_rows(enum cllm_dtype type)
{
    enum { K = 2 * QK, ROWS = 29 };
    const size_t esize = type == CLLM_DTYPE_F32 ? 4 : 2;
    uint8_t *data = malloc(esize * K * ROWS);
    float *row = malloc(K * sizeof *row);
    for (int i = 0; i < K * ROWS; i++) {
        const float v = 0.03f * gaussian();
        const uint16_t h = cllm_f32_to_bf16(v);
        memcpy(data + esize * (size_t)i, esize == 4 ? (const void *)&v : &h, esize);
    }
    const struct cllm_tensor t = {"w", type, 2, {K, ROWS, 1, 1}, esize * K * ROWS, data};
    const size_t row_bytes = (K / QK) * BLOCK_BYTES;
    const int64_t row0 = 4, n = ROWS - row0;
    uint8_t *want = malloc(row_bytes * n), *got = malloc(row_bytes * n);
    for (int64_t r = 0; r < n; r++) {
        CHECK(cllm_dequant_row(type, data + esize * K * (size_t)(row0 + r), row, K));
        CHECK(cllm_quantize_row_q6_k(row, K, want + row_bytes * r));
    }
    for (int threads = 1; threads <= 7; threads += 2) {
        memset(got, 0xa5, row_bytes * n);
        CHECK(cllm_convert_rows_q6_k(&t, row0, n, got, threads));
        CHECKF(memcmp(got, want, row_bytes * n) == 0, "%s, %d threads", cllm_dtype_name(type),
               threads);
    }
    CHECK(!cllm_convert_rows_q6_k(&t, ROWS - 1, 2, got, 2)); /* past the end */
    CHECK(!cllm_convert_rows_q6_k(&t, -1, 1, got, 2));
    const struct cllm_tensor narrow = {"w", type, 2, {K - 32, ROWS, 1, 1}, t.nbytes, data};
    CHECK(!cllm_convert_rows_q6_k(&narrow, 0, 1, got, 1));
    free(data), free(row), free(want), free(got);
}

int main(void)
{
    test_round_trip();
    test_refusals();
    test_convert_rows(CLLM_DTYPE_F32);
    test_convert_rows(CLLM_DTYPE_BF16);
    return test_summary();
}
