/*
 * Widening to BF16 (tensor/convert.c, what the CUDA backend loads GGUF weights through): for
 * the first tensor of every type in the small real GGUF, converted rows on 1 and 5 threads,
 * from row 0 and from an offset, equal dequantizing each row and rounding it one by one.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/f16.h"
#include "model/model_files.h"
#include "tensor/convert.h"
#include "test.h"

static void check_tensor(const struct cllm_tensor *t)
{
    int64_t cols = t->ne[0], rows = cllm_tensor_nrows(t);
    int64_t row0 = rows > 7 ? 3 : 0, n = rows - row0 < 200 ? rows - row0 : 200;
    uint64_t rb;
    CHECK(cllm_dtype_row_bytes(t->dtype, cols, &rb));
    uint16_t *want = malloc((size_t)(n * cols) * 2), *got = malloc((size_t)(n * cols) * 2);
    float *row = malloc((size_t)cols * sizeof *row);
    for (int64_t r = 0; r < n; r++) {
        CHECK(cllm_dequant_row(t->dtype, (const char *)t->data + (uint64_t)(row0 + r) * rb, row,
                               cols));
        for (int64_t i = 0; i < cols; i++)
            want[r * cols + i] = cllm_f32_to_bf16(row[i]);
    }
    for (int threads = 1; threads <= 5; threads += 4) {
        memset(got, 0xff, (size_t)(n * cols) * 2);
        CHECK(cllm_convert_rows_bf16(t, row0, n, got, threads));
        CHECKF(memcmp(got, want, (size_t)(n * cols) * 2) == 0, "%s (%s), %d threads", t->name,
               cllm_dtype_name(t->dtype), threads);
    }
    CHECK(!cllm_convert_rows_bf16(t, rows - 1, 2, got, 2)); /* past the end */
    CHECK(!cllm_convert_rows_bf16(t, -1, 1, got, 2));
    free(want), free(got), free(row);
}

int main(void)
{
    char err[512] = "";
    struct cllm_model_files *mf;
    if (cllm_model_files_open(&mf, test_env("CLLM_TEST_GGUF"), err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    bool seen[CLLM_DTYPE_COUNT] = {false};
    int n_types = 0;
    for (size_t i = 0; i < cllm_model_files_n_tensors(mf); i++) {
        const struct cllm_tensor *t = cllm_model_files_tensor_at(mf, i);
        if (seen[t->dtype])
            continue;
        seen[t->dtype] = true;
        n_types++;
        check_tensor(t);
    }
    printf("%d types checked\n", n_types);
    CHECK(n_types >= 4); /* F32, Q5_0, Q8_0, Q4_K, Q6_K in this file */
    cllm_model_files_free(mf);
    return test_summary();
}
