/*
 * The engine on the real small model:
 *   - batch invariance: each workload question's greedy answer is byte-identical whether it
 *     runs alone or together with 11 others, and again under memory pressure that forces
 *     preemption and recomputation;
 *   - the same with the text of each step delivered during the next one (overlap forced on, as
 *     on a GPU), including a stop string that ends a request while a step computes it;
 *   - the same with run-ahead forced on (step N+1 launched before step N's tokens are seen,
 *     as on a GPU; the CPU draws the tokens as a device would): same answers and token counts,
 *     also when an EOS token or a stop string ends a request that the next step already
 *     computes, and under preemption;
 *   - a device that fails mid-batch under --device auto (lost, with and without run-ahead, or
 *     once): the engine moves to the CPU and every answer is still the same as alone;
 *   - a device short of memory for large steps: the engine goes on in smaller ones, every
 *     answer still the same as alone;
 *   - a device that stops answering: the engine reports itself stalled past its stall timeout
 *     (and only then), refuses new requests, and goes on once the device answers;
 *   - seeded sampling with Qwen's default settings gives the same answers alone and batched
 *     (the host draws of a step run on the CPU backend's threads together);
 *   - cancellation frees the request's KV blocks within a step;
 *   - max_time ends a running request with the text of the tokens it has, and a waiting one
 *     with none;
 *   - prompts beyond the context window and a full queue are refused with clear errors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/mmap.h"
#include "core/status.h"
#include "engine/engine.h"
#include "test.h"

#define N_Q 12
#define GEN 24

static struct cllm_model_files *mf;
static struct cllm_ids prompts[N_Q];

static void load_prompts(void)
{
    char path[4096], err[256], *text;
    size_t len;
    snprintf(path, sizeof path, "%s/pmpp_questions.json", test_env("CLLM_WORKLOAD"));
    if (cllm_read_file(path, 1 << 24, &text, &len, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    for (int i = 0; i < N_Q; i++) {
        const char *q = cJSON_GetArrayItem(root, i * 7)->valuestring;
        struct cllm_buf b = {0};
        cllm_buf_appendf(&b, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                             "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n", q);
        cllm_tokenize(mf->tok, b.data, b.len, &prompts[i]);
        cllm_buf_free(&b);
    }
    cJSON_Delete(root);
    free(text);
}

static void params(struct cllm_request_params *p, int32_t max_tokens)
{
    memset(p, 0, sizeof *p);
    cllm_sampling_params_default(&p->sampling);
    p->max_tokens = max_tokens;
    p->stop_ids[p->n_stop_ids++] = 151645;
}

/* Runs questions [0, n) with at most `together` in flight; answers[i] gets the text and
 * (when n_gen is not NULL) n_gen[i] the tokens generated. Greedy, unless `sampling` is given:
 * then question i draws with it and seed sampling->seed + i. */
static void run_sampled(struct cllm_engine *e, int n, int together, struct cllm_buf *answers,
                        int32_t *n_gen, const struct cllm_sampling_params *sampling)
{
    struct cllm_request *reqs[N_Q] = {0};
    struct cllm_request_output outs[N_Q];
    memset(outs, 0, sizeof outs);
    struct cllm_request_params p;
    params(&p, GEN);
    char err[256];
    for (int start = 0; start < n; start += together) {
        int end = start + together < n ? start + together : n;
        for (int i = start; i < end; i++) {
            if (sampling) {
                p.sampling = *sampling;
                p.sampling.seed = sampling->seed + (uint64_t)i;
            }
            CHECKF(cllm_engine_submit(e, prompts[i].v, (int32_t)prompts[i].n, &p, &reqs[i], err,
                                      sizeof err) == CLLM_OK, "%s", err);
        }
        for (int i = start; i < end; i++) {
            if (!reqs[i])
                continue;
            while (!cllm_request_poll(reqs[i], -1, &outs[i]))
                ;
            CHECK(outs[i].reason == CLLM_FINISH_STOP || outs[i].reason == CLLM_FINISH_LENGTH);
            answers[i] = outs[i].text;
            if (n_gen)
                n_gen[i] = outs[i].n_generated;
            cllm_request_release(reqs[i]);
        }
    }
}

static void run_counted(struct cllm_engine *e, int n, int together, struct cllm_buf *answers,
                        int32_t *n_gen)
{
    run_sampled(e, n, together, answers, n_gen, NULL);
}

static void run(struct cllm_engine *e, int n, int together, struct cllm_buf *answers)
{
    run_counted(e, n, together, answers, NULL);
}

/* The tests' engine settings; overlap and run_ahead as in cllm_engine_config: 1 forces them
 * on, -1 off. */
static void config_modes(struct cllm_engine_config *c, int64_t kv_bytes, int32_t batch_tokens,
                         int32_t n_ctx, int32_t max_queue, int32_t overlap, int32_t run_ahead)
{
    cllm_engine_config_default(c);
    c->n_threads = 2;
    c->kv_bytes = kv_bytes;
    c->max_batch_tokens = batch_tokens;
    c->max_seqs = 16;
    c->n_ctx = n_ctx;
    c->max_queue = max_queue;
    c->overlap = overlap;
    c->run_ahead = run_ahead;
}

static struct cllm_engine *engine_modes(int64_t kv_bytes, int32_t batch_tokens, int32_t n_ctx,
                                        int32_t max_queue, int32_t overlap, int32_t run_ahead)
{
    struct cllm_engine_config c;
    config_modes(&c, kv_bytes, batch_tokens, n_ctx, max_queue, overlap, run_ahead);
    char err[512];
    struct cllm_engine *e = NULL;
    CHECKF(cllm_engine_new(&e, mf, &c, err, sizeof err) == CLLM_OK, "%s", err);
    return e;
}

static struct cllm_engine *engine_overlap(int64_t kv_bytes, int32_t batch_tokens,
                                          int32_t n_ctx, int32_t max_queue, int32_t overlap)
{
    return engine_modes(kv_bytes, batch_tokens, n_ctx, max_queue, overlap, -1);
}

/* The CPU's default: each step's text delivered right after it. */
static struct cllm_engine *engine(int64_t kv_bytes, int32_t batch_tokens, int32_t n_ctx,
                                  int32_t max_queue)
{
    return engine_overlap(kv_bytes, batch_tokens, n_ctx, max_queue, -1);
}

/* Stats are published after each engine step, a moment after the last request finishes:
 * wait (up to 2 s) for the engine to report itself idle. */
static void wait_idle(struct cllm_engine *e, struct cllm_engine_stats *st)
{
    for (int i = 0; i < 200; i++) {
        cllm_engine_stats(e, st);
        if (st->kv_blocks_used == 0 && st->running == 0)
            return;
        usleep(10000);
    }
}

/* A stop string from the middle of question 0's answer ends it there, in a batch of four,
 * with and without overlap: with overlap the stop is found while the next step computes the
 * request, whose extra token must not show, and its blocks must still come back. */
static void test_stop_string(const struct cllm_buf *alone)
{
    const struct cllm_buf *a = &alone[0];
    CHECKF(a->len >= 16, "answer 0 too short for a stop string: %zu bytes", a->len);
    if (a->len < 16)
        return;
    size_t at = a->len / 2;
    while (at > 0 && ((unsigned char)a->data[at] & 0xc0) == 0x80)
        at--; /* start on a character */
    char stop[5] = {0};
    memcpy(stop, a->data + at, 4);
    size_t first = (size_t)(strstr(a->data, stop) - a->data);
    /* no overlap; overlap; overlap and run-ahead */
    for (int mode = 0; mode < 3; mode++) {
        int overlap = mode == 0 ? -1 : 1;
        struct cllm_engine *e = engine_modes(0, 256, 512, 0, overlap, mode == 2 ? 1 : -1);
        if (!e)
            return;
        struct cllm_request_params p;
        params(&p, GEN);
        const char *stops[] = {stop};
        struct cllm_request *reqs[4];
        struct cllm_request_output outs[4];
        memset(outs, 0, sizeof outs);
        char err[256];
        for (int i = 0; i < 4; i++) {
            p.stop = i == 0 ? stops : NULL;
            p.n_stop = i == 0 ? 1 : 0;
            CHECKF(cllm_engine_submit(e, prompts[i].v, (int32_t)prompts[i].n, &p, &reqs[i], err,
                                      sizeof err) == CLLM_OK, "%s", err);
        }
        for (int i = 0; i < 4; i++) {
            while (!cllm_request_poll(reqs[i], -1, &outs[i]))
                ;
            cllm_request_release(reqs[i]);
        }
        CHECKF(outs[0].reason == CLLM_FINISH_STOP && outs[0].text.len == first &&
                   memcmp(outs[0].text.data, a->data, first) == 0,
               "mode %d: stop string \"%s\" should cut the answer at byte %zu, got %zu bytes",
               mode, stop, first, outs[0].text.len);
        for (int i = 1; i < 4; i++)
            CHECKF(outs[i].text.len == alone[i].len &&
                       memcmp(outs[i].text.data, alone[i].data, alone[i].len) == 0,
                   "mode %d: question %d changed next to a stopped request", mode, i);
        struct cllm_engine_stats st;
        wait_idle(e, &st);
        CHECK(st.kv_blocks_used == 0 && st.running == 0 && st.requests_finished == 4);
        for (int i = 0; i < 4; i++)
            cllm_buf_free(&outs[i].text);
        cllm_engine_free(e);
    }
}

/* An EOS token from the middle of question 0's answer: the step after the one that draws it
 * already computes the request with run-ahead; that token must not show or count, and the
 * answers, token counts and finish reasons of all four requests equal those without
 * run-ahead. */
static void test_eos_run_ahead(const struct cllm_buf *alone)
{
    struct cllm_ids ids = {0};
    cllm_tokenize(mf->tok, alone[0].data, alone[0].len, &ids);
    CHECKF(ids.n >= 4, "answer 0 too short for an EOS test: %zu tokens", ids.n);
    if (ids.n < 4) {
        cllm_ids_free(&ids);
        return;
    }
    int32_t eos = ids.v[ids.n / 2];
    cllm_ids_free(&ids);
    struct cllm_request_output outs[2][4];
    memset(outs, 0, sizeof outs);
    for (int ra = 0; ra < 2; ra++) {
        struct cllm_engine *e = engine_modes(0, 256, 512, 0, 1, ra ? 1 : -1);
        if (!e)
            return;
        struct cllm_request_params p;
        params(&p, GEN);
        p.stop_ids[p.n_stop_ids++] = eos;
        struct cllm_request *reqs[4];
        char err[256];
        for (int i = 0; i < 4; i++)
            CHECKF(cllm_engine_submit(e, prompts[i].v, (int32_t)prompts[i].n, &p, &reqs[i], err,
                                      sizeof err) == CLLM_OK,
                   "%s", err);
        for (int i = 0; i < 4; i++) {
            while (!cllm_request_poll(reqs[i], -1, &outs[ra][i]))
                ;
            cllm_request_release(reqs[i]);
        }
        struct cllm_engine_stats st;
        wait_idle(e, &st);
        CHECKF(st.kv_blocks_used == 0 && st.running == 0 && st.requests_finished == 4,
               "run-ahead %d: %d blocks and %d requests left, %llu finished", ra,
               (int)st.kv_blocks_used, (int)st.running, (unsigned long long)st.requests_finished);
        cllm_engine_free(e);
    }
    CHECKF(outs[0][0].reason == CLLM_FINISH_STOP && outs[0][0].n_generated < GEN &&
               outs[0][0].text.len < alone[0].len,
           "token %d should end answer 0 early (%d tokens, %zu of %zu bytes)", (int)eos,
           (int)outs[0][0].n_generated, outs[0][0].text.len, alone[0].len);
    for (int i = 0; i < 4; i++) {
        const struct cllm_request_output *a = &outs[0][i], *b = &outs[1][i];
        CHECKF(a->reason == b->reason && a->n_generated == b->n_generated &&
                   a->text.len == b->text.len &&
                   (a->text.len == 0 || memcmp(a->text.data, b->text.data, a->text.len) == 0),
               "question %d with EOS %d: run-ahead gives %d tokens (reason %d), without %d (%d)", i,
               (int)eos, (int)b->n_generated, (int)b->reason, (int)a->n_generated, (int)a->reason);
        cllm_buf_free(&outs[0][i].text);
        cllm_buf_free(&outs[1][i].text);
    }
}

/* A fresh directory dir (a mkdtemp template) and the path of a fault file `name` in it, set as
 * CLLM_FAULT_FILE (src/backend/fault.h); false if no directory could be made. */
static bool fault_file(char *dir, const char *name, char *trigger, size_t cap)
{
    if (!mkdtemp(dir)) {
        CHECKF(0, "mkdtemp failed");
        return false;
    }
    snprintf(trigger, cap, "%s/%s", dir, name);
    setenv("CLLM_FAULT_FILE", trigger, 1);
    return true;
}

/* Questions [0, n) submitted to e, greedy. */
static void submit_first(struct cllm_engine *e, int n, struct cllm_request **reqs)
{
    struct cllm_request_params p;
    params(&p, GEN);
    char err[256];
    for (int i = 0; i < n; i++)
        CHECKF(cllm_engine_submit(e, prompts[i].v, (int32_t)prompts[i].n, &p, &reqs[i], err,
                                  sizeof err) == CLLM_OK,
               "%s", err);
}

/* Waits for reqs[0, n) (outs: what their polls left so far) and checks that each answer is
 * the one alone; releases them. `what` names the case. */
static void expect_alone(struct cllm_request **reqs, struct cllm_request_output *outs, int n,
                         const struct cllm_buf *alone, const char *what)
{
    for (int i = 0; i < n; i++) {
        while (!cllm_request_poll(reqs[i], -1, &outs[i]))
            ;
        cllm_request_release(reqs[i]);
        CHECKF(outs[i].reason != CLLM_FINISH_ERROR && outs[i].text.len == alone[i].len &&
                   memcmp(outs[i].text.data, alone[i].data, alone[i].len) == 0,
               "%s, question %d: reason %d (%s), %zu bytes of %zu", what, i, (int)outs[i].reason,
               outs[i].error, outs[i].text.len, alone[i].len);
        cllm_buf_free(&outs[i].text);
    }
}

/* A device that fails in the middle of a batch (CLLM_FAULT_FILE; the CPU backend passing for
 * a GPU by CLLM_FAULT_NAME) under --device auto: the engine moves to the CPU, and every
 * request still gets its whole answer, the same as alone -- lost for good without and with
 * run-ahead (whose placeholder tokens go with the device), and a step failing once
 * (CLLM_FAULT_ONCE) with run-ahead. */
static void test_device_lost(const struct cllm_buf *alone)
{
    char dir[] = "/tmp/cllm-lost-XXXXXX", trigger[64];
    if (!fault_file(dir, "lost", trigger, sizeof trigger))
        return;
    setenv("CLLM_FAULT_NAME", "fake-gpu", 1);
    for (int mode = 0; mode < 3; mode++) {
        const int ra = mode > 0;
        if (mode == 2)
            setenv("CLLM_FAULT_ONCE", "1", 1);
        struct cllm_engine *e = engine_modes(0, 256, 512, 0, ra ? 1 : -1, ra ? 1 : -1);
        if (!e)
            break;
        CHECKF(!strcmp(cllm_engine_backend_name(e), "fake-gpu"), "mode %d: starts on %s", mode,
               cllm_engine_backend_name(e));
        struct cllm_request *reqs[4];
        struct cllm_request_output outs[4];
        memset(outs, 0, sizeof outs);
        submit_first(e, 4, reqs);
        /* lost once the first answer is a few tokens in (the others are mid-prompt or also
         * generating) */
        while (!cllm_request_poll(reqs[0], 10, &outs[0]) && outs[0].n_generated < 3)
            ;
        fclose(fopen(trigger, "w"));
        char what[64];
        snprintf(what, sizeof what, "mode %d, after the device failed", mode);
        expect_alone(reqs, outs, 4, alone, what);
        CHECKF(!strcmp(cllm_engine_backend_name(e), "cpu"), "mode %d: ends on %s", mode,
               cllm_engine_backend_name(e));
        struct cllm_engine_stats st;
        wait_idle(e, &st);
        CHECK(st.kv_blocks_used == 0 && st.running == 0 && st.requests_finished == 4);
        cllm_engine_free(e);
        unlink(trigger);
    }
    unsetenv("CLLM_FAULT_FILE");
    unsetenv("CLLM_FAULT_NAME");
    unsetenv("CLLM_FAULT_ONCE");
    rmdir(dir);
}

/* Polls e up to 10 s for cllm_engine_stalled to say `want`; returns the seconds it took. */
static double wait_stalled(struct cllm_engine *e, bool want, char *why, size_t why_len)
{
    const double t0 = cllm_now();
    while (cllm_engine_stalled(e, why, why_len) != want && cllm_now() - t0 < 10)
        usleep(10000);
    return cllm_now() - t0;
}

/* A device short of memory for large steps (CLLM_FAULT_NOMEM_TOKENS: while the fault file
 * exists, a matmul over more than 16 tokens finds no room, CLLM_ERR_NOMEM): the engine goes on
 * in smaller steps (halving its budget of 256 tokens until they fit) and every answer of a
 * batch of four started under the fault is still the one alone, with and without run-ahead.
 * Without run-ahead the steps do not grow back before long (a wait of 2^30 steps): the batch
 * leaves them at 16 tokens and one sequence (of 256 and 16). With run-ahead they try to every
 * 2 steps (twice as long after each try that found no room, up to 32), and once the fault
 * is gone they are as configured again after a few answers. With no room for even one token (a
 * limit of 0) the requests end with the error, not a hang, and once there is room again the
 * engine answers. */
static void test_device_short_of_memory(const struct cllm_buf *alone)
{
    char dir[] = "/tmp/cllm-nomem-XXXXXX", trigger[64];
    if (!fault_file(dir, "nomem", trigger, sizeof trigger))
        return;
    setenv("CLLM_FAULT_NOMEM_TOKENS", "16", 1);
    for (int mode = 0; mode < 2; mode++) {
        const int ra = mode ? 1 : -1;
        struct cllm_engine_config c;
        config_modes(&c, 0, 256, 512, 0, ra, ra);
        c.grow_back_steps = mode ? 2 : 1 << 30;
        char err[512];
        struct cllm_engine *e = NULL;
        CHECKF(cllm_engine_new(&e, mf, &c, err, sizeof err) == CLLM_OK, "%s", err);
        if (!e)
            break;
        struct cllm_request *reqs[4];
        struct cllm_request_output outs[4];
        memset(outs, 0, sizeof outs);
        fclose(fopen(trigger, "w"));
        submit_first(e, 4, reqs);
        char what[64];
        snprintf(what, sizeof what, "run-ahead %d, short of memory", ra);
        expect_alone(reqs, outs, 4, alone, what);
        struct cllm_engine_stats st;
        wait_idle(e, &st);
        CHECK(st.kv_blocks_used == 0 && st.running == 0 && st.requests_finished == 4);
        char why[256] = "";
        if (mode == 0) {
            CHECKF(st.step_tokens == 16 && st.step_seqs == 1,
                   "after the shortage: steps of %d tokens and %d sequences", (int)st.step_tokens,
                   (int)st.step_seqs);
            /* what /health reports: slower, with the numbers */
            CHECKF(cllm_engine_degraded(e, why, sizeof why) &&
                       strstr(why, "16 tokens, 1 sequences (configured: 256, 16)"),
                   "degraded: \"%s\"", why);
        }
        if (mode == 1) {
            /* room again: the steps grow back as answers go on */
            unlink(trigger);
            int rounds = 0;
            for (; rounds < 12 && (st.step_tokens < 256 || st.step_seqs < 16); rounds++) {
                submit_first(e, 1, reqs);
                expect_alone(reqs, outs, 1, alone, "growing back");
                wait_idle(e, &st);
            }
            printf("short of memory: steps as configured again after %d answers (%llu steps)\n",
                   rounds, (unsigned long long)st.steps);
            CHECKF(st.step_tokens == 256 && st.step_seqs == 16,
                   "room again: steps of %d tokens and %d sequences after %d answers",
                   (int)st.step_tokens, (int)st.step_seqs, rounds);
            CHECKF(!cllm_engine_degraded(e, why, sizeof why), "room again, still degraded: %s",
                   why);
            /* no room at all: the error, then answers again once there is room */
            fclose(fopen(trigger, "w"));
            setenv("CLLM_FAULT_NOMEM_TOKENS", "0", 1);
            memset(outs, 0, sizeof outs);
            submit_first(e, 1, reqs);
            while (!cllm_request_poll(reqs[0], -1, &outs[0]))
                ;
            CHECKF(outs[0].reason == CLLM_FINISH_ERROR && strstr(outs[0].error, "out of memory"),
                   "no room for a token: reason %d (%s)", (int)outs[0].reason, outs[0].error);
            cllm_request_release(reqs[0]);
            cllm_buf_free(&outs[0].text);
            unlink(trigger);
            memset(outs, 0, sizeof outs);
            submit_first(e, 1, reqs);
            expect_alone(reqs, outs, 1, alone, "room again");
        }
        cllm_engine_free(e);
        unlink(trigger);
    }
    unsetenv("CLLM_FAULT_FILE");
    unsetenv("CLLM_FAULT_NOMEM_TOKENS");
    rmdir(dir);
}

/* A device that stops answering without an error (CLLM_FAULT_STALL: each sync waits while the
 * fault file exists). On the fake GPU with a stall timeout of 0.5 s (run-ahead, as on a GPU):
 * the engine reports itself stalled once a step has run 0.5 s and refuses new requests, and
 * once the device answers again it is no longer stalled and the request's answer is the same
 * as alone. On the CPU (the default: no stall timeout) a stall of 1.5 s is not reported. */
static void test_device_stall(const struct cllm_buf *alone)
{
    char dir[] = "/tmp/cllm-stall-XXXXXX", trigger[64];
    if (!fault_file(dir, "stall", trigger, sizeof trigger))
        return;
    setenv("CLLM_FAULT_STALL", "1", 1);
    for (int gpu = 1; gpu >= 0; gpu--) {
        if (gpu)
            setenv("CLLM_FAULT_NAME", "fake-gpu", 1);
        else
            unsetenv("CLLM_FAULT_NAME");
        struct cllm_engine_config c;
        config_modes(&c, 0, 256, 512, 0, gpu ? 1 : -1, gpu ? 1 : -1);
        c.stall_timeout = gpu ? 0.5 : 0;
        char err[512], why[256] = "";
        struct cllm_engine *e = NULL;
        enum cllm_status rc = cllm_engine_new(&e, mf, &c, err, sizeof err);
        CHECKF(rc == CLLM_OK, "%s", err);
        if (rc)
            break;
        CHECK(!cllm_engine_stalled(e, why, sizeof why));
        struct cllm_request_params p;
        params(&p, GEN);
        struct cllm_request *r, *late = NULL;
        struct cllm_request_output out = {0};
        CHECKF(cllm_engine_submit(e, prompts[0].v, (int32_t)prompts[0].n, &p, &r, err,
                                  sizeof err) == CLLM_OK,
               "%s", err);
        while (!cllm_request_poll(r, 10, &out) && out.n_generated < 3)
            ;
        fclose(fopen(trigger, "w"));
        double waited = wait_stalled(e, true, why, sizeof why);
        struct cllm_engine_stats st;
        cllm_engine_stats(e, &st);
        if (gpu) {
            printf("stall: reported after %.2f s: %s\n", waited, why);
            CHECKF(waited < 5 && strstr(why, "does not answer") && strstr(why, "fake-gpu"),
                   "the stalled fake GPU: reported after %.2f s: '%s'", waited, why);
            CHECKF(st.stalled && st.turn_seconds > 0.5, "stats: stalled %d after %.2f s",
                   (int)st.stalled, st.turn_seconds);
            rc = cllm_engine_submit(e, prompts[1].v, (int32_t)prompts[1].n, &p, &late, err,
                                    sizeof err);
            CHECKF(rc == CLLM_ERR_DEVICE && strstr(err, "does not answer"),
                   "a submit while stalled: %s (%s)", cllm_status_str(rc), err);
            CHECK(!cllm_engine_lost(e, NULL, 0));
        } else {
            CHECKF(waited >= 1.5 && !st.stalled,
                   "the CPU, no stall timeout: not stalled after %.2f s (%s)", waited, why);
        }
        unlink(trigger);
        if (gpu)
            CHECKF(wait_stalled(e, false, why, sizeof why) < 5, "still stalled once the device "
                                                                "answers");
        while (!cllm_request_poll(r, -1, &out))
            ;
        CHECKF(out.reason != CLLM_FINISH_ERROR && out.text.len == alone[0].len &&
                   memcmp(out.text.data, alone[0].data, alone[0].len) == 0,
               "%s: the answer after the stall differs (%zu bytes of %zu)", gpu ? "gpu" : "cpu",
               out.text.len, alone[0].len);
        cllm_request_release(r);
        if (late)
            cllm_request_release(late);
        cllm_buf_free(&out.text);
        cllm_engine_free(e);
    }
    unsetenv("CLLM_FAULT_FILE");
    unsetenv("CLLM_FAULT_NAME");
    unsetenv("CLLM_FAULT_STALL");
    rmdir(dir);
}

static void test_invariance(void)
{
    struct cllm_buf alone[N_Q] = {0}, batched[N_Q] = {0}, squeezed[N_Q] = {0};
    int32_t n_alone[N_Q] = {0}, n_batched[N_Q] = {0};
    struct cllm_engine *e = engine(0, 256, 512, 0);
    if (!e)
        return;
    run_counted(e, N_Q, 1, alone, n_alone);
    cllm_engine_free(e);
    e = engine_overlap(0, 256, 512, 0, 1);
    if (!e)
        return;
    /* Alone again with overlap (which also leaves the prompts in the prefix cache as before). */
    struct cllm_buf alone_overlap[N_Q] = {0};
    run(e, N_Q, 1, alone_overlap);
    for (int i = 0; i < N_Q; i++) {
        CHECKF(alone_overlap[i].len == alone[i].len &&
                   memcmp(alone_overlap[i].data, alone[i].data, alone[i].len) == 0,
               "question %d: the answer alone differs with overlap", i);
        cllm_buf_free(&alone_overlap[i]);
    }
    cllm_engine_free(e);
    /* Batched and squeezed as on a GPU: overlap and run-ahead. */
    e = engine_modes(0, 256, 512, 0, 1, 1);
    if (!e)
        return;
    run_counted(e, N_Q, N_Q, batched, n_batched);
    struct cllm_engine_stats st;
    wait_idle(e, &st);
    printf("batched run: %llu steps, prefix cache hits %llu of %llu blocks\n",
           (unsigned long long)st.steps, (unsigned long long)st.prefix_hits,
           (unsigned long long)st.prefix_queries);
    CHECK(st.prefix_hits > 0);
    CHECK(st.kv_blocks_used == 0);
    cllm_engine_free(e);
    /* 16 blocks of 16 tokens: about three sequences fit, so the rest wait or are preempted. */
    int64_t per_token = 24 * 2 * 2 * 64 * 4; /* layers x (K,V) x kv heads x head dim x F32 */
    e = engine_modes(per_token * 16 * 16, 64, 256, 0, 1, 1);
    if (!e)
        return;
    run(e, N_Q, N_Q, squeezed);
    wait_idle(e, &st);
    printf("squeezed run: %llu steps, %llu preemptions\n", (unsigned long long)st.steps,
           (unsigned long long)st.preemptions);
    CHECK(st.preemptions > 0);
    CHECK(st.kv_blocks_used == 0);
    cllm_engine_free(e);
    test_stop_string(alone);
    test_eos_run_ahead(alone);
    test_device_lost(alone);
    test_device_short_of_memory(alone);
    test_device_stall(alone);
    for (int i = 0; i < N_Q; i++) {
        CHECKF(n_batched[i] == n_alone[i], "question %d: %d tokens batched, %d alone", i,
               (int)n_batched[i], (int)n_alone[i]);
        CHECKF(alone[i].len > 0 && batched[i].len == alone[i].len &&
                   memcmp(batched[i].data, alone[i].data, alone[i].len) == 0,
               "question %d: batched answer differs:\n  alone:   %s\n  batched: %s", i,
               alone[i].data, batched[i].data);
        CHECKF(squeezed[i].len == alone[i].len &&
                   memcmp(squeezed[i].data, alone[i].data, alone[i].len) == 0,
               "question %d: answer under preemption differs", i);
        cllm_buf_free(&alone[i]);
        cllm_buf_free(&batched[i]);
        cllm_buf_free(&squeezed[i]);
    }
}

/* Drawn tokens (Qwen's defaults: temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.1;
 * a seed per question) are the same alone and batched: a step's host draws run on the CPU
 * backend's threads together, each with its own row of logits to work on. */
static void test_sampled_invariance(void)
{
    struct cllm_sampling_params sp;
    cllm_sampling_params_default(&sp);
    sp.temperature = 0.7f;
    sp.top_k = 20;
    sp.top_p = 0.8f;
    sp.repetition_penalty = 1.1f;
    sp.seed = 1000;
    struct cllm_buf alone[N_Q] = {0}, batched[N_Q] = {0}, greedy[1] = {0};
    struct cllm_engine *e = engine(0, 256, 512, 0);
    if (!e)
        return;
    run_sampled(e, N_Q, 1, alone, NULL, &sp);
    run_sampled(e, N_Q, N_Q, batched, NULL, &sp);
    run(e, 1, 1, greedy);
    cllm_engine_free(e);
    CHECKF(greedy[0].len != alone[0].len || memcmp(greedy[0].data, alone[0].data, alone[0].len),
           "question 0: the sampled answer is the greedy one (were the settings used?)");
    for (int i = 0; i < N_Q; i++) {
        CHECKF(alone[i].len > 0 && batched[i].len == alone[i].len &&
                   memcmp(batched[i].data, alone[i].data, alone[i].len) == 0,
               "question %d: sampled answer differs batched:\n  alone:   %s\n  batched: %s", i,
               alone[i].data, batched[i].data);
        cllm_buf_free(&alone[i]);
        cllm_buf_free(&batched[i]);
    }
    cllm_buf_free(&greedy[0]);
}

/* Penalties drawn the GPU's way -- each row carrying its sampler's seen tokens, and the token
 * of the step in flight (run-ahead) named by unseen_output, counted by the model, which the
 * CPU engine with run-ahead forced does as a device would -- give the host sampler's answers:
 * greedy with a repetition penalty and OpenAI's presence and frequency penalties, batched. */
static void test_penalties_run_ahead(void)
{
    enum { N = 6 };
    struct cllm_sampling_params sp;
    cllm_sampling_params_default(&sp);
    sp.repetition_penalty = 1.2f;
    sp.presence_penalty = -1.0f;
    sp.frequency_penalty = 0.5f;
    struct cllm_buf host[N] = {0}, ahead[N] = {0}, plain[N] = {0};
    struct cllm_engine *e = engine(0, 256, 512, 0);
    if (!e)
        return;
    run_sampled(e, N, N, host, NULL, &sp);
    run(e, N, N, plain);
    cllm_engine_free(e);
    if (!(e = engine_modes(0, 256, 512, 0, 1, 1)))
        return;
    run_sampled(e, N, N, ahead, NULL, &sp);
    cllm_engine_free(e);
    int changed = 0;
    for (int i = 0; i < N; i++) {
        changed += plain[i].len != host[i].len || memcmp(plain[i].data, host[i].data, host[i].len);
        CHECKF(host[i].len > 0 && ahead[i].len == host[i].len &&
                   memcmp(ahead[i].data, host[i].data, host[i].len) == 0,
               "question %d: penalized answer differs drawn the device's way:\n  host:  %s\n"
               "  model: %s",
               i, host[i].data, ahead[i].data);
        cllm_buf_free(&host[i]);
        cllm_buf_free(&ahead[i]);
        cllm_buf_free(&plain[i]);
    }
    CHECKF(changed > 0, "the penalties changed no answer (were they used?)");
}

/* One request's text: prompt, greedy under sp, at most max_tokens, its last n_carried prompt
 * tokens counted as generated (cllm_request_params.n_carried). */
static struct cllm_buf answer(struct cllm_engine *e, const struct cllm_ids *prompt,
                              const struct cllm_sampling_params *sp, int32_t max_tokens,
                              int32_t n_carried)
{
    struct cllm_request_params p;
    params(&p, max_tokens);
    p.sampling = *sp;
    p.n_carried = n_carried;
    struct cllm_request *r = NULL;
    struct cllm_request_output out = {0};
    char err[256] = "";
    CHECKF(cllm_engine_submit(e, prompt->v, (int32_t)prompt->n, &p, &r, err, sizeof err) == CLLM_OK,
           "%s", err);
    if (r) {
        while (!cllm_request_poll(r, -1, &out))
            ;
        cllm_request_release(r);
    }
    return out.text;
}

/* A request that goes on elsewhere from its text so far (the server after a stall) keeps its
 * presence and frequency penalties: with the tokens before the move counted as generated
 * (n_carried), its answer goes on as the whole answer did; without, it differs somewhere. */
static void test_carried_penalties(void)
{
    enum { N = 4, FIRST = 8 };
    struct cllm_sampling_params sp;
    cllm_sampling_params_default(&sp);
    sp.presence_penalty = 1.0f;
    sp.frequency_penalty = 0.5f;
    struct cllm_engine *e = engine(0, 256, 512, 0);
    if (!e)
        return;
    int forgot_differs = 0;
    for (int i = 0; i < N; i++) {
        struct cllm_buf whole = answer(e, &prompts[i], &sp, GEN, 0);
        struct cllm_buf first = answer(e, &prompts[i], &sp, FIRST, 0);
        struct cllm_ids moved = {0};
        cllm_ids_append(&moved, prompts[i].v, prompts[i].n);
        cllm_tokenize(mf->tok, first.data, first.len, &moved);
        const int32_t n_carried = (int32_t)(moved.n - prompts[i].n);
        struct cllm_buf rest = answer(e, &moved, &sp, GEN - n_carried, n_carried);
        struct cllm_buf forgot = answer(e, &moved, &sp, GEN - n_carried, 0);
        struct cllm_buf both = {0};
        cllm_buf_append(&both, first.data, first.len);
        cllm_buf_append(&both, rest.data, rest.len);
        CHECKF(first.len > 0 && both.len == whole.len && !memcmp(both.data, whole.data, whole.len),
               "question %d: carried with its %d tokens counted, the answer differs:\n"
               "  whole: %s\n  moved: %s",
               i, (int)n_carried, whole.data, both.data);
        forgot_differs += forgot.len != rest.len || memcmp(forgot.data, rest.data, rest.len);
        cllm_buf_free(&whole);
        cllm_buf_free(&first);
        cllm_buf_free(&rest);
        cllm_buf_free(&forgot);
        cllm_buf_free(&both);
        cllm_ids_free(&moved);
    }
    CHECKF(forgot_differs > 0, "not counting the carried tokens changed no answer");
    /* more carried tokens than the prompt has: refused */
    struct cllm_request_params p;
    params(&p, 4);
    p.n_carried = (int32_t)prompts[0].n + 1;
    struct cllm_request *r = NULL;
    char err[256] = "";
    CHECK(cllm_engine_submit(e, prompts[0].v, (int32_t)prompts[0].n, &p, &r, err, sizeof err) ==
              CLLM_ERR_RANGE &&
          strstr(err, "n_carried") != NULL);
    cllm_engine_free(e);
}

/* The cancel and limit tests' engine (context 128, a queue of 2; run_ahead > 0 forces overlap
 * and run-ahead on, else both off) and their requests: 100 tokens, no stop token. */
static struct cllm_engine *small_engine(int32_t run_ahead, struct cllm_request_params *p)
{
    params(p, 100);
    p->n_stop_ids = 0;
    return engine_modes(0, 128, 128, 2, run_ahead > 0 ? 1 : -1, run_ahead > 0 ? 1 : -1);
}

/* A cancelled request ends within a step and gives its blocks back, with and without
 * run-ahead (which may hold it in a launched step). */
static void test_cancel(int32_t run_ahead)
{
    struct cllm_request_params p;
    struct cllm_engine *e = small_engine(run_ahead, &p);
    if (!e)
        return;
    char err[256] = "";
    struct cllm_request *r;
    CHECK(cllm_engine_submit(e, prompts[0].v, (int32_t)prompts[0].n, &p, &r, err, sizeof err) ==
          CLLM_OK);
    struct cllm_request_output o = {0};
    while (!cllm_request_poll(r, -1, &o) && o.n_generated < 2)
        ;
    cllm_request_cancel(r);
    while (!cllm_request_poll(r, -1, &o))
        ;
    CHECKF(o.reason == CLLM_FINISH_CANCELLED && o.n_generated < 100,
           "run-ahead %d: reason %d after %d tokens", (int)run_ahead, (int)o.reason,
           (int)o.n_generated);
    cllm_request_release(r);
    cllm_buf_free(&o.text);
    struct cllm_engine_stats st;
    wait_idle(e, &st);
    CHECKF(st.kv_blocks_used == 0 && st.running == 0, "run-ahead %d: %d blocks, %d running left",
           (int)run_ahead, (int)st.kv_blocks_used, (int)st.running);
    cllm_engine_free(e);
}

static void test_cancel_and_limits(void)
{
    test_cancel(-1);
    test_cancel(1);
    struct cllm_request_params p;
    struct cllm_engine *e = small_engine(-1, &p);
    if (!e)
        return;
    char err[256] = "";
    struct cllm_request *r;
    struct cllm_request_output o = {0};

    int32_t long_prompt[200];
    for (int i = 0; i < 200; i++)
        long_prompt[i] = prompts[1].v[i % prompts[1].n];
    CHECK(cllm_engine_submit(e, long_prompt, 200, &p, &r, err, sizeof err) == CLLM_ERR_RANGE);
    CHECK(strstr(err, "context window") != NULL);
    CHECK(cllm_engine_submit(e, long_prompt, 0, &p, &r, err, sizeof err) == CLLM_ERR_INVALID_ARG);
    p.sampling.top_p = 2.0f;
    CHECK(cllm_engine_submit(e, long_prompt, 5, &p, &r, err, sizeof err) == CLLM_ERR_RANGE);
    CHECK(strstr(err, "top_p") != NULL);
    long_prompt[0] = 10000000;
    p.sampling.top_p = 1.0f;
    CHECK(cllm_engine_submit(e, long_prompt, 5, &p, &r, err, sizeof err) == CLLM_ERR_RANGE);
    /* Freeing the engine with requests in flight finishes them as cancelled. */
    struct cllm_request *a, *b;
    p.max_tokens = 50;
    CHECK(cllm_engine_submit(e, prompts[2].v, (int32_t)prompts[2].n, &p, &a, err, sizeof err) == CLLM_OK);
    CHECK(cllm_engine_submit(e, prompts[3].v, (int32_t)prompts[3].n, &p, &b, err, sizeof err) == CLLM_OK);
    cllm_engine_free(e);
    CHECK(cllm_request_poll(a, 0, &o) && cllm_request_poll(b, 0, &o));
    cllm_buf_free(&o.text);
    cllm_request_release(a);
    cllm_request_release(b);
}

/* max_time, with and without run-ahead, on one sequence slot: a request still generating when
 * its time is over ends then (not before) with the text of the tokens it counts, exactly the
 * text the same prompt gives with max_tokens set to that count; one still waiting behind it
 * for the slot ends at its own time with no text. Greedy: the same tokens either way. */
static void test_max_time(int32_t run_ahead)
{
    struct cllm_engine_config c;
    cllm_engine_config_default(&c);
    c.n_threads = 2;
    c.max_seqs = 1;
    c.n_ctx = 512;
    c.overlap = c.run_ahead = run_ahead > 0 ? 1 : -1;
    char err[512] = "";
    struct cllm_engine *e = NULL;
    CHECKF(cllm_engine_new(&e, mf, &c, err, sizeof err) == CLLM_OK, "%s", err);
    if (!e)
        return;
    struct cllm_request_params p;
    params(&p, 400); /* more than ~1.5 s of tokens on any CPU this runs on */
    p.n_stop_ids = 0;
    struct cllm_request *a = NULL, *b = NULL, *ref = NULL;
    struct cllm_request_output oa = {0}, ob = {0}, oref = {0};
    p.max_time = 1.5;
    CHECK(cllm_engine_submit(e, prompts[0].v, (int32_t)prompts[0].n, &p, &a, err, sizeof err) ==
          CLLM_OK);
    p.max_time = 0.3;
    CHECK(cllm_engine_submit(e, prompts[1].v, (int32_t)prompts[1].n, &p, &b, err, sizeof err) ==
          CLLM_OK);
    if (!a || !b)
        goto out;
    while (!cllm_request_poll(a, -1, &oa))
        ;
    while (!cllm_request_poll(b, -1, &ob))
        ;
    CHECKF(oa.reason == CLLM_FINISH_TIME && oa.n_generated >= 1 && oa.n_generated < 400,
           "run-ahead %d: reason %s after %d tokens", (int)run_ahead,
           cllm_finish_reason_str(oa.reason), (int)oa.n_generated);
    CHECKF(oa.t_finish - oa.t_submit >= 1.5, "ended after %.3f s", oa.t_finish - oa.t_submit);
    CHECKF(ob.reason == CLLM_FINISH_TIME && ob.n_generated == 0 && ob.text.len == 0 &&
               ob.t_finish - ob.t_submit >= 0.3 && ob.t_finish < oa.t_finish,
           "run-ahead %d: the waiting request: reason %s, %d tokens, ended after %.3f s",
           (int)run_ahead, cllm_finish_reason_str(ob.reason), (int)ob.n_generated,
           ob.t_finish - ob.t_submit);
    if (oa.n_generated >= 1) {
        p.max_time = 0;
        p.max_tokens = oa.n_generated;
        CHECK(cllm_engine_submit(e, prompts[0].v, (int32_t)prompts[0].n, &p, &ref, err,
                                 sizeof err) == CLLM_OK);
        while (ref && !cllm_request_poll(ref, -1, &oref))
            ;
        CHECKF(oref.reason == CLLM_FINISH_LENGTH && oref.text.len == oa.text.len &&
                   memcmp(oref.text.data, oa.text.data, oa.text.len) == 0,
               "run-ahead %d: %d tokens: '%.*s' cut by time, '%.*s' by max_tokens", (int)run_ahead,
               (int)oa.n_generated, (int)oa.text.len, oa.text.data, (int)oref.text.len,
               oref.text.data);
    }
    printf("max_time, run-ahead %d: %d tokens in 1.5 s\n", (int)run_ahead, (int)oa.n_generated);
    struct cllm_engine_stats st;
    wait_idle(e, &st);
    CHECKF(st.kv_blocks_used == 0 && st.running == 0, "run-ahead %d: %d blocks, %d running left",
           (int)run_ahead, (int)st.kv_blocks_used, (int)st.running);
out:
    if (a)
        cllm_request_release(a);
    if (b)
        cllm_request_release(b);
    if (ref)
        cllm_request_release(ref);
    cllm_buf_free(&oa.text);
    cllm_buf_free(&ob.text);
    cllm_buf_free(&oref.text);
    cllm_engine_free(e);
}

int main(void)
{
    char err[1024];
    if (cllm_model_files_open(&mf, test_env("CLLM_TEST_GGUF"), err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    load_prompts();
    test_invariance();
    test_sampled_invariance();
    test_penalties_run_ahead();
    test_carried_penalties();
    test_cancel_and_limits();
    test_max_time(-1);
    test_max_time(1);
    for (int i = 0; i < N_Q; i++)
        cllm_ids_free(&prompts[i]);
    cllm_model_files_free(mf);
    return test_summary();
}
