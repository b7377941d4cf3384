/*
 * The sampler. Penalties touch only the sparse table of seen tokens; then either argmax
 * (greedy) or transformers' chain temperature -> top-k -> top-p -> min-p, a softmax in double
 * over the survivors and one inverse-CDF draw from xoshiro256** (seeded through splitmix64).
 * The vocab is ~152k, so nothing sorts it whole: top-k finds its threshold with a k-sized
 * min-heap, top-p without top-k bounds its nucleus with a one-pass histogram of logit gaps,
 * min-p bounds its survivors by a logit gap, and only the candidates inside the bound are
 * sorted and given the exact rules.
 */
#include "sampling/sampling.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hashmap.h"
#include "core/status.h"

/* Gap histogram for top-p: buckets of (max logit - logit) over [0, GAP_RANGE); the last bucket
 * also takes every larger gap. 1/8 of a logit per bucket keeps the sorted candidate set close
 * to the nucleus itself. */
#define GAP_BUCKETS 512
#define GAP_RANGE 64.0

struct cand {
    float logit; /* after penalties and temperature */
    int32_t token;
    double weight; /* exp(logit - max logit): the unnormalised probability */
};

struct cllm_sampler {
    struct cllm_sampling_params p;
    int32_t n_vocab;
    int32_t top_k;   /* effective top-k: 0 when off or >= n_vocab */
    bool track;      /* some penalty is on, so seen tokens are recorded */
    uint64_t rng[4]; /* xoshiro256** state */
    /* [n_seen] distinct tokens of prompt + generated, first-seen order */
    struct cllm_token_count *seen;
    size_t n_seen, cap_seen;
    struct cllm_u64map index; /* token -> its position in seen */
    float *heap;              /* [top_k] scratch min-heap for the top-k threshold */
    struct cand *cand;        /* [cap_cand] scratch candidates, grown on demand */
    size_t cap_cand;
};

/* What a draw picks from: one token, every token (dense: logits[] hold the weights), or the
 * first n entries of s->cand in descending order. */
struct dist {
    int32_t single; /* >= 0: this token with probability 1 */
    bool dense;
    size_t n;
    double total; /* sum of the weights drawn from */
};

void cllm_sampling_params_default(struct cllm_sampling_params *p)
{
    *p = (struct cllm_sampling_params){
        .temperature = 0.0f,
        .top_k = 0,
        .top_p = 1.0f,
        .min_p = 0.0f,
        .repetition_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .seed = 0,
    };
}

enum cllm_status cllm_sampling_params_check(const struct cllm_sampling_params *p, char *err,
                                            size_t err_len)
{
    /* Written as "!(in range)" so that NaN, which fails every comparison, is rejected too. */
    if (!(p->temperature >= 0.0f && isfinite(p->temperature)))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "temperature must be >= 0 and finite (0 = greedy), got %g",
                         (double)p->temperature);
    if (p->top_k < 0)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "top_k must be >= 0 (0 = off), got %d",
                         (int)p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "top_p must be in (0, 1], got %g",
                         (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "min_p must be in [0, 1], got %g",
                         (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && isfinite(p->repetition_penalty)))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "repetition_penalty must be > 0 and finite (1 = off), got %g",
                         (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "presence_penalty must be in [-2, 2], got %g",
                         (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "frequency_penalty must be in [-2, 2], got %g",
                         (double)p->frequency_penalty);
    return CLLM_OK;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double uniform(struct cllm_sampler *s)
{
    return (double)(xoshiro_next(s->rng) >> 11) * 0x1.0p-53;
}

static enum cllm_status record(struct cllm_sampler *s, int32_t token, bool generated)
{
    uint64_t pos;
    if (cllm_u64map_get(&s->index, (uint64_t)token, &pos)) {
        if (generated && s->seen[pos].count < UINT32_MAX)
            s->seen[pos].count++;
        return CLLM_OK;
    }
    if (s->n_seen == s->cap_seen) {
        const size_t cap = cllm_grow_cap(s->cap_seen, s->n_seen + 1, 64);
        struct cllm_token_count *seen = cllm_realloc_array(s->seen, cap, sizeof *seen);
        if (!seen)
            return CLLM_ERR_NOMEM;
        s->seen = seen;
        s->cap_seen = cap;
    }
    enum cllm_status st = cllm_u64map_put(&s->index, (uint64_t)token, s->n_seen);
    if (st)
        return st;
    s->seen[s->n_seen++] = (struct cllm_token_count){.token = token, .count = generated ? 1 : 0};
    return CLLM_OK;
}

bool cllm_sampling_penalized(const struct cllm_sampling_params *p)
{
    return p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f ||
           p->frequency_penalty != 0.0f;
}

enum cllm_status cllm_sampler_new(struct cllm_sampler **out, const struct cllm_sampling_params *p,
                                  int32_t n_vocab, const int32_t *prompt, size_t n_prompt)
{
    *out = NULL;
    enum cllm_status st = cllm_sampling_params_check(p, NULL, 0);
    if (st)
        return st;
    if (n_vocab <= 0 || (n_prompt && !prompt))
        return CLLM_ERR_INVALID_ARG;
    struct cllm_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return CLLM_ERR_NOMEM;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->top_k = p->top_k < n_vocab ? p->top_k : 0;
    s->track = cllm_sampling_penalized(p);
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    st = CLLM_ERR_NOMEM;
    if (s->top_k > 0 && !(s->heap = cllm_malloc_array((size_t)s->top_k, sizeof *s->heap)))
        goto fail;
    /* Only the repetition penalty looks at the prompt. */
    if (p->repetition_penalty != 1.0f) {
        for (size_t i = 0; i < n_prompt; i++) {
            if (prompt[i] < 0 || prompt[i] >= n_vocab)
                continue;
            if ((st = record(s, prompt[i], false)))
                goto fail;
        }
    }
    *out = s;
    return CLLM_OK;
fail:
    cllm_sampler_free(s);
    return st;
}

void cllm_sampler_free(struct cllm_sampler *s)
{
    if (!s)
        return;
    cllm_u64map_free(&s->index);
    free(s->seen);
    free(s->heap);
    free(s->cand);
    free(s);
}

enum cllm_status cllm_sampler_accept(struct cllm_sampler *s, int32_t token)
{
    if (token < 0 || token >= s->n_vocab)
        return CLLM_ERR_RANGE;
    return s->track ? record(s, token, true) : CLLM_OK;
}

/* One logit through the penalties (cllm_penalize). */
static float penalized(float l, uint32_t count, float rep, float pres, float freq)
{
    if (rep != 1.0f)
        l = l < 0.0f ? l * rep : l / rep;
    if (count) {
        l -= freq * (float)count;
        l -= pres;
    }
    return l;
}

/* Repetition penalty first, then frequency and presence, each in float as the references do. */
void cllm_penalize(float *logits, int32_t n_vocab, const struct cllm_token_count *seen, size_t n,
                   int32_t extra, float rep, float pres, float freq)
{
    bool extra_listed = false;
    for (size_t i = 0; i < n; i++) {
        const int32_t t = seen[i].token;
        if (t < 0 || t >= n_vocab)
            continue;
        uint32_t count = seen[i].count;
        if (t == extra) {
            extra_listed = true;
            if (count < UINT32_MAX)
                count++;
        }
        logits[t] = penalized(logits[t], count, rep, pres, freq);
    }
    if (extra >= 0 && extra < n_vocab && !extra_listed)
        logits[extra] = penalized(logits[extra], 1, rep, pres, freq);
}

const struct cllm_token_count *cllm_sampler_seen(const struct cllm_sampler *s, size_t *n)
{
    *n = s->track ? s->n_seen : 0;
    return s->seen;
}

int32_t cllm_argmax(const float *l, int32_t n)
{
    int32_t i = 0;
    while (i < n && isnan(l[i]))
        i++;
    if (i == n)
        return 0;
    int32_t best = i;
    float bv = l[i];
    for (i++; i < n; i++) {
        if (l[i] > bv) {
            bv = l[i];
            best = i;
        }
    }
    return best;
}

static void sift_down(float *h, int32_t n, int32_t i)
{
    float v = h[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && h[c + 1] < h[c])
            c++;
        if (!(h[c] < v))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

/* A min-heap of the k largest seen so far: most logits lose to the heap's root at once, so
 * this is one compare per logit for the usual k of 20-100. */
float cllm_kth_largest(float *heap, int32_t k, const float *l, int32_t n)
{
    memcpy(heap, l, (size_t)k * sizeof *heap);
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i);
    for (int32_t i = k; i < n; i++) {
        if (l[i] > heap[0]) {
            heap[0] = l[i];
            sift_down(heap, k, 0);
        }
    }
    return heap[0];
}

static enum cllm_status reserve_cand(struct cllm_sampler *s, size_t n)
{
    if (n <= s->cap_cand)
        return CLLM_OK;
    const size_t cap = cllm_grow_cap(s->cap_cand, n, 256);
    struct cand *c = cllm_realloc_array(s->cand, cap, sizeof *c);
    if (!c)
        return CLLM_ERR_NOMEM;
    s->cand = c;
    s->cap_cand = cap;
    return CLLM_OK;
}

/* Collects every finite-weight token with logit >= thr into s->cand, with its weight. */
static enum cllm_status gather(struct cllm_sampler *s, const float *logits, double thr, float mx,
                               size_t *n_out)
{
    size_t n = 0;
    for (int32_t i = 0; i < s->n_vocab; i++) {
        float l = logits[i];
        if (!((double)l >= thr) || l == -INFINITY)
            continue;
        if (n == s->cap_cand && reserve_cand(s, n + 1))
            return CLLM_ERR_NOMEM;
        s->cand[n++] = (struct cand){.logit = l, .token = i, .weight = exp((double)l - mx)};
    }
    *n_out = n;
    return CLLM_OK;
}

/* Descending logit; ties in ascending token order, so every rule that cuts inside a run of
 * ties keeps the lower ids (torch's unstable sort leaves that order unspecified). */
static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return (x->token > y->token) - (x->token < y->token);
}

/* One pass over the vocab for top-p without top-k: the softmax denominator over every token and
 * a logit gap that bounds the nucleus. Once the bucket mass reaches top_p every later token is
 * cut; the bound still takes the next non-empty bucket, so that the first cut token lies among
 * the candidates and the exact scan sees the cut (a rounding difference between the bucket sums
 * and the sorted sums then cannot hide it; build_dist widens the bound if it ever does). */
static void nucleus_bound(const float *logits, int32_t n, float mx, double top_p, double *z_out,
                          double *gap_out)
{
    double mass[GAP_BUCKETS] = {0};
    uint32_t count[GAP_BUCKETS] = {0};
    const double per_gap = GAP_BUCKETS / GAP_RANGE;
    double z = 0.0;
    for (int32_t i = 0; i < n; i++) {
        double g = (double)mx - (double)logits[i];
        double w = exp(-g);
        int b = g < GAP_RANGE ? (int)(g * per_gap) : GAP_BUCKETS - 1;
        mass[b] += w;
        count[b]++;
        z += w;
    }
    *z_out = z;
    *gap_out = INFINITY;
    double lim = top_p * z, cum = 0.0;
    for (int b = 0; b < GAP_BUCKETS - 1; b++) {
        cum += mass[b];
        if (cum < lim)
            continue;
        for (int c = b + 1; c < GAP_BUCKETS - 1; c++) {
            if (count[c]) {
                *gap_out = (c + 1) / per_gap;
                break;
            }
        }
        break;
    }
}

/* Applies penalties, temperature and the filters; describes the survivors in *d. */
static enum cllm_status build_dist(struct cllm_sampler *s, float *logits, struct dist *d)
{
    const int32_t n = s->n_vocab;
    *d = (struct dist){.single = -1};
    if (s->track)
        cllm_penalize(logits, s->n_vocab, s->seen, s->n_seen, -1, s->p.repetition_penalty,
                      s->p.presence_penalty, s->p.frequency_penalty);
    if (s->p.temperature == 0.0f) {
        d->single = cllm_argmax(logits, n);
        return CLLM_OK;
    }
    /* Temperature divides in float, as TemperatureLogitsWarper does on float32 scores. The
     * division is monotone, so the largest result is the largest logit divided; that logit's
     * id is also the fallback when no finite maximum remains (+inf logits, or a temperature
     * so small that the division overflows). */
    const float t = s->p.temperature;
    float raw_mx = -INFINITY;
    int32_t raw_best = 0;
    for (int32_t i = 0; i < n; i++) {
        float l = logits[i];
        if (l > raw_mx) {
            raw_mx = l;
            raw_best = i;
        }
        logits[i] = isnan(l) ? -INFINITY : l / t;
    }
    const float mx = raw_mx / t;
    if (!isfinite(mx)) {
        d->single = raw_best;
        return CLLM_OK;
    }
    const bool use_k = s->top_k > 0;
    const bool use_p = s->p.top_p < 1.0f;
    const bool use_min = s->p.min_p > 0.0f;
    if (!use_k && !use_p && !use_min) {
        /* Plain softmax: the weights stay in logits[] and the draw walks them in id order. */
        double total = 0.0;
        for (int32_t i = 0; i < n; i++) {
            float w = (float)exp((double)logits[i] - mx);
            logits[i] = w;
            total += w;
        }
        d->dense = true;
        d->total = total;
        return CLLM_OK;
    }

    /* The candidates: a superset of the survivors, as a logit threshold. */
    const double top_p = s->p.top_p, min_p = s->p.min_p;
    double z = 0.0, thr, p_gap = INFINITY;
    double min_gap = use_min ? -log(min_p) * (1.0 + 1e-9) + 1e-9 : INFINITY;
    if (use_k) {
        thr = cllm_kth_largest(s->heap, s->top_k, logits, n);
    } else {
        if (use_p)
            nucleus_bound(logits, n, mx, top_p, &z, &p_gap);
        thr = (double)mx - (p_gap < min_gap ? p_gap : min_gap);
    }
    size_t nc;
    struct cand *c;
    enum cllm_status st;
    for (;;) {
        if ((st = gather(s, logits, thr, mx, &nc)))
            return st;
        c = s->cand;
        qsort(c, nc, sizeof *c, cand_cmp);
        size_t keep = nc;
        if (use_p) {
            /* TopPLogitsWarper drops a token when the ascending cumulative mass up to it is
             * <= 1 - top_p, i.e. when the mass strictly above it is >= top_p; the top one stays.
             * Its softmax runs over the top-k survivors when top-k is on, else the vocab. */
            if (use_k) {
                z = 0.0;
                for (size_t i = 0; i < nc; i++)
                    z += c[i].weight;
            }
            double lim = top_p * z, above = 0.0;
            for (keep = 0; keep < nc; keep++) {
                if (keep > 0 && above >= lim)
                    break;
                above += c[keep].weight;
            }
            /* Every candidate survived while top-p's bound was the binding one: the bound fell
             * short through rounding, so widen it to min-p's and cut again. */
            if (keep == nc && !use_k && p_gap < min_gap) {
                p_gap = INFINITY;
                thr = (double)mx - min_gap;
                continue;
            }
        }
        if (use_min) {
            /* MinPLogitsWarper drops p < min_p * p_max; p / p_max is exactly the weight. */
            size_t i = 1;
            while (i < keep && !(c[i].weight < min_p))
                i++;
            keep = i;
        }
        nc = keep;
        break;
    }
    double total = 0.0;
    for (size_t i = 0; i < nc; i++)
        total += c[i].weight;
    d->n = nc;
    d->total = total;
    return CLLM_OK;
}

static int32_t draw(struct cllm_sampler *s, const float *logits, const struct dist *d)
{
    if (d->single >= 0)
        return d->single;
    double r = uniform(s) * d->total, cum = 0.0;
    if (d->dense) {
        int32_t last = 0;
        for (int32_t i = 0; i < s->n_vocab; i++) {
            if (logits[i] <= 0.0f)
                continue;
            cum += logits[i];
            last = i;
            if (r < cum)
                return i;
        }
        return last; /* r landed past the rounded total */
    }
    for (size_t i = 0; i < d->n; i++) {
        cum += s->cand[i].weight;
        if (r < cum)
            return s->cand[i].token;
    }
    return s->cand[d->n - 1].token;
}

int32_t cllm_sampler_sample(struct cllm_sampler *s, float *logits)
{
    struct dist d;
    if (build_dist(s, logits, &d))
        return -1;
    int32_t token = draw(s, logits, &d);
    if (s->track && record(s, token, true))
        return -1;
    return token;
}

enum cllm_status cllm_sampler_probs(struct cllm_sampler *s, float *logits, double *probs)
{
    struct dist d;
    enum cllm_status st = build_dist(s, logits, &d);
    if (st)
        return st;
    memset(probs, 0, (size_t)s->n_vocab * sizeof *probs);
    if (d.single >= 0) {
        probs[d.single] = 1.0;
    } else if (d.dense) {
        for (int32_t i = 0; i < s->n_vocab; i++)
            probs[i] = logits[i] / d.total;
    } else {
        for (size_t i = 0; i < d.n; i++)
            probs[s->cand[i].token] = s->cand[i].weight / d.total;
    }
    return CLLM_OK;
}
