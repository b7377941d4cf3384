/* Helpers shared by the subcommands. */
#include <stdio.h>
#include <time.h>

#include <string.h>

#include "cmd.h"
#include "core/status.h"
#include "tokenizer/chat_template.h"

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

enum cllm_status cllm_cmd_read_all(FILE *f, struct cllm_buf *b)
{
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        enum cllm_status st = cllm_buf_append(b, chunk, n);
        if (st)
            return st;
    }
    return ferror(f) ? CLLM_ERR_IO : CLLM_OK;
}

enum cllm_status cllm_cmd_render_prompt(const struct cllm_model_files *mf, bool raw,
                                        const char *system, const char *user, size_t user_len,
                                        struct cllm_buf *out, char *err, size_t err_len)
{
    if (raw)
        return cllm_buf_append(out, user, user_len);
    struct cllm_chat_template *t;
    enum cllm_status st = cllm_chat_template_init(&t, mf->chat_template, err, err_len);
    if (st) {
        if (st == CLLM_ERR_NOT_FOUND)
            cllm_fail(err, err_len, st, "%s has no chat template: use --raw", mf->path);
        return st;
    }
    struct cllm_chat_message msgs[2];
    size_t n = 0;
    if (system)
        msgs[n++] = (struct cllm_chat_message){"system", system, strlen(system)};
    msgs[n++] = (struct cllm_chat_message){"user", user, user_len};
    st = cllm_chat_template_render(t, msgs, n, true, out, err, err_len);
    cllm_chat_template_free(t);
    return st;
}
