/*
 * `cllm bench`: throughput and latency measured through the engine, as users see them.
 *
 *   cllm bench --model PATH [--prompt-tokens 512] [--gen-tokens 128] [--runs 5]
 *       one sequence: prefill rate (time to first token of a prompt-tokens prompt) and decode
 *       rate (gen-tokens tokens, EOS ignored), the median of the runs.
 *   cllm bench --model PATH --workload FILE.json [--concurrency N] [--max-tokens M]
 *       a JSON array of questions, rendered with the chat template, at most N in flight:
 *       wall time, output tokens/s, time to first token and inter-token latency p50/p99.
 * The prefix cache is off in the single-sequence mode, so repeated runs measure real work.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "backend/cpu/threadpool.h"
#include "cmd.h"
#include "core/alloc.h"
#include "core/log.h"
#include "core/mmap.h"
#include "gen_opts.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The q-quantile (0..1) of v[0..n), sorting v. */
static double quantile(double *v, size_t n, double q)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* Runs one request to the end; fills its output. */
static bool run_one(struct cllm_engine *e, const int32_t *ids, int32_t n,
                    const struct cllm_request_params *p, struct cllm_request_output *out)
{
    char err[512];
    struct cllm_request *r;
    if (cllm_engine_submit(e, ids, n, p, &r, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        return false;
    }
    memset(out, 0, sizeof *out);
    while (!cllm_request_poll(r, -1, out))
        out->text.len = 0;
    cllm_buf_free(&out->text);
    cllm_request_release(r);
    return out->reason != CLLM_FINISH_ERROR;
}

static int single(struct cllm_engine *e, const struct cllm_model_files *mf, int32_t prompt_tokens,
                  int32_t gen_tokens, int runs, int threads)
{
    /* A prompt of real text, repeated to length: the workload's questions. */
    int32_t *ids = cllm_malloc_array((size_t)prompt_tokens, sizeof *ids);
    struct cllm_ids text_ids = {0};
    const char *seed = "CUDA 的线程块（thread block）在流多处理器上如何调度？请解释 warp、共享内存与"
                       "同步屏障之间的关系，并给出一个矩阵乘法 tiling 的例子。 ";
    cllm_tokenize(mf->tok, seed, strlen(seed), &text_ids);
    for (int32_t i = 0; i < prompt_tokens; i++)
        ids[i] = text_ids.v[i % text_ids.n];
    cllm_ids_free(&text_ids);

    struct cllm_request_params p;
    memset(&p, 0, sizeof p);
    cllm_sampling_params_default(&p.sampling); /* greedy; no stop ids: always gen_tokens */
    double *prefill = calloc((size_t)runs, sizeof *prefill), *decode = calloc((size_t)runs, sizeof *decode);
    int rc = 0;
    for (int r = 0; r < runs && rc == 0; r++) {
        struct cllm_request_output o;
        p.max_tokens = 1;
        if (!run_one(e, ids, prompt_tokens, &p, &o)) {
            rc = 1;
            break;
        }
        prefill[r] = prompt_tokens / (o.t_first_token - o.t_submit);
        p.max_tokens = gen_tokens;
        /* decode after a short prompt: the first tokens of the long one (all, if fewer) */
        if (!run_one(e, ids, prompt_tokens < 16 ? prompt_tokens : 16, &p, &o)) {
            rc = 1;
            break;
        }
        decode[r] = (o.n_generated - 1) / (o.t_finish - o.t_first_token);
        fprintf(stderr, "run %d: prefill %.1f tok/s, decode %.2f tok/s\n", r + 1, prefill[r],
                decode[r]);
    }
    if (rc == 0)
        printf("cllm: %d threads, prefill %.1f tok/s (%d-token prompt), decode %.2f tok/s (%d "
               "tokens), median of %d runs\n",
               threads, quantile(prefill, (size_t)runs, 0.5), prompt_tokens,
               quantile(decode, (size_t)runs, 0.5), gen_tokens, runs);
    free(prefill);
    free(decode);
    free(ids);
    return rc;
}

/* The questions of a workload file: a JSON array of strings. */
static char **read_workload(const char *path, int *n)
{
    char *text, err[512];
    size_t len;
    *n = 0;
    if (cllm_read_file(path, 64u << 20, &text, &len, err, sizeof err)) {
        fprintf(stderr, "cllm: %s\n", err);
        return NULL;
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsArray(root)) {
        fprintf(stderr, "cllm: %s: expected a JSON array of strings\n", path);
        cJSON_Delete(root);
        return NULL;
    }
    char **qs = calloc((size_t)cJSON_GetArraySize(root) + 1, sizeof *qs);
    const cJSON *e;
    cJSON_ArrayForEach(e, root)
    {
        if (cJSON_IsString(e))
            qs[(*n)++] = strdup(e->valuestring);
    }
    cJSON_Delete(root);
    return qs;
}

static int workload(struct cllm_engine *e, const struct cllm_model_files *mf, const char *path,
                    int concurrency, bool raw, const struct cllm_request_params *p)
{
    int n;
    char **qs = read_workload(path, &n);
    if (!qs || n == 0) {
        free(qs);
        return 1;
    }
    struct cllm_ids *ids = calloc((size_t)n, sizeof *ids);
    struct cllm_request **reqs = calloc((size_t)n, sizeof *reqs);
    struct cllm_request_output *outs = calloc((size_t)n, sizeof *outs);
    char err[512];
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        struct cllm_buf rendered = {0};
        if (cllm_cmd_render_prompt(mf, raw, NULL, qs[i], strlen(qs[i]), &rendered, err,
                                   sizeof err) ||
            cllm_tokenize(mf->tok, rendered.data, rendered.len, &ids[i])) {
            fprintf(stderr, "cllm: question %d: %s\n", i, err);
            rc = 1;
        }
        cllm_buf_free(&rendered);
    }
    double t0 = cllm_cmd_now();
    int next = 0, done = 0, in_flight = 0, cut = 0;
    long long generated = 0, prompt = 0, cached = 0;
    while (rc == 0 && done < n) {
        while (next < n && in_flight < concurrency) {
            if (cllm_engine_submit(e, ids[next].v, (int32_t)ids[next].n, p, &reqs[next], err,
                                   sizeof err)) {
                fprintf(stderr, "cllm: question %d: %s\n", next, err);
                rc = 1;
                break;
            }
            next++;
            in_flight++;
        }
        for (int i = 0; i < next; i++) {
            if (!reqs[i] || outs[i].finished)
                continue;
            if (cllm_request_poll(reqs[i], 0, &outs[i])) {
                in_flight--;
                done++;
                generated += outs[i].n_generated;
                prompt += outs[i].n_prompt;
                cached += outs[i].n_cached;
                cut += outs[i].reason == CLLM_FINISH_TIME;
            }
            outs[i].text.len = 0;
        }
        if (done < n) {
            /* A short wait on the newest request, not a spin; its state is read again above. */
            struct cllm_request_output wait = {0};
            cllm_request_poll(reqs[next - 1], 2, &wait);
            cllm_buf_free(&wait.text);
        }
    }
    double wall = cllm_cmd_now() - t0;
    double *ttft = calloc((size_t)n, sizeof *ttft), *itl = NULL;
    size_t n_itl = 0, cap_itl = 0;
    /* Steady-state decode: tokens delivered after every request has its first token, over
     * that window (what llama-batched-bench calls S_TG when all start together). */
    double all_started = 0, t_end = 0;
    for (int i = 0; i < n && reqs[i]; i++) {
        if (outs[i].t_first_token > all_started)
            all_started = outs[i].t_first_token;
        if (outs[i].t_finish > t_end)
            t_end = outs[i].t_finish;
    }
    long long steady_tokens = 0;
    for (int i = 0; i < n && reqs[i]; i++) {
        /* (one that max_time ended before its first token: the time to its empty answer) */
        ttft[i] = (outs[i].t_first_token > 0 ? outs[i].t_first_token : outs[i].t_finish) -
                  outs[i].t_submit;
        int32_t k = cllm_request_token_times(reqs[i], NULL, 0);
        double *t = calloc((size_t)k + 1, sizeof *t);
        cllm_request_token_times(reqs[i], t, k);
        if (n_itl + (size_t)k > cap_itl) {
            cap_itl = (n_itl + (size_t)k) * 2;
            itl = realloc(itl, cap_itl * sizeof *itl);
        }
        for (int32_t j = 1; j < k; j++)
            itl[n_itl++] = t[j] - t[j - 1];
        for (int32_t j = 0; j < k; j++)
            steady_tokens += t[j] > all_started;
        free(t);
    }
    if (rc == 0)
        printf("workload %s: %d requests, concurrency %d, max_tokens %d\n"
               "  wall %.2f s, %lld prompt tokens (%lld from the prefix cache), %lld output "
               "tokens, %.1f output tok/s\n"
               "  time to first token p50 %.0f ms, p99 %.0f ms; inter-token latency p50 %.1f ms, "
               "p99 %.1f ms\n"
               "  decode throughput %.1f tok/s (after all requests started)\n",
               path, n, concurrency, p->max_tokens, wall, prompt, cached, generated,
               generated / wall, quantile(ttft, (size_t)n, 0.5) * 1e3,
               quantile(ttft, (size_t)n, 0.99) * 1e3, quantile(itl, n_itl, 0.5) * 1e3,
               quantile(itl, n_itl, 0.99) * 1e3,
               t_end > all_started ? steady_tokens / (t_end - all_started) : 0.0);
    if (rc == 0 && cut > 0)
        printf("  %d of %d requests ended by --max-time %g s with the text they had\n", cut, n,
               p->max_time);
    for (int i = 0; i < n; i++) {
        cllm_request_release(reqs[i]);
        cllm_buf_free(&outs[i].text);
        cllm_ids_free(&ids[i]);
        free(qs[i]);
    }
    free(qs), free(ids), free(reqs), free(outs), free(ttft), free(itl);
    return rc;
}

int cllm_cmd_bench(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"workload", required_argument, 0, 'w'},
                                         {"concurrency", required_argument, 0, 'c'},
                                         {"prompt-tokens", required_argument, 0, 'P'},
                                         {"gen-tokens", required_argument, 0, 'G'},
                                         {"runs", required_argument, 0, 'R'},
                                         {"raw-prompts", no_argument, 0, 'W'},
                                         {"ignore-eos", no_argument, 0, 'E'},
                                         {"help", no_argument, 0, 'h'},
                                         CLLM_GEN_LONG_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *model = NULL, *work = NULL;
    bool raw = false, ignore_eos = false;
    int concurrency = 1 << 20, runs = 5;
    int32_t prompt_tokens = 512, gen_tokens = 128;
    struct cllm_gen_opts g;
    cllm_gen_opts_init(&g);
    int c;
    while ((c = getopt_long(argc, argv, "m:w:c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'w': work = optarg; break;
        case 'c': concurrency = atoi(optarg); break;
        case 'P': prompt_tokens = atoi(optarg); break;
        case 'G': gen_tokens = atoi(optarg); break;
        case 'R': runs = atoi(optarg); break;
        case 'W': raw = true; break;
        case 'E': ignore_eos = true; break;
        default:
            if (cllm_gen_opts_parse(&g, c, optarg) == 1)
                break;
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: cllm bench --model PATH [--prompt-tokens N] [--gen-tokens N] [--runs N]\n"
                    "       cllm bench --model PATH --workload FILE.json [--concurrency N] "
                    "[--max-tokens M] [--raw-prompts] [--ignore-eos]\n" CLLM_GEN_USAGE);
            return c == 'h' ? 0 : 2;
        }
    }
    if (concurrency < 1 || prompt_tokens < 1 || gen_tokens < 2 || runs < 1) {
        fprintf(stderr, "cllm: bench: counts must be positive (gen-tokens >= 2)\n");
        return 2;
    }
    cllm_log_set_level(CLLM_LOG_WARN);
    struct cllm_model_files *mf = cllm_cmd_open_model(model);
    if (!mf)
        return 1;
    struct cllm_request_params p;
    cllm_gen_opts_params(&g, mf, &p);
    if (ignore_eos)
        p.n_stop_ids = 0;
    if (!work) {
        g.engine.max_seqs = 1;
        g.engine.prefix_cache = false;
        if (!g.engine.n_ctx)
            g.engine.n_ctx = prompt_tokens + gen_tokens + 32;
    } else if (!g.engine.max_seqs) {
        g.engine.max_seqs = concurrency < 256 ? concurrency : 256;
    }
    char err[1024];
    struct cllm_engine *e;
    int rc = 1;
    if (cllm_engine_new(&e, mf, &g.engine, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
    } else {
        int threads = g.engine.n_threads ? g.engine.n_threads : cllm_cpu_physical_cores();
        rc = work ? workload(e, mf, work, concurrency, raw, &p)
                  : single(e, mf, prompt_tokens, gen_tokens, runs, threads);
        cllm_engine_free(e);
    }
    cllm_model_files_free(mf);
    return rc;
}
