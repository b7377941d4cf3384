/*
 * `cllm probe-device --model PATH [engine options]`: the child process of the server's GPU
 * probe (src/server/probe.h), not meant to be run by hand. It starts an engine under
 * --device auto as the server would (the GPU, its device check, else the CPU), generates a
 * few tokens through it, and exits 0 if that ran on a GPU, CLLM_PROBE_EXIT_NO_GPU if no GPU
 * starts, CLLM_PROBE_EXIT_CHECK_FAILED if one failed its device check, 1 on an error. A
 * crash or a hang here costs only this process.
 *
 * CLLM_FAULT_PROBE=crash|hang (tests only) makes it die or hang once its engine started, as a
 * broken GPU stack would.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmd.h"
#include "core/log.h"
#include "core/status.h"
#include "engine/engine.h"
#include "gen_opts.h"
#include "server/probe.h"

/* A few greedy tokens through the engine thread: the step paths a check does not take
 * (recorded decode steps, the device's sampler, run-ahead). */
static enum cllm_status generate(struct cllm_engine *e, const struct cllm_model_files *mf,
                                 char *err, size_t err_len)
{
    struct cllm_ids ids = {0};
    if (cllm_tokenize(mf->tok, "1, 2, 3,", 8, &ids) || ids.n == 0) {
        cllm_ids_free(&ids);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "cannot tokenize the probe's prompt");
    }
    struct cllm_request_params p;
    memset(&p, 0, sizeof p);
    cllm_sampling_params_default(&p.sampling);
    p.sampling.temperature = 0;
    p.max_tokens = 8;
    struct cllm_request *r = NULL;
    enum cllm_status st = cllm_engine_submit(e, ids.v, (int32_t)ids.n, &p, &r, err, err_len);
    cllm_ids_free(&ids);
    if (st)
        return st;
    struct cllm_request_output o = {0};
    while (!cllm_request_poll(r, -1, &o))
        o.text.len = 0;
    if (o.reason == CLLM_FINISH_ERROR)
        st = cllm_fail(err, err_len, CLLM_ERR_DEVICE, "%s", o.error);
    cllm_buf_free(&o.text);
    cllm_request_release(r);
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
    /* No GPU starts (the usual case on a CPU machine): nothing more to try. */
    struct cllm_backend_options bo = {CLLM_BACKEND_AUTO, 1, 0, CLLM_CPU_WEIGHTS_STORED};
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
    enum cllm_status st = cllm_engine_new(&e, mf, &g.engine, err, sizeof err);
    if (!st)
        st = generate(e, mf, err, sizeof err);
    int rc = 1;
    if (st) {
        cllm_log(CLLM_LOG_ERROR, "probe-device: %s", err);
    } else {
        const char *name = cllm_engine_backend_name(e);
        rc = strcmp(name, "cpu") != 0 ? 0 : CLLM_PROBE_EXIT_CHECK_FAILED;
        cllm_log(CLLM_LOG_INFO, "probe-device: the engine ran on %s", name);
    }
    const char *fault = getenv("CLLM_FAULT_PROBE");
    if (fault && !strcmp(fault, "crash"))
        abort(); /* (not SIGSEGV: the sanitizers would report it as a bug of ours) */
    if (fault && !strcmp(fault, "hang"))
        for (;;)
            pause();
    cllm_engine_free(e);
    cllm_model_files_free(mf);
    return rc;
}
