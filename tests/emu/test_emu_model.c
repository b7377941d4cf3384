/*
 * The engine and the model on the CUDA backend, run on the CPU under the CUDA emulator
 * (tests/emu) with a micro Qwen2 model (make_micro_model.py, vocabulary 512): the GPU's whole
 * path -- weights rounded to BF16 at load, decode steps recorded and replayed, tokens drawn on
 * the device, run-ahead taking each step's tokens from the previous step's draw -- in every CI
 * run. Kernels run one at a time here, so this finds logic errors, not races.
 *
 *   - logits of a prompt against the CPU backend (F32) within BF16's error;
 *   - greedy answers with run-ahead equal those without, alone and batched (batch
 *     invariance), also next to a request with penalties and under preemption;
 *   - seeded sampling: the same answer alone twice and batched (counter-based draws), also
 *     with a penalty;
 *   - penalties on the device (the token of the step in flight counted too) give the host
 *     sampler's greedy answers, with run-ahead and without; the host's draws of a step on
 *     the engine's threads (CLLM_HOST_PENALTIES=1) give the same, alone and batched;
 *   - a device short of memory: steps whose draws find no room go on in smaller steps, and
 *     the answers are those given alone; steps whose graphs find none run op by op;
 *   - the engine's device check: a device whose BLAS is wrong is not served from.
 *
 * The MUSA build's configuration runs it with the vendor BLAS doing every GEMM, and again with
 * no BLAS (EMU_NO_BLAS=1): our GEMM on CUDA cores, batch-invariant like the tensor-core one.
 *
 * CLLM_TEST_MICRO names the micro model's folder (scripts/test makes it).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "core/status.h"
#include "engine/engine.h"
#include "model/model.h"
#include "emu_hooks.h"
#include "test.h"

#define N_P 4
#define GEN 16
#define EOS 502 /* <|im_end|> */

static struct cllm_model_files *mf;
static int32_t prompts[N_P][48], lens[N_P];

static void make_prompts(void)
{
    uint64_t x = 12345;
    for (int p = 0; p < N_P; p++) {
        lens[p] = 5 + 11 * p; /* 5, 16, 27, 38: one to three KV blocks */
        for (int i = 0; i < lens[p]; i++)
            prompts[p][i] = (int32_t)(test_splitmix(&x) % 500);
    }
}

/* --- the model: logits against the CPU backend --- */

static float *prompt_logits(enum cllm_backend_kind kind, const int32_t *ids, int32_t n)
{
    struct cllm_backend_options o = {kind, 1, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    struct cllm_backend *be = NULL;
    struct cllm_model *m = NULL;
    struct cllm_kv_cache kv = {0};
    char err[512] = "";
    float *out = NULL;
    if (cllm_backend_new(&be, &o, err, sizeof err) ||
        cllm_model_init(&m, mf, be, 64, 1, err, sizeof err) ||
        cllm_kv_cache_init(&kv, m, 8, 16, err, sizeof err)) {
        CHECKF(0, "%s backend: %s", kind == CLLM_BACKEND_CUDA ? "cuda" : "cpu", err);
        goto done;
    }
    int32_t pos[64], seq[64], table[8] = {3, 0, 5, 1, 7, 2, 6, 4}, last = n - 1;
    for (int32_t t = 0; t < n; t++)
        pos[t] = t, seq[t] = 0;
    int32_t slot[64];
    for (int32_t t = 0; t < n; t++)
        slot[t] = table[t / 16] * 16 + t % 16;
    struct cllm_step st = {n, ids, pos, seq, slot, table, 1, 8, 1, &last};
    const float *logits;
    enum cllm_status rc = cllm_model_forward(m, &kv, &st, &logits);
    CHECKF(rc == CLLM_OK, "forward: %s", cllm_status_str(rc));
    if (rc == CLLM_OK) {
        out = malloc(512 * sizeof *out);
        memcpy(out, logits, 512 * sizeof *out);
    }
done:
    if (m)
        cllm_kv_cache_free(&kv, m);
    cllm_model_free(m);
    cllm_backend_free(be);
    return out;
}

/* BF16 weights and activations against F32: the error is a few BF16 steps of the logits'
 * size (a wrong op, head or position gives tens of percent of the range). */
static void test_logits(void)
{
    for (int p = 0; p < N_P; p += 3) {
        float *cpu = prompt_logits(CLLM_BACKEND_CPU, prompts[p], lens[p]);
        float *gpu = prompt_logits(CLLM_BACKEND_CUDA, prompts[p], lens[p]);
        if (cpu && gpu) {
            float lo = cpu[0], hi = cpu[0], err = 0;
            for (int i = 0; i < 512; i++) {
                lo = fminf(lo, cpu[i]), hi = fmaxf(hi, cpu[i]);
                err = fmaxf(err, fabsf(gpu[i] - cpu[i]));
            }
            printf("prompt %d (%d tokens): max |cuda - cpu| = %.3g of a range of %.3g\n", p,
                   (int)lens[p], err, hi - lo);
            CHECKF(err <= 0.03f * (hi - lo), "prompt %d: logits off by %.3g of a range of %.3g", p,
                   err, hi - lo);
        }
        free(cpu), free(gpu);
    }
}

/* --- the engine --- */

struct answer {
    int32_t n;
    int32_t reason;
    struct cllm_buf text;
};

/* These tests' engine: steps of up to 64 tokens and 8 sequences, a context of 256. */
static void small_config(struct cllm_engine_config *c, enum cllm_backend_kind kind,
                         int64_t kv_bytes)
{
    cllm_engine_config_default(c);
    c->backend = kind;
    c->kv_bytes = kv_bytes;
    c->max_batch_tokens = 64;
    c->max_seqs = 8;
    c->n_ctx = 256;
}

static struct cllm_engine *engine(int32_t run_ahead, int64_t kv_bytes)
{
    struct cllm_engine_config c;
    small_config(&c, CLLM_BACKEND_CUDA, kv_bytes);
    c.run_ahead = run_ahead;
    char err[512] = "";
    struct cllm_engine *e = NULL;
    CHECKF(cllm_engine_new(&e, mf, &c, err, sizeof err) == CLLM_OK, "%s", err);
    return e;
}

/* Prompts which[0..n) together with params p[i]; out[i] their answers. */
static void run(struct cllm_engine *e, const int *which, int n, const struct cllm_request_params *p,
                struct answer *out)
{
    struct cllm_request *reqs[N_P + 1] = {0};
    char err[256];
    for (int i = 0; i < n; i++)
        CHECKF(cllm_engine_submit(e, prompts[which[i]], lens[which[i]], &p[i], &reqs[i], err,
                                  sizeof err) == CLLM_OK,
               "%s", err);
    for (int i = 0; i < n; i++) {
        struct cllm_request_output o;
        memset(&o, 0, sizeof o);
        if (reqs[i]) {
            while (!cllm_request_poll(reqs[i], -1, &o))
                ;
            cllm_request_release(reqs[i]);
        }
        out[i] = (struct answer){o.n_generated, (int32_t)o.reason, o.text};
    }
}

static void params(struct cllm_request_params *p, float temperature, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    cllm_sampling_params_default(&p->sampling);
    p->sampling.temperature = temperature;
    p->sampling.top_k = temperature > 0 ? 40 : 0;
    p->sampling.seed = seed;
    p->max_tokens = GEN;
    p->stop_ids[p->n_stop_ids++] = EOS;
}

static bool same(const struct answer *a, const struct answer *b)
{
    return a->n == b->n && a->reason == b->reason && a->text.len == b->text.len &&
           (a->text.len == 0 || memcmp(a->text.data, b->text.data, a->text.len) == 0);
}

static void free_answers(struct answer *a, int n)
{
    for (int i = 0; i < n; i++)
        cllm_buf_free(&a[i].text);
}

static void test_engine(void)
{
    int all[N_P] = {0, 1, 2, 3};
    struct cllm_request_params greedy[N_P + 1], sampled[N_P];
    for (int i = 0; i <= N_P; i++)
        params(&greedy[i], 0.0f, 0);
    for (int i = 0; i < N_P; i++)
        params(&sampled[i], 0.8f, 100 + (uint64_t)i);
    struct answer serial[N_P], alone[N_P], batched[N_P + 1], again[N_P];

    struct cllm_engine *e = engine(-1, 1 << 20);
    if (!e)
        return;
    for (int i = 0; i < N_P; i++)
        run(e, &all[i], 1, greedy, &serial[i]);
    cllm_engine_free(e);

    e = engine(0, 1 << 20); /* run-ahead: the CUDA backend's default */
    if (!e)
        return;
    for (int i = 0; i < N_P; i++)
        run(e, &all[i], 1, greedy, &alone[i]);
    run(e, all, N_P, greedy, batched);
    for (int i = 0; i < N_P; i++) {
        printf("prompt %d: %d tokens (reason %d)\n", i, (int)alone[i].n, (int)alone[i].reason);
        CHECKF(alone[i].n > 0 && same(&alone[i], &serial[i]),
               "prompt %d: run-ahead gives %d tokens, one step at a time %d, or other text", i,
               (int)alone[i].n, (int)serial[i].n);
        CHECKF(same(&batched[i], &alone[i]), "prompt %d: batched answer differs from alone", i);
    }
    free_answers(batched, N_P);

    /* next to a request with a repetition penalty */
    int with_penalty[N_P + 1] = {0, 1, 2, 3, 1};
    greedy[N_P].sampling.repetition_penalty = 1.3f;
    run(e, with_penalty, N_P + 1, greedy, batched);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &alone[i]), "prompt %d: answer differs next to a penalty", i);
    CHECK(batched[N_P].n > 0);
    free_answers(batched, N_P + 1);

    /* seeded sampling: alone twice and batched alike */
    for (int i = 0; i < N_P; i++) {
        run(e, &all[i], 1, &sampled[i], &again[i]);
        run(e, &all[i], 1, &sampled[i], &batched[i]);
        CHECKF(same(&again[i], &batched[i]), "prompt %d: the same seed gave another answer", i);
        cllm_buf_free(&batched[i].text);
    }
    run(e, all, N_P, sampled, batched);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &again[i]), "prompt %d: sampled answer batched differs", i);
    free_answers(batched, N_P);
    free_answers(again, N_P);

    /* seeded sampling with a penalty, alone and batched alike */
    struct cllm_request_params penalized[N_P];
    for (int i = 0; i < N_P; i++) {
        penalized[i] = sampled[i];
        penalized[i].sampling.repetition_penalty = 1.3f;
        run(e, &all[i], 1, &penalized[i], &again[i]);
    }
    run(e, all, N_P, penalized, batched);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &again[i]), "prompt %d: penalized answer batched differs", i);
    free_answers(batched, N_P);
    free_answers(again, N_P);
    struct cllm_engine_stats st;
    cllm_engine_stats(e, &st);
    printf("run-ahead engine: %llu steps\n", (unsigned long long)st.steps);
    cllm_engine_free(e);

    /* preemption: 6 blocks of 16 tokens for four sequences of up to 54 */
    int64_t per_token = 2 * 2 * 64 * 2; /* layers x (K, V) x head_dim x BF16 */
    e = engine(0, per_token * 16 * 6);
    if (!e)
        return;
    run(e, all, N_P, greedy, batched);
    cllm_engine_stats(e, &st);
    printf("squeezed: %llu steps, %llu preemptions\n", (unsigned long long)st.steps,
           (unsigned long long)st.preemptions);
    CHECK(st.preemptions > 0);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &alone[i]), "prompt %d: answer under preemption differs", i);
    free_answers(batched, N_P);
    cllm_engine_free(e);
    free_answers(alone, N_P);
    free_answers(serial, N_P);
}

/* Greedy answers with penalties: repetition, presence and frequency, each alone and all
 * three; drawn on the device with run-ahead, one step at a time, and on the host. */
static void test_penalties(void)
{
    int all[N_P] = {0, 1, 2, 3};
    struct cllm_request_params pen[N_P], plain[N_P];
    for (int i = 0; i < N_P; i++) {
        params(&pen[i], 0.0f, 0);
        params(&plain[i], 0.0f, 0);
        struct cllm_sampling_params *sp = &pen[i].sampling;
        sp->repetition_penalty = i == 1 ? 1.0f : 1.3f;
        sp->presence_penalty = i == 2 ? 0.0f : 0.4f;
        sp->frequency_penalty = i == 0 ? 0.0f : 0.3f;
    }
    struct answer ahead[N_P], serial[N_P], host[N_P], host_alone[N_P], unpenalized[N_P];
    struct cllm_engine *e = engine(0, 1 << 20);
    if (!e)
        return;
    run(e, all, N_P, pen, ahead);
    run(e, all, N_P, plain, unpenalized);
    cllm_engine_free(e);
    if (!(e = engine(-1, 1 << 20)))
        return;
    run(e, all, N_P, pen, serial);
    cllm_engine_free(e);
    setenv("CLLM_HOST_PENALTIES", "1", 1);
    e = engine(0, 1 << 20);
    unsetenv("CLLM_HOST_PENALTIES");
    if (!e)
        return;
    run(e, all, N_P, pen, host);
    for (int i = 0; i < N_P; i++)
        run(e, &all[i], 1, &pen[i], &host_alone[i]);
    cllm_engine_free(e);
    int changed = 0;
    for (int i = 0; i < N_P; i++) {
        changed += !same(&ahead[i], &unpenalized[i]);
        CHECKF(ahead[i].n > 0 && same(&ahead[i], &host[i]),
               "prompt %d: penalized on the device (run-ahead) differs from the host", i);
        CHECKF(same(&serial[i], &host[i]),
               "prompt %d: penalized on the device (step by step) differs from the host", i);
        CHECKF(same(&host_alone[i], &host[i]), "prompt %d: host draws batched differ", i);
    }
    CHECKF(changed > 0, "the penalties changed no answer (were they used?)");
    free_answers(ahead, N_P);
    free_answers(serial, N_P);
    free_answers(host, N_P);
    free_answers(host_alone, N_P);
    free_answers(unpenalized, N_P);
}

/* A device short of memory for a step: here the emulator refuses the draw's buffers for two
 * rows or more (they grow with a step's sampled rows, as on a GPU), so every step of more
 * than one sequence fails as out of memory. The engine goes on in smaller steps (engine_device.c:
 * smaller_steps) down to one sequence, and every answer, greedy and seeded, is the one given
 * alone; then, with room again, the next batch too. Then short of memory for the recorded
 * steps' graphs only: the same answers, in steps as large as configured. */
static void test_short_of_memory(void)
{
    int all[N_P] = {0, 1, 2, 3};
    struct cllm_request_params p[N_P];
    struct answer alone[N_P], batched[N_P];
    for (int i = 0; i < N_P; i++)
        params(&p[i], i % 2 ? 0.8f : 0.0f, 200 + (uint64_t)i);
    struct cllm_engine *e = engine(0, 1 << 20);
    if (!e)
        return;
    for (int i = 0; i < N_P; i++)
        run(e, &all[i], 1, &p[i], &alone[i]);
    cllm_engine_free(e);
    if (!(e = engine(0, 1 << 20)))
        return;
    const long refused = emu_refused_allocations();
    emu_refuse_device_bytes(2 * sizeof(struct cllm_sample_row));
    run(e, all, N_P, p, batched);
    emu_refuse_device_bytes(0);
    const long n_refused = emu_refused_allocations() - refused;
    printf("short of memory: %ld allocations refused\n", n_refused);
    CHECKF(n_refused > 0, "no draw asked for more room");
    for (int i = 0; i < N_P; i++) {
        CHECKF(batched[i].n > 0 && same(&batched[i], &alone[i]),
               "prompt %d: short of memory, %d tokens (reason %d), alone %d", i, (int)batched[i].n,
               (int)batched[i].reason, (int)alone[i].n);
        cllm_buf_free(&batched[i].text);
    }
    run(e, all, N_P, p, batched);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &alone[i]), "prompt %d: with room again, another answer", i);
    free_answers(batched, N_P);
    cllm_engine_free(e);

    /* No room for the recorded steps' graphs (4 KiB: the emulator counts 1 KiB a node), room
     * for everything else a step needs: the model runs its steps op by op, and the engine
     * never sees a shortage (a CUDA error left behind by the failed instantiation made the
     * first unrecorded step fail, and the engine halve its steps). After 4 steps op by op
     * (CLLM_UNRECORDED_STEPS; 8 after the next failure, ...) the model tries to record again. */
    setenv("CLLM_MUSA_GRAPHS", "1", 1); /* the MUSA build records steps only when asked */
    setenv("CLLM_UNRECORDED_STEPS", "4", 1);
    e = engine(0, 1 << 20);
    unsetenv("CLLM_MUSA_GRAPHS");
    unsetenv("CLLM_UNRECORDED_STEPS");
    if (!e)
        return;
    const long graphs_before = emu_refused_graphs();
    emu_refuse_device_bytes(4096);
    run(e, all, N_P, p, batched);
    emu_refuse_device_bytes(0);
    struct cllm_engine_stats st;
    cllm_engine_stats(e, &st);
    const long n_graphs = emu_refused_graphs() - graphs_before;
    printf(
        "no room for graphs: %ld recordings refused in %llu steps, %lld steps still unrecorded\n",
        n_graphs, (unsigned long long)st.steps, (long long)st.unrecorded_steps);
    CHECKF(n_graphs >= 2, "%ld recordings refused: not tried again after 4 steps", n_graphs);
    /* the last refusal's wait (4 steps doubled per refused retry, up to 16x) has not run out:
     * the engine reports it (/health "degraded") */
    char why[256] = "";
    CHECKF(st.unrecorded_steps > 0 && st.unrecorded_steps <= 64 &&
               cllm_engine_degraded(e, why, sizeof why) && strstr(why, "record") &&
               !strstr(why, "limits"),
           "%lld steps unrecorded, degraded: \"%s\"", (long long)st.unrecorded_steps, why);
    CHECKF(st.step_tokens == 64 && st.step_seqs == 8,
           "graphs refused: steps of %d tokens and %d sequences (of 64 and 8)", (int)st.step_tokens,
           (int)st.step_seqs);
    for (int i = 0; i < N_P; i++)
        CHECKF(same(&batched[i], &alone[i]), "prompt %d: graphs refused, another answer", i);
    free_answers(batched, N_P);
    free_answers(alone, N_P);
    cllm_engine_free(e);
}

/* --- the device check (engine/device_check.h) --- */

static struct cllm_engine *checked_engine(enum cllm_backend_kind kind, bool no_check,
                                          enum cllm_status want, char *err, size_t err_len)
{
    struct cllm_engine_config c;
    small_config(&c, kind, 1 << 20);
    c.no_device_check = no_check;
    struct cllm_engine *e = NULL;
    err[0] = 0;
    enum cllm_status st = cllm_engine_new(&e, mf, &c, err, err_len);
    CHECKF(st == want, "engine (kind %d, check %s): %s, want %s: %s", (int)kind,
           no_check ? "off" : "on", cllm_status_str(st), cllm_status_str(want), err);
    return e;
}

/* A device that starts and then computes wrong logits -- here a BLAS that passes the backend's
 * start-up probe (16 deep) and drops the rest of every longer sum -- is served from under
 * --device auto only as its second try made it right, with every GEMM on CUDA cores; asked
 * for by name it is an error, and it runs as it is only when the check is off. A device wrong
 * whichever way its GEMMs run (CLLM_FAULT_WRONG_MATMUL: matmuls that do nothing, fault.h) is
 * not served from under --device auto. */
static void test_device_check(void)
{
    char err[1024];
    struct cllm_engine *e = checked_engine(CLLM_BACKEND_AUTO, false, CLLM_OK, err, sizeof err);
    char why[256] = "";
    if (e)
        CHECKF(!strcmp(cllm_engine_backend_name(e), "cuda") &&
                   !cllm_engine_fallback(e, why, sizeof why) && !cllm_engine_gemm_on_cores(e),
               "a right device: served from %s (fallback '%s', GEMM on CUDA cores %d)",
               cllm_engine_backend_name(e), why, (int)cllm_engine_gemm_on_cores(e));
    cllm_engine_free(e);

    /* (a run with no BLAS, EMU_NO_BLAS=1, gets one here: the wrong one) */
    const char *no_blas = getenv("EMU_NO_BLAS");
    const bool had_no_blas = no_blas && !strcmp(no_blas, "1");
    unsetenv("EMU_NO_BLAS");
    setenv("CLLM_CUBLAS", "1", 1);
    setenv("EMU_BLAS_SHORT_K", "1", 1);
    e = checked_engine(CLLM_BACKEND_AUTO, false, CLLM_OK, err, sizeof err);
    if (e)
        CHECKF(!strcmp(cllm_engine_backend_name(e), "cuda") &&
                   !cllm_engine_fallback(e, why, sizeof why) && cllm_engine_gemm_on_cores(e),
               "a device wrong with its BLAS: served from %s, GEMM on CUDA cores %d ('%s')",
               cllm_engine_backend_name(e), (int)cllm_engine_gemm_on_cores(e), why);
    if (e) /* said as a degradation (/health) */
        CHECKF(cllm_engine_degraded(e, why, sizeof why) && strstr(why, "CUDA cores"),
               "GEMMs on CUDA cores not said: '%s'", why);
    cllm_engine_free(e);
    e = checked_engine(CLLM_BACKEND_CUDA, false, CLLM_ERR_DEVICE, err, sizeof err);
    CHECKF(strstr(err, "device check") && strstr(err, "--no-device-check"),
           "the refusal says why and what to do: %s", err);
    printf("a wrong device asked for by name: %s\n", err);
    cllm_engine_free(e);
    e = checked_engine(CLLM_BACKEND_CUDA, true, CLLM_OK, err, sizeof err);
    if (e)
        CHECKF(!strcmp(cllm_engine_backend_name(e), "cuda") && !cllm_engine_gemm_on_cores(e),
               "no check: served from %s", cllm_engine_backend_name(e));
    cllm_engine_free(e);
    unsetenv("EMU_BLAS_SHORT_K");

    char trigger[] = "/tmp/cllm-wrong-device-XXXXXX";
    const int fd = mkstemp(trigger); /* exists: the fault is on */
    CHECK(fd >= 0);
    close(fd);
    setenv("CLLM_FAULT_FILE", trigger, 1);
    setenv("CLLM_FAULT_WRONG_MATMUL", "1", 1);
    e = checked_engine(CLLM_BACKEND_AUTO, false, CLLM_OK, err, sizeof err);
    if (e)
        CHECKF(!strcmp(cllm_engine_backend_name(e), "cpu") &&
                   cllm_engine_fallback(e, why, sizeof why) && strstr(why, "device check") &&
                   !cllm_engine_gemm_on_cores(e),
               "a device wrong either way: served from %s, saying why: '%s'",
               cllm_engine_backend_name(e), why);
    cllm_engine_free(e);
    unsetenv("CLLM_FAULT_WRONG_MATMUL");
    unsetenv("CLLM_FAULT_FILE");
    unlink(trigger);
    unsetenv("CLLM_CUBLAS");
    if (had_no_blas)
        setenv("EMU_NO_BLAS", "1", 1);
}

int main(void)
{
    char err[1024];
    if (cllm_model_files_open(&mf, test_env("CLLM_TEST_MICRO"), err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    make_prompts();
    test_logits();
    test_engine();
    test_penalties();
    test_short_of_memory();
    test_device_check();
    cllm_model_files_free(mf);
    return test_summary();
}
