#include "tensor/convert.h"

#include <pthread.h>
#include <stdlib.h>

#include "core/f16.h"

#define MAX_THREADS 64

struct convert_job {
    const struct cllm_tensor *t;
    uint64_t row_bytes;
    int64_t row0, n_rows;
    uint16_t *dst;
    int ith, nth;
    bool ok;
};

static void *convert_task(void *arg)
{
    struct convert_job *j = arg;
    int64_t cols = j->t->ne[0];
    int64_t start = j->n_rows * j->ith / j->nth, end = j->n_rows * (j->ith + 1) / j->nth;
    float *row = malloc((size_t)cols * sizeof *row);
    j->ok = row != NULL;
    for (int64_t r = start; j->ok && r < end; r++) {
        const char *src = (const char *)j->t->data + (uint64_t)(j->row0 + r) * j->row_bytes;
        j->ok = cllm_dequant_row(j->t->dtype, src, row, cols);
        uint16_t *out = j->dst + r * cols;
        for (int64_t i = 0; j->ok && i < cols; i++)
            out[i] = cllm_f32_to_bf16(row[i]);
    }
    free(row);
    return NULL;
}

bool cllm_convert_rows_bf16(const struct cllm_tensor *t, int64_t row0, int64_t n_rows,
                            uint16_t *dst, int n_threads)
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
        jobs[i] = (struct convert_job){t, row_bytes, row0, n_rows, dst, i, nth, false};
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
