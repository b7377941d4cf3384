/*
 * Shared by the chat template tests: loading tests/fixtures/chat_template_golden.json (made by
 * gen_chat_template.py from transformers' apply_chat_template) and comparing cllm's render of
 * every fixture conversation, both with and without the generation prompt, with the reference.
 */
#ifndef CLLM_TESTS_CHAT_TEMPLATE_FIXTURE_H
#define CLLM_TESTS_CHAT_TEMPLATE_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/buf.h"
#include "core/mmap.h"
#include "tokenizer/chat_template.h"
#include "test.h"

/* The parsed fixture (cJSON_Delete it), NULL with a message on failure. */
static cJSON *fixture_load(void)
{
    char path[4096], err[512] = "";
    snprintf(path, sizeof path, "%s/chat_template_golden.json", test_env("CLLM_FIXTURES"));
    char *json;
    size_t len;
    if (cllm_read_file(path, 16u << 20, &json, &len, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return NULL;
    }
    cJSON *root = cJSON_ParseWithLength(json, len);
    free(json);
    if (!root)
        fprintf(stderr, "%s: not valid JSON\n", path);
    return root;
}

/* The renders of template `name` in the fixture, following renders_as. */
static const cJSON *fixture_renders(const cJSON *root, const char *name)
{
    const cJSON *tmpl = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "templates"), name);
    const cJSON *as = cJSON_GetObjectItem(tmpl, "renders_as");
    if (cJSON_IsString(as))
        return fixture_renders(root, as->valuestring);
    return cJSON_GetObjectItem(tmpl, "renders");
}

/* Renders every case with t and checks it against renders ([[no prompt, prompt] per case]; a
 * null render must fail). Returns the number of renders compared. */
static int fixture_check(const struct cllm_chat_template *t, const cJSON *cases,
                         const cJSON *renders, const char *label)
{
    int compared = 0, failures = 0;
    CHECKF(cJSON_GetArraySize(cases) == cJSON_GetArraySize(renders), "%s: fixture shape", label);
    for (int c = 0; c < cJSON_GetArraySize(cases) && c < cJSON_GetArraySize(renders); c++) {
        const cJSON *tc = cJSON_GetArrayItem(cases, c);
        const char *name = cJSON_GetObjectItem(tc, "name")->valuestring;
        const cJSON *jm = cJSON_GetObjectItem(tc, "messages");
        size_t n = (size_t)cJSON_GetArraySize(jm);
        struct cllm_chat_message *msgs = calloc(n ? n : 1, sizeof *msgs);
        for (size_t i = 0; i < n; i++) {
            const cJSON *m = cJSON_GetArrayItem(jm, (int)i);
            msgs[i].role = cJSON_GetObjectItem(m, "role")->valuestring;
            msgs[i].content = cJSON_GetObjectItem(m, "content")->valuestring;
            msgs[i].content_len = strlen(msgs[i].content);
        }
        for (int gp = 0; gp < 2; gp++) {
            const cJSON *want = cJSON_GetArrayItem(cJSON_GetArrayItem(renders, c), gp);
            struct cllm_buf out = {0};
            char err[256] = "";
            enum cllm_status st = cllm_chat_template_render(t, msgs, n, gp, &out, err, sizeof err);
            bool ok;
            if (cJSON_IsNull(want))
                ok = st != CLLM_OK;
            else
                ok = st == CLLM_OK && cJSON_IsString(want) &&
                     out.len == strlen(want->valuestring) &&
                     memcmp(out.data, want->valuestring, out.len) == 0;
            if (!ok && failures++ < 5)
                fprintf(stderr, "%s: case %s (generation prompt %d): %s\n  got:  %s\n  want: %s\n",
                        label, name, gp, st ? err : "differs", st ? "(error)" : out.data,
                        cJSON_IsString(want) ? want->valuestring : "(error)");
            CHECK(ok);
            compared++;
            cllm_buf_free(&out);
        }
        free(msgs);
    }
    return compared;
}

#endif
