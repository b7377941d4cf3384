/*
 * Which way each GEMM runs a step (gemm_internal.h's gemm_way): the tiled kernel's shapes by
 * name, the ways tuned at start-up per weight shape and step size (cllm_cuda_gemm_tune, which
 * times them on the device), the default way elsewhere, and the scratch a way needs. Host
 * code only; the kernels are in gemm.cu and gemm_tiled.cu.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

/* The tiled kernel's shape where no tuned plan says otherwise (cllm_cuda_gemm_use_tiling). */
static int current_tiling = TILING_128X64;
/* The skinny kernel's W prefetch: 0 by its slices (AHEAD_MIN_SLICES), 1 always, -1 never. */
static int skinny_ahead = 0;
/* Slices (warps per block) from which the skinny kernel loads W a group ahead by default. */
#define AHEAD_MIN_SLICES 4
/* Blocks a skinny row tile by default (cllm_cuda_gemm_force_split). */
static int skinny_parts = 1;

void cllm_cuda_gemm_force_ahead(int mode)
{
    skinny_ahead = mode > 0 ? 1 : mode < 0 ? -1 : 0;
}

void cllm_cuda_gemm_force_split(int parts)
{
    skinny_parts = parts == 2 || parts == 4 ? parts : 1;
}

const char *cllm_cuda_gemm_tiling(void)
{
    return tilings[current_tiling].name;
}

cudaError_t cllm_cuda_gemm_use_tiling(const char *name)
{
    for (int i = 0; i < N_TILINGS; i++)
        if (name && strcmp(name, tilings[i].name) == 0) {
            cudaError_t e = cllm_cuda_gemm_prepare_tiling(i);
            if (e == cudaSuccess)
                current_tiling = i;
            return e;
        }
    return cudaErrorInvalidValue;
}

#ifdef CLLM_HAVE_MMA

/* --- ways and plans --- */

/* Step sizes a plan keeps one way for: the skinny kernel's three token-tile counts, then
 * powers of two. A bucket is timed at one step size: one sequence's decode step, the skinny
 * tiles' fullest steps, then the middle of each range (192: the evaluation's batch). */
#define N_BUCKETS 11
static const int32_t bucket_max[N_BUCKETS] = {8,   16,   32,   64,   128,      256,
                                              512, 1024, 2048, 4096, INT32_MAX};
static const int32_t bucket_probe[N_BUCKETS] = {1, 16, 32, 48, 96, 192, 384, 768, 1536, 3072, 6144};

static int bucket_of(int32_t n)
{
    int b = 0;
    while (n > bucket_max[b])
        b++;
    return b;
}

/* The ways tuned for one weight shape, bucket by bucket (bit b of `tuned`). Process-wide, as
 * the tiling is: all the devices of a process are alike (backend_cuda.cu). */
#define MAX_PLANS 32
struct gemm_plan {
    int32_t N, K;
    unsigned tuned;
    gemm_way way[N_BUCKETS];
};
static gemm_plan plans[MAX_PLANS];
static int n_plans;
static std::mutex plans_lock; /* a backend may tune while another one's steps launch */

static int64_t tiles_of(int tiling, int32_t N, int32_t n)
{
    const struct tiling_shape *t = &tilings[tiling];
    return ((int64_t)n + t->n - 1) / t->n * (((int64_t)N + t->m - 1) / t->m);
}

/* The way of an untuned step: the process's tiling, its slices in parallel when its tiles
 * number fewer than about two blocks per SM of an H100/H200 (132 SMs: 256 tiles of a shape two
 * of whose blocks fit an SM, 128 of one that takes the SM alone), the skinny prefetch in blocks
 * of AHEAD_MIN_SLICES warps or more. */
static gemm_way default_way(int32_t N, int32_t K, int32_t n)
{
    gemm_way w;
    w.parts = split_fits(N, K, skinny_parts) ? skinny_parts : 1;
    w.tiling = current_tiling;
    w.parallel = tiles_of(current_tiling, N, n) < 128 * tilings[current_tiling].min_blocks;
    w.ahead =
        skinny_ahead != 0 ? skinny_ahead > 0 : cllm_cuda_gemm_slices(N, K) >= AHEAD_MIN_SLICES;
    return w;
}

gemm_way cllm_cuda_gemm_way_for(int32_t N, int32_t K, int32_t n)
{
    const int b = bucket_of(n);
    std::lock_guard<std::mutex> hold(plans_lock);
    for (int i = 0; i < n_plans; i++)
        if (plans[i].N == N && plans[i].K == K && (plans[i].tuned >> b & 1u))
            return plans[i].way[b];
    return default_way(N, K, n);
}

static void keep_way(int32_t N, int32_t K, int b, const gemm_way &w)
{
    std::lock_guard<std::mutex> hold(plans_lock);
    int i = 0;
    while (i < n_plans && !(plans[i].N == N && plans[i].K == K))
        i++;
    if (i == MAX_PLANS)
        return; /* full: this shape keeps the default ways */
    if (i == n_plans) {
        plans[i] = gemm_plan{N, K, 0u, {}};
        n_plans++;
    }
    plans[i].way[b] = w;
    plans[i].tuned |= 1u << b;
}

void cllm_cuda_gemm_forget_plans(void)
{
    std::lock_guard<std::mutex> hold(plans_lock);
    n_plans = 0;
}

int cllm_cuda_gemm_tuned(int32_t N, int32_t K, int32_t n_max)
{
    if (n_max < 1)
        return 0;
    const unsigned want = (2u << bucket_of(n_max)) - 1u; /* buckets 0 .. n_max's */
    std::lock_guard<std::mutex> hold(plans_lock);
    for (int i = 0; i < n_plans; i++)
        if (plans[i].N == N && plans[i].K == K)
            return (plans[i].tuned & want) == want;
    return 0;
}

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n, bool norm_inside)
{
    if (N <= 0 || n <= 0 || norm_inside) /* the norm: decode steps, never split (launch_skinny) */
        return 0;
    const gemm_way w = cllm_cuda_gemm_way_for(N, K, n);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX)
        return split_fits(N, K, w.parts) ? split_scratch(N, K, n) : 0;
    return runs_parallel(w, N, K, n) ? parallel_scratch(N, K, n) : 0;
}

/* --- tuning --- */

/* The ways worth timing for a step of n tokens, the default way first: both skinny
 * prefetches, each with one block a row tile and with 2 or 4 where split_fits and the scratch
 * holds them; each tiled shape with its slices in series, and in parallel blocks where there
 * are slices and the tiles number fewer than about four blocks per SM (twice the default
 * rule's bound) and the scratch holds them. Restricted to the process's tiling, the default
 * prefetch and the default split where `what` does not include CLLM_CUDA_GEMM_TUNE_TILING /
 * _AHEAD / _SPLIT. */
static int ways_to_time(int32_t N, int32_t K, int32_t n, unsigned what, size_t scratch_bytes,
                        gemm_way *out)
{
    const gemm_way base = default_way(N, K, n);
    int count = 0;
    out[count++] = base;
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX) {
        for (int parts = 1; parts <= 4; parts *= 2) {
            const bool open = (what & CLLM_CUDA_GEMM_TUNE_SPLIT) &&
                              (parts == 1 || (split_fits(N, K, parts) &&
                                              scratch_bytes >= split_scratch(N, K, n)));
            if (!open && parts != base.parts)
                continue;
            for (int other = 0; other < ((what & CLLM_CUDA_GEMM_TUNE_AHEAD) ? 2 : 1); other++) {
                if (parts == base.parts && !other)
                    continue; /* the default way, already first */
                out[count] = base;
                out[count].parts = parts;
                out[count++].ahead = other ? !base.ahead : base.ahead;
            }
        }
        return count;
    }
    const bool sliced = cllm_cuda_gemm_slices(N, K) > 1;
    for (int t = 0; t < N_TILINGS; t++) {
        if (!(what & CLLM_CUDA_GEMM_TUNE_TILING) && t != current_tiling)
            continue;
        if (cllm_cuda_gemm_prepare_tiling(t) != cudaSuccess) {
            (void)cudaGetLastError(); /* a shape this device cannot give its ring: not timed */
            continue;
        }
        for (int parallel = 0; parallel < 2; parallel++) {
            /* a shape for blocks of one slice: in series only where there is one slice, in
             * parallel however many tiles there are (its blocks are too few otherwise) */
            const bool one = tilings[t].one_slice;
            if (!parallel && one && sliced)
                continue;
            if (parallel && !(sliced && (one || tiles_of(t, N, n) < 256 * tilings[t].min_blocks) &&
                              scratch_bytes >= parallel_scratch(N, K, n)))
                continue;
            if (t == base.tiling && (parallel != 0) == (base.parallel && sliced))
                continue; /* the default way, already first */
            out[count++] = gemm_way{t, parallel != 0, base.ahead, base.parts};
        }
    }
    return count;
}

size_t cllm_cuda_gemm_tune_scratch_bytes(int32_t N, int32_t K, int32_t n_max)
{
    size_t need = 0;
    for (int b = 0; b < N_BUCKETS && N > 0 && n_max > 0; b++) {
        const int32_t n = bucket_probe[b] < n_max ? bucket_probe[b] : n_max;
        size_t s = 0;
        if (n > CLLM_CUDA_GEMM_SKINNY_MAX && cllm_cuda_gemm_slices(N, K) > 1)
            s = parallel_scratch(N, K, n);
        else if (n <= CLLM_CUDA_GEMM_SKINNY_MAX && (split_fits(N, K, 2) || split_fits(N, K, 4)))
            s = split_scratch(N, K, n);
        need = s > need ? s : need;
        if (n == n_max)
            break;
    }
    return need;
}

/* Times one way as the engine runs it: `reps` launches recorded as one graph, the weights in
 * turn (as the layers follow each other: from HBM, not from the L2 the launch before filled),
 * replayed three times; the faster of the last two, per launch. */
static cudaError_t time_way(bool paired, const gemm_way &way, const gemm_call &a,
                            const __nv_bfloat16 *const *w, int32_t n_w, int32_t n, int reps,
                            cudaEvent_t start, cudaEvent_t stop, float *us)
{
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamBeginCapture(a.stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess)
        return e;
    for (int r = 0; r < reps && e == cudaSuccess; r++) {
        gemm_call ar = a;
        ar.w = w[r % n_w];
        e = cllm_cuda_gemm_launch(paired, way, ar, n);
    }
    const cudaError_t ended = cudaStreamEndCapture(a.stream, &graph);
    if (e == cudaSuccess)
        e = ended;
    if (e == cudaSuccess)
        e = cllm_graph_instantiate(&exec, graph);
    *us = INFINITY;
    for (int i = 0; i < 3 && e == cudaSuccess; i++) {
        float ms = 0.0f;
        e = cudaEventRecord(start, a.stream);
        if (e == cudaSuccess)
            e = cudaGraphLaunch(exec, a.stream);
        if (e == cudaSuccess)
            e = cudaEventRecord(stop, a.stream);
        if (e == cudaSuccess)
            e = cudaEventSynchronize(stop);
        if (e == cudaSuccess)
            e = cudaEventElapsedTime(&ms, start, stop);
        if (e == cudaSuccess && i > 0 && 1000.0f * ms / (float)reps < *us)
            *us = 1000.0f * ms / (float)reps;
    }
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    return e;
}

static int describe_way(char *out, size_t len, int32_t N, int32_t K, int32_t n, const gemm_way &w)
{
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX && split_fits(N, K, w.parts))
        return snprintf(out, len, "%s, %d blocks a tile", w.ahead ? "ahead" : "not ahead", w.parts);
    if (n <= CLLM_CUDA_GEMM_SKINNY_MAX)
        return snprintf(out, len, "%s", w.ahead ? "ahead" : "not ahead");
    const bool parallel = runs_parallel(w, N, K, n);
    const bool fallback =
        tilings[w.tiling].one_slice && cllm_cuda_gemm_slices(N, K) > 1 && !parallel;
    return snprintf(out, len, "%s%s", tilings[fallback ? TILING_128X64 : w.tiling].name,
                    parallel ? " parallel" : "");
}

void cllm_cuda_gemm_way(int32_t N, int32_t K, int32_t n, char *out, size_t len)
{
    describe_way(out, len, N, K, n, cllm_cuda_gemm_way_for(N, K, n));
}

/* Appends to report without overrunning it. */
static void report_add(char *report, size_t len, size_t *at, const char *fmt, ...)
{
    if (!report || *at >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(report + *at, len - *at, fmt, ap);
    va_end(ap);
    if (k > 0)
        *at = *at + (size_t)k < len ? *at + (size_t)k : len;
}

cudaError_t cllm_cuda_gemm_tune(const __nv_bfloat16 *const *w, int32_t n_w, int32_t N, int32_t K,
                                int paired, const __nv_bfloat16 *x, int32_t n_max, void *y,
                                int32_t ldy, void *scratch, size_t scratch_bytes, unsigned what,
                                cudaStream_t stream, char *report, size_t report_len)
{
    if (report && report_len)
        report[0] = '\0';
    if (N < 1 || n_max < 1 || n_w < 1 || (paired && N % 2) || ldy < (paired ? N / 2 : N))
        return cudaErrorInvalidValue;
    for (int32_t i = 0; i < n_w; i++)
        if (!cllm_cuda_gemm_supported(w[i], x, K))
            return cudaErrorInvalidValue;
    const gemm_call a = {w[0], NULL, N, K, x, y, ldy, scratch, scratch_bytes, stream, NULL};
    cudaEvent_t start = NULL, stop = NULL;
    cudaError_t e = cudaEventCreate(&start);
    if (e == cudaSuccess)
        e = cudaEventCreate(&stop);
    size_t at = 0;
    report_add(report, report_len, &at, "%dx%d", (int)N, (int)K);
    for (int b = 0; b < N_BUCKETS && e == cudaSuccess; b++) {
        const int32_t n = bucket_probe[b] < n_max ? bucket_probe[b] : n_max;
        gemm_way ways[2 * N_TILINGS + 1];
        const int count = ways_to_time(N, K, n, what, scratch_bytes, ways);
        /* enough launches a graph (~20 us at least on an H200) that the gaps between the
         * kernels of a recorded step are in the time, and the graph's own start is not; every
         * weight once in decode steps, whose time is the weights' stream */
        int reps = n <= CLLM_CUDA_GEMM_SKINNY_MAX ? 8 : n <= 256 ? 2 : 1;
        const int32_t distinct = n <= CLLM_CUDA_GEMM_SKINNY_MAX ? n_w : n_w < 4 ? n_w : 4;
        reps = reps > distinct ? reps : (int)distinct;
        float best = INFINITY, first = INFINITY;
        int won = 0;
        for (int i = 0; i < count && count > 1 && e == cudaSuccess; i++) {
            float us;
            e = time_way(paired != 0, ways[i], a, w, n_w, n, reps, start, stop, &us);
            if (i == 0)
                first = us; /* ways[0] is the default way */
            if (e == cudaSuccess && us < best)
                best = us, won = i;
        }
        if (e != cudaSuccess)
            break;
        keep_way(N, K, b, ways[won]);
        char name[48];
        describe_way(name, sizeof name, N, K, n, ways[won]);
        if (count > 1)
            report_add(report, report_len, &at, "; n<=%d: %s %.1f us (default %.1f)",
                       bucket_max[b] == INT32_MAX ? (int)n : (int)bucket_max[b], name, (double)best,
                       (double)first);
        if (n == n_max)
            break;
    }
    if (start)
        cudaEventDestroy(start);
    if (stop)
        cudaEventDestroy(stop);
    return e;
}

#else /* no tensor-core MMA on this vendor: the backend uses its BLAS */

size_t cllm_cuda_gemm_scratch_bytes(int32_t N, int32_t K, int32_t n, bool norm_inside)
{
    (void)N, (void)K, (void)n, (void)norm_inside;
    return 0;
}

size_t cllm_cuda_gemm_tune_scratch_bytes(int32_t N, int32_t K, int32_t n_max)
{
    (void)N, (void)K, (void)n_max;
    return 0;
}

cudaError_t cllm_cuda_gemm_tune(const __nv_bfloat16 *const *w, int32_t n_w, int32_t N, int32_t K,
                                int paired, const __nv_bfloat16 *x, int32_t n_max, void *y,
                                int32_t ldy, void *scratch, size_t scratch_bytes, unsigned what,
                                cudaStream_t stream, char *report, size_t report_len)
{
    (void)w, (void)n_w, (void)N, (void)K, (void)paired, (void)x, (void)n_max, (void)y, (void)ldy,
        (void)scratch, (void)scratch_bytes, (void)what, (void)stream;
    if (report && report_len)
        report[0] = '\0';
    return cudaErrorInvalidValue;
}

void cllm_cuda_gemm_forget_plans(void)
{
}

int cllm_cuda_gemm_tuned(int32_t N, int32_t K, int32_t n_max)
{
    (void)N, (void)K, (void)n_max;
    return 0;
}

void cllm_cuda_gemm_way(int32_t N, int32_t K, int32_t n, char *out, size_t len)
{
    (void)N, (void)K, (void)n;
    snprintf(out, len, "vendor BLAS");
}

#endif
