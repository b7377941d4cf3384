/* Helpers shared by the subcommands. */
#include <stdio.h>
#include <time.h>

#include "cmd.h"

struct cllm_model_files *cllm_cmd_open_model(const char *path)
{
    if (!path) {
        fprintf(stderr, "cllm: --model PATH is required (a .gguf file or an HF folder)\n");
        return NULL;
    }
    char err[1024] = "";
    struct cllm_model_files *mf;
    if (cllm_model_files_open(&mf, path, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        return NULL;
    }
    return mf;
}

double cllm_cmd_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
