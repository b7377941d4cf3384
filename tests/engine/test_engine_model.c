/*
 * The engine on the real small model:
 *   - batch invariance: each workload question's greedy answer is byte-identical whether it
 *     runs alone or together with 11 others, and again under memory pressure that forces
 *     preemption and recomputation;
 *   - the same with the text of each step delivered during the next one (overlap forced on, as
 *     on a GPU), including a stop string that ends a request while a step computes it;
 *   - cancellation frees the request's KV blocks within a step;
 *   - prompts beyond the context window and a full queue are refused with clear errors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/mmap.h"
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

/* Runs questions [0, n) with at most `together` in flight; answers[i] gets the text. */
static void run(struct cllm_engine *e, int n, int together, struct cllm_buf *answers)
{
    struct cllm_request *reqs[N_Q] = {0};
    struct cllm_request_output outs[N_Q];
    memset(outs, 0, sizeof outs);
    struct cllm_request_params p;
    params(&p, GEN);
    char err[256];
    for (int start = 0; start < n; start += together) {
        int end = start + together < n ? start + together : n;
        for (int i = start; i < end; i++)
            CHECKF(cllm_engine_submit(e, prompts[i].v, (int32_t)prompts[i].n, &p, &reqs[i], err,
                                      sizeof err) == CLLM_OK, "%s", err);
        for (int i = start; i < end; i++) {
            if (!reqs[i])
                continue;
            while (!cllm_request_poll(reqs[i], -1, &outs[i]))
                ;
            CHECK(outs[i].reason == CLLM_FINISH_STOP || outs[i].reason == CLLM_FINISH_LENGTH);
            answers[i] = outs[i].text;
            cllm_request_release(reqs[i]);
        }
    }
}

static struct cllm_engine *engine_overlap(int64_t kv_bytes, int32_t batch_tokens,
                                          int32_t n_ctx, int32_t max_queue, int32_t overlap)
{
    struct cllm_engine_config c;
    cllm_engine_config_default(&c);
    c.n_threads = 2;
    c.kv_bytes = kv_bytes;
    c.max_batch_tokens = batch_tokens;
    c.max_seqs = 16;
    c.n_ctx = n_ctx;
    c.max_queue = max_queue;
    c.overlap = overlap;
    char err[512];
    struct cllm_engine *e = NULL;
    CHECKF(cllm_engine_new(&e, mf, &c, err, sizeof err) == CLLM_OK, "%s", err);
    return e;
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
    for (int overlap = -1; overlap <= 1; overlap += 2) {
        struct cllm_engine *e = engine_overlap(0, 256, 512, 0, overlap);
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
               "overlap %d: stop string \"%s\" should cut the answer at byte %zu, got %zu bytes",
               overlap, stop, first, outs[0].text.len);
        for (int i = 1; i < 4; i++)
            CHECKF(outs[i].text.len == alone[i].len &&
                       memcmp(outs[i].text.data, alone[i].data, alone[i].len) == 0,
                   "overlap %d: question %d changed next to a stopped request", overlap, i);
        struct cllm_engine_stats st;
        wait_idle(e, &st);
        CHECK(st.kv_blocks_used == 0 && st.running == 0 && st.requests_finished == 4);
        for (int i = 0; i < 4; i++)
            cllm_buf_free(&outs[i].text);
        cllm_engine_free(e);
    }
}

static void test_invariance(void)
{
    struct cllm_buf alone[N_Q] = {0}, batched[N_Q] = {0}, squeezed[N_Q] = {0};
    struct cllm_engine *e = engine(0, 256, 512, 0);
    if (!e)
        return;
    run(e, N_Q, 1, alone);
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
    run(e, N_Q, N_Q, batched);
    struct cllm_engine_stats st;
    cllm_engine_stats(e, &st);
    printf("batched run: %llu steps, prefix cache hits %llu of %llu blocks\n",
           (unsigned long long)st.steps, (unsigned long long)st.prefix_hits,
           (unsigned long long)st.prefix_queries);
    CHECK(st.prefix_hits > 0);
    cllm_engine_free(e);
    /* 16 blocks of 16 tokens: about three sequences fit, so the rest wait or are preempted. */
    int64_t per_token = 24 * 2 * 2 * 64 * 4; /* layers x (K,V) x kv heads x head dim x F32 */
    e = engine_overlap(per_token * 16 * 16, 64, 256, 0, 1);
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
    for (int i = 0; i < N_Q; i++) {
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

static void test_cancel_and_limits(void)
{
    struct cllm_engine *e = engine(0, 128, 128, 2);
    if (!e)
        return;
    struct cllm_request_params p;
    params(&p, 100);
    p.n_stop_ids = 0;
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
    CHECK(o.reason == CLLM_FINISH_CANCELLED && o.n_generated < 100);
    cllm_request_release(r);
    cllm_buf_free(&o.text);
    struct cllm_engine_stats st;
    wait_idle(e, &st);
    CHECK(st.kv_blocks_used == 0 && st.running == 0);

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

int main(void)
{
    char err[1024];
    if (cllm_model_files_open(&mf, test_env("CLLM_TEST_GGUF"), err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    load_prompts();
    test_invariance();
    test_cancel_and_limits();
    for (int i = 0; i < N_Q; i++)
        cllm_ids_free(&prompts[i]);
    cllm_model_files_free(mf);
    return test_summary();
}
