/* The subcommands of the cllm binary; each returns the process exit code. */
#ifndef CLLM_TOOLS_CMD_H
#define CLLM_TOOLS_CMD_H

#include <stdbool.h>

#include "model/model_files.h"

int cllm_cmd_info(int argc, char **argv);
int cllm_cmd_tokenize(int argc, char **argv);

/* Opens --model for a command, printing "cllm: <error>" on failure; NULL then. */
struct cllm_model_files *cllm_cmd_open_model(const char *path);
/* Monotonic seconds. */
double cllm_cmd_now(void);

#endif
