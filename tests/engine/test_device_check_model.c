/*
 * The device check's arithmetic (engine/device_check.h) and its bound on the real small model:
 *   - a row's error as a share of the reference's range, and +inf where it must fail (a NaN or
 *     infinity from the device, a flat reference row the device does not match);
 *   - the same model on two CPU backends (1 and 2 threads) agrees exactly, with one sequence
 *     whose prefill takes three steps and with two sequences sharing every step, and its
 *     draws (greedy, top-k) are what the rows allow;
 *   - the quantized GGUF on the CPU (8-bit activations, the reference a GPU is checked against
 *     when it serves a GGUF) against the F32 HF folder made from it (exact arithmetic): within a
 *     third of the bound. A right GPU's own BF16 error is of the same size (README, Measured),
 *     so the bound leaves room for both while a wrong op shows as tens of percent (the
 *     emulator's test_emu_model: a BLAS that drops part of each sum is 55% off).
 *   - the attention op at long contexts (cllm_attention_compare): two CPU backends agree
 *     exactly; an op that loses the keys past 256 (every call, or from its second call on)
 *     is off by more than twice the bound; an op that fails is the checked side's failure.
 * (The device side of the check runs under the CUDA emulator in test_emu_model.)
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "core/status.h"
#include "engine/device_check.h"
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
    struct cllm_backend_options o = {CLLM_BACKEND_CPU, threads, 0, CLLM_CPU_WEIGHTS_STORED};
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
     * decode steps. The CPU draws on the host as a device sampler would: greedy, then top-k. */
    compare(&gguf1, &gguf2, 1, &r, "GGUF, 1 thread vs 2, one sequence");
    CHECKF(r.rows == 5 && r.worst == 0.0f && r.top1_same == 5, "rows %d, worst %g", (int)r.rows,
           r.worst);
    CHECKF(r.draws == 2 && r.bad_draws == 0, "%d of %d draws wrong", (int)r.bad_draws,
           (int)r.draws);
    /* Two sequences in every step: 2 prefill rows, 2 per decode step, one greedy and one top-k
     * draw in the last step. */
    compare(&gguf1, &gguf3, 2, &r, "GGUF, 1 thread vs 2, two sequences");
    CHECKF(r.rows == 6 && r.worst == 0.0f && r.top1_same == 6, "rows %d, worst %g", (int)r.rows,
           r.worst);
    CHECKF(r.draws == 2 && r.bad_draws == 0, "%d of %d draws wrong", (int)r.bad_draws,
           (int)r.draws);
    compare(&gguf1, &hf, 2, &r, "GGUF (8-bit activations) vs its F32 HF folder");
    CHECKF(r.rows == 6 && r.worst <= CLLM_DEVICE_CHECK_BOUND / 3,
           "rows %d, worst %.3f%% of a row's range: the bound (%.0f%%) has too little room",
           (int)r.rows, 100.0 * r.worst, 100.0 * CLLM_DEVICE_CHECK_BOUND);
    unload(&gguf1), unload(&gguf2), unload(&gguf3), unload(&hf);
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
    struct cllm_backend_options o1 = {CLLM_BACKEND_CPU, 1, 0, CLLM_CPU_WEIGHTS_STORED};
    struct cllm_backend_options o2 = {CLLM_BACKEND_CPU, 2, 0, CLLM_CPU_WEIGHTS_STORED};
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
    test_attention();
    test_models();
    return test_summary();
}
