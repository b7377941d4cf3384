/*
 * `cllm serve --model PATH [--host H] [--port N] [--api-key KEY] [--max-queue N]
 * [--max-body BYTES] [generation/engine options]`: the HTTP server (src/server). Request
 * defaults are the model's generation_config overridden by the flags (gen_opts.c), which each
 * request may override again.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmd.h"
#include "core/log.h"
#include "gen_opts.h"
#include "server/keeper.h"
#include "server/server.h"

enum {
    OPT_HOST = 2000,
    OPT_PORT,
    OPT_API_KEY,
    OPT_MAX_QUEUE,
    OPT_MAX_BODY,
    OPT_PROBE_TIMEOUT,
    OPT_STALL_TIMEOUT,
    OPT_NO_KEEPER
};

/* Seconds the GPU probe (src/server/probe.h) may take before the server gives up on the GPU:
 * a healthy one loads, checks and generates in seconds; the health check's 180 s deadline
 * must leave room for a CPU start after it. */
#define DEFAULT_PROBE_TIMEOUT_S 90

static void usage(FILE *f)
{
    fprintf(f,
            "usage: cllm serve --model PATH [options]\n"
            "  --host ADDR             address to listen on (default 0.0.0.0)\n"
            "  --port N                port (default 8000)\n"
            "  --api-key KEY           require Authorization: Bearer KEY (/ and /health stay "
            "open)\n"
            "  --max-queue N           waiting requests at most; more get 429 (default 4096)\n"
            "  --max-body BYTES        request body limit; more get 413 (default 8 MiB)\n"
            "  --gpu-probe-timeout S   --device auto: the GPU is first tried in a child process;\n"
            "                          one that crashes, fails or takes longer than S seconds\n"
            "                          (default %d) leaves the server on the CPU; 0: not tried\n"
            "  --stall-timeout S       a step that runs longer than S seconds is a device that\n"
            "                          no longer answers: --device auto moves to the CPU, the\n"
            "                          requests going on there; else /health says 503 and they\n"
            "                          end with the text they have (default 30 on a GPU, never\n"
            "                          on the CPU, not even when set if it took over from a GPU;\n"
            "                          0: never)\n"
            "  --no-keeper             serve from this process; by default a parent process\n"
            "                          (the keeper) restarts the server if it dies of a signal\n"
            "                          (a crashing GPU driver), on the CPU under --device auto\n"
            "request defaults (each request may override them) and engine sizing:\n" CLLM_GEN_USAGE,
            DEFAULT_PROBE_TIMEOUT_S);
}

static bool parse_ull(const char *s, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out)
{
    char *end;
    errno = 0;
    if (!s || *s == '-')
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static void request_defaults(void *ctx, const struct cllm_model_files *mf,
                             struct cllm_request_params *p)
{
    cllm_gen_opts_params(ctx, mf, p);
}

/* args: argv as given (getopt_long reorders argv), for the keeper to start the server with */
static int serve(int argc, char **argv, char **args)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"host", required_argument, 0, OPT_HOST},
        {"port", required_argument, 0, OPT_PORT},
        {"api-key", required_argument, 0, OPT_API_KEY},
        {"max-queue", required_argument, 0, OPT_MAX_QUEUE},
        {"max-body", required_argument, 0, OPT_MAX_BODY},
        {"gpu-probe-timeout", required_argument, 0, OPT_PROBE_TIMEOUT},
        {"stall-timeout", required_argument, 0, OPT_STALL_TIMEOUT},
        {"no-keeper", no_argument, 0, OPT_NO_KEEPER},
        {"help", no_argument, 0, 'h'},
        CLLM_GEN_LONG_OPTIONS,
        {0, 0, 0, 0}};
    struct cllm_gen_opts g;
    cllm_gen_opts_init(&g);
    struct cllm_server_config cfg = {.host = "0.0.0.0",
                                     .port = CLLM_SERVER_DEFAULT_PORT,
                                     .probe_timeout_s = DEFAULT_PROBE_TIMEOUT_S};
    unsigned long long v;
    double stall_timeout = 0; /* the engine's default */
    bool keeper = true;
    int c;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            cfg.model_path = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        case OPT_HOST:
            cfg.host = optarg;
            break;
        case OPT_API_KEY:
            cfg.api_key = optarg;
            break;
        case OPT_PROBE_TIMEOUT:
            if (!parse_ull(optarg, 0, 3600, &v)) {
                fprintf(stderr, "cllm: invalid value '%s' for --gpu-probe-timeout\n", optarg);
                return 2;
            }
            cfg.probe_timeout_s = (double)v;
            break;
        case OPT_NO_KEEPER:
            keeper = false;
            break;
        case OPT_STALL_TIMEOUT: {
            char *end;
            errno = 0;
            double t = strtod(optarg, &end);
            if (errno || end == optarg || *end || !(t >= 0 && t <= 86400)) {
                fprintf(stderr, "cllm: invalid value '%s' for --stall-timeout (seconds, 0-86400)\n",
                        optarg);
                return 2;
            }
            stall_timeout = t > 0 ? t : -1; /* the engine's "never" */
            break;
        }
        case OPT_PORT:
        case OPT_MAX_QUEUE:
        case OPT_MAX_BODY:
            if (!parse_ull(optarg, c == OPT_PORT ? 0 : 1,
                           c == OPT_PORT        ? 65535
                           : c == OPT_MAX_QUEUE ? 1 << 24
                                                : 1ULL << 34,
                           &v)) {
                fprintf(stderr, "cllm: invalid value '%s' for --%s\n", optarg,
                        c == OPT_PORT        ? "port"
                        : c == OPT_MAX_QUEUE ? "max-queue"
                                             : "max-body");
                return 2;
            }
            if (c == OPT_PORT)
                cfg.port = (int)v;
            else if (c == OPT_MAX_QUEUE)
                g.engine.max_queue = (int32_t)v;
            else
                cfg.max_body = (size_t)v;
            break;
        default:
            if (cllm_gen_opts_parse(&g, c, optarg) == 1)
                break;
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "cllm: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!cfg.model_path) {
        fprintf(stderr, "cllm: --model PATH is required (a .gguf file or an HF folder)\n");
        return 2;
    }
    cfg.engine = g.engine;
    cfg.engine.stall_timeout = stall_timeout;
    /* The probe and the keeper run this very binary. */
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        if (cfg.probe_timeout_s > 0)
            cfg.probe_exe = exe;
    }
    cllm_log_set_level(CLLM_LOG_INFO);
    struct cllm_keeper_child kept;
    if (cllm_keeper_child(&kept)) {
        cfg.listen_fd = kept.listen_fd;
        cfg.ready_fd = kept.ready_fd;
        cfg.restarts = kept.restarts;
        cfg.fallback = kept.fallback[0] ? kept.fallback : NULL;
        cfg.custody_fd = kept.custody_fd;
    } else if (keeper && n <= 0) {
        cllm_log(CLLM_LOG_WARN, "cannot find this binary (/proc/self/exe): serving without a "
                                "keeper, so a crash ends the server");
    } else if (keeper) {
        const struct cllm_keeper_config k = {
            .exe = exe,
            .argc = argc,
            .argv = args,
            .host = cfg.host,
            .port = cfg.port,
            .restart_on_cpu = g.engine.backend == CLLM_BACKEND_AUTO,
        };
        return cllm_keeper_run(&k);
    }
    cfg.request_defaults = request_defaults;
    cfg.request_defaults_ctx = &g;
    char err[1024] = "";
    if (cllm_server_run(&cfg, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        return 1;
    }
    return 0;
}

int cllm_cmd_serve(int argc, char **argv)
{
    char **args = calloc((size_t)argc + 1, sizeof *args);
    if (!args) {
        fprintf(stderr, "cllm: out of memory\n");
        return 1;
    }
    memcpy(args, argv, (size_t)argc * sizeof *args);
    int rc = serve(argc, argv, args);
    free(args);
    return rc;
}
