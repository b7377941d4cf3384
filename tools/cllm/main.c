/*
 * The cllm binary: one executable, subcommands dispatched here. This file only composes the
 * layers (open a model, run a command); each command lives in its own cmd_*.c.
 */
#include <stdio.h>
#include <string.h>

#include "cllm.h"
#include "cmd.h"

static void usage(FILE *f)
{
    fprintf(f,
            "cllm %s - LLM inference server for Qwen2.5 models\n\n"
            "usage: cllm <command> [options]\n\n"
            "commands:\n"
            "  info      --model PATH            describe a model (GGUF file or HF folder)\n"
            "  tokenize  --model PATH [--ids|--decode] [--bench N]\n"
            "                                    text on stdin -> token ids on stdout (or back)\n"
            "  generate  --model PATH [--prompt TEXT] ...\n"
            "                                    stream an answer (cllm generate --help)\n"
            "  serve     --model PATH [--port 8000] ...\n"
            "                                    the HTTP server (cllm serve --help)\n"
            "  bench     --model PATH ...        throughput and latency, on a synthetic prompt\n"
            "                                    or a workload (cllm bench --help)\n",
            CLLM_VERSION);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("cllm %s\n", CLLM_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "info"))
        return cllm_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize"))
        return cllm_cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "generate"))
        return cllm_cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench"))
        return cllm_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve"))
        return cllm_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "probe-device")) /* the server's child process (not in the usage) */
        return cllm_cmd_probe_device(argc - 1, argv + 1);
    fprintf(stderr, "cllm: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
