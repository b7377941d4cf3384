/*
 * `cllm probe-device --model PATH [engine options]`: the child process of the server's GPU
 * probe (src/server/probe.h), not meant to be run by hand. It starts an engine under
 * --device auto as the server would (the GPU, its device check, else the CPU), generates a
 * few tokens through it alone and then in a full batch (generate_wide), and exits 0 if that
 * ran on a GPU (CLLM_PROBE_EXIT_GPU_ON_CORES if that GPU passed its device check only with
 * every GEMM on CUDA cores), CLLM_PROBE_EXIT_NO_GPU if no GPU starts,
 * CLLM_PROBE_EXIT_CHECK_FAILED if one failed its device check, 1 on an error. A
 * crash or a hang here costs only this process.
 *
 * CLLM_FAULT_PROBE=crash|hang (tests only) makes it die or hang once its engine started, as a
 * broken GPU stack would; CLLM_FAULT_PROBE=wide makes one sync of the full batch fail (it
 * creates CLLM_FAULT_FILE's file with CLLM_FAULT_ONCE=1), as a GPU that fails at that width;
 * CLLM_FAULT_PROBE=on-cores reports its GPU as one that passed its device check only with
 * every GEMM on CUDA cores.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "cmd.h"
#include "core/log.h"
#include "core/status.h"
#include "engine/engine.h"
#include "gen_opts.h"
#include "server/probe.h"

/* The probe's prompt, short and continued the same way by any right model, and its length. */
#define PROBE_PROMPT "1, 2, 3,"
#define PROBE_TOKENS 8

static enum cllm_status submit_text(struct cllm_engine *e, const struct cllm_model_files *mf,
                                    const char *text, const struct cllm_request_params *p,
                                    struct cllm_request **r, char *err, size_t err_len)
{
    struct cllm_ids ids = {0};
    if (cllm_tokenize(mf->tok, text, strlen(text), &ids) || ids.n == 0) {
        cllm_ids_free(&ids);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot tokenize the probe's prompt");
    }
    enum cllm_status st = cllm_engine_submit(e, ids.v, (int32_t)ids.n, p, r, err, err_len);
    cllm_ids_free(&ids);
    return st;
}

static void greedy_params(struct cllm_request_params *p)
{
    memset(p, 0, sizeof *p);
    cllm_sampling_params_default(&p->sampling);
    p->sampling.temperature = 0;
    p->max_tokens = PROBE_TOKENS;
}

/* A few greedy tokens through the engine thread, alone: the step paths a check does not take
 * (recorded decode steps, the device's sampler, run-ahead). The answer goes to text. */
static enum cllm_status generate(struct cllm_engine *e, const struct cllm_model_files *mf,
                                 struct cllm_buf *text, char *err, size_t err_len)
{
    struct cllm_request_params p;
    greedy_params(&p);
    struct cllm_request *r = NULL;
    enum cllm_status st = submit_text(e, mf, PROBE_PROMPT, &p, &r, err, err_len);
    if (st)
        return st;
    struct cllm_request_output o = {0};
    while (!cllm_request_poll(r, -1, &o))
        ;
    if (o.reason == CLLM_FINISH_ERROR)
        st = cllm_fail(err, err_len, CLLM_ERR_DEVICE, "%s", o.error);
    *text = o.text;
    cllm_request_release(r);
    return st;
}

/* A full batch: as many sequences as a step takes (the evaluation sends 192 at once), so the
 * shapes a served batch reaches -- every recorded decode step size as the sequences end one
 * length after another, attention and the device's sampler at full width -- have run in this
 * process before the server trusts the GPU with them. Half are the alone prompt, greedy: a
 * step's rows do not depend on the batch, so each must give the alone answer; half draw with
 * Qwen2.5's sampling defaults (penalties, top-k, top-p on the device). An error, a move to the
 * CPU (a step failed on the GPU), or most greedy answers differing fails the probe. */
static enum cllm_status generate_wide(struct cllm_engine *e, const struct cllm_model_files *mf,
                                      int32_t width, const struct cllm_buf *alone, char *err,
                                      size_t err_len)
{
    struct cllm_request **reqs = calloc((size_t)width, sizeof *reqs);
    struct cllm_request_output *outs = calloc((size_t)width, sizeof *outs);
    if (!reqs || !outs) {
        free(reqs), free(outs);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
    }
    const double t0 = cllm_now();
    enum cllm_status st = CLLM_OK;
    int32_t n = 0;
    for (; n < width && !st; n++) {
        struct cllm_request_params p;
        greedy_params(&p);
        char text[64] = PROBE_PROMPT;
        if (n % 2) {
            struct cllm_sampling_params *sp = &p.sampling;
            sp->temperature = 0.7f, sp->top_k = 20, sp->top_p = 0.8f;
            sp->repetition_penalty = 1.1f, sp->seed = (uint64_t)n;
            p.max_tokens = 1 + (n / 2) % PROBE_TOKENS; /* the batch shrinks step by step */
            snprintf(text, sizeof text, "%d, %d, %d,", (int)n, (int)n + 1, (int)n + 2);
        }
        st = submit_text(e, mf, text, &p, &reqs[n], err, err_len);
    }
    if (st)
        n--; /* reqs[n - 1] was not submitted */
    bool on_cpu = false;
    for (int32_t i = 0; i < n && !st && !on_cpu; i++) {
        while (!cllm_request_poll(reqs[i], 50, &outs[i])) {
            on_cpu = !strcmp(cllm_engine_backend_name(e), "cpu");
            if (on_cpu) /* the rest would run on the CPU, slowly, for nothing */
                break;
        }
        if (!on_cpu && outs[i].reason == CLLM_FINISH_ERROR)
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE, "%d sequences at once: %s", (int)width,
                           outs[i].error);
    }
    /* a move seen while waiting, or after all were answered: the CPU may have finished them all
     * before a poll saw it (a small model, quickly) */
    if (!st && (on_cpu || !strcmp(cllm_engine_backend_name(e), "cpu")))
        st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                       "a step of %d sequences failed on the GPU (the engine moved to the CPU)",
                       (int)width);
    int32_t n_greedy = 0, n_differ = 0;
    for (int32_t i = 0; i < n && !st; i += 2) {
        n_greedy++;
        n_differ += outs[i].text.len != alone->len ||
                    memcmp(outs[i].text.data, alone->data, alone->len) != 0;
    }
    if (!st) {
        cllm_log(n_differ ? CLLM_LOG_WARN : CLLM_LOG_INFO,
                 "probe-device: %d sequences at once in %.2f s; %d of the %d greedy ones differ "
                 "from the answer alone",
                 (int)n, cllm_now() - t0, (int)n_differ, (int)n_greedy);
        if (2 * n_differ > n_greedy)
            st = cllm_fail(err, err_len, CLLM_ERR_DEVICE,
                           "%d of %d greedy answers in a batch of %d differ from the answer "
                           "alone: the GPU computes wrongly at that width",
                           (int)n_differ, (int)n_greedy, (int)width);
    }
    for (int32_t i = 0; i < n; i++) {
        cllm_request_cancel(reqs[i]);
        cllm_request_release(reqs[i]);
        cllm_buf_free(&outs[i].text);
    }
    free(reqs);
    free(outs);
    return st;
}

int cllm_cmd_probe_device(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, CLLM_GEN_LONG_OPTIONS, {0, 0, 0, 0}};
    struct cllm_gen_opts g;
    cllm_gen_opts_init(&g);
    const char *model = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "m:", opts, NULL)) != -1) {
        if (c == 'm')
            model = optarg;
        else if (cllm_gen_opts_parse(&g, c, optarg) != 1)
            return 2;
    }
    if (!model || optind < argc) {
        fprintf(stderr, "usage: cllm probe-device --model PATH [engine options] (the server's "
                        "GPU probe)\n");
        return 2;
    }
    cllm_log_set_level(CLLM_LOG_INFO);
    /* A probe whose server died (crashed, or killed by its keeper) must not go on holding the
     * GPU, or hang on: it dies with the thread that started it, which waits for it. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* No GPU starts (the usual case on a CPU machine): nothing more to try. */
    struct cllm_backend_options bo = {CLLM_BACKEND_AUTO, 1, 0, CLLM_CPU_WEIGHTS_STORED, 0, false};
    struct cllm_backend *be = NULL;
    char err[1024] = "";
    if (cllm_backend_new(&be, &bo, err, sizeof err) != CLLM_OK) {
        cllm_log(CLLM_LOG_ERROR, "probe-device: %s", err);
        return 1;
    }
    const bool gpu = strcmp(be->iface->name, "cpu") != 0;
    cllm_backend_free(be);
    if (!gpu)
        return CLLM_PROBE_EXIT_NO_GPU;
    struct cllm_model_files *mf = cllm_cmd_open_model(model);
    if (!mf)
        return 1;
    g.engine.backend = CLLM_BACKEND_AUTO;
    struct cllm_engine *e = NULL;
    struct cllm_buf alone = {0};
    enum cllm_status st = cllm_engine_new(&e, mf, &g.engine, err, sizeof err);
    if (!st)
        st = generate(e, mf, &alone, err, sizeof err);
    int rc = 1;
    const char *fault = getenv("CLLM_FAULT_PROBE");
    if (st) {
        cllm_log(CLLM_LOG_ERROR, "probe-device: %s", err);
    } else {
        const char *name = cllm_engine_backend_name(e);
        /* (CLLM_FAULT_PROBE=on-cores: as if it had taken them) */
        const bool on_cores = cllm_engine_gemm_on_cores(e) || (fault && !strcmp(fault, "on-cores"));
        rc = !strcmp(name, "cpu") ? CLLM_PROBE_EXIT_CHECK_FAILED
             : on_cores           ? CLLM_PROBE_EXIT_GPU_ON_CORES
                                  : 0;
        cllm_log(CLLM_LOG_INFO, "probe-device: the engine ran on %s%s", name,
                 on_cores ? " with every GEMM on CUDA cores" : "");
    }
    const bool on_gpu = rc == 0 || rc == CLLM_PROBE_EXIT_GPU_ON_CORES;
    const char *trigger = getenv("CLLM_FAULT_FILE");
    if (on_gpu && fault && !strcmp(fault, "wide") && trigger) {
        /* the device fails one sync of the full batch (fault.h), then works on */
        setenv("CLLM_FAULT_ONCE", "1", 1);
        FILE *f = fopen(trigger, "w");
        if (f)
            fclose(f);
    }
    if (on_gpu) {
        st = generate_wide(e, mf, cllm_engine_max_seqs(e), &alone, err, sizeof err);
        if (st) {
            cllm_log(CLLM_LOG_ERROR, "probe-device: %s", err);
            rc = 1;
        }
    }
    cllm_buf_free(&alone);
    if (fault && !strcmp(fault, "crash"))
        abort(); /* (not SIGSEGV: the sanitizers would report it as a bug of ours) */
    if (fault && !strcmp(fault, "hang"))
        for (;;)
            pause();
    cllm_engine_free(e);
    cllm_model_files_free(mf);
    return rc;
}
