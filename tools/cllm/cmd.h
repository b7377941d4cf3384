/* The subcommands of the cllm binary; each returns the process exit code. */
#ifndef CLLM_TOOLS_CMD_H
#define CLLM_TOOLS_CMD_H

#include <stdbool.h>

#include <stdio.h>

#include "core/buf.h"
#include "model/model_files.h"

int cllm_cmd_info(int argc, char **argv);
int cllm_cmd_tokenize(int argc, char **argv);
int cllm_cmd_generate(int argc, char **argv);
int cllm_cmd_bench(int argc, char **argv);
int cllm_cmd_serve(int argc, char **argv);
int cllm_cmd_probe_device(int argc, char **argv);

/* Opens --model for a command, printing "cllm: <error>" on failure; NULL then. */
struct cllm_model_files *cllm_cmd_open_model(const char *path);
/* Monotonic seconds. */
double cllm_cmd_now(void);
/* Reads a whole stream into b. */
enum cllm_status cllm_cmd_read_all(FILE *f, struct cllm_buf *b);
/* The prompt text for one user message: rendered with the model's chat template (with system
 * as the system message, or the template's default when NULL), or as is when raw. */
enum cllm_status cllm_cmd_render_prompt(const struct cllm_model_files *mf, bool raw,
                                        const char *system, const char *user, size_t user_len,
                                        struct cllm_buf *out, char *err, size_t err_len);

#endif
