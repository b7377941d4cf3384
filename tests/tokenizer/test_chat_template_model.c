/*
 * The chat template of the real model, read the way the server reads it (cllm_model_files_open
 * on the GGUF and on the HF folder made from it), is recognised as Qwen2.5's and renders every
 * fixture conversation exactly as transformers' apply_chat_template does.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_fixture.h"
#include "model/model_files.h"
#include "tokenizer/chat_template.h"
#include "test.h"

static int check_model(const char *path, const cJSON *root, const char *label)
{
    struct cllm_model_files *mf = NULL;
    char err[512] = "";
    CHECKF(cllm_model_files_open(&mf, path, err, sizeof err) == CLLM_OK, "%s: %s", label, err);
    if (!mf)
        return 0;
    CHECKF(mf->chat_template != NULL, "%s: no chat template", label);

    /* The fixture stores the GGUF's template under its file name: it must be this one. */
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    const cJSON *stored = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "real_sources"), base);
    if (mf->format == CLLM_MODEL_FORMAT_GGUF)
        CHECKF(cJSON_IsString(stored) && mf->chat_template &&
                   !strcmp(stored->valuestring, mf->chat_template),
               "%s: template differs from the fixture's %s", label, base);

    int compared = 0;
    struct cllm_chat_template *t = NULL;
    CHECKF(cllm_chat_template_init(&t, mf->chat_template, err, sizeof err) == CLLM_OK, "%s: %s",
           label, err);
    if (t) {
        CHECK(cllm_chat_template_format(t) == CLLM_CHAT_CHATML_QWEN25);
        size_t len;
        const char *sys = cllm_chat_template_default_system(t, &len);
        CHECKF(sys && !strcmp(sys, "You are Qwen, created by Alibaba Cloud. You are a helpful "
                                   "assistant."),
               "%s: default system prompt %s", label, sys ? sys : "(none)");
        compared = fixture_check(t, cJSON_GetObjectItem(root, "cases"),
                                 fixture_renders(root, "qwen2.5"), label);
    }
    cllm_chat_template_free(t);
    cllm_model_files_free(mf);
    return compared;
}

int main(void)
{
    cJSON *root = fixture_load();
    CHECK(root != NULL);
    if (root) {
        int n_cases = cJSON_GetArraySize(cJSON_GetObjectItem(root, "cases"));
        int compared = check_model(test_env("CLLM_TEST_GGUF"), root, "gguf");
        compared += check_model(test_env("CLLM_TEST_HF"), root, "hf");
        printf("compared %d renders with transformers\n", compared);
        CHECK(n_cases >= 25 && compared == 4 * n_cases);
    }
    cJSON_Delete(root);
    return test_summary();
}
