/* The device check (device_check.h): fixed sequences through two models, row by row. */
#include "engine/device_check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/log.h"
#include "core/status.h"
#include "engine/request.h"
#include "sampling/sampling.h"

/* Sequence 0: a prefill of more than 32 tokens (the tiled GEMMs), then DECODE single tokens;
 * 3 KV blocks. Sequence 1, where the models' steps take both: a shorter prompt in the same
 * prefill step, then decoded beside sequence 0 (several sequences per step, as served). */
#define PREFILL0 40
#define PREFILL1 24
#define DECODE 2
#define LEN_MAX (PREFILL0 + DECODE)
#define BLOCK 16
#define MAX_BLOCKS 3 /* per sequence */
#define BOTH_STEP (PREFILL0 + PREFILL1)

float cllm_logit_row_error(const float *a, const float *b, int32_t n)
{
    float lo = INFINITY, hi = -INFINITY, err = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        lo = fminf(lo, b[i]), hi = fmaxf(hi, b[i]);
        err = fmaxf(err, fabsf(a[i] - b[i]));
    }
    if (err == 0.0f)
        return 0.0f;
    return hi > lo ? err / (hi - lo) : INFINITY;
}

/* Both models' caches and the sequences' layout: blocks not in order in the pool and the
 * two sequences' blocks interleaved, so a wrong slot or block lookup shows. */
struct check_run {
    struct cllm_kv_cache kv[2];
    int32_t n_seqs;
    int32_t ids[2][LEN_MAX];
    int32_t table[2][MAX_BLOCKS];
    /* the step being built: segments of the sequences, each output its segment's last token */
    int32_t tokens[BOTH_STEP], pos[BOTH_STEP], seq[BOTH_STEP], slot[BOTH_STEP], outputs[2];
    struct cllm_step step;
};

static void layout(struct check_run *c, int32_t n_vocab, int32_t n_seqs)
{
    static const int32_t table[2][MAX_BLOCKS] = {{4, 0, 2}, {1, 3, 3}};
    /* ordinary tokens of any Qwen2 vocabulary (below its specials), spread over it */
    const int32_t span = n_vocab < 32000 ? n_vocab : 32000;
    c->n_seqs = n_seqs;
    memcpy(c->table, table, sizeof table);
    for (int32_t t = 0; t < LEN_MAX; t++) {
        c->ids[0][t] = (int32_t)(((int64_t)t * 7919 + 11) % span);
        c->ids[1][t] = (int32_t)(((int64_t)t * 104729 + 5) % span);
    }
    c->step = (struct cllm_step){.tokens = c->tokens,
                                 .pos = c->pos,
                                 .seq = c->seq,
                                 .slot = c->slot,
                                 .block_table = &c->table[0][0],
                                 .n_seqs = n_seqs,
                                 .max_blocks = MAX_BLOCKS,
                                 .outputs = c->outputs};
}

static void step_clear(struct check_run *c)
{
    c->step.n_tokens = c->step.n_outputs = 0;
}

/* Positions [t0, t1) of sequence q join the step; its last one is an output. */
static void step_add(struct check_run *c, int32_t q, int32_t t0, int32_t t1)
{
    for (int32_t t = t0; t < t1; t++) {
        int32_t i = c->step.n_tokens++;
        c->tokens[i] = c->ids[q][t];
        c->pos[i] = t;
        c->seq[i] = q;
        c->slot[i] = c->table[q][t / BLOCK] * BLOCK + t % BLOCK;
    }
    c->outputs[c->step.n_outputs++] = c->step.n_tokens - 1;
}

/* The step as built, through both models, compared output by output; a's rows are copied to
 * keep_a if given. */
static enum cllm_status compare_step(struct cllm_model *m[2], struct check_run *c, float *keep_a,
                                     struct cllm_agreement *r, bool *a_failed, char *err,
                                     size_t err_len)
{
    const int32_t n_vocab = cllm_model_hparams(m[0])->n_vocab;
    const float *logits[2];
    for (int i = 0; i < 2; i++) {
        enum cllm_status s = cllm_model_forward(m[i], &c->kv[i], &c->step, &logits[i]);
        if (s) {
            *a_failed = i == 0;
            return cllm_fail(err, err_len, s, "%s model: forward of a %d-token step failed: %s",
                             i == 0 ? "the checked" : "the reference", (int)c->step.n_tokens,
                             cllm_status_str(s));
        }
    }
    for (int32_t o = 0; o < c->step.n_outputs; o++) {
        const float *la = logits[0] + (int64_t)o * n_vocab, *lb = logits[1] + (int64_t)o * n_vocab;
        const float e = cllm_logit_row_error(la, lb, n_vocab);
        if (!(e <= r->worst)) { /* also takes the first row, and +inf */
            r->worst = e;
            r->worst_row = r->rows;
        }
        r->top1_same += cllm_argmax(la, n_vocab) == cllm_argmax(lb, n_vocab);
        r->rows++;
    }
    if (keep_a)
        memcpy(keep_a, logits[0], (size_t)c->step.n_outputs * (size_t)n_vocab * sizeof *keep_a);
    return CLLM_OK;
}

bool cllm_draw_allowed(const float *want, int32_t n_vocab, const struct cllm_sample_row *k,
                       const struct cllm_token_count *seen, int32_t n_seen, int32_t t, float slack,
                       float *scratch)
{
    if (t < 0 || t >= n_vocab)
        return false;
    float *x = scratch;
    memcpy(x, want, (size_t)n_vocab * sizeof *x);
    const float rep = k->repetition_penalty > 0.0f ? k->repetition_penalty : 1.0f;
    if (n_seen > 0)
        cllm_penalize(x, n_vocab, seen, (size_t)n_seen, -1, rep, k->presence_penalty,
                      k->frequency_penalty);
    const float xt = x[t];
    int32_t above = 0; /* logits clearly greater than the drawn one's */
    for (int32_t v = 0; v < n_vocab; v++)
        above += x[v] > xt + slack;
    if (k->temperature == 0.0f)
        return above == 0;
    if (k->top_k > 0 && above >= k->top_k)
        return false;
    float mx = -INFINITY;
    for (int32_t v = 0; v < n_vocab; v++)
        mx = fmaxf(mx, x[v]);
    /* Min-p keeps t when its probability is at least min_p of the top token's, after the
     * temperature; what top-k and top-p keep does not change that ratio. */
    if (k->min_p > 0.0f && (double)(xt + slack - mx) / k->temperature < log((double)k->min_p))
        return false;
    if (k->top_p >= 1.0f)
        return true;
    /* Top-p keeps t when the tokens before it hold less than top_p of the mass (after the
     * temperature, over what top-k keeps). Counted generously: the mass of tokens clearly
     * above t, over every token top-k might keep. */
    const float floor = k->top_k > 0 && k->top_k < n_vocab
                            ? cllm_kth_largest(x + n_vocab, k->top_k, x, n_vocab) - slack
                            : -INFINITY;
    double z = 0.0, mass_above = 0.0;
    for (int32_t v = 0; v < n_vocab; v++) {
        if (!(x[v] >= floor))
            continue;
        const double p = exp((double)(x[v] - mx) / k->temperature);
        z += p;
        if (x[v] > xt + slack)
            mass_above += p;
    }
    return mass_above < (double)k->top_p * z;
}

/* Draws from the step as built -- the one just compared, whose logits from a are want -- with
 * a's sampler (the step runs again: its cache slots get the same values), in every way a
 * request may ask: greedy, top-k, the penalties, top-p alone, and Qwen2.5's defaults; a drawn
 * token must be one the row's processors allow on want (cllm_draw_allowed), within DRAW_SLACK
 * of the row's range, as the draw computes the step's logits once more and a vendor BLAS need
 * not give the same bits twice (a near-tie may then go the other way; a broken sampler misses
 * by far more). The penalized kinds take the row's three best tokens as seen (generated once),
 * so that a sampler that skips the penalties would draw one of them. The draws are spread
 * over the step's outputs, a step per one or two of them. */
#define DRAW_SLACK 0.01f
#define DRAW_SEEN 3
struct draw_kind {
    const char *name;
    struct cllm_sample_row row;
    int times; /* draws, at counters 0, 1, ... */
};
static const struct draw_kind draw_kinds[] = {
    {"greedy", {.temperature = 0.0f, .top_p = 1.0f, .seed = 1}, 1},
    {"top-k 20 at temperature 1", {.temperature = 1.0f, .top_k = 20, .top_p = 1.0f, .seed = 7}, 1},
    {"greedy with penalties (repetition 2, presence 1, frequency 1)",
     {.temperature = 0.0f,
      .top_p = 1.0f,
      .repetition_penalty = 2.0f,
      .presence_penalty = 1.0f,
      .frequency_penalty = 1.0f,
      .seed = 2},
     1},
    /* the check's prompts are not text: their rows are flat, so a small top-p, for a sampler
     * that ignored it to draw outside what it keeps (78% of the mass on the 0.5B) */
    {"top-p 0.2 at temperature 1", {.temperature = 1.0f, .top_p = 0.2f, .seed = 11}, 3},
    /* and a large min-p, for the same reason */
    {"min-p 0.3 at temperature 1",
     {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.3f, .seed = 13},
     2},
    {"Qwen2.5's defaults (temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.1)",
     {.temperature = 0.7f, .top_k = 20, .top_p = 0.8f, .repetition_penalty = 1.1f, .seed = 5},
     4},
};
#define N_DRAW_KINDS ((int)(sizeof draw_kinds / sizeof draw_kinds[0]))

static bool kind_penalized(const struct cllm_sample_row *k)
{
    return (k->repetition_penalty > 0.0f && k->repetition_penalty != 1.0f) ||
           k->presence_penalty != 0.0f || k->frequency_penalty != 0.0f;
}

/* Draw i of the list: its kind and row (its counter and its outputs' seen tokens set). */
static int draw_at(int i, struct cllm_sample_row *row)
{
    for (int k = 0; k < N_DRAW_KINDS; k++) {
        if (i < draw_kinds[k].times) {
            *row = draw_kinds[k].row;
            row->counter = (uint64_t)i;
            return k;
        }
        i -= draw_kinds[k].times;
    }
    return -1;
}

static enum cllm_status check_draws(struct cllm_model *a, struct check_run *c, const float *want,
                                    struct cllm_agreement *r, char *err, size_t err_len)
{
    const int32_t n_vocab = cllm_model_hparams(a)->n_vocab, n_out = c->step.n_outputs;
    int n_draws = 0;
    for (int k = 0; k < N_DRAW_KINDS; k++)
        n_draws += draw_kinds[k].times;
    float *scratch = malloc(2 * (size_t)n_vocab * sizeof *scratch);
    if (!scratch)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    /* each output's seen tokens: its row's DRAW_SEEN best, as generated once; its slack */
    struct cllm_token_count seen[2][DRAW_SEEN];
    float slack[2];
    for (int32_t o = 0; o < n_out; o++) {
        const float *row = want + (int64_t)o * n_vocab;
        float lo = row[0], hi = row[0];
        for (int32_t v = 1; v < n_vocab; v++)
            lo = fminf(lo, row[v]), hi = fmaxf(hi, row[v]);
        slack[o] = DRAW_SLACK * (hi - lo);
        for (int j = 0; j < DRAW_SEEN; j++) {
            int32_t best = -1;
            for (int32_t v = 0; v < n_vocab; v++) {
                bool taken = false;
                for (int i = 0; i < j; i++)
                    taken = taken || seen[o][i].token == v;
                if (!taken && (best < 0 || row[v] > row[best]))
                    best = v;
            }
            seen[o][j] = (struct cllm_token_count){best, 1};
        }
    }
    const float *logits;
    enum cllm_status s = CLLM_OK;
    r->first_bad_kind = NULL;
    for (int d0 = 0; d0 < n_draws && !s; d0 += n_out) {
        struct cllm_sample_row rows[2];
        int32_t tokens[2] = {-1, -1};
        int kind[2];
        for (int32_t o = 0; o < n_out; o++) {
            kind[o] = draw_at(d0 + o < n_draws ? d0 + o : 0, &rows[o]);
            if (kind_penalized(&rows[o]))
                rows[o].counts_at = o * DRAW_SEEN, rows[o].n_counts = DRAW_SEEN;
        }
        if ((s = cllm_model_forward_sample(a, &c->kv[0], &c->step, rows, &seen[0][0], tokens,
                                           &logits)))
            break;
        for (int32_t o = 0; o < n_out && d0 + o < n_draws; o++) {
            const bool pen = rows[o].n_counts > 0;
            const bool ok = cllm_draw_allowed(want + (int64_t)o * n_vocab, n_vocab, &rows[o],
                                              pen ? seen[o] : NULL, pen ? DRAW_SEEN : 0, tokens[o],
                                              slack[o], scratch);
            r->draws++;
            r->bad_draws += !ok;
            if (!ok && !r->first_bad_kind)
                r->first_bad_kind = draw_kinds[kind[o]].name;
        }
    }
    free(scratch);
    if (s)
        cllm_fail(err, err_len, s, "the checked model: drawing a token failed: %s",
                  cllm_status_str(s));
    return s;
}

enum cllm_status cllm_models_compare(struct cllm_model *a, struct cllm_model *b, int32_t max_seqs,
                                     struct cllm_agreement *r, bool *a_failed, char *err,
                                     size_t err_len)
{
    *r = (struct cllm_agreement){0};
    r->worst = -1.0f;
    *a_failed = false;
    if (cllm_model_hparams(a)->n_vocab != cllm_model_hparams(b)->n_vocab)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "the models' vocabularies differ");
    int32_t chunk = cllm_model_max_tokens(a);
    if (cllm_model_max_tokens(b) < chunk)
        chunk = cllm_model_max_tokens(b);
    struct check_run *c = calloc(1, sizeof *c);
    float *last_a = malloc(2 * (size_t)cllm_model_hparams(a)->n_vocab * sizeof *last_a);
    if (!c || !last_a) {
        free(c), free(last_a);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    }
    struct cllm_model *m[2] = {a, b};
    layout(c, cllm_model_hparams(a)->n_vocab, max_seqs >= 2 && chunk >= BOTH_STEP ? 2 : 1);
    enum cllm_status st = CLLM_OK;
    int n_kv = 0;
    for (; n_kv < 2; n_kv++) {
        st = cllm_kv_cache_init(&c->kv[n_kv], m[n_kv], 2 * MAX_BLOCKS - 1, BLOCK, err, err_len);
        if (st) {
            *a_failed = n_kv == 0;
            break;
        }
    }
    if (c->n_seqs == 2) { /* both prompts in one step */
        step_clear(c);
        step_add(c, 0, 0, PREFILL0);
        step_add(c, 1, 0, PREFILL1);
        if (!st)
            st = compare_step(m, c, NULL, r, a_failed, err, err_len);
    }
    for (int32_t t0 = 0; c->n_seqs == 1 && !st && t0 < PREFILL0; t0 += chunk) {
        step_clear(c);
        step_add(c, 0, t0, t0 + chunk < PREFILL0 ? t0 + chunk : PREFILL0);
        st = compare_step(m, c, NULL, r, a_failed, err, err_len);
    }
    for (int32_t d = 0; !st && d < DECODE; d++) {
        step_clear(c);
        step_add(c, 0, PREFILL0 + d, PREFILL0 + d + 1);
        if (c->n_seqs == 2)
            step_add(c, 1, PREFILL1 + d, PREFILL1 + d + 1);
        st = compare_step(m, c, d == DECODE - 1 ? last_a : NULL, r, a_failed, err, err_len);
    }
    if (!st && (st = check_draws(a, c, last_a, r, err, err_len))) /* the last decode step */
        *a_failed = true;
    for (int i = 0; i < n_kv; i++)
        cllm_kv_cache_free(&c->kv[i], m[i]);
    free(c);
    free(last_a);
    return st;
}

enum cllm_status cllm_device_check(struct cllm_model *dev, const char *dev_name, int32_t max_seqs,
                                   const struct cllm_model_files *mf, int32_t n_threads,
                                   struct cllm_agreement *r, char *err, size_t err_len)
{
    const double t_start = cllm_now(); /* the CPU model's start-up included */
    struct cllm_backend *cpu = NULL;
    struct cllm_model *ref = NULL;
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        n_threads, 0,
                                     CLLM_CPU_WEIGHTS_STORED, 0,         false};
    enum cllm_status st = cllm_backend_new(&cpu, &o, err, err_len);
    if (!st)
        st = cllm_model_init(&ref, mf, cpu, BOTH_STEP, 2, err, err_len);
    bool dev_failed = false;
    if (!st && (st = cllm_models_compare(dev, ref, max_seqs, r, &dev_failed, err, err_len)) &&
        dev_failed)
        st = CLLM_ERR_DEVICE; /* err says what failed */
    struct cllm_attn_agreement at = {.worst = 0.0f};
    const double t_attn = cllm_now();
    if (!st && r->worst <= CLLM_DEVICE_CHECK_BOUND && r->bad_draws == 0 &&
        (st = cllm_attention_compare(cllm_model_backend(dev), cpu, cllm_model_hparams(dev), &at,
                                     &dev_failed, err, err_len)) &&
        dev_failed)
        st = CLLM_ERR_DEVICE;
    const double t_end = cllm_now();
    if (!st) {
        const float pct = 100.0f * r->worst;
        if (r->worst <= CLLM_DEVICE_CHECK_BOUND && r->bad_draws == 0 &&
            at.worst <= CLLM_DEVICE_CHECK_BOUND) {
            cllm_log(CLLM_LOG_INFO,
                     "device check: %s agrees with the CPU on %d logit rows: worst error %.2f%% "
                     "of a row's range (bound %.0f%%), the same top token in %d of %d; its "
                     "%d draws are right; its attention at up to %d keys: worst error %.2f%% "
                     "of a head's largest output in %d rows (%.2f s, of which attention "
                     "%.2f s)",
                     dev_name, (int)r->rows, pct, 100.0f * CLLM_DEVICE_CHECK_BOUND,
                     (int)r->top1_same, (int)r->rows, (int)r->draws, (int)at.longest,
                     100.0f * at.worst, (int)at.rows, t_end - t_start, t_end - t_attn);
        } else if (r->worst <= CLLM_DEVICE_CHECK_BOUND && r->bad_draws == 0) {
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "device check: the %s backend's attention differs from the CPU's by "
                           "%.3g%% of a head's largest output at a context of %d keys (bound "
                           "%.0f%%; its logits on sequences of up to 42 tokens agree)",
                           dev_name, 100.0f * at.worst, (int)at.worst_len,
                           100.0f * CLLM_DEVICE_CHECK_BOUND);
        } else if (r->bad_draws) {
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "device check: the %s backend's sampler drew %d tokens of %d that "
                           "the rows' processors do not allow (the first: %s; within %.0f%% of "
                           "the row's range)",
                           dev_name, (int)r->bad_draws, (int)r->draws, r->first_bad_kind,
                           100.0f * DRAW_SLACK);
        } else {
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "device check: the %s backend's logits differ from the CPU's by %.3g%% "
                           "of a row's range in row %d of %d (rows: the prefill's, then the decode "
                           "steps', each in sequence order; bound %.0f%%; the same top token in "
                           "%d of %d rows)",
                           dev_name, pct, (int)r->worst_row, (int)r->rows,
                           100.0f * CLLM_DEVICE_CHECK_BOUND, (int)r->top1_same, (int)r->rows);
        }
    }
    cllm_model_free(ref);
    cllm_backend_free(cpu);
    return st;
}
