/* The device check (device_check.h): one fixed sequence through two models, row by row. */
#include "engine/device_check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/log.h"
#include "core/status.h"

#define PREFILL 40 /* > 32: the tiled GEMMs; 3 KV blocks with the decode steps */
#define DECODE 2
#define BLOCK 16
#define N_BLOCKS 3

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

static int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Both models' caches, and the step layout they share: one sequence whose blocks are not in
 * order in the pool, so a wrong slot or block lookup shows. */
struct check_run {
    struct cllm_kv_cache kv[2];
    int32_t tokens[PREFILL + DECODE], pos[PREFILL + DECODE], seq[PREFILL + DECODE];
    int32_t slot[PREFILL + DECODE];
    int32_t table[N_BLOCKS];
};

static void layout(struct check_run *c, int32_t n_vocab)
{
    static const int32_t table[N_BLOCKS] = {2, 0, 1};
    /* ordinary tokens of any Qwen2 vocabulary (below its specials), spread over it */
    const int32_t span = n_vocab < 32000 ? n_vocab : 32000;
    for (int32_t i = 0; i < N_BLOCKS; i++)
        c->table[i] = table[i];
    for (int32_t t = 0; t < PREFILL + DECODE; t++) {
        c->tokens[t] = (int32_t)(((int64_t)t * 7919 + 11) % span);
        c->pos[t] = t;
        c->seq[t] = 0;
        c->slot[t] = c->table[t / BLOCK] * BLOCK + t % BLOCK;
    }
}

/* Tokens [t0, t1) as one step of each model, compared on its last token's logits. */
static enum cllm_status compare_step(struct cllm_model *m[2], struct check_run *c, int32_t t0,
                                     int32_t t1, struct cllm_agreement *r, bool *a_failed,
                                     char *err, size_t err_len)
{
    const int32_t n_vocab = cllm_model_hparams(m[0])->n_vocab, last = t1 - t0 - 1;
    struct cllm_step st = {.n_tokens = t1 - t0,
                           .tokens = c->tokens + t0,
                           .pos = c->pos + t0,
                           .seq = c->seq + t0,
                           .slot = c->slot + t0,
                           .block_table = c->table,
                           .n_seqs = 1,
                           .max_blocks = N_BLOCKS,
                           .n_outputs = 1,
                           .outputs = &last};
    const float *logits[2];
    for (int i = 0; i < 2; i++) {
        enum cllm_status s = cllm_model_forward(m[i], &c->kv[i], &st, &logits[i]);
        if (s) {
            *a_failed = i == 0;
            return cllm_fail(err, err_len, s, "%s model: forward of tokens %d..%d failed: %s",
                             i == 0 ? "the checked" : "the reference", (int)t0, (int)t1 - 1,
                             cllm_status_str(s));
        }
    }
    const float e = cllm_logit_row_error(logits[0], logits[1], n_vocab);
    if (!(e <= r->worst)) { /* also takes the first row, and +inf */
        r->worst = e;
        r->worst_row = r->rows;
    }
    r->top1_same += argmax(logits[0], n_vocab) == argmax(logits[1], n_vocab);
    r->rows++;
    return CLLM_OK;
}

/* Draws from a's logits of the step [t, t + 1) with a's sampler (the step runs again: its
 * cache slot gets the same values): greedy must give a's argmax, top-k a token among a's k
 * best. */
#define DRAW_TOP_K 20
static enum cllm_status check_draws(struct cllm_model *a, struct check_run *c, int32_t t,
                                    struct cllm_agreement *r, char *err, size_t err_len)
{
    const int32_t n_vocab = cllm_model_hparams(a)->n_vocab, last = 0;
    struct cllm_step st = {.n_tokens = 1,
                           .tokens = c->tokens + t,
                           .pos = c->pos + t,
                           .seq = c->seq + t,
                           .slot = c->slot + t,
                           .block_table = c->table,
                           .n_seqs = 1,
                           .max_blocks = N_BLOCKS,
                           .n_outputs = 1,
                           .outputs = &last};
    const float *logits;
    float *row = malloc((size_t)n_vocab * sizeof *row);
    if (!row)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    enum cllm_status s = cllm_model_forward(a, &c->kv[0], &st, &logits);
    if (!s)
        memcpy(row, logits, (size_t)n_vocab * sizeof *row);
    const struct cllm_sample_row rows[2] = {
        {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1, .counter = 0},
        {.temperature = 1.0f,
         .top_k = DRAW_TOP_K,
         .top_p = 1.0f,
         .min_p = 0.0f,
         .seed = 7,
         .counter = 3}};
    for (int i = 0; i < 2 && !s; i++) {
        int32_t token = -1;
        s = cllm_model_forward_sample(a, &c->kv[0], &st, &rows[i], &token, &logits);
        if (s)
            break;
        int32_t above = 0; /* logits greater than the drawn one's */
        if (token >= 0 && token < n_vocab)
            for (int32_t v = 0; v < n_vocab; v++)
                above += row[v] > row[token];
        const bool ok = token >= 0 && token < n_vocab &&
                        (i == 0 ? token == argmax(row, n_vocab) : above < DRAW_TOP_K);
        r->draws++;
        r->bad_draws += !ok;
    }
    free(row);
    if (s)
        cllm_fail(err, err_len, s, "the checked model: drawing a token failed: %s",
                  cllm_status_str(s));
    return s;
}

enum cllm_status cllm_models_compare(struct cllm_model *a, struct cllm_model *b,
                                     struct cllm_agreement *r, bool *a_failed, char *err,
                                     size_t err_len)
{
    *r = (struct cllm_agreement){0};
    r->worst = -1.0f;
    *a_failed = false;
    if (cllm_model_hparams(a)->n_vocab != cllm_model_hparams(b)->n_vocab)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "the models' vocabularies differ");
    struct check_run c = {0};
    struct cllm_model *m[2] = {a, b};
    layout(&c, cllm_model_hparams(a)->n_vocab);
    enum cllm_status st = CLLM_OK;
    int n_kv = 0;
    for (; n_kv < 2 && st == CLLM_OK; n_kv++) {
        st = cllm_kv_cache_init(&c.kv[n_kv], m[n_kv], N_BLOCKS, BLOCK, err, err_len);
        if (st) {
            *a_failed = n_kv == 0;
            break;
        }
    }
    int32_t chunk = cllm_model_max_tokens(a);
    if (cllm_model_max_tokens(b) < chunk)
        chunk = cllm_model_max_tokens(b);
    for (int32_t t0 = 0; st == CLLM_OK && t0 < PREFILL; t0 += chunk)
        st = compare_step(m, &c, t0, t0 + chunk < PREFILL ? t0 + chunk : PREFILL, r, a_failed, err,
                          err_len);
    for (int32_t t = PREFILL; st == CLLM_OK && t < PREFILL + DECODE; t++)
        st = compare_step(m, &c, t, t + 1, r, a_failed, err, err_len);
    if (st == CLLM_OK && (st = check_draws(a, &c, PREFILL + DECODE - 1, r, err, err_len)))
        *a_failed = true;
    for (int i = 0; i < n_kv; i++)
        cllm_kv_cache_free(&c.kv[i], m[i]);
    return st;
}

enum cllm_status cllm_device_check(struct cllm_model *dev, const char *dev_name,
                                   const struct cllm_model_files *mf, int32_t n_threads,
                                   struct cllm_agreement *r, char *err, size_t err_len)
{
    struct cllm_backend *cpu = NULL;
    struct cllm_model *ref = NULL;
    struct cllm_backend_options o = {CLLM_BACKEND_CPU, n_threads, 0};
    enum cllm_status st = cllm_backend_new(&cpu, &o, err, err_len);
    if (!st)
        st = cllm_model_init(&ref, mf, cpu, PREFILL, 1, err, err_len);
    bool dev_failed = false;
    if (!st && (st = cllm_models_compare(dev, ref, r, &dev_failed, err, err_len)) && dev_failed)
        st = CLLM_ERR_DEVICE; /* err says what failed */
    if (!st) {
        const float pct = 100.0f * r->worst;
        if (r->worst <= CLLM_DEVICE_CHECK_BOUND && r->bad_draws == 0) {
            cllm_log(CLLM_LOG_INFO,
                     "device check: %s agrees with the CPU on %d logit rows: worst error %.2f%% "
                     "of a row's range (bound %.0f%%), the same top token in %d of %d; its "
                     "%d draws are right",
                     dev_name, (int)r->rows, pct, 100.0f * CLLM_DEVICE_CHECK_BOUND,
                     (int)r->top1_same, (int)r->rows, (int)r->draws);
        } else if (r->bad_draws) {
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "device check: the %s backend's sampler drew %d wrong tokens of %d "
                           "(greedy must be its argmax, top-%d among its %d best logits)",
                           dev_name, (int)r->bad_draws, (int)r->draws, DRAW_TOP_K, DRAW_TOP_K);
        } else {
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "device check: the %s backend's logits differ from the CPU's by %.3g%% "
                           "of a row's range in row %d of %d (rows: the prefill's, then one per "
                           "decode step; bound %.0f%%; the same top token in %d of %d rows)",
                           dev_name, pct, (int)r->worst_row, (int)r->rows,
                           100.0f * CLLM_DEVICE_CHECK_BOUND, (int)r->top1_same, (int)r->rows);
        }
    }
    cllm_model_free(ref);
    cllm_backend_free(cpu);
    return st;
}
