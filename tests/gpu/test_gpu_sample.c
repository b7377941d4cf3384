/*
 * Device sampling (backend/cuda/sample.cu) against the host sampler (sampling/sampling.c):
 * greedy rows give exactly the host's argmax; sampled rows never leave the set the host keeps
 * (cllm_sampler_probs > 0) and their draw frequencies match the host's probabilities; a draw
 * depends only on its row and (seed, counter): the same again, alone or in another batch.
 * Shapes n in {1, 7, 256} by n_vocab in {1, 100, 151936}; logits peaked, flat, in runs of
 * ties, with NaN and +-inf; parameters covering every path of the kernel, the exact fallback
 * for candidate sets beyond shared memory included. Prints, never asserts, kernel times.
 *
 * Frequency bound. For N draws over K kept tokens, E[TVD] <= 1/2 sum sqrt(p_i / N) <=
 * 1/2 sqrt(K / N) (Cauchy-Schwarz), and one draw moves the TVD by at most 1/N, so by McDiarmid
 * P(TVD > E + eps) <= exp(-2 N eps^2); eps = sqrt(ln(1e6) / 2N) makes a false failure a 1e-6
 * event. A wrong rule (a token cut or kept wrongly, a wrong temperature) moves far more.
 *
 * Without a CUDA device it prints why and exits 77 (skipped).
 */
#include <cuda_runtime_api.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/sample.h"
#include "sampling/sampling.h"
#include "test.h"

#ifndef BIG_VOCAB
#define BIG_VOCAB 151936 /* Qwen2.5's; the CPU emulator's CI run takes 32768 */
#endif
#ifndef DRAWS
#define DRAWS 50000 /* per configuration, small vocab */
#endif
#ifndef DRAWS_BIG
#define DRAWS_BIG 10240 /* per configuration, 151,936 vocab (in launches of 256 rows) */
#endif
#ifndef BENCH_REPS
#define BENCH_REPS 10 /* launches timed per case; 0 skips the timings */
#endif

/* A row's processors, positionally: temperature, top_k, top_p, min_p, seed, counter. */
#define ROW(t, k, p, m, s, c)                                                                  \
    {.temperature = (t), .top_k = (k), .top_p = (p), .min_p = (m), .seed = (s), .counter = (c)}

enum kind { PEAKED, FLAT, TIES, SPECIAL, ZEROS, TAIL, N_KINDS };

/* One row of logits of a kind: PEAKED a bell with 40 peaks (like real logits), FLAT uniform in
 * [-1, 1), TIES six values in long runs, SPECIAL peaked with NaN and -inf sprinkled (NaN
 * first), ZEROS +0 and -0 only, TAIL 30 peaks over one long run of equal low logits. */
static void make_row(enum kind kind, uint64_t seed, float *l, int32_t n)
{
    uint64_t x = seed * 7919 + (uint64_t)kind;
    switch (kind) {
    case PEAKED:
    case SPECIAL:
        for (int32_t i = 0; i < n; i++) {
            double s = 0;
            for (int j = 0; j < 4; j++)
                s += test_urand(&x);
            l[i] = (float)(s * 5.0 - 10.0);
        }
        for (int j = 0; j < 40; j++)
            l[test_splitmix(&x) % (uint64_t)n] = (float)(18.0 - 0.3 * j + test_urand(&x) * 0.1);
        for (int32_t i = 0; kind == SPECIAL && i < n; i++) {
            if (i % 7 == 0)
                l[i] = NAN;
            else if (i % 11 == 3)
                l[i] = -INFINITY;
        }
        break;
    case FLAT:
        for (int32_t i = 0; i < n; i++)
            l[i] = (float)(test_urand(&x) * 2.0 - 1.0);
        break;
    case TIES:
        for (int32_t i = 0; i < n; i++)
            l[i] = (float)(test_splitmix(&x) % 6) * 0.75f;
        break;
    case ZEROS:
        for (int32_t i = 0; i < n; i++)
            l[i] = (test_splitmix(&x) & 1) ? -0.0f : 0.0f;
        break;
    case TAIL:
        for (int32_t i = 0; i < n; i++)
            l[i] = -2.0f;
        for (int j = 0; j < 30 && j < n; j++)
            l[test_splitmix(&x) % (uint64_t)n] = (float)(9.0 - 0.25 * j);
        break;
    default:
        break;
    }
}

static struct cllm_sampling_params params_of(const struct cllm_sample_row *r)
{
    struct cllm_sampling_params p;
    cllm_sampling_params_default(&p);
    p.temperature = r->temperature;
    p.top_k = r->top_k;
    p.top_p = r->top_p;
    p.min_p = r->min_p;
    p.seed = r->seed;
    return p;
}

/* The host's distribution for a row (probs[n]); false if the sampler refused. */
static bool host_probs(const struct cllm_sample_row *r, const float *src, int32_t n, double *probs)
{
    struct cllm_sampling_params p = params_of(r);
    struct cllm_sampler *s;
    if (cllm_sampler_new(&s, &p, n, NULL, 0) != CLLM_OK)
        return false;
    float *l = malloc((size_t)n * sizeof *l);
    memcpy(l, src, (size_t)n * sizeof *l);
    enum cllm_status st = cllm_sampler_probs(s, l, probs);
    free(l);
    cllm_sampler_free(s);
    return st == CLLM_OK;
}

static int32_t host_greedy(const float *src, int32_t n)
{
    struct cllm_sampling_params p;
    cllm_sampling_params_default(&p);
    struct cllm_sampler *s;
    if (cllm_sampler_new(&s, &p, n, NULL, 0) != CLLM_OK)
        return -2;
    float *l = malloc((size_t)n * sizeof *l);
    memcpy(l, src, (size_t)n * sizeof *l);
    int32_t t = cllm_sampler_sample(s, l);
    free(l);
    cllm_sampler_free(s);
    return t;
}

static bool ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return true;
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    test_failed++;
    return false;
}

static void *dev_copy(const void *src, size_t bytes)
{
    void *p = NULL;
    if (!ok(cudaMalloc(&p, bytes), "cudaMalloc"))
        return NULL;
    if (!ok(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice), "upload")) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

/* Samples n rows of the device logits as rows says; tokens[n] on the host. The device output
 * is poisoned first, so a row the kernel skipped shows up as -1. */
static bool run(const float *d_logits, int32_t n, int32_t n_vocab,
                const struct cllm_sample_row *rows, int32_t *tokens)
{
    struct cllm_sample_row *d_rows = dev_copy(rows, (size_t)n * sizeof *rows);
    int32_t *d_tokens = NULL;
    bool good =
        d_rows && ok(cudaMalloc((void **)&d_tokens, (size_t)n * sizeof *d_tokens), "cudaMalloc");
    good = good && ok(cudaMemset(d_tokens, 0xff, (size_t)n * sizeof *d_tokens), "poison");
    size_t scratch_bytes = cllm_cuda_sample_scratch_bytes(n, n_vocab);
    void *scratch = NULL;
    if (good && scratch_bytes)
        good = ok(cudaMalloc(&scratch, scratch_bytes), "cudaMalloc (scratch)");
    good = good && ok(cllm_cuda_sample(d_logits, n, n_vocab, d_rows, d_tokens, scratch,
                                       scratch_bytes, NULL),
                      "cllm_cuda_sample");
    good = good && ok(cudaDeviceSynchronize(), "kernel");
    good =
        good && ok(cudaMemcpy(tokens, d_tokens, (size_t)n * sizeof *tokens, cudaMemcpyDeviceToHost),
                   "download");
    cudaFree(scratch);
    cudaFree(d_tokens);
    cudaFree(d_rows);
    if (good)
        for (int32_t i = 0; i < n; i++)
            CHECKF(tokens[i] >= 0 && tokens[i] < n_vocab, "row %d: token %d of %d", (int)i,
                   (int)tokens[i], (int)n_vocab);
    return good;
}

/* Parameters that reach every path of the kernel (at 151,936; small vocabs turn big k off). */
static const struct cllm_sample_row CONFIGS[] = {
    /* T, top_k, top_p, min_p, seed, counter */
    ROW(1.0f, 0, 1.0f, 0.0f, 1, 0),      /* plain softmax: one pass */
    ROW(0.7f, 20, 0.8f, 0.0f, 2, 0),     /* Qwen2.5's generation_config */
    ROW(1.0f, 50, 1.0f, 0.0f, 3, 0),     /* top-k */
    ROW(1.3f, 0, 0.9f, 0.0f, 4, 0),      /* top-p: gap histogram */
    ROW(1.0f, 0, 1.0f, 0.05f, 5, 0),     /* min-p alone */
    ROW(0.8f, 40, 0.95f, 0.02f, 6, 0),   /* all three */
    ROW(1.0f, 0, 0.5f, 0.1f, 7, 0),      /* top-p and min-p */
    ROW(1.5f, 1, 1.0f, 0.0f, 8, 0),      /* top-k 1: the max and its ties */
    ROW(2.0f, 20000, 1.0f, 0.0f, 9, 0),  /* k past shared memory: exact top-k */
    ROW(3.0f, 0, 0.99f, 0.0f, 10, 0),    /* a wide nucleus: exact top-p */
    ROW(1.0f, 30000, 0.9f, 0.0f, 11, 0), /* exact top-k then top-p */
    ROW(0.05f, 0, 1.0f, 0.0f, 12, 0),    /* cold */
    ROW(1.0f, 0, 1e-6f, 0.0f, 13, 0),    /* top-p keeps the top token only */
    ROW(1.0f, 0, 1.0f, 1.0f, 14, 0),     /* min-p 1: the max and its ties */
};
#define N_CONFIGS ((int)(sizeof CONFIGS / sizeof CONFIGS[0]))

/* Every shape: greedy rows equal the host argmax; sampled rows stay in the host's kept set;
 * a second launch, and each row launched alone, give the same tokens. */
static void test_shapes(void)
{
    static const int32_t vocabs[] = {1, 100, BIG_VOCAB};
    static const int32_t ns[] = {1, 7, 256};
    for (int v = 0; v < 3; v++) {
        const int32_t nv = vocabs[v];
        const int32_t n_max = 256;
        float *logits = malloc((size_t)n_max * (size_t)nv * sizeof *logits);
        for (int32_t r = 0; r < n_max; r++)
            make_row((enum kind)(r % N_KINDS), (uint64_t)r + 100 * (uint64_t)v,
                     logits + (size_t)r * (size_t)nv, nv);
        float *d_logits = dev_copy(logits, (size_t)n_max * (size_t)nv * sizeof *logits);
        double *probs = malloc((size_t)nv * sizeof *probs);
        if (!d_logits || !probs)
            goto free_all;
        for (int s = 0; s < 3; s++) {
            const int32_t n = ns[s];
            struct cllm_sample_row *rows = malloc((size_t)n * sizeof *rows);
            int32_t *tok = malloc((size_t)n * sizeof *tok),
                    *again = malloc((size_t)n * sizeof *again);
            /* Greedy, with the filters set (greedy ignores them). */
            for (int32_t r = 0; r < n; r++) {
                rows[r] = CONFIGS[r % N_CONFIGS];
                rows[r].temperature = 0.0f;
                rows[r].counter = (uint64_t)r;
            }
            if (run(d_logits, n, nv, rows, tok)) {
                int bad = 0;
                for (int32_t r = 0; r < n; r++) {
                    int32_t want = host_greedy(logits + (size_t)r * (size_t)nv, nv);
                    if (tok[r] != want && bad++ < 5)
                        fprintf(stderr, "greedy vocab %d n %d row %d (kind %d): %d, host %d\n",
                                (int)nv, (int)n, (int)r, (int)(r % N_KINDS), (int)tok[r],
                                (int)want);
                }
                CHECKF(bad == 0, "greedy: %d of %d rows differ (vocab %d)", bad, (int)n, (int)nv);
            }
            /* Sampled: every configuration on every kind. */
            for (int32_t r = 0; r < n; r++) {
                rows[r] = CONFIGS[(r / N_KINDS + r) % N_CONFIGS];
                rows[r].seed = 1000 + (uint64_t)r;
                rows[r].counter = (uint64_t)(r * 31 + s);
            }
            if (run(d_logits, n, nv, rows, tok) && run(d_logits, n, nv, rows, again)) {
                CHECK(memcmp(tok, again, (size_t)n * sizeof *tok) == 0);
                int outside = 0;
                for (int32_t r = 0; r < n; r++) {
                    if (!host_probs(&rows[r], logits + (size_t)r * (size_t)nv, nv, probs)) {
                        CHECK(0);
                        continue;
                    }
                    if (!(probs[tok[r]] > 0.0) && outside++ < 5)
                        fprintf(stderr,
                                "vocab %d n %d row %d (kind %d, T %g k %d p %g min_p %g): token "
                                "%d has host probability 0\n",
                                (int)nv, (int)n, (int)r, (int)(r % N_KINDS),
                                (double)rows[r].temperature, (int)rows[r].top_k,
                                (double)rows[r].top_p, (double)rows[r].min_p, (int)tok[r]);
                }
                CHECKF(outside == 0, "%d of %d sampled tokens outside the kept set (vocab %d)",
                       outside, (int)n, (int)nv);
                /* Batch invariance: rows 0 and n - 1 alone. */
                int32_t one;
                if (run(d_logits, 1, nv, rows, &one))
                    CHECK(one == tok[0]);
                if (run(d_logits + (size_t)(n - 1) * (size_t)nv, 1, nv, rows + n - 1, &one))
                    CHECK(one == tok[n - 1]);
            }
            free(rows);
            free(tok);
            free(again);
        }
    free_all:
        cudaFree(d_logits);
        free(probs);
        free(logits);
    }
}

/* Hand-made rows whose answer is known. */
static void test_edges(void)
{
    enum { NV = 8 };
    static const struct {
        float l[NV];
        struct cllm_sample_row row;
        int32_t want; /* -1: any token the host keeps */
    } cases[] = {
        {{NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN}, ROW(0, 0, 1, 0, 0, 0), 0},
        {{NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN}, ROW(1, 0, 1, 0, 0, 0), 0},
        {{NAN, -INFINITY, NAN, -INFINITY, NAN, NAN, NAN, NAN}, ROW(0, 0, 1, 0, 0, 0), 1},
        {{NAN, -INFINITY, NAN, -INFINITY, NAN, NAN, NAN, NAN}, ROW(1, 5, 0.5f, 0.1f, 0, 0), 0},
        {{-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY},
         ROW(0.5f, 0, 1, 0, 0, 0),
         0},
        {{1, INFINITY, 2, INFINITY, 3, 0, 0, 0}, ROW(1, 0, 1, 0, 0, 0), 1},
        {{1, INFINITY, 2, INFINITY, 3, 0, 0, 0}, ROW(0, 0, 1, 0, 0, 0), 1},
        {{1, 5, 2, 5, 3, 0, NAN, 0}, ROW(0, 0, 1, 0, 0, 0), 1},
        {{-0.0f, 0.0f, -0.0f, 0.0f, -1, -1, -1, -1}, ROW(0, 0, 1, 0, 0, 0), 0},
        {{1, 2e30f, 2, 1e30f, 3, 0, 0, 0}, ROW(1e-10f, 0, 1, 0, 0, 0), 1}, /* x overflows */
        {{1, 3, 2, 3, 3, 0, 0, 0}, ROW(1, 1, 1, 0, 0, 0), -1},    /* top-k 1 keeps the 3 ties */
        {{1, 3, 2, 3, 3, 0, 0, 0}, ROW(1, 0, 1, 1, 0, 0), -1},    /* min-p 1 as well */
        {{1, 3, 2, 3, 3, 0, 0, 0}, ROW(1, 0, 0.25f, 0, 0, 0), 1}, /* top-p: the run's lowest id */
        {{1, 3, 2, 3, 3, 0, 0, 0}, ROW(1, 8, 1, 0, 0, 0), -1},    /* k = n_vocab: off */
        {{1, 3, 2, 3, 3, 0, 0, 0}, ROW(1, 100, 1, 0, 0, 0), -1},  /* k > n_vocab: off */
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    for (int c = 0; c < n; c++) {
        float *d = dev_copy(cases[c].l, sizeof cases[c].l);
        if (!d)
            continue;
        double probs[NV];
        CHECK(host_probs(&cases[c].row, cases[c].l, NV, probs));
        for (uint64_t counter = 0; counter < 20; counter++) {
            struct cllm_sample_row row = cases[c].row;
            row.counter = counter;
            int32_t tok;
            if (!run(d, 1, NV, &row, &tok))
                break;
            if (cases[c].want >= 0)
                CHECKF(tok == cases[c].want, "edge case %d: token %d, want %d", c, (int)tok,
                       (int)cases[c].want);
            else
                CHECKF(probs[tok] > 0, "edge case %d: token %d is not kept", c, (int)tok);
        }
        cudaFree(d);
    }

    /* Arguments: nothing to do, and what the launcher refuses. */
    float *d = dev_copy(cases[0].l, sizeof cases[0].l);
    struct cllm_sample_row row = ROW(1, 0, 1, 0, 0, 0);
    struct cllm_sample_row *d_row = dev_copy(&row, sizeof row);
    int32_t *d_tok = NULL;
    if (d && d_row && ok(cudaMalloc((void **)&d_tok, sizeof *d_tok), "cudaMalloc")) {
        CHECK(cllm_cuda_sample(d, 0, NV, d_row, d_tok, NULL, 0, NULL) == cudaSuccess);
        CHECK(cllm_cuda_sample(d, -1, NV, d_row, d_tok, NULL, 0, NULL) == cudaErrorInvalidValue);
        CHECK(cllm_cuda_sample(d, 1, 0, d_row, d_tok, NULL, 0, NULL) == cudaErrorInvalidValue);
        CHECK(cllm_cuda_sample(d, 1, CLLM_CUDA_SAMPLE_MAX_VOCAB + 1, d_row, d_tok, NULL, 0, NULL) ==
              cudaErrorInvalidValue);
        CHECK(cudaGetLastError() == cudaSuccess);
    }
    cudaFree(d_tok);
    cudaFree(d_row);
    cudaFree(d);
}

/* Penalties on the device (cllm_cuda_penalize) against the host's: each row's seen tokens
 * from a real host sampler (prompt and generated tokens), plus one generated token the host
 * has not recorded (unseen_output: from an earlier draw's device array) that is already
 * generated, only in the prompt, or new; the penalized logits are the host's bit for bit, and
 * the draws after them are the host sampler's (greedy: its token; Qwen's defaults: a token it
 * keeps), the host sampler having recorded that token. */
static void test_penalties(void)
{
    enum { N = 12, PROMPT = 30 };
    static const int32_t vocabs[] = {100, BIG_VOCAB};
    for (int v = 0; v < 2; v++) {
        const int32_t nv = vocabs[v];
        uint64_t x = 4242 + (uint64_t)v;
        float *src = malloc((size_t)N * (size_t)nv * sizeof *src);
        float *want = malloc((size_t)N * (size_t)nv * sizeof *want);
        float *got = malloc((size_t)N * (size_t)nv * sizeof *got);
        struct cllm_token_count *counts = malloc((size_t)N * (PROMPT + 40) * sizeof *counts);
        struct cllm_sample_row rows[N];
        struct cllm_sampler *after[N]; /* each row's sampler with the unseen token recorded */
        int32_t prev[N];
        size_t n_counts = 0;
        memset(rows, 0, sizeof rows);
        for (int i = 0; i < N; i++) {
            make_row((enum kind)(i % N_KINDS), 900 + (uint64_t)i, src + (size_t)i * nv, nv);
            struct cllm_sampling_params p;
            cllm_sampling_params_default(&p);
            const int mode = i % 4; /* repetition, presence + frequency, all three, none */
            if (mode == 0 || mode == 2)
                p.repetition_penalty = i % 8 < 4 ? 1.1f : 0.8f;
            if (mode == 1 || mode == 2) {
                p.presence_penalty = 0.5f + (float)i * 0.1f;
                p.frequency_penalty = i % 3 == 0 ? -0.25f : 0.3f;
            }
            int32_t prompt[PROMPT];
            for (int k = 0; k < PROMPT; k++)
                prompt[k] = (int32_t)(test_splitmix(&x) % (uint64_t)nv);
            struct cllm_sampler *before;
            CHECK(cllm_sampler_new(&before, &p, nv, prompt, PROMPT) == CLLM_OK);
            CHECK(cllm_sampler_new(&after[i], &p, nv, prompt, PROMPT) == CLLM_OK);
            int32_t last = prompt[1];
            for (int k = 0; k < 2 + i * 3; k++) { /* generated tokens, some of them repeated */
                last = k % 4 == 3 ? last : (int32_t)(test_splitmix(&x) % (uint64_t)nv);
                CHECK(cllm_sampler_accept(before, last) == CLLM_OK);
                CHECK(cllm_sampler_accept(after[i], last) == CLLM_OK);
            }
            /* the unseen token: none, one generated before, one of the prompt's, a new one */
            const int u = (i / 4 + i) % 4;
            prev[i] = u == 1   ? last
                      : u == 2 ? prompt[5]
                               : (int32_t)(test_splitmix(&x) % (uint64_t)nv);
            size_t n_seen;
            const struct cllm_token_count *seen = cllm_sampler_seen(before, &n_seen);
            memcpy(counts + n_counts, seen, n_seen * sizeof *seen);
            rows[i].repetition_penalty = p.repetition_penalty;
            rows[i].presence_penalty = p.presence_penalty;
            rows[i].frequency_penalty = p.frequency_penalty;
            rows[i].counts_at = (int32_t)n_counts;
            rows[i].n_counts = (int32_t)n_seen;
            rows[i].unseen_output = u > 0 && mode != 3 ? i + 1 : 0;
            n_counts += n_seen;
            float *w = want + (size_t)i * nv;
            memcpy(w, src + (size_t)i * nv, (size_t)nv * sizeof *w);
            if (mode != 3) {
                cllm_penalize(w, nv, seen, n_seen, rows[i].unseen_output ? prev[i] : -1,
                              p.repetition_penalty, p.presence_penalty, p.frequency_penalty);
                if (rows[i].unseen_output)
                    CHECK(cllm_sampler_accept(after[i], prev[i]) == CLLM_OK);
            }
            cllm_sampler_free(before);
        }
        const size_t bytes = (size_t)N * (size_t)nv * sizeof *src;
        float *d = dev_copy(src, bytes);
        struct cllm_sample_row *d_rows = dev_copy(rows, sizeof rows);
        struct cllm_token_count *d_counts = dev_copy(counts, n_counts * sizeof *counts);
        int32_t *d_prev = dev_copy(prev, sizeof prev);
        if (d && d_rows && d_counts && d_prev &&
            ok(cllm_cuda_penalize(d, N, nv, d_rows, d_counts, d_prev, NULL), "penalize") &&
            ok(cudaMemcpy(got, d, bytes, cudaMemcpyDeviceToHost), "download")) {
            for (int i = 0; i < N; i++) {
                int32_t bad = -1;
                for (int32_t t = 0; t < nv && bad < 0; t++) {
                    const float a = got[(size_t)i * nv + t], b = want[(size_t)i * nv + t];
                    if (!(isnan(a) && isnan(b)) && memcmp(&a, &b, sizeof a) != 0)
                        bad = t;
                }
                CHECKF(bad < 0, "vocab %d row %d: token %d penalized to %.9g, the host %.9g",
                       (int)nv, i, (int)bad, bad < 0 ? 0.0 : (double)got[(size_t)i * nv + bad],
                       bad < 0 ? 0.0 : (double)want[(size_t)i * nv + bad]);
            }
            /* the draws after them: greedy, then Qwen's defaults */
            int32_t tokens[N];
            if (run(d, N, nv, rows, tokens))
                for (int i = 0; i < N; i++) {
                    float *l = malloc((size_t)nv * sizeof *l);
                    memcpy(l, src + (size_t)i * nv, (size_t)nv * sizeof *l);
                    const int32_t host = cllm_sampler_sample(after[i], l);
                    CHECKF(tokens[i] == host, "vocab %d row %d: greedy %d, the host's %d", (int)nv,
                           i, (int)tokens[i], (int)host);
                    free(l);
                }
            struct cllm_sample_row qwen[N];
            memcpy(qwen, rows, sizeof rows);
            double *probs = malloc((size_t)nv * sizeof *probs);
            for (int i = 0; i < N; i++)
                qwen[i].temperature = 0.7f, qwen[i].top_k = 20, qwen[i].top_p = 0.8f,
                qwen[i].seed = 5, qwen[i].counter = (uint64_t)i;
            if (run(d, N, nv, qwen, tokens))
                for (int i = 0; i < N; i++) {
                    /* want holds the penalized row: the host's distribution over it */
                    CHECK(host_probs(&qwen[i], want + (size_t)i * nv, nv, probs));
                    CHECKF(probs[tokens[i]] > 0, "vocab %d row %d: token %d is not kept", (int)nv,
                           i, (int)tokens[i]);
                }
            free(probs);
        }
        /* nothing to do */
        CHECK(cllm_cuda_penalize(d, 0, nv, d_rows, d_counts, d_prev, NULL) == cudaSuccess);
        CHECK(cllm_cuda_penalize(d, 1, 0, d_rows, d_counts, d_prev, NULL) == cudaErrorInvalidValue);
        for (int i = 0; i < N; i++)
            cllm_sampler_free(after[i]);
        cudaFree(d_prev);
        cudaFree(d_counts);
        cudaFree(d_rows);
        cudaFree(d);
        free(counts);
        free(got);
        free(want);
        free(src);
    }
}

/* Counts of `draws` tokens drawn from one row (counters 0..draws-1) in launches of at most
 * `batch` rows over `batch` device copies of the row. */
static bool draw_counts(const float *row, int32_t nv, const struct cllm_sample_row *cfg,
                        int32_t draws, int32_t batch, long *count)
{
    float *rep = malloc((size_t)batch * (size_t)nv * sizeof *rep);
    for (int32_t r = 0; r < batch; r++)
        memcpy(rep + (size_t)r * (size_t)nv, row, (size_t)nv * sizeof *row);
    float *d = dev_copy(rep, (size_t)batch * (size_t)nv * sizeof *rep);
    free(rep);
    struct cllm_sample_row *rows = malloc((size_t)batch * sizeof *rows);
    int32_t *tok = malloc((size_t)batch * sizeof *tok);
    bool good = d != NULL;
    memset(count, 0, (size_t)nv * sizeof *count);
    for (int32_t done = 0; good && done < draws; done += batch) {
        int32_t m = draws - done < batch ? draws - done : batch;
        for (int32_t r = 0; r < m; r++) {
            rows[r] = *cfg;
            rows[r].counter = (uint64_t)(done + r);
        }
        good = run(d, m, nv, rows, tok);
        for (int32_t r = 0; good && r < m; r++)
            count[tok[r]]++;
    }
    cudaFree(d);
    free(rows);
    free(tok);
    return good;
}

/* TVD between the draw frequencies and probs over `groups` groups of tokens (group[i]); also
 * fails any draw of a token the host removed. */
static void check_frequencies(const char *what, const long *count, const double *probs,
                              const int32_t *group, int32_t nv, int32_t groups, long draws)
{
    double *pg = calloc((size_t)groups, sizeof *pg), *fg = calloc((size_t)groups, sizeof *fg);
    long removed = 0;
    int32_t kept = 0;
    for (int32_t i = 0; i < nv; i++) {
        if (!(probs[i] > 0.0)) {
            removed += count[i];
            continue;
        }
        int32_t g = group ? group[i] : i;
        pg[g] += probs[i];
        fg[g] += (double)count[i] / (double)draws;
    }
    double tvd = 0.0;
    for (int32_t g = 0; g < groups; g++) {
        tvd += fabs(pg[g] - fg[g]);
        kept += pg[g] > 0.0;
    }
    tvd *= 0.5;
    const double bound =
        0.5 * sqrt((double)kept / (double)draws) + sqrt(log(1e6) / (2.0 * (double)draws));
    CHECKF(removed == 0, "%s: %ld draws of removed tokens", what, removed);
    CHECKF(tvd < bound, "%s: TVD %.4f over %d groups, bound %.4f", what, tvd, (int)kept, bound);
    free(pg);
    free(fg);
}

static void test_frequencies(void)
{
    enum { NV = 100 };
    float row[NV];
    double probs[NV];
    long count[NV];
    static const enum kind kinds[] = {PEAKED, FLAT, TIES};
    static const struct cllm_sample_row cfg[] = {
        ROW(1.0f, 0, 1.0f, 0.0f, 21, 0),  ROW(0.7f, 20, 0.8f, 0.0f, 22, 0),
        ROW(1.0f, 10, 1.0f, 0.0f, 23, 0), ROW(1.3f, 0, 0.9f, 0.0f, 24, 0),
        ROW(1.0f, 0, 1.0f, 0.2f, 25, 0),  ROW(0.8f, 40, 0.95f, 0.02f, 26, 0),
        ROW(2.0f, 0, 0.5f, 0.1f, 27, 0),
    };
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        /* Spread the PEAKED row so that every rule cuts somewhere in 100 tokens. */
        make_row(kinds[k], 77 + k, row, NV);
        if (kinds[k] == PEAKED)
            for (int i = 0; i < NV; i++)
                row[i] = row[i] * 0.25f;
        for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
            char what[96];
            snprintf(what, sizeof what, "kind %d, T %g k %d p %g min_p %g", (int)kinds[k],
                     (double)cfg[c].temperature, (int)cfg[c].top_k, (double)cfg[c].top_p,
                     (double)cfg[c].min_p);
            if (!host_probs(&cfg[c], row, NV, probs) ||
                !draw_counts(row, NV, &cfg[c], DRAWS, DRAWS, count)) {
                CHECK(0);
                continue;
            }
            check_frequencies(what, count, probs, NULL, NV, NV, DRAWS);
        }
    }

    /* BIG_VOCAB tokens: the shared-memory paths and the exact fallback (k and nuclei beyond
     * the 16,384 candidates shared memory holds). The TAIL row's 30 peaks
     * are groups of their own and the long run of equal logits is one group, so the fallback's
     * cut inside that run (by id) and its mass are both checked. */
    float *big = malloc((size_t)BIG_VOCAB * sizeof *big);
    double *bprobs = malloc((size_t)BIG_VOCAB * sizeof *bprobs);
    long *bcount = malloc((size_t)BIG_VOCAB * sizeof *bcount);
    int32_t *group = malloc((size_t)BIG_VOCAB * sizeof *group);
    static const struct {
        enum kind kind;
        struct cllm_sample_row cfg;
    } bigcfg[] = {
        {PEAKED, ROW(0.7f, 20, 0.8f, 0.0f, 31, 0)},
        {PEAKED, ROW(1.0f, 0, 0.9f, 0.0f, 32, 0)},
        {PEAKED, ROW(1.0f, 0, 1.0f, 0.1f, 33, 0)},
        {TAIL, ROW(1.0f, 0, 0.95f, 0.0f, 34, 0)},    /* nucleus of ~100k: exact top-p, id cut */
        {TAIL, ROW(1.0f, 20000, 1.0f, 0.0f, 35, 0)}, /* exact top-k inside the run */
        {TAIL, ROW(1.0f, 0, 1.0f, 0.0f, 36, 0)},     /* plain softmax */
        {TAIL, ROW(1.0f, 30000, 0.9f, 0.0f, 37, 0)}, /* exact top-k, then top-p */
    };
    for (size_t c = 0; c < sizeof bigcfg / sizeof bigcfg[0]; c++) {
        make_row(bigcfg[c].kind, 5, big, BIG_VOCAB);
        if (!host_probs(&bigcfg[c].cfg, big, BIG_VOCAB, bprobs) ||
            !draw_counts(big, BIG_VOCAB, &bigcfg[c].cfg, DRAWS_BIG, 256, bcount)) {
            CHECK(0);
            continue;
        }
        /* Groups: each token with probability >= 1e-4 alone, the rest together. */
        int32_t groups = 1;
        for (int32_t i = 0; i < BIG_VOCAB; i++)
            group[i] = bprobs[i] >= 1e-4 ? groups++ : 0;
        char what[96];
        snprintf(what, sizeof what, "vocab %d kind %d, T %g k %d p %g min_p %g", BIG_VOCAB,
                 (int)bigcfg[c].kind, (double)bigcfg[c].cfg.temperature, (int)bigcfg[c].cfg.top_k,
                 (double)bigcfg[c].cfg.top_p, (double)bigcfg[c].cfg.min_p);
        check_frequencies(what, bcount, bprobs, group, BIG_VOCAB, groups, DRAWS_BIG);
    }
    free(big);
    free(bprobs);
    free(bcount);
    free(group);
}

/* The same (seed, counter) gives the same token in any row of any batch; other counters move
 * it. */
static void test_streams(void)
{
    enum { NV = 1000, N = 64 };
    float *l = malloc((size_t)N * NV * sizeof *l);
    for (int r = 0; r < N; r++)
        make_row(FLAT, 3, l + (size_t)r * NV, NV); /* the same row everywhere */
    float *d = dev_copy(l, (size_t)N * NV * sizeof *l);
    struct cllm_sample_row rows[N];
    int32_t tok[N];
    for (int r = 0; r < N; r++)
        rows[r] = (struct cllm_sample_row)ROW(1.0f, 0, 1.0f, 0.0f, 42, (uint64_t)(r % 8));
    if (d && run(d, N, NV, rows, tok)) {
        int same = 1, distinct = 0;
        for (int r = 8; r < N; r++)
            same &= tok[r] == tok[r % 8];
        for (int r = 1; r < 8; r++)
            distinct += tok[r] != tok[0];
        CHECK(same);
        CHECKF(distinct >= 5, "counters 1..7 repeat counter 0's token %d times", 7 - distinct);
        /* Another seed, another stream. */
        int32_t other[N];
        for (int r = 0; r < N; r++)
            rows[r].seed = 43;
        if (run(d, N, NV, rows, other)) {
            int differ = 0;
            for (int r = 0; r < 8; r++)
                differ += other[r] != tok[r];
            CHECKF(differ >= 5, "seeds 42 and 43 agree on %d of 8 draws", 8 - differ);
        }
    }
    cudaFree(d);
    free(l);
}

/* Kernel times at the shape that matters: 256 rows of 151,936. */
static void bench(void)
{
    enum { N = 256 };
    const int reps = BENCH_REPS;
    if (reps <= 0)
        return;
    float *l = malloc((size_t)N * BIG_VOCAB * sizeof *l);
    for (int r = 0; r < N; r++)
        make_row(PEAKED, (uint64_t)r, l + (size_t)r * BIG_VOCAB, BIG_VOCAB);
    float *d = dev_copy(l, (size_t)N * BIG_VOCAB * sizeof *l);
    free(l);
    struct cllm_sample_row *rows = malloc(N * sizeof *rows), *d_rows = NULL;
    int32_t *d_tok = NULL;
    cudaEvent_t a, b;
    if (!d || !ok(cudaMalloc((void **)&d_rows, N * sizeof *rows), "cudaMalloc") ||
        !ok(cudaMalloc((void **)&d_tok, N * sizeof *d_tok), "cudaMalloc") ||
        !ok(cudaEventCreate(&a), "event") || !ok(cudaEventCreate(&b), "event"))
        goto out;
    static const struct {
        const char *name;
        struct cllm_sample_row cfg;
    } cases[] = {
        {"greedy", ROW(0.0f, 0, 1.0f, 0.0f, 1, 0)},
        {"temperature", ROW(1.0f, 0, 1.0f, 0.0f, 1, 0)},
        {"top-k 20 + top-p 0.8", ROW(0.7f, 20, 0.8f, 0.0f, 1, 0)},
        {"top-p 0.95", ROW(1.0f, 0, 0.95f, 0.0f, 1, 0)},
        {"min-p 0.05", ROW(1.0f, 0, 1.0f, 0.05f, 1, 0)},
        {"top-k 50000 (exact)", ROW(1.0f, 50000, 1.0f, 0.0f, 1, 0)},
        {"top-p 0.99 T 3 (exact)", ROW(3.0f, 0, 0.99f, 0.0f, 1, 0)},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int r = 0; r < N; r++) {
            rows[r] = cases[c].cfg;
            rows[r].counter = (uint64_t)r;
        }
        if (!ok(cudaMemcpy(d_rows, rows, N * sizeof *rows, cudaMemcpyHostToDevice), "upload"))
            break;
        ok(cllm_cuda_sample(d, N, BIG_VOCAB, d_rows, d_tok, NULL, 0, NULL), "warm-up");
        ok(cudaEventRecord(a, NULL), "event");
        for (int i = 0; i < reps; i++)
            cllm_cuda_sample(d, N, BIG_VOCAB, d_rows, d_tok, NULL, 0, NULL);
        ok(cudaEventRecord(b, NULL), "event");
        ok(cudaEventSynchronize(b), "event");
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        printf("bench: %d x %d, %-24s %8.1f us per launch\n", N, BIG_VOCAB, cases[c].name,
               1000.0 * ms / reps);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
out:
    cudaFree(d);
    cudaFree(d_rows);
    cudaFree(d_tok);
    free(rows);
}

int main(void)
{
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("skipped: no CUDA device\n");
        return 77;
    }
    test_edges();
    test_penalties();
    test_streams();
    test_shapes();
    test_frequencies();
    bench();
    return test_summary();
}
