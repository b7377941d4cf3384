/*
 * `cllm generate --model PATH [--prompt TEXT | < stdin] [--raw] [--system TEXT] ...`: renders
 * the prompt with the chat template (unless --raw), streams the answer to stdout as it is
 * produced and prints prompt size, time to first token, prefill and decode rates to stderr.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "core/buf.h"
#include "core/log.h"
#include "gen_opts.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: cllm generate --model PATH [--prompt TEXT] [--raw] [--system TEXT] "
               "[options] (prompt from stdin without --prompt)\n" CLLM_GEN_USAGE);
}

int cllm_cmd_generate(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"prompt", required_argument, 0, 'p'},
                                         {"system", required_argument, 0, 's'},
                                         {"raw", no_argument, 0, 'r'},
                                         {"help", no_argument, 0, 'h'},
                                         CLLM_GEN_LONG_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL, *system = NULL;
    bool raw = false;
    struct cllm_gen_opts g;
    cllm_gen_opts_init(&g);
    int c;
    while ((c = getopt_long(argc, argv, "m:p:s:rh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': prompt = optarg; break;
        case 's': system = optarg; break;
        case 'r': raw = true; break;
        case 'h': usage(stdout); return 0;
        default:
            if (cllm_gen_opts_parse(&g, c, optarg) == 1)
                break;
            usage(stderr);
            return 2;
        }
    }
    cllm_log_set_level(CLLM_LOG_WARN);
    int rc = 1;
    struct cllm_buf text = {0}, rendered = {0};
    struct cllm_ids ids = {0};
    struct cllm_engine *engine = NULL;
    struct cllm_request *req = NULL;
    char err[1024] = "";
    struct cllm_model_files *mf = cllm_cmd_open_model(model);
    if (!mf)
        goto done;
    if (prompt)
        cllm_buf_append(&text, prompt, strlen(prompt));
    else if (cllm_cmd_read_all(stdin, &text) != CLLM_OK) {
        fprintf(stderr, "cllm: cannot read the prompt from stdin\n");
        goto done;
    }
    if (text.len == 0) {
        fprintf(stderr, "cllm: the prompt is empty\n");
        goto done;
    }
    if (cllm_cmd_render_prompt(mf, raw, system, text.data ? text.data : "", text.len, &rendered,
                               err, sizeof err) != CLLM_OK ||
        cllm_tokenize(mf->tok, rendered.data ? rendered.data : "", rendered.len, &ids) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err[0] ? err : "cannot tokenize the prompt");
        goto done;
    }
    if (ids.n == 0) {
        fprintf(stderr, "cllm: the prompt is empty\n");
        goto done;
    }
    struct cllm_request_params params;
    cllm_gen_opts_params(&g, mf, &params);
    /* One sequence: size the context to this prompt and answer unless told otherwise. */
    g.engine.max_seqs = 1;
    if (!g.engine.n_ctx) {
        int64_t need = (int64_t)ids.n + params.max_tokens;
        g.engine.n_ctx = need < mf->hp.n_ctx_train ? (int32_t)need : mf->hp.n_ctx_train;
    }
    double t0 = cllm_cmd_now();
    if (cllm_engine_new(&engine, mf, &g.engine, err, sizeof err) != CLLM_OK ||
        cllm_engine_submit(engine, ids.v, (int32_t)ids.n, &params, &req, err, sizeof err) !=
            CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        goto done;
    }
    double t_loaded = cllm_cmd_now();
    struct cllm_request_output out = {0};
    bool finished = false;
    while (!finished) {
        finished = cllm_request_poll(req, -1, &out);
        if (out.text.len) {
            fwrite(out.text.data, 1, out.text.len, stdout);
            fflush(stdout);
            out.text.len = 0;
        }
    }
    fputc('\n', stdout);
    cllm_buf_free(&out.text);
    double prefill_s = out.t_first_token - out.t_submit;
    double decode_s = out.t_finish - out.t_first_token;
    fprintf(stderr,
            "\n[%s] prompt %d tokens, generated %d tokens (%s); load %.2f s, time to first token "
            "%.0f ms (prefill %.1f tok/s), decode %.2f tok/s\n",
            cllm_engine_backend_name(engine), out.n_prompt, out.n_generated,
            cllm_finish_reason_str(out.reason), t_loaded - t0, prefill_s * 1e3,
            out.n_prompt / prefill_s,
            out.n_generated > 1 ? (out.n_generated - 1) / decode_s : 0.0);
    if (out.reason == CLLM_FINISH_ERROR)
        fprintf(stderr, "cllm: %s\n", out.error);
    else
        rc = 0;
done:
    cllm_request_release(req);
    cllm_engine_free(engine);
    cllm_model_files_free(mf);
    cllm_ids_free(&ids);
    cllm_buf_free(&text);
    cllm_buf_free(&rendered);
    return rc;
}
