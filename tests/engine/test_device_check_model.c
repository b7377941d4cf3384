/*
 * The device check's arithmetic (engine/device_check.h) and its bound on the real small model:
 *   - a row's error as a share of the reference's range, and +inf where it must fail (a NaN or
 *     infinity from the device, a flat reference row the device does not match);
 *   - the same model on two CPU backends (1 and 2 threads) agrees exactly, with one sequence
 *     whose prefill takes three steps and with two sequences sharing every step, and its
 *     draws (greedy, top-k, penalized greedy, top-p alone, Qwen2.5's defaults) are what the
 *     rows allow, and what a draw may be is what each processor allows (cllm_draw_allowed);
 *   - the quantized GGUF on the CPU (8-bit activations, the reference a GPU is checked against
 *     when it serves a GGUF) against the F32 HF folder made from it (exact arithmetic): within a
 *     third of the bound. A right GPU's own BF16 error is of the same size (docs/measured.md),
 *     so the bound leaves room for both while a wrong op shows as tens of percent (the
 *     emulator's test_emu_model: a BLAS that drops part of each sum is 55% off).
 *   - the attention op at long contexts (cllm_attention_compare): two CPU backends agree
 *     exactly; an op that loses the keys past 256 (every call, or from its second call on)
 *     is off by more than twice the bound; an op that fails is the checked side's failure.
 * (The device side of the check runs under the CUDA emulator in test_emu_model.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/status.h"
#include "engine/device_check.h"
#include "sampling/sampling.h"
#include "test.h"

static void test_row_error(void)
{
    const float ref[4] = {1.0f, 2.0f, 3.0f, 5.0f};
    const float same[4] = {1.0f, 2.0f, 3.0f, 5.0f};
    const float off[4] = {1.0f, 2.0f, 4.0f, 5.0f};
    const float nan_row[4] = {1.0f, NAN, 3.0f, 5.0f};
    const float inf_row[4] = {1.0f, 2.0f, INFINITY, 5.0f};
    const float flat[4] = {2.0f, 2.0f, 2.0f, 2.0f};
    CHECK(cllm_logit_row_error(same, ref, 4) == 0.0f);
    CHECKF(cllm_logit_row_error(off, ref, 4) == 0.25f, "%g", cllm_logit_row_error(off, ref, 4));
    CHECK(isinf(cllm_logit_row_error(nan_row, ref, 4)));
    CHECK(isinf(cllm_logit_row_error(inf_row, ref, 4)));
    CHECK(cllm_logit_row_error(flat, flat, 4) == 0.0f);
    CHECK(isinf(cllm_logit_row_error(ref, flat, 4)));
}

struct loaded {
    struct cllm_model_files *mf;
    struct cllm_backend *be;
    struct cllm_model *m;
};

static bool load(struct loaded *l, const char *path, int32_t threads, int32_t max_tokens,
                 int32_t max_outputs)
{
    char err[512] = "";
    struct cllm_backend_options o = {CLLM_BACKEND_CPU,        threads, 0,
                                     CLLM_CPU_WEIGHTS_STORED, 0,       false};
    memset(l, 0, sizeof *l);
    bool ok = !cllm_model_files_open(&l->mf, path, err, sizeof err) &&
              !cllm_backend_new(&l->be, &o, err, sizeof err) &&
              !cllm_model_init(&l->m, l->mf, l->be, max_tokens, max_outputs, err, sizeof err);
    CHECKF(ok, "%s: %s", path, err);
    return ok;
}

static void unload(struct loaded *l)
{
    cllm_model_free(l->m);
    cllm_backend_free(l->be);
    cllm_model_files_free(l->mf);
}

static void compare(struct loaded *a, struct loaded *b, int32_t max_seqs, struct cllm_agreement *r,
                    const char *what)
{
    bool a_failed = true;
    char err[512] = "";
    enum cllm_status st = cllm_models_compare(a->m, b->m, max_seqs, r, &a_failed, err, sizeof err);
    CHECKF(st == CLLM_OK && !a_failed, "%s: %s", what, err);
    printf("%s: %d rows, worst error %.3f%% of a row's range (row %d), the same top token in "
           "%d\n",
           what, (int)r->rows, 100.0 * r->worst, (int)r->worst_row, (int)r->top1_same);
}

static const float *order_key;
static int by_key_descending(const void *a, const void *b)
{
    const float x = order_key[*(const int32_t *)a], y = order_key[*(const int32_t *)b];
    return (x < y) - (x > y);
}

/* How many tokens row k allows on row: a token is allowed when few enough tokens, and little
 * enough mass, lie clearly above it in the penalized row, so the allowed ones lead that row's
 * descending order; counted down it to the first refused one (not one call per token of the
 * vocabulary: each call reads the whole row). order gets the order. */
static int32_t allowed_count(const float *row, int32_t n_vocab, const struct cllm_sample_row *k,
                             const struct cllm_token_count *seen, int32_t n_seen, float slack,
                             float *scratch, int32_t *order)
{
    float *x = malloc((size_t)n_vocab * sizeof *x);
    memcpy(x, row, (size_t)n_vocab * sizeof *x);
    if (n_seen > 0)
        cllm_penalize(x, n_vocab, seen, (size_t)n_seen, -1,
                      k->repetition_penalty > 0.0f ? k->repetition_penalty : 1.0f,
                      k->presence_penalty, k->frequency_penalty);
    for (int32_t v = 0; v < n_vocab; v++)
        order[v] = v;
    order_key = x;
    qsort(order, (size_t)n_vocab, sizeof *order, by_key_descending);
    int32_t n = 0;
    while (n < n_vocab &&
           cllm_draw_allowed(row, n_vocab, k, seen, n_seen, order[n], slack, scratch))
        n++;
    free(x);
    return n;
}

/* The draw check's power on real logits: the next-token row after 40 tokens of the check's
 * first sequence through the model, under the kinds check_draws uses (their values repeated
 * here). A sampler that skipped the penalties would draw a token the penalized greedy kind
 * refuses; one that skipped top-p would draw, at each top-p 0.2 draw, outside what top-p keeps
 * with the probability of the mass outside (at least half), and so for min-p 0.3; Qwen2.5's
 * defaults keep fewer tokens than their top-k alone. */
static void test_draw_power(struct loaded *l)
{
    enum { N = 40 };
    const int32_t n_vocab = cllm_model_hparams(l->m)->n_vocab;
    int32_t tokens[N], pos[N], seq[N], slot[N], table[3] = {0, 1, 2}, out = N - 1;
    for (int32_t t = 0; t < N; t++)
        tokens[t] = (int32_t)(((int64_t)t * 7919 + 11) % 32000), pos[t] = t, seq[t] = 0,
        slot[t] = t;
    struct cllm_step step = {N, tokens, pos, seq, slot, table, 1, 3, 1, &out};
    struct cllm_kv_cache kv;
    const float *logits = NULL;
    char err[256] = "";
    if (cllm_kv_cache_init(&kv, l->m, 3, 16, err, sizeof err) ||
        cllm_model_forward(l->m, &kv, &step, &logits)) {
        CHECKF(false, "forward: %s", err);
        return;
    }
    float *row = malloc((size_t)n_vocab * sizeof *row), *scratch = malloc(2 * (size_t)n_vocab * 4);
    memcpy(row, logits, (size_t)n_vocab * sizeof *row);
    cllm_kv_cache_free(&kv, l->m);
    float lo = row[0], hi = row[0];
    for (int32_t v = 1; v < n_vocab; v++)
        lo = fminf(lo, row[v]), hi = fmaxf(hi, row[v]);
    const float slack = 0.01f * (hi - lo);
    /* the row's three best, as seen (generated once) */
    struct cllm_token_count seen[3];
    for (int j = 0; j < 3; j++) {
        int32_t best = -1;
        for (int32_t v = 0; v < n_vocab; v++) {
            bool taken = false;
            for (int i = 0; i < j; i++)
                taken = taken || seen[i].token == v;
            if (!taken && (best < 0 || row[v] > row[best]))
                best = v;
        }
        seen[j] = (struct cllm_token_count){best, 1};
    }
    const struct cllm_sample_row pen = {.temperature = 0.0f,
                                        .top_p = 1.0f,
                                        .repetition_penalty = 2.0f,
                                        .presence_penalty = 1.0f,
                                        .frequency_penalty = 1.0f};
    CHECKF(!cllm_draw_allowed(row, n_vocab, &pen, seen, 3, seen[0].token, slack, scratch),
           "penalized greedy allows the unpenalized argmax");
    const struct cllm_sample_row p2 = {.temperature = 1.0f, .top_p = 0.2f};
    const struct cllm_sample_row qwen = {
        .temperature = 0.7f, .top_k = 20, .top_p = 0.8f, .repetition_penalty = 1.1f};
    const struct cllm_sample_row k20 = {.temperature = 0.7f, .top_k = 20, .top_p = 1.0f};
    int32_t *order = malloc((size_t)n_vocab * sizeof *order);
    const int32_t qwen_kept = allowed_count(row, n_vocab, &qwen, seen, 3, slack, scratch, order);
    const int32_t k20_kept = allowed_count(row, n_vocab, &k20, seen, 3, slack, scratch, order);
    const struct cllm_sample_row m3 = {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.3f};
    const int32_t m3_kept = allowed_count(row, n_vocab, &m3, NULL, 0, slack, scratch, order);
    const int32_t p2_kept = allowed_count(row, n_vocab, &p2, NULL, 0, slack, scratch, order);
    /* the mass of what top-p 0.2 and min-p 0.3 refuse, at temperature 1 (order: the row's) */
    double z = 0.0, p2_out = 0.0, m3_out = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) {
        const double p = exp((double)(row[order[i]] - hi));
        z += p;
        p2_out += i < p2_kept ? 0.0 : p;
        m3_out += i < m3_kept ? 0.0 : p;
    }
    free(order);
    printf("draw check on a real row: top-p 0.2 allows %d tokens of %d, %.0f%% of the mass "
           "outside; min-p 0.3 %d, %.0f%% outside; Qwen2.5's defaults %d (top-k 20 alone: %d)\n",
           (int)p2_kept, (int)n_vocab, 100.0 * p2_out / z, (int)m3_kept, 100.0 * m3_out / z,
           (int)qwen_kept, (int)k20_kept);
    CHECKF(p2_kept >= 1 && p2_out >= 0.5 * z, "top-p 0.2 allows %d, %.0f%% of the mass outside",
           (int)p2_kept, 100.0 * p2_out / z);
    CHECKF(m3_kept >= 1 && m3_out >= 0.5 * z, "min-p 0.3 allows %d, %.0f%% of the mass outside",
           (int)m3_kept, 100.0 * m3_out / z);
    CHECKF(qwen_kept >= 1 && qwen_kept < k20_kept, "Qwen's defaults allow %d, top-k alone %d",
           (int)qwen_kept, (int)k20_kept);
    free(row), free(scratch);
}

static void test_models(void)
{
    struct loaded gguf1, gguf2, gguf3, hf;
    if (!load(&gguf1, test_env("CLLM_TEST_GGUF"), 1, 64, 2) ||
        !load(&gguf2, test_env("CLLM_TEST_GGUF"), 2, 16, 1) ||
        !load(&gguf3, test_env("CLLM_TEST_GGUF"), 2, 64, 2) ||
        !load(&hf, test_env("CLLM_TEST_HF"), 2, 64, 2))
        return;
    struct cllm_agreement r;
    /* One sequence: steps of 16 tokens cut its prefill into 16 + 16 + 8: three rows, then two
     * decode steps. The CPU draws on the host as a device sampler would: twelve draws of six
     * kinds (greedy, top-k, penalized greedy, top-p alone, min-p alone, Qwen2.5's defaults). */
    test_draw_power(&gguf1);
    compare(&gguf1, &gguf2, 1, &r, "GGUF, 1 thread vs 2, one sequence");
    CHECKF(r.rows == 5 && r.worst == 0.0f && r.top1_same == 5, "rows %d, worst %g", (int)r.rows,
           r.worst);
    CHECKF(r.draws == 12 && r.bad_draws == 0, "%d of %d draws wrong (the first: %s)",
           (int)r.bad_draws, (int)r.draws, r.first_bad_kind ? r.first_bad_kind : "none");
    /* Two sequences in every step: 2 prefill rows, 2 per decode step, the twelve draws two at a
     * time in the last step. */
    compare(&gguf1, &gguf3, 2, &r, "GGUF, 1 thread vs 2, two sequences");
    CHECKF(r.rows == 6 && r.worst == 0.0f && r.top1_same == 6, "rows %d, worst %g", (int)r.rows,
           r.worst);
    CHECKF(r.draws == 12 && r.bad_draws == 0, "%d of %d draws wrong (the first: %s)",
           (int)r.bad_draws, (int)r.draws, r.first_bad_kind ? r.first_bad_kind : "none");
    compare(&gguf1, &hf, 2, &r, "GGUF (8-bit activations) vs its F32 HF folder");
    CHECKF(r.rows == 6 && r.worst <= CLLM_DEVICE_CHECK_BOUND / 3,
           "rows %d, worst %.3f%% of a row's range: the bound (%.0f%%) has too little room",
           (int)r.rows, 100.0 * r.worst, 100.0 * CLLM_DEVICE_CHECK_BOUND);
    unload(&gguf1), unload(&gguf2), unload(&gguf3), unload(&hf);
}

/* What a draw may be (cllm_draw_allowed), on a row whose probabilities at temperature 1 are
 * 0.472, 0.427, 0.064, 0.024, ... */
static void test_draw_allowed(void)
{
    const float want[8] = {5.0f, 4.9f, 3.0f, 2.0f, 1.0f, 0.0f, -1.0f, -2.0f};
    float scratch[16];
    const struct cllm_token_count first[1] = {{0, 0}}, two[2] = {{0, 1}, {1, 1}};
#define ALLOWED(row, seen, n_seen, t, slack)                                                       \
    cllm_draw_allowed(want, 8, &(row), seen, n_seen, t, slack, scratch)
    struct cllm_sample_row greedy = {.temperature = 0.0f, .top_p = 1.0f};
    CHECK(ALLOWED(greedy, NULL, 0, 0, 0.0f) && !ALLOWED(greedy, NULL, 0, 1, 0.0f));
    CHECK(ALLOWED(greedy, NULL, 0, 1, 0.2f)); /* a near-tie may go either way */
    CHECK(!ALLOWED(greedy, NULL, 0, -1, 0.0f) && !ALLOWED(greedy, NULL, 0, 8, 0.0f));
    /* repetition 2 on token 0 (seen in the prompt): 2.5, so token 1 is the argmax */
    struct cllm_sample_row rep = greedy;
    rep.repetition_penalty = 2.0f;
    CHECK(ALLOWED(rep, first, 1, 1, 0.0f) && !ALLOWED(rep, first, 1, 0, 0.0f));
    CHECK(ALLOWED(rep, NULL, 0, 0, 0.0f)); /* nothing seen: nothing penalized */
    /* presence and frequency 1.5 on tokens 0 and 1, generated once: 2.0 and 1.9 < 3.0 */
    struct cllm_sample_row pf = greedy;
    pf.presence_penalty = 1.5f, pf.frequency_penalty = 1.5f;
    CHECK(ALLOWED(pf, two, 2, 2, 0.0f) && !ALLOWED(pf, two, 2, 0, 0.0f));
    struct cllm_sample_row top2 = {.temperature = 1.0f, .top_k = 2, .top_p = 1.0f};
    CHECK(ALLOWED(top2, NULL, 0, 1, 0.0f) && !ALLOWED(top2, NULL, 0, 2, 0.0f));
    CHECK(ALLOWED(top2, NULL, 0, 2, 2.0f)); /* within slack of the second best */
    /* top-p 0.5: tokens 0 and 1 (0.472 before token 1), not 2 (0.899 before it) */
    struct cllm_sample_row p5 = {.temperature = 1.0f, .top_p = 0.5f};
    CHECK(ALLOWED(p5, NULL, 0, 0, 0.0f) && ALLOWED(p5, NULL, 0, 1, 0.0f));
    CHECK(!ALLOWED(p5, NULL, 0, 2, 0.0f));
    struct cllm_sample_row p4 = {.temperature = 1.0f, .top_p = 0.4f};
    CHECK(ALLOWED(p4, NULL, 0, 0, 0.0f) && !ALLOWED(p4, NULL, 0, 1, 0.0f));
    /* the temperature counts: at 0.1, token 0 holds 0.73 */
    struct cllm_sample_row cold = {.temperature = 0.1f, .top_p = 0.5f};
    CHECK(!ALLOWED(cold, NULL, 0, 1, 0.0f));
    /* top-p over what top-k keeps: within the top 2, token 0 holds 0.525 */
    struct cllm_sample_row k2p5 = {.temperature = 1.0f, .top_k = 2, .top_p = 0.5f};
    CHECK(!ALLOWED(k2p5, NULL, 0, 1, 0.0f) && ALLOWED(k2p5, NULL, 0, 0, 0.0f));
    /* min-p 0.5: token 1 holds 0.905 of token 0's probability, token 2 0.135 */
    struct cllm_sample_row m5 = {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.5f};
    CHECK(ALLOWED(m5, NULL, 0, 0, 0.0f) && ALLOWED(m5, NULL, 0, 1, 0.0f));
    CHECK(!ALLOWED(m5, NULL, 0, 2, 0.0f) && ALLOWED(m5, NULL, 0, 2, 2.0f));
    /* at temperature 10 token 2 holds 0.82 of the top's */
    struct cllm_sample_row hot = m5;
    hot.temperature = 10.0f;
    CHECK(ALLOWED(hot, NULL, 0, 2, 0.0f) && !ALLOWED(hot, NULL, 0, 7, 0.0f));
#undef ALLOWED
}

/* --- the attention at long contexts (cllm_attention_compare) --- */

/* A CPU backend with a broken attention op, as a vendor stack might break a GPU's: the
 * partial results past the first 256 keys lost (every call, or from the second call on: a
 * scratch the op does not leave fit for its next call), or the op failing. */
enum attn_fault { DROP_SPLITS, STALE_SECOND_CALL, FAIL };
static enum attn_fault fault;
static int attn_calls;
static const struct cllm_backend_iface *cpu_iface;

static enum cllm_status broken_attention(struct cllm_backend *be, const struct cllm_attn_batch *b,
                                         const float *q, int32_t ldq, const void *k_cache,
                                         const void *v_cache, int32_t n_head, int32_t n_kv,
                                         int32_t head_dim, float scale, void *scratch, void *out)
{
    const bool broken = fault == DROP_SPLITS || (fault == STALE_SECOND_CALL && attn_calls > 0);
    attn_calls++;
    if (fault == FAIL)
        return CLLM_ERR_DEVICE;
    int32_t pos[64];
    struct cllm_attn_batch short_b = *b;
    if (broken && b->n_tokens <= 64) { /* every token sees keys 0..255 at most */
        for (int32_t t = 0; t < b->n_tokens; t++)
            pos[t] = b->pos[t] < 255 ? b->pos[t] : 255;
        short_b.pos = pos;
    }
    return cpu_iface->attention(be, &short_b, q, ldq, k_cache, v_cache, n_head, n_kv, head_dim,
                                scale, scratch, out);
}

static void test_attention(void)
{
    /* the 1.5B's heads (12 query, 2 KV, 128 wide) and the 0.5B's (14, 2, 64) */
    struct cllm_hparams shapes[2] = {{.n_head = 12, .n_head_kv = 2, .head_dim = 128},
                                     {.n_head = 14, .n_head_kv = 2, .head_dim = 64}};
    struct cllm_backend *one = NULL, *two = NULL;
    char err[512] = "";
    struct cllm_backend_options o1 = {CLLM_BACKEND_CPU, 1, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    struct cllm_backend_options o2 = {CLLM_BACKEND_CPU, 2, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    const bool made = !cllm_backend_new(&one, &o1, err, sizeof err) &&
                      !cllm_backend_new(&two, &o2, err, sizeof err);
    CHECKF(made, "%s", err);
    if (!made) {
        cllm_backend_free(one);
        return;
    }
    struct cllm_backend_iface broken_iface = *two->iface;
    broken_iface.attention = broken_attention;
    cpu_iface = two->iface;
    struct cllm_backend broken = {&broken_iface, two->ctx};
    for (int i = 0; i < 2; i++) {
        struct cllm_hparams *hp = &shapes[i];
        hp->rope_theta = 1e6f;
        struct cllm_attn_agreement r;
        bool a_failed = true;
        enum cllm_status st = cllm_attention_compare(two, one, hp, &r, &a_failed, err, sizeof err);
        CHECKF(st == CLLM_OK && !a_failed, "heads %d/%d: %s", (int)hp->n_head, (int)hp->n_head_kv,
               err);
        /* CPU threads do not change a row's arithmetic: the same bits */
        CHECKF(r.rows == 2 * 20 * hp->n_head && r.worst == 0.0f && r.longest == 4200,
               "1 thread vs 2: rows %d, worst %g", (int)r.rows, r.worst);

        fault = DROP_SPLITS, attn_calls = 0;
        st = cllm_attention_compare(&broken, one, hp, &r, &a_failed, err, sizeof err);
        printf("heads %d/%d, keys past 256 lost: worst error %.1f%% of a head's largest output "
               "at %d keys\n",
               (int)hp->n_head, (int)hp->n_head_kv, 100.0 * r.worst, (int)r.worst_len);
        CHECKF(st == CLLM_OK && r.worst > 2 * CLLM_DEVICE_CHECK_BOUND && r.worst_len > 256,
               "lost splits: worst %g at %d keys", r.worst, (int)r.worst_len);
        CHECKF(attn_calls == 2, "the checked op ran %d times, want 2", attn_calls);

        fault = STALE_SECOND_CALL, attn_calls = 0;
        st = cllm_attention_compare(&broken, one, hp, &r, &a_failed, err, sizeof err);
        CHECKF(st == CLLM_OK && r.worst > 2 * CLLM_DEVICE_CHECK_BOUND,
               "a wrong second call: worst %g", r.worst);

        fault = FAIL;
        st = cllm_attention_compare(&broken, one, hp, &r, &a_failed, err, sizeof err);
        CHECKF(st == CLLM_ERR_DEVICE && a_failed && strstr(err, "checked"),
               "a failing op: %s, a_failed %d: %s", cllm_status_str(st), a_failed, err);
        st = cllm_attention_compare(one, &broken, hp, &r, &a_failed, err, sizeof err);
        CHECKF(st == CLLM_ERR_DEVICE && !a_failed && strstr(err, "reference"),
               "a failing reference: %s, a_failed %d: %s", cllm_status_str(st), a_failed, err);
    }
    struct cllm_hparams bad = {.n_head = 12, .n_head_kv = 5, .head_dim = 128};
    bool a_failed = true;
    struct cllm_attn_agreement r;
    CHECK(cllm_attention_compare(two, one, &bad, &r, &a_failed, err, sizeof err) ==
              CLLM_ERR_INVALID_ARG &&
          !a_failed);
    cllm_backend_free(one);
    cllm_backend_free(two);
}

int main(void)
{
    test_row_error();
    test_draw_allowed();
    test_attention();
    test_models();
    return test_summary();
}
