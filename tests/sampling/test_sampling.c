/*
 * The sampler: parameter validation, greedy and penalties on hand-made logits, determinism per
 * seed, draw frequencies against the distribution (chi-square), the fast candidate paths
 * against a brute-force full-sort reference, and tests/fixtures/sampling_golden.json (made by
 * gen_sampling.py with transformers' own logits processors). Prints, never asserts, the time
 * of one sample() on 151,936 logits.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "core/mmap.h"
#include "sampling/sampling.h"
#include "test.h"

#define QWEN_VOCAB 151936

/* gen_sampling.py's synth_logits, bit for bit: a bell of four 22-bit uniforms plus 40 peaks. */
static void synth_logits(uint64_t seed, float *out, int32_t n)
{
    uint64_t st = seed;
    for (int32_t i = 0; i < n; i++) {
        uint64_t s = 0;
        for (int j = 0; j < 4; j++)
            s += test_splitmix(&st) >> 42;
        out[i] = (float)((double)s * 0x1p-20 - 10.0);
    }
    for (int j = 0; j < 40; j++)
        out[test_splitmix(&st) % (uint64_t)n] = (float)(18.0 - 0.3 * j);
}

static struct cllm_sampling_params params(float t, int32_t k, float p, float min_p, float rep)
{
    struct cllm_sampling_params sp;
    cllm_sampling_params_default(&sp);
    sp.temperature = t;
    sp.top_k = k;
    sp.top_p = p;
    sp.min_p = min_p;
    sp.repetition_penalty = rep;
    return sp;
}

static void test_params_check(void)
{
    struct cllm_sampling_params ok;
    cllm_sampling_params_default(&ok);
    char err[128];
    CHECK(cllm_sampling_params_check(&ok, err, sizeof err) == CLLM_OK);
    CHECK(ok.temperature == 0.0f && ok.top_k == 0 && ok.top_p == 1.0f && ok.min_p == 0.0f &&
          ok.repetition_penalty == 1.0f && ok.presence_penalty == 0.0f &&
          ok.frequency_penalty == 0.0f);

    /* Bounds that are allowed. */
    struct cllm_sampling_params edge = ok;
    edge.temperature = 100.0f;
    edge.top_k = 1000000;
    edge.top_p = 1e-6f;
    edge.min_p = 1.0f;
    edge.repetition_penalty = 1e-3f;
    edge.presence_penalty = -2.0f;
    edge.frequency_penalty = 2.0f;
    CHECK(cllm_sampling_params_check(&edge, err, sizeof err) == CLLM_OK);

    static const struct {
        int field; /* 0 temperature, 1 top_k, 2 top_p, 3 min_p, 4 rep, 5 presence, 6 frequency */
        float v;
        const char *want; /* expected in the message */
    } bad[] = {
        {0, -0.1f, "temperature must be >= 0"},
        {0, NAN, "temperature"},
        {0, INFINITY, "temperature"},
        {1, -1.0f, "top_k must be >= 0 (0 = off), got -1"},
        {2, 0.0f, "top_p must be in (0, 1], got 0"},
        {2, 1.5f, "top_p must be in (0, 1], got 1.5"},
        {2, -0.5f, "top_p"},
        {2, NAN, "top_p must be in (0, 1], got nan"},
        {3, -0.01f, "min_p must be in [0, 1]"},
        {3, 1.01f, "min_p"},
        {3, NAN, "min_p"},
        {4, 0.0f, "repetition_penalty must be > 0"},
        {4, -1.0f, "repetition_penalty"},
        {4, NAN, "repetition_penalty"},
        {4, INFINITY, "repetition_penalty"},
        {5, -2.5f, "presence_penalty must be in [-2, 2]"},
        {5, 2.01f, "presence_penalty"},
        {5, NAN, "presence_penalty"},
        {6, 3.0f, "frequency_penalty must be in [-2, 2], got 3"},
        {6, -INFINITY, "frequency_penalty"},
        {6, NAN, "frequency_penalty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct cllm_sampling_params p = ok;
        switch (bad[i].field) {
        case 0:
            p.temperature = bad[i].v;
            break;
        case 1:
            p.top_k = (int32_t)bad[i].v;
            break;
        case 2:
            p.top_p = bad[i].v;
            break;
        case 3:
            p.min_p = bad[i].v;
            break;
        case 4:
            p.repetition_penalty = bad[i].v;
            break;
        case 5:
            p.presence_penalty = bad[i].v;
            break;
        case 6:
            p.frequency_penalty = bad[i].v;
            break;
        }
        err[0] = 0;
        enum cllm_status st = cllm_sampling_params_check(&p, err, sizeof err);
        CHECKF(st == CLLM_ERR_RANGE && strstr(err, bad[i].want), "case %zu: st %d err '%s'", i,
               (int)st, err);
        CHECK(cllm_sampling_params_check(&p, NULL, 0) == CLLM_ERR_RANGE);
        struct cllm_sampler *s = (struct cllm_sampler *)&p; /* must be overwritten */
        CHECK(cllm_sampler_new(&s, &p, 10, NULL, 0) == CLLM_ERR_RANGE && s == NULL);
    }
    struct cllm_sampler *s;
    CHECK(cllm_sampler_new(&s, &ok, 0, NULL, 0) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_sampler_new(&s, &ok, -5, NULL, 0) == CLLM_ERR_INVALID_ARG);
    CHECK(cllm_sampler_new(&s, &ok, 10, NULL, 3) == CLLM_ERR_INVALID_ARG);
}

static int32_t sample1(const struct cllm_sampling_params *p, const float *src, int32_t n,
                       const int32_t *prompt, size_t n_prompt)
{
    struct cllm_sampler *s;
    if (cllm_sampler_new(&s, p, n, prompt, n_prompt))
        return -2;
    float l[64];
    memcpy(l, src, (size_t)n * sizeof *l);
    int32_t t = cllm_sampler_sample(s, l);
    cllm_sampler_free(s);
    return t;
}

static void test_greedy(void)
{
    struct cllm_sampling_params g = params(0, 0, 1, 0, 1);
    const float a[8] = {0.5f, 2.0f, -1.0f, 3.0f, 3.0f, 1.0f, -INFINITY, 2.9f};
    CHECK(sample1(&g, a, 8, NULL, 0) == 3); /* tie 3 / 4: lowest index */
    const float b[4] = {-5.0f, -2.0f, -2.0f, -3.0f};
    CHECK(sample1(&g, b, 4, NULL, 0) == 1);
    const float c[4] = {NAN, 1.0f, NAN, 4.0f};
    CHECK(sample1(&g, c, 4, NULL, 0) == 3); /* NaN never wins, even first */
    const float d[3] = {NAN, NAN, NAN};
    CHECK(sample1(&g, d, 3, NULL, 0) == 0);
    /* Greedy ignores top-k/top-p/min-p and the seed. */
    struct cllm_sampling_params g2 = params(0, 2, 0.1f, 0.9f, 1);
    g2.seed = 99;
    CHECK(sample1(&g2, a, 8, NULL, 0) == 3);

    /* Repetition penalty, transformers' rule: 3.0 / 1.5 = 2.0 < 2.9 -> token 7 wins; a negative
     * logit is multiplied (further down); each distinct token is penalised once. */
    struct cllm_sampling_params r = params(0, 0, 1, 0, 1.5f);
    const int32_t prompt[] = {3, 3, 3, 4, 200, -1}; /* 200 and -1: outside the vocab, ignored */
    CHECK(sample1(&r, a, 8, prompt, 6) == 7);
    const float e[3] = {-1.0f, -1.2f, -3.0f};
    const int32_t p0[] = {0};
    CHECK(sample1(&r, e, 3, p0, 1) == 1);                      /* -1.5 < -1.2 */
    struct cllm_sampling_params r2 = params(0, 0, 1, 0, 0.5f); /* < 1 favours repeats */
    CHECK(sample1(&r2, e, 3, (const int32_t[]){2}, 1) == 0);
    const float f[3] = {1.0f, 1.9f, 0.0f};
    CHECK(sample1(&r2, f, 3, (const int32_t[]){0}, 1) == 0); /* 1.0 / 0.5 = 2 > 1.9 */

    /* Generated tokens: presence and frequency count only those, the prompt never. */
    struct cllm_sampling_params pf = params(0, 0, 1, 0, 1);
    pf.frequency_penalty = 0.4f;
    struct cllm_sampler *s;
    CHECK(cllm_sampler_new(&s, &pf, 3, (const int32_t[]){0, 0, 0}, 3) == CLLM_OK);
    const float h[3] = {2.0f, 1.0f, 0.0f};
    float l[3];
    int32_t seq[6];
    for (int i = 0; i < 6; i++) {
        memcpy(l, h, sizeof l);
        seq[i] = cllm_sampler_sample(s, l);
    }
    /* 0 (2.0), 0 (1.6), 0 (1.2), then 0 at 0.8 < 1.0 -> 1, then 0 (0.8) vs 1 (0.6) -> 0, then
     * 0 (0.4) vs 1 (0.6) -> 1. */
    const int32_t want[6] = {0, 0, 0, 1, 0, 1};
    CHECK(memcmp(seq, want, sizeof want) == 0);
    cllm_sampler_free(s);

    pf = params(0, 0, 1, 0, 1);
    pf.presence_penalty = 1.5f;
    CHECK(cllm_sampler_new(&s, &pf, 3, NULL, 0) == CLLM_OK);
    CHECK(cllm_sampler_accept(s, 0) == CLLM_OK);
    CHECK(cllm_sampler_accept(s, 3) == CLLM_ERR_RANGE);
    CHECK(cllm_sampler_accept(s, -1) == CLLM_ERR_RANGE);
    memcpy(l, h, sizeof l);
    CHECK(cllm_sampler_sample(s, l) == 1); /* 2.0 - 1.5 = 0.5 < 1.0 */
    memcpy(l, h, sizeof l);
    CHECK(cllm_sampler_sample(s, l) == 0); /* 0.5 vs 1 - 1.5 = -0.5: presence does not grow */
    cllm_sampler_free(s);
}

/* The exact penalised values through the probability hook: a plain softmax (T = 1). */
static void test_penalty_values(void)
{
    struct cllm_sampling_params p = params(1, 0, 1, 0, 1.25f);
    p.presence_penalty = 0.5f;
    p.frequency_penalty = -0.25f;
    const float src[6] = {2.0f, -2.0f, 0.0f, 1.0f, 3.0f, -0.5f};
    const int32_t prompt[] = {0, 1, 0, 5};
    struct cllm_sampler *s;
    CHECK(cllm_sampler_new(&s, &p, 6, prompt, 4) == CLLM_OK);
    CHECK(cllm_sampler_accept(s, 4) == CLLM_OK);
    CHECK(cllm_sampler_accept(s, 4) == CLLM_OK);
    CHECK(cllm_sampler_accept(s, 1) == CLLM_OK);
    float l[6];
    double probs[6];
    memcpy(l, src, sizeof l);
    CHECK(cllm_sampler_probs(s, l, probs) == CLLM_OK);
    /* 0: 2/1.25; 1: -2*1.25 +0.25 -0.5; 2, 3: untouched; 4: 3/1.25 + 0.5 - 0.5; 5: -0.5*1.25 */
    const double want_l[6] = {1.6, -2.75, 0.0, 1.0, 2.4, -0.625};
    double z = 0, max_rel = 0;
    for (int i = 0; i < 6; i++)
        z += exp(want_l[i]);
    for (int i = 0; i < 6; i++) {
        double w = exp(want_l[i]) / z;
        max_rel = fmax(max_rel, fabs(probs[i] - w) / w);
    }
    CHECKF(max_rel < 1e-6, "max rel %g", max_rel);
    cllm_sampler_free(s);
}

static void random_row(uint64_t *x, float *l, int32_t n, double scale)
{
    for (int32_t i = 0; i < n; i++)
        l[i] = (float)((test_urand(x) - 0.5) * scale);
}

/* cllm_penalize, which a GPU sampler repeats: over the sampler's seen tokens and one more
 * generated token not recorded yet (extra), the same bits as recording that token first; and
 * the sampler's own greedy choice is the argmax of those values. */
static void test_penalize_extra(void)
{
    enum { V = 64 };
    uint64_t x = 77;
    int checked = 0;
    for (int c = 0; c < 300; c++) {
        struct cllm_sampling_params p = params(0, 0, 1, 0, 1.0f);
        const int mode = c % 4; /* repetition only, presence/frequency only, all, none */
        if (mode == 0 || mode == 2)
            p.repetition_penalty = (float)(0.5 + test_urand(&x));
        if (mode == 1 || mode == 2) {
            p.presence_penalty = (float)(test_urand(&x) * 4 - 2);
            p.frequency_penalty = (float)(test_urand(&x) * 4 - 2);
        }
        int32_t prompt[12];
        for (int i = 0; i < 12; i++)
            prompt[i] = (int32_t)(test_splitmix(&x) % (V + 8)) - 4; /* some out of range */
        struct cllm_sampler *a, *b;
        CHECK(cllm_sampler_new(&a, &p, V, prompt, 12) == CLLM_OK);
        CHECK(cllm_sampler_new(&b, &p, V, prompt, 12) == CLLM_OK);
        const int n_gen = (int)(test_splitmix(&x) % 6);
        for (int i = 0; i < n_gen; i++) {
            int32_t t = (int32_t)(test_splitmix(&x) % V);
            CHECK(cllm_sampler_accept(a, t) == CLLM_OK && cllm_sampler_accept(b, t) == CLLM_OK);
        }
        /* the extra token: one generated before, one of the prompt, or any */
        const int32_t extra = c % 3 == 0 && n_gen ? (int32_t)(test_splitmix(&x) % V)
                              : c % 3 == 1        ? (prompt[0] < 0 ? 0 : prompt[0] % V)
                                                  : (int32_t)(test_splitmix(&x) % V);
        float src[V], ours[V], want[V];
        random_row(&x, src, V, 8.0);
        src[c % V] = 0.0f;
        memcpy(ours, src, sizeof src);
        size_t n_seen;
        const struct cllm_token_count *seen = cllm_sampler_seen(a, &n_seen);
        CHECK(mode != 3 || n_seen == 0);
        cllm_penalize(ours, V, seen, n_seen, extra, p.repetition_penalty, p.presence_penalty,
                      p.frequency_penalty);
        CHECK(cllm_sampler_accept(b, extra) == CLLM_OK);
        seen = cllm_sampler_seen(b, &n_seen);
        memcpy(want, src, sizeof src);
        cllm_penalize(want, V, seen, n_seen, -1, p.repetition_penalty, p.presence_penalty,
                      p.frequency_penalty);
        CHECKF(memcmp(ours, want, sizeof ours) == 0,
               "case %d: penalties with an extra token differ", c);
        float l[V];
        memcpy(l, src, sizeof src);
        CHECKF(cllm_sampler_sample(b, l) == cllm_argmax(want, V), "case %d: greedy", c);
        cllm_sampler_free(a);
        cllm_sampler_free(b);
        checked++;
    }
    CHECK(checked == 300);
}

static void test_determinism(void)
{
    enum { N = 3000, STEPS = 200 };
    float *row = malloc(N * sizeof *row), *l = malloc(N * sizeof *l);
    int32_t seqs[3][STEPS];
    const uint64_t seeds[3] = {42, 42, 43};
    for (int r = 0; r < 3; r++) {
        struct cllm_sampling_params p = params(0.9f, 40, 0.9f, 0.0f, 1.1f);
        p.seed = seeds[r];
        struct cllm_sampler *s;
        CHECK(cllm_sampler_new(&s, &p, N, (const int32_t[]){1, 2, 3}, 3) == CLLM_OK);
        uint64_t x = 7; /* the same rows for every sampler */
        for (int i = 0; i < STEPS; i++) {
            random_row(&x, row, N, 6.0);
            memcpy(l, row, N * sizeof *l);
            seqs[r][i] = cllm_sampler_sample(s, l);
        }
        cllm_sampler_free(s);
    }
    CHECK(memcmp(seqs[0], seqs[1], sizeof seqs[0]) == 0);
    int differ = 0;
    for (int i = 0; i < STEPS; i++)
        differ += seqs[0][i] != seqs[2][i];
    CHECKF(differ > STEPS / 2, "seeds 42 and 43 differ in only %d of %d tokens", differ, STEPS);

    /* top_k = 1 is greedy whatever the seed (no tie at the top in these rows). */
    uint64_t x = 11;
    int mismatches = 0;
    for (int i = 0; i < 50; i++) {
        random_row(&x, row, N, 10.0);
        struct cllm_sampling_params p = params(1.3f, 1, 1, 0, 1);
        p.seed = (uint64_t)i;
        struct cllm_sampler *s;
        if (cllm_sampler_new(&s, &p, N, NULL, 0))
            break;
        memcpy(l, row, N * sizeof *l);
        int32_t t = cllm_sampler_sample(s, l);
        int32_t best = 0;
        for (int32_t j = 1; j < N; j++)
            best = row[j] > row[best] ? j : best;
        mismatches += t != best;
        cllm_sampler_free(s);
    }
    CHECKF(mismatches == 0, "top_k=1 differs from argmax %d times", mismatches);
    free(row);
    free(l);
}

/* Draw frequencies against the probabilities sample() claims; a fixed seed keeps it
 * deterministic, and the bound (p ~ 1e-4 for a true fit) still fails any real bias. */
static void test_frequencies(void)
{
    enum { N = 8, DRAWS = 200000 };
    const float src[N] = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -3.0f, 0.7f};
    static const struct {
        float t, p, min_p;
        int32_t k;
        double chi_max; /* chi-square bound for the survivors' degrees of freedom */
    } cfg[] = {
        {1.0f, 1.0f, 0.0f, 0, 32.0}, /* 7 df */
        {0.7f, 0.9f, 0.0f, 0, 30.0}, /* top-p */
        {1.5f, 1.0f, 0.0f, 4, 22.0}, /* top-k: 3 df */
        {1.0f, 1.0f, 0.1f, 0, 30.0}, /* min-p */
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        struct cllm_sampling_params p = params(cfg[c].t, cfg[c].k, cfg[c].p, cfg[c].min_p, 1);
        p.seed = 1234 + c;
        struct cllm_sampler *s;
        if (cllm_sampler_new(&s, &p, N, NULL, 0)) {
            CHECK(0);
            continue;
        }
        float l[N];
        double probs[N];
        memcpy(l, src, sizeof l);
        CHECK(cllm_sampler_probs(s, l, probs) == CLLM_OK);
        /* An independent softmax of the same survivors. */
        double z = 0, sum = 0;
        for (int i = 0; i < N; i++)
            if (probs[i] > 0)
                z += exp(src[i] / cfg[c].t);
        for (int i = 0; i < N; i++) {
            sum += probs[i];
            if (probs[i] > 0)
                CHECKF(fabs(probs[i] - exp(src[i] / cfg[c].t) / z) < 1e-6, "cfg %zu token %d", c,
                       i);
        }
        CHECK(fabs(sum - 1.0) < 1e-12);
        long count[N] = {0};
        for (int d = 0; d < DRAWS; d++) {
            memcpy(l, src, sizeof l);
            int32_t t = cllm_sampler_sample(s, l);
            if (t < 0 || t >= N) {
                CHECK(0);
                break;
            }
            count[t]++;
        }
        double chi = 0;
        bool drew_removed = false;
        for (int i = 0; i < N; i++) {
            if (probs[i] == 0) {
                drew_removed |= count[i] != 0;
                continue;
            }
            double e = probs[i] * DRAWS;
            chi += (count[i] - e) * (count[i] - e) / e;
        }
        CHECKF(!drew_removed, "cfg %zu drew a removed token", c);
        CHECKF(chi < cfg[c].chi_max, "cfg %zu chi-square %.2f", c, chi);
        cllm_sampler_free(s);
    }
}

/* ---- brute-force reference: every rule on a full sort, no shortcuts ---- */

struct ref_item {
    float l;
    int32_t id;
};

static int ref_cmp(const void *a, const void *b)
{
    const struct ref_item *x = a, *y = b;
    if (x->l != y->l)
        return x->l > y->l ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static void reference_probs(const struct cllm_sampling_params *p, const float *src, int32_t n,
                            const int32_t *seen, size_t n_seen, double *probs)
{
    struct ref_item *it = malloc((size_t)n * sizeof *it);
    bool *rep = calloc((size_t)n, 1);
    for (size_t i = 0; i < n_seen; i++)
        rep[seen[i]] = true;
    for (int32_t i = 0; i < n; i++) {
        float l = src[i];
        if (rep[i])
            l = l < 0 ? l * p->repetition_penalty : l / p->repetition_penalty;
        l = isnan(l) ? -INFINITY : l / p->temperature;
        it[i] = (struct ref_item){l, i};
    }
    qsort(it, (size_t)n, sizeof *it, ref_cmp);
    double *w = malloc((size_t)n * sizeof *w);
    for (int32_t i = 0; i < n; i++)
        w[i] = exp((double)it[i].l - it[0].l);
    int32_t keep = n;
    if (p->top_k > 0 && p->top_k < n) {
        keep = p->top_k;
        while (keep < n && it[keep].l == it[p->top_k - 1].l)
            keep++;
    }
    if (p->top_p < 1) {
        double z = 0, above = 0;
        for (int32_t i = 0; i < keep; i++)
            z += w[i];
        int32_t i = 0;
        for (; i < keep; i++) {
            if (i > 0 && above >= p->top_p * z)
                break;
            above += w[i];
        }
        keep = i;
    }
    if (p->min_p > 0) {
        int32_t i = 1;
        while (i < keep && !(w[i] < p->min_p))
            i++;
        keep = i;
    }
    double z = 0;
    for (int32_t i = 0; i < keep; i++)
        z += w[i];
    memset(probs, 0, (size_t)n * sizeof *probs);
    for (int32_t i = 0; i < keep; i++)
        probs[it[i].id] = w[i] / z;
    free(it);
    free(rep);
    free(w);
}

/* Random configurations on rows with ties, masked and NaN logits, against the reference. */
static void test_against_reference(void)
{
    enum { N = 5000 };
    float *row = malloc(N * sizeof *row), *l = malloc(N * sizeof *l);
    double *got = malloc(N * sizeof *got), *want = malloc(N * sizeof *want);
    uint64_t x = 99;
    int bad_cases = 0;
    for (int c = 0; c < 300; c++) {
        int32_t n = 2 + (int32_t)(test_urand(&x) * (N - 2));
        int shape = c % 4;
        for (int32_t i = 0; i < n; i++) {
            double u = test_urand(&x);
            if (shape == 0)
                row[i] = (float)((u - 0.5) * 12); /* flat: wide nuclei */
            else if (shape == 1)
                row[i] = (float)(floor((u - 0.5) * 16) / 2); /* half steps: many ties */
            else
                row[i] = (float)((u - 0.5) * 8 + (test_urand(&x) < 0.01 ? 12 : 0)); /* peaked */
        }
        if (shape == 3) {
            for (int32_t i = 0; i < n; i += 7)
                row[i] = i % 2 ? -INFINITY : NAN;
        }
        struct cllm_sampling_params p;
        cllm_sampling_params_default(&p);
        p.temperature = (float)(0.2 + test_urand(&x) * 2);
        p.top_k = test_urand(&x) < 0.5
                      ? 0
                      : 1 + (int32_t)(test_urand(&x) * (test_urand(&x) < 0.2 ? n + 10 : 60));
        p.top_p = test_urand(&x) < 0.3 ? 1.0f : (float)(0.05 + test_urand(&x) * 0.95);
        p.min_p = test_urand(&x) < 0.5 ? 0.0f : (float)(test_urand(&x) * 0.5);
        p.repetition_penalty = test_urand(&x) < 0.5 ? 1.0f : (float)(0.7 + test_urand(&x));
        int32_t seen[20];
        for (int i = 0; i < 20; i++)
            seen[i] = (int32_t)(test_urand(&x) * n);
        struct cllm_sampler *s;
        if (cllm_sampler_new(&s, &p, n, seen, 20)) {
            CHECK(0);
            continue;
        }
        memcpy(l, row, (size_t)n * sizeof *l);
        CHECK(cllm_sampler_probs(s, l, got) == CLLM_OK);
        reference_probs(&p, row, n, seen, 20, want);
        double worst = 0;
        bool same_set = true;
        for (int32_t i = 0; i < n; i++) {
            same_set &= (got[i] > 0) == (want[i] > 0);
            if (want[i] > 0)
                worst = fmax(worst, fabs(got[i] - want[i]) / want[i]);
        }
        /* A plain softmax keeps its weights in the float logits row, so it is within float
         * rounding of the reference; every filtered path works in double throughout. */
        bool dense = p.top_k == 0 && p.top_p == 1.0f && p.min_p == 0.0f;
        if (!same_set || worst > (dense ? 2e-7 : 1e-12)) {
            bad_cases++;
            fprintf(stderr, "reference case %d: n %d t %g k %d p %g min_p %g rep %g: %s, rel %g\n",
                    c, n, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                    same_set ? "same set" : "DIFFERENT SET", worst);
        }
        /* The draw stays inside the survivors. */
        memcpy(l, row, (size_t)n * sizeof *l);
        int32_t t = cllm_sampler_sample(s, l);
        CHECKF(t >= 0 && t < n && want[t] > 0, "case %d drew %d", c, t);
        cllm_sampler_free(s);
    }
    CHECKF(bad_cases == 0, "%d of 300 random cases differ from the reference", bad_cases);
    free(row);
    free(l);
    free(got);
    free(want);
}

static void test_degenerate(void)
{
    /* No finite maximum: greedy fallback, never a crash or an out-of-range id. */
    struct cllm_sampling_params p = params(0.8f, 0, 0.9f, 0, 1);
    const float a[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    CHECK(sample1(&p, a, 4, NULL, 0) == 0);
    const float b[4] = {NAN, NAN, 1.0f, NAN};
    CHECK(sample1(&p, b, 4, NULL, 0) == 2);
    const float c[4] = {1.0f, INFINITY, 2.0f, INFINITY};
    CHECK(sample1(&p, c, 4, NULL, 0) == 1);
    /* A tiny temperature overflows logits to +inf: still the argmax. */
    struct cllm_sampling_params q = params(1e-38f, 0, 1, 0, 1);
    const float d[3] = {100.0f, 300.0f, 200.0f};
    CHECK(sample1(&q, d, 3, NULL, 0) == 1);
    /* One-token vocab; top_k beyond the vocab is off. */
    struct cllm_sampling_params r = params(1, 5, 0.5f, 0.5f, 1.3f);
    const float e[1] = {-3.0f};
    CHECK(sample1(&r, e, 1, (const int32_t[]){0}, 1) == 0);
    /* min_p = 1 keeps exactly the tied maxima. */
    struct cllm_sampling_params m = params(1, 0, 1, 1.0f, 1);
    struct cllm_sampler *s;
    CHECK(cllm_sampler_new(&s, &m, 5, NULL, 0) == CLLM_OK);
    float f[5] = {1.0f, 3.0f, 2.0f, 3.0f, 0.0f};
    double probs[5];
    CHECK(cllm_sampler_probs(s, f, probs) == CLLM_OK);
    CHECK(probs[1] == 0.5 && probs[3] == 0.5 && probs[0] == 0 && probs[2] == 0 && probs[4] == 0);
    cllm_sampler_free(s);
    cllm_sampler_free(NULL);
}

static float *fixture_logits(const cJSON *tc, int32_t n)
{
    float *l = malloc((size_t)n * sizeof *l);
    if (!l)
        return NULL;
    const cJSON *arr = cJSON_GetObjectItem(tc, "logits");
    if (cJSON_IsArray(arr)) {
        if (cJSON_GetArraySize(arr) != n) {
            free(l);
            return NULL;
        }
        int32_t i = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, arr)
        {
            /* null stands for -inf, which JSON cannot spell */
            l[i++] = cJSON_IsNumber(v) ? (float)v->valuedouble : -INFINITY;
        }
    } else {
        synth_logits((uint64_t)cJSON_GetObjectItem(tc, "synth_seed")->valuedouble, l, n);
    }
    return l;
}

static size_t ids_of(const cJSON *arr, int32_t *out, size_t cap)
{
    size_t n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr)
    {
        if (n < cap)
            out[n++] = (int32_t)v->valuedouble;
    }
    return n;
}

static void test_golden(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/sampling_golden.json", test_env("CLLM_FIXTURES"));
    char *text = NULL, err[256];
    size_t len = 0;
    if (cllm_read_file(path, 16u << 20, &text, &len, err, sizeof err) != CLLM_OK) {
        CHECKF(0, "%s", err);
        return;
    }
    cJSON *doc = cJSON_ParseWithLength(text, len);
    free(text);
    if (!doc) {
        CHECKF(0, "%s: not JSON", path);
        return;
    }
    const cJSON *cases = cJSON_GetObjectItem(doc, "cases");
    CHECK(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) >= 15);
    int n_cases = 0;
    bool had_qwen = false;
    const cJSON *tc;
    cJSON_ArrayForEach(tc, cases)
    {
        const char *name = cJSON_GetObjectItem(tc, "name")->valuestring;
        int32_t n = (int32_t)cJSON_GetObjectItem(tc, "n_vocab")->valuedouble;
        had_qwen |= n == QWEN_VOCAB;
        struct cllm_sampling_params p;
        cllm_sampling_params_default(&p);
        p.temperature = (float)cJSON_GetObjectItem(tc, "temperature")->valuedouble;
        p.top_k = (int32_t)cJSON_GetObjectItem(tc, "top_k")->valuedouble;
        p.top_p = (float)cJSON_GetObjectItem(tc, "top_p")->valuedouble;
        p.min_p = (float)cJSON_GetObjectItem(tc, "min_p")->valuedouble;
        p.repetition_penalty = (float)cJSON_GetObjectItem(tc, "repetition_penalty")->valuedouble;
        int32_t prompt[512], gen[64];
        size_t n_prompt = ids_of(cJSON_GetObjectItem(tc, "prompt"), prompt, 512);
        size_t n_gen = ids_of(cJSON_GetObjectItem(tc, "generated"), gen, 64);
        float *l = fixture_logits(tc, n);
        double *probs = malloc((size_t)n * sizeof *probs);
        struct cllm_sampler *s = NULL;
        if (!l || !probs || cllm_sampler_new(&s, &p, n, prompt, n_prompt)) {
            CHECKF(0, "%s: setup failed", name);
            goto next;
        }
        for (size_t i = 0; i < n_gen; i++)
            CHECK(cllm_sampler_accept(s, gen[i]) == CLLM_OK);
        CHECK(cllm_sampler_probs(s, l, probs) == CLLM_OK);
        const cJSON *surv = cJSON_GetObjectItem(tc, "survivors");
        const cJSON *want = cJSON_GetObjectItem(tc, "probs");
        int32_t n_surv = 0;
        for (int32_t i = 0; i < n; i++)
            n_surv += probs[i] > 0;
        CHECKF(n_surv == cJSON_GetArraySize(surv), "%s: %d survivors, want %d", name, n_surv,
               cJSON_GetArraySize(surv));
        double worst = 0;
        const cJSON *t, *w = want ? want->child : NULL;
        cJSON_ArrayForEach(t, surv)
        {
            int32_t id = (int32_t)t->valuedouble;
            double pw = w ? w->valuedouble : -1;
            w = w ? w->next : NULL;
            if (id < 0 || id >= n || !(probs[id] > 0)) {
                CHECKF(0, "%s: token %d should survive", name, id);
                continue;
            }
            worst = fmax(worst, fabs(probs[id] - pw) / pw);
        }
        CHECKF(worst < 1e-5, "%s: worst relative error %g", name, worst);
        n_cases++;
    next:
        cllm_sampler_free(s);
        free(l);
        free(probs);
    }
    CHECK(n_cases == cJSON_GetArraySize(cases) && had_qwen);
    cJSON_Delete(doc);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Not asserted: sanitizer builds are several times slower than release ones. */
static void bench(void)
{
    float *row = malloc(QWEN_VOCAB * sizeof *row), *l = malloc(QWEN_VOCAB * sizeof *l);
    synth_logits(7, row, QWEN_VOCAB);
    static const struct {
        const char *name;
        float t, p, min_p, rep;
        int32_t k;
    } cfg[] = {
        {"greedy", 0, 1, 0, 1, 0},
        {"greedy rep1.05", 0, 1, 0, 1.05f, 0},
        {"qwen t0.7 k20 p0.8 rep1.05", 0.7f, 0.8f, 0, 1.05f, 20},
        {"t1 p0.9", 1, 0.9f, 0, 1, 0},
        {"t1.6 p0.8 (wide nucleus)", 1.6f, 0.8f, 0, 1, 0},
        {"t1 min_p0.05", 1, 1, 0.05f, 1, 0},
        {"t1 plain softmax", 1, 1, 0, 1, 0},
    };
    int32_t prompt[500];
    for (int i = 0; i < 500; i++)
        prompt[i] = (i * 7919) % QWEN_VOCAB;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        struct cllm_sampling_params p =
            params(cfg[c].t, cfg[c].k, cfg[c].p, cfg[c].min_p, cfg[c].rep);
        struct cllm_sampler *s;
        if (cllm_sampler_new(&s, &p, QWEN_VOCAB, prompt, 500))
            continue;
        enum { REPS = 20 };
        double total = 0;
        for (int r = 0; r < REPS; r++) {
            memcpy(l, row, QWEN_VOCAB * sizeof *l);
            double t0 = now_ms();
            CHECK(cllm_sampler_sample(s, l) >= 0);
            total += now_ms() - t0;
        }
        printf("sample() on %d logits, %-28s %.3f ms\n", QWEN_VOCAB, cfg[c].name, total / REPS);
        cllm_sampler_free(s);
    }
    /* What a GPU step costs the engine for penalties: 192 requests' seen lists (500 distinct
     * prompt tokens each, repetition 1.1) copied into one array, as build_sample_rows does. */
    enum { SEQS = 192 };
    struct cllm_sampling_params p = params(0.7f, 20, 0.8f, 0, 1.1f);
    struct cllm_sampler *seqs[SEQS];
    size_t total_seen = 0;
    for (int i = 0; i < SEQS; i++) {
        CHECK(cllm_sampler_new(&seqs[i], &p, QWEN_VOCAB, prompt, 500) == CLLM_OK);
        size_t n;
        cllm_sampler_seen(seqs[i], &n);
        total_seen += n;
    }
    struct cllm_token_count *all = malloc(total_seen * sizeof *all);
    double best = 1e9;
    for (int r = 0; r < 20; r++) {
        double t0 = now_ms();
        size_t at = 0;
        for (int i = 0; i < SEQS; i++) {
            size_t n;
            const struct cllm_token_count *seen = cllm_sampler_seen(seqs[i], &n);
            memcpy(all + at, seen, n * sizeof *seen);
            at += n;
        }
        best = fmin(best, now_ms() - t0);
        CHECK(at == total_seen);
    }
    printf("penalty counts of %d sequences (%zu entries, %zu KiB) gathered in %.3f ms\n", SEQS,
           total_seen, total_seen * sizeof *all / 1024, best);
    for (int i = 0; i < SEQS; i++)
        cllm_sampler_free(seqs[i]);
    free(all);
    free(row);
    free(l);
}

int main(void)
{
    test_params_check();
    test_greedy();
    test_penalty_values();
    test_penalize_extra();
    test_determinism();
    test_frequencies();
    test_against_reference();
    test_degenerate();
    test_golden();
    bench();
    return test_summary();
}
