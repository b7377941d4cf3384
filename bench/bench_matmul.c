/*
 * Matmul micro-benchmark on a real GGUF (default: the 1.5B Q4_K_M model): decode (1 token) and
 * prefill (64, 512 tokens) on blk.0.ffn_up (Q4_K), blk.0.ffn_down (Q6_K) and output (Q6_K),
 * with 1 and 2 threads, printing time per call, GFLOP/s and weight GB/s. Decode is also run
 * "cold", cycling through the same tensor of every layer (more bytes than the L3 cache), next to
 * this machine's plain memory-read bandwidth measured in the same run, its bound. Synthetic
 * F32/F16/BF16 weights cover the float paths (also the 1.5B model's FFN shapes in BF16, and the
 * same quantized to Q6_K as --cpu-weights q6_k does, and in Q8_0); the float ones run under each
 * family whose kernels for them differ (AVX-512 BF16's, AVX-512's 16 lanes, AVX2's), side by side,
 * and the 8-bit ones under this CPU's family (CLLM_CPU_ISA's choice) and AVX2's, K-quants packed
 * 16 rows at a time where a family's kernels take them so (pack_x16.h). Weights streamed from
 * memory for 8 and 32 tokens (every layer's K-quant tensors, BF16 matrices larger than the L3) run
 * with the kernels' fetch-ahead on and off. Times are medians of repeated calls. Usage:
 * bench_matmul [model.gguf] [max_threads]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/matmul.h"
#include "backend/cpu/pack_x16.h"
#include "backend/cpu/threadpool.h"
#include "core/f16.h"
#include "model/gguf.h"
#include "tensor/convert.h"
#include "tensor/quant.h"

#define DEFAULT_MODEL "/root/.cache/cllm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
#define MIN_SECONDS 0.4

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --- memory bandwidth: sum a buffer split over the pool's threads --- */

struct sum_job {
    const uint64_t *buf;
    size_t n;
    uint64_t partial[64];
};

static void sum_task(void *ctx, int ith, int nth)
{
    struct sum_job *j = ctx;
    int64_t a, b;
    cllm_split_rows((int64_t)j->n, ith, nth, &a, &b);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = a; i + 4 <= b; i += 4) {
        s0 += j->buf[i];
        s1 += j->buf[i + 1];
        s2 += j->buf[i + 2];
        s3 += j->buf[i + 3];
    }
    j->partial[ith] = s0 + s1 + s2 + s3;
}

static double read_bandwidth(struct cllm_threadpool *tp, size_t bytes)
{
    struct sum_job j = {.n = bytes / 8};
    uint64_t *buf = malloc(bytes);
    if (!buf)
        return 0.0;
    for (size_t i = 0; i < j.n; i++)
        buf[i] = i;
    j.buf = buf;
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        cllm_threadpool_run(tp, sum_task, &j);
        double t = now() - t0;
        if (t < best)
            best = t;
    }
    uint64_t s = 0;
    for (int i = 0; i < cllm_threadpool_n_threads(tp); i++)
        s += j.partial[i];
    if (s == 42) /* keep the sums alive */
        printf(" ");
    free(buf);
    return (double)bytes / best / 1e9;
}

/* --- matmul timing --- */

/* Seconds per call: the median of repeated runs (and the fastest in *best), cycling over the n
 * weights. On a shared machine the fastest run is the better estimate of the code's speed. */
static double time_matmul(struct cllm_threadpool *tp, const struct cllm_tensor *const *w, int n,
                          bool packed, const float *x, int64_t nt, float *y, void *scratch,
                          size_t ss, double *best)
{
    double times[4096];
    int reps = 0;
    double start = now();
    while (reps < 4096 && (reps < 3 || now() - start < MIN_SECONDS)) {
        double t0 = now();
        const struct cllm_tensor *wt = w[reps % n];
        enum cllm_status st = packed
                                  ? cllm_cpu_matmul_packed(tp, wt, x, nt, y, wt->ne[1], scratch, ss)
                                  : cllm_cpu_matmul(tp, wt, x, nt, y, wt->ne[1], scratch, ss);
        times[reps++] = now() - t0;
        if (st != CLLM_OK) {
            fprintf(stderr, "matmul failed: %d\n", st);
            exit(1);
        }
    }
    for (int i = 1; i < reps; i++) /* insertion sort: reps is small */
        for (int k = i; k > 0 && times[k] < times[k - 1]; k--) {
            double t = times[k];
            times[k] = times[k - 1];
            times[k - 1] = t;
        }
    *best = times[0];
    return times[reps / 2];
}

static void bench_tensor(struct cllm_threadpool *tp, const char *label,
                         const struct cllm_tensor *const *w, int n, bool packed, int64_t nt)
{
    const int64_t K = w[0]->ne[0], N = w[0]->ne[1];
    float *x = malloc(sizeof(float) * K * nt);
    float *y = malloc(sizeof(float) * N * nt);
    size_t ss = 0;
    for (int i = 0; i < n; i++) {
        size_t s = cllm_cpu_matmul_scratch_size(w[i]->dtype, K, nt);
        if (s > ss)
            ss = s;
    }
    void *scratch = malloc(ss ? ss : 1);
    srand(1);
    for (int64_t i = 0; i < K * nt; i++)
        x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    double best;
    double t = time_matmul(tp, w, n, packed, x, nt, y, scratch, ss, &best);
    double flops = 2.0 * (double)K * (double)N * (double)nt;
    printf("%-24s %-4s %5lld x %-6lld tokens %3lld  threads %d  %8.3f ms (min %8.3f)  "
           "%6.1f GFLOP/s  %6.2f GB/s weights (at min: %6.1f, %6.2f)\n",
           label, cllm_dtype_name(w[0]->dtype), (long long)K, (long long)N, (long long)nt,
           cllm_threadpool_n_threads(tp), t * 1e3, best * 1e3, flops / t / 1e9,
           (double)w[0]->nbytes / t / 1e9, flops / best / 1e9, (double)w[0]->nbytes / best / 1e9);
    fflush(stdout);
    free(x);
    free(y);
    free(scratch);
}

/* bench_tensor under this CPU's kernels (CLLM_CPU_ISA's choice) and, where those are not
 * AVX2's and the CPU has AVX2, at once under AVX2's: a moment apart, as this VM's speed drifts
 * by 10-20% over minutes. Under each, where its kernels multiply the weights packed
 * (pack_x16.h), first packed as the CPU backend packs them at load. Labels end in the family
 * ("packed" added). */
static void bench_families(struct cllm_threadpool *tp, const char *what,
                           const struct cllm_tensor *const *w, int n, int64_t nt)
{
    const char *best = cllm_cpu_matmul_isa();
    const bool beside_avx2 = strcmp(best, "avx2") != 0 && cllm_cpu_matmul_use_isa("avx2");
    char label[64];
    for (int v = 0; v < (beside_avx2 ? 2 : 1); v++) {
        cllm_cpu_matmul_use_isa(v ? "avx2" : best);
        const char *isa = cllm_cpu_matmul_isa();
        if (cllm_cpu_matmul_packs(w[0]->dtype, w[0]->ne[0], w[0]->ne[1])) {
            struct cllm_tensor *packed = calloc((size_t)n, sizeof *packed);
            const struct cllm_tensor **pw = calloc((size_t)n, sizeof *pw);
            for (int i = 0; i < n; i++) {
                void *data = malloc(w[i]->nbytes);
                if (!packed || !pw || !data)
                    exit(1);
                cllm_x16_pack(w[i]->dtype, w[i]->data, w[i]->ne[0], 0, w[i]->ne[1], data);
                packed[i] = *w[i];
                packed[i].data = data;
                pw[i] = &packed[i];
            }
            snprintf(label, sizeof label, "%s %s packed", what, isa);
            bench_tensor(tp, label, pw, n, true, nt);
            for (int i = 0; i < n; i++)
                free((void *)packed[i].data);
            free(packed);
            free(pw);
        }
        snprintf(label, sizeof label, "%s %s", what, isa);
        bench_tensor(tp, label, w, n, false, nt);
    }
    cllm_cpu_matmul_use_isa(best);
}

/* The kernel families whose kernels for float weights of type t differ, fastest first, that
 * this CPU runs: AVX-512 BF16's (BF16 only), AVX-512's and AVX2's (or the best alone). */
static int float_families(enum cllm_dtype t, const char *out[3])
{
    static const char *const all[] = {"avx512bf16", "avx512", "avx2"};
    const char *isa = cllm_cpu_matmul_isa();
    int n = 0;
    for (int i = t == CLLM_DTYPE_BF16 ? 0 : 1; i < 3; i++)
        if (cllm_cpu_matmul_use_isa(all[i]))
            out[n++] = all[i];
    cllm_cpu_matmul_use_isa(isa);
    if (n == 0)
        out[n++] = isa;
    return n;
}

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : DEFAULT_MODEL;
    int max_threads = argc > 2 ? atoi(argv[2]) : 2;
    char err[512];
    struct cllm_gguf *g = NULL;
    if (cllm_gguf_open(&g, path, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    printf("model %s, kernels %s\n", path, cllm_cpu_matmul_isa());

    const char *names[] = {"blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "output.weight"};
    const struct cllm_tensor *hot[3];
    for (int i = 0; i < 3; i++) {
        hot[i] = cllm_gguf_find_tensor(g, names[i]);
        if (!hot[i]) {
            fprintf(stderr, "%s: no tensor %s\n", path, names[i]);
            return 1;
        }
    }
    /* Every layer's tensor of the same name and dtype as blk.0's: decode without cache help. */
    const struct cllm_tensor *cold[2][128];
    int n_cold[2] = {0, 0};
    for (int c = 0; c < 2; c++) {
        const char *suffix = c == 0 ? "ffn_up.weight" : "ffn_down.weight";
        for (int l = 0; l < 128; l++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.%s", l, suffix);
            const struct cllm_tensor *t = cllm_gguf_find_tensor(g, name);
            if (t && t->dtype == hot[c]->dtype)
                cold[c][n_cold[c]++] = t;
        }
    }
    /* Synthetic float weights (HF checkpoints): the 0.5B model's ffn_up in F32, F16 and BF16 of
     * the same values, and the 1.5B model's ffn_up and ffn_down in BF16 (LLaMA-Factory's). */
    enum { N_SYNTH = 6, N_STREAMED = 2 };
    static const struct {
        enum cllm_dtype type;
        int64_t k, n;
    } synth_shape[N_SYNTH] = {{CLLM_DTYPE_F32, 896, 4864},
                              {CLLM_DTYPE_F16, 896, 4864},
                              {CLLM_DTYPE_BF16, 896, 4864},
                              {CLLM_DTYPE_BF16, 1536, 8960},
                              {CLLM_DTYPE_BF16, 8960, 1536},
                              /* the 1.5B's stacked gate/up: more bytes than the L3 cache */
                              {CLLM_DTYPE_BF16, 1536, 17920}};
    struct cllm_tensor synth[N_SYNTH];
    void *sdata[N_SYNTH];
    for (int f = 0; f < N_SYNTH; f++) {
        const enum cllm_dtype type = synth_shape[f].type;
        const int64_t n = synth_shape[f].k * synth_shape[f].n;
        const uint64_t esize = type == CLLM_DTYPE_F32 ? 4 : 2;
        sdata[f] = malloc(esize * (uint64_t)n);
        if (!sdata[f])
            return 1;
        for (int64_t i = 0; i < n; i++) {
            const float v = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
            const uint16_t h = type == CLLM_DTYPE_F16 ? cllm_f32_to_f16(v) : cllm_f32_to_bf16(v);
            memcpy((uint8_t *)sdata[f] + esize * i, esize == 4 ? (const void *)&v : &h, esize);
        }
        synth[f] = (struct cllm_tensor){"synthetic", type, 2,
                                        {synth_shape[f].k, synth_shape[f].n, 1, 1},
                                        esize * (uint64_t)n, sdata[f]};
    }

    /* The 1.5B model's BF16 FFN weights quantized to Q6_K at load, as --cpu-weights q6_k
     * does: what the CPU's 8-bit path gains over the float one; then the same shapes in Q8_0
     * (a common GGUF export of a fine-tune), of pseudo-random quants (the speed does not
     * depend on their values). */
    enum { N_Q6 = 2, N_QS = 4 };
    struct cllm_tensor qsyn[N_QS];
    void *qsyn_data[N_QS];
    for (int f = 0; f < N_QS; f++) {
        const struct cllm_tensor *src = &synth[3 + f % N_Q6]; /* the 1.5B's FFN shapes */
        const enum cllm_dtype type = f < N_Q6 ? CLLM_DTYPE_Q6_K : CLLM_DTYPE_Q8_0;
        uint64_t bytes;
        if (!cllm_dtype_row_bytes(type, src->ne[0], &bytes))
            return 1;
        bytes *= (uint64_t)src->ne[1];
        if (!(qsyn_data[f] = malloc(bytes)))
            return 1;
        if (type == CLLM_DTYPE_Q6_K &&
            !cllm_convert_rows_q6_k(src, 0, src->ne[1], qsyn_data[f], max_threads))
            return 1;
        if (type == CLLM_DTYPE_Q8_0) {
            struct cllm_block_q8_0 *blk = qsyn_data[f];
            for (uint64_t i = 0; i < bytes / sizeof *blk; i++) {
                blk[i].d = cllm_f32_to_f16(0.01f);
                for (int j = 0; j < CLLM_QK; j++)
                    blk[i].qs[j] = (int8_t)((i * 2654435761u + (uint64_t)j * 40503u) >> 7);
            }
        }
        const struct cllm_tensor t = {
            "synthetic", type, 2, {src->ne[0], src->ne[1], 1, 1}, bytes, qsyn_data[f],
        };
        qsyn[f] = t;
    }

    /* Touch the weights once so page faults stay out of the timings. */
    volatile uint8_t sink = 0;
    for (uint64_t i = 0; i < cllm_gguf_n_tensors(g); i++) {
        const struct cllm_tensor *t = cllm_gguf_tensor(g, i);
        for (uint64_t o = 0; o < t->nbytes; o += 4096)
            sink ^= ((const uint8_t *)t->data)[o];
    }
    (void)sink;

    for (int nth = 1; nth <= max_threads; nth++) {
        struct cllm_threadpool *tp = NULL;
        if (cllm_threadpool_new(&tp, nth) != CLLM_OK)
            return 1;
        printf("\n== %d thread%s: memory read bandwidth (1 GiB sum) %.2f GB/s\n", nth,
               nth > 1 ? "s" : "", read_bandwidth(tp, (size_t)1 << 30));
        /* The model's K-quants and the synthetic 8-bit weights */
        for (int c = 0; c < 2; c++) {
            char what[64];
            snprintf(what, sizeof what, "decode cold (%d layers)", n_cold[c]);
            bench_families(tp, what, cold[c], n_cold[c], 1);
        }
        for (int i = 0; i < 3; i++)
            bench_families(tp, i == 2 ? "decode (cold: 1 tensor)" : "decode hot (L3)", &hot[i], 1,
                           1);
        static const int64_t prefill[] = {64, 512};
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < 2; i++)
                bench_families(tp, "prefill", &hot[i], 1, prefill[p]);
        for (int f = 0; f < N_QS; f++) {
            const struct cllm_tensor *t = &qsyn[f];
            bench_families(tp, "decode synth", &t, 1, 1);
            bench_families(tp, "prefill synth", &t, 1, 64);
        }
        for (int f = 0; f < N_SYNTH - 1; f++) {
            const struct cllm_tensor *t = &synth[f];
            /* under each family whose kernels differ: AVX-512 BF16's rounded activations,
             * AVX-512's 16 lanes and AVX2's 8 */
            const char *isa = cllm_cpu_matmul_isa(), *fam[3];
            const int n_fam = float_families(t->dtype, fam);
            for (int v = 0; v < n_fam; v++) {
                char label[64];
                cllm_cpu_matmul_use_isa(fam[v]);
                snprintf(label, sizeof label, "decode synth %s", cllm_cpu_matmul_isa());
                bench_tensor(tp, label, &t, 1, false, 1);
                snprintf(label, sizeof label, "prefill synth %s", cllm_cpu_matmul_isa());
                bench_tensor(tp, label, &t, 1, false, 64);
            }
            cllm_cpu_matmul_use_isa(isa);
        }
        /* Weights streamed from memory for a few tokens (decode steps of several sequences):
         * the kernels' fetch-ahead on and off, a moment apart, under this CPU's kernels and
         * AVX2's: every layer's K-quant tensors in turn, and BF16 matrices larger than the L3. */
        struct {
            const struct cllm_tensor *const *w;
            int n;
        } streamed[] = {{cold[0], n_cold[0]},
                        {cold[1], n_cold[1]},
                        {(const struct cllm_tensor *[]){&synth[N_SYNTH - 1]}, 1},
                        {(const struct cllm_tensor *[]){&synth[4]}, 1}};
        const char *isa = cllm_cpu_matmul_isa();
        const bool beside_avx2 = strcmp(isa, "avx2") != 0 && cllm_cpu_matmul_use_isa("avx2");
        cllm_cpu_matmul_use_isa(isa);
        for (size_t f = 0; f < sizeof streamed / sizeof streamed[0]; f++) {
            const char *fam[3] = {isa, "avx2"};
            const int n_fam = streamed[f].w[0]->dtype == CLLM_DTYPE_BF16
                                  ? float_families(CLLM_DTYPE_BF16, fam)
                                  : (beside_avx2 ? 2 : 1);
            for (int nt = 8; nt <= 32; nt *= 4)
                for (int v = 0; v < n_fam; v++) {
                    cllm_cpu_matmul_use_isa(fam[v]);
                    for (int on = 1; on >= 0; on--) {
                        char label[64];
                        cllm_cpu_matmul_fetch_ahead(on);
                        snprintf(label, sizeof label, "fetch-ahead %-3s %s", on ? "on" : "off",
                                 cllm_cpu_matmul_isa());
                        bench_tensor(tp, label, streamed[f].w, streamed[f].n, false, nt);
                    }
                }
        }
        cllm_cpu_matmul_fetch_ahead(true);
        cllm_cpu_matmul_use_isa(isa);
        cllm_threadpool_free(tp);
    }
    for (int f = 0; f < N_SYNTH; f++)
        free(sdata[f]);
    for (int f = 0; f < N_QS; f++)
        free(qsyn_data[f]);
    cllm_gguf_free(g);
    return 0;
}
