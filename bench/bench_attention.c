/*
 * Attention and SiLU micro-benchmark of the CPU kernel families (one thread): one decode
 * token's attention items (a KV head and its query heads) of the Qwen2.5-1.5B shape (12 query
 * heads, 2 KV heads of 128) over 64 to 2048 cached positions in 16-slot pages, and SiLU over
 * the FFN's 8960 columns, each family beside the portable kernel (attend_ref.c, libm's expf)
 * in the same run. Then a batch's attention with its caches in memory rather than in the L3:
 * a step of 32 sequences of 300 positions through 28 layers' caches (~0.55 GB, pages out of
 * order), as items of one KV head and as items of a token's two (attend.h), the CPU backend's
 * two ways. Times are medians of repeated calls. Usage: bench_attention
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/cpu/attend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ref.h"

#define N_HEAD 12
#define N_KV 2
#define HEAD_DIM 128
#define PAGE 16
#define MAX_POS 2048
#define FFN 8960
#define REPEATS 15

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median microseconds of one call of fn(arg), each sample long enough to time. */
static double median_us(void (*fn)(void *), void *arg)
{
    double t[REPEATS];
    int calls = 1;
    for (double d = 0; d < 2e-3; calls *= 2) {
        const double t0 = now();
        for (int c = 0; c < calls; c++)
            fn(arg);
        d = now() - t0;
    }
    for (int r = 0; r < REPEATS; r++) {
        const double t0 = now();
        for (int c = 0; c < calls; c++)
            fn(arg);
        t[r] = (now() - t0) / calls * 1e6;
    }
    qsort(t, REPEATS, sizeof t[0], cmp_double);
    return t[REPEATS / 2];
}

struct attend_run {
    struct cllm_attend_item items[N_KV];
    cllm_attend_fn fn;
};

static void run_attend(void *arg)
{
    struct attend_run *r = arg;
    for (int k = 0; k < N_KV; k++)
        r->fn(&r->items[k]);
}

struct silu_run {
    const float *gate, *up;
    float *out;
    cllm_silu_mul_fn fn;
};

static void run_silu(void *arg)
{
    struct silu_run *r = arg;
    r->fn(r->gate, r->up, FFN, r->out);
}

static float *random_floats(size_t n, float scale)
{
    float *v = malloc(n * sizeof *v);
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; v && i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        v[i] = ((float)(s >> 40) / (float)(1 << 24) * 2.0f - 1.0f) * scale;
    }
    return v;
}

/* A step's attention from memory: COLD_SEQS sequences, COLD_LAYERS layers' caches. */
#define COLD_SEQS 32
#define COLD_LAYERS 28
#define COLD_POS 300
#define COLD_RUNS 7

struct cold_step {
    float *k[COLD_LAYERS], *v[COLD_LAYERS], *q, *out;
    int32_t *table; /* [COLD_SEQS][blocks a sequence] */
    int blocks;
};

static void run_cold(const struct cold_step *c, int32_t kv_per_item)
{
    for (int l = 0; l < COLD_LAYERS; l++)
        for (int s = 0; s < COLD_SEQS; s++)
            for (int h = 0; h < N_KV; h += kv_per_item) {
                const size_t heads = ((size_t)s * N_HEAD + (size_t)h * (N_HEAD / N_KV)) * HEAD_DIM;
                const struct cllm_attend_item it = {
                    .q = c->q + heads,
                    .out = c->out + heads,
                    .k = c->k[l] + (size_t)h * HEAD_DIM,
                    .v = c->v[l] + (size_t)h * HEAD_DIM,
                    .slot_stride = N_KV * HEAD_DIM,
                    .block_table = c->table + (size_t)s * (size_t)c->blocks,
                    .block_size = PAGE,
                    .n_pos = COLD_POS,
                    .group = N_HEAD / N_KV,
                    .n_kv = kv_per_item,
                    .head_dim = HEAD_DIM,
                    .scale = 0.08838834764831845f,
                };
                cllm_cpu_attend(&it);
            }
}

/* ms per step, items of one KV head vs of all a token's, alternating; 0 on no memory. */
static bool bench_cold(double *per_head_ms, double *per_token_ms)
{
    struct cold_step c = {.blocks = (COLD_POS + PAGE - 1) / PAGE};
    const int pool = COLD_SEQS * c.blocks * 2; /* blocks drawn from a pool twice the size */
    const size_t pool_floats = (size_t)pool * PAGE * N_KV * HEAD_DIM;
    bool ok = (c.table = malloc((size_t)COLD_SEQS * (size_t)c.blocks * sizeof *c.table)) &&
              (c.q = random_floats((size_t)COLD_SEQS * N_HEAD * HEAD_DIM, 1)) &&
              (c.out = malloc((size_t)COLD_SEQS * N_HEAD * HEAD_DIM * sizeof *c.out));
    for (int l = 0; ok && l < COLD_LAYERS; l++)
        ok = (c.k[l] = random_floats(pool_floats, 1)) && (c.v[l] = random_floats(pool_floats, 1));
    if (ok) {
        for (int i = 0; i < COLD_SEQS * c.blocks; i++) /* each block once, scattered */
            c.table[i] = (int32_t)(((int64_t)i * 7919 + 13) % pool);
        double t[2][COLD_RUNS];
        for (int r = 0; r < COLD_RUNS; r++)
            for (int w = 0; w < 2; w++) {
                const double t0 = now();
                run_cold(&c, w ? N_KV : 1);
                t[w][r] = (now() - t0) * 1e3;
            }
        qsort(t[0], COLD_RUNS, sizeof t[0][0], cmp_double);
        qsort(t[1], COLD_RUNS, sizeof t[1][0], cmp_double);
        *per_head_ms = t[0][COLD_RUNS / 2];
        *per_token_ms = t[1][COLD_RUNS / 2];
    }
    for (int l = 0; l < COLD_LAYERS; l++)
        free(c.k[l]), free(c.v[l]);
    free(c.table), free(c.q), free(c.out);
    return ok;
}

int main(void)
{
    const int n_pages = MAX_POS / PAGE;
    const size_t cache_floats = (size_t)MAX_POS * N_KV * HEAD_DIM;
    float *k = random_floats(cache_floats, 1), *v = random_floats(cache_floats, 1);
    float *q = random_floats((size_t)N_HEAD * HEAD_DIM, 1);
    float *out = malloc((size_t)N_HEAD * HEAD_DIM * sizeof *out);
    int32_t *table = malloc((size_t)n_pages * sizeof *table);
    float *gate = random_floats(FFN, 6), *up = random_floats(FFN, 2), *silu = malloc(FFN * 4);
    if (!k || !v || !q || !out || !table || !gate || !up || !silu)
        return 1;
    for (int i = 0; i < n_pages; i++)
        table[i] = (i * 37 + 5) % n_pages; /* pages out of order, as a long-lived cache has them */
    static const char *const families[] = {"avx2", "avx512"};
    static const int lengths[] = {64, 256, 512, 1024, 2048};
    printf("attention, one token of the 1.5B (12/2 heads of 128), 1 thread, us per token:\n");
    printf("%-8s %10s", "family", "positions");
    printf(" %10s %10s %8s\n", "portable", "family", "speedup");
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++) {
        if (!cllm_cpu_matmul_use_isa(families[f]))
            continue;
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            struct attend_run r;
            for (int h = 0; h < N_KV; h++)
                r.items[h] = (struct cllm_attend_item){
                    .q = q + (size_t)h * (N_HEAD / N_KV) * HEAD_DIM,
                    .out = out + (size_t)h * (N_HEAD / N_KV) * HEAD_DIM,
                    .k = k + (size_t)h * HEAD_DIM,
                    .v = v + (size_t)h * HEAD_DIM,
                    .slot_stride = N_KV * HEAD_DIM,
                    .block_table = table,
                    .block_size = PAGE,
                    .n_pos = lengths[li],
                    .group = N_HEAD / N_KV,
                    .n_kv = 1,
                    .head_dim = HEAD_DIM,
                    .scale = 0.08838834764831845f,
                };
            r.fn = cllm_attend_ref;
            const double ref_us = median_us(run_attend, &r);
            r.fn = cllm_cpu_attend;
            const double us = median_us(run_attend, &r);
            printf("%-8s %10d %10.2f %10.2f %7.2fx\n", families[f], lengths[li], ref_us, us,
                   ref_us / us);
        }
        struct silu_run s = {gate, up, silu, cllm_ref_silu_mul};
        const double ref_us = median_us(run_silu, &s);
        s.fn = cllm_cpu_silu_mul;
        const double us = median_us(run_silu, &s);
        printf("%-8s silu_mul over %d columns: %.2f us (libm expf) vs %.2f us: %.2fx\n",
               families[f], FFN, ref_us, us, ref_us / us);
        double head_ms, token_ms;
        if (bench_cold(&head_ms, &token_ms))
            printf("%-8s from memory, %d sequences x %d positions x %d layers: items of a KV "
                   "head %.2f ms, of a token %.2f ms: %.2fx\n",
                   families[f], COLD_SEQS, COLD_POS, COLD_LAYERS, head_ms, token_ms,
                   head_ms / token_ms);
    }
    cllm_cpu_matmul_use_isa(NULL);
    free(k), free(v), free(q), free(out), free(table), free(gate), free(up), free(silu);
    return 0;
}
