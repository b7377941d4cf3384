/*
 * Chat template recognition and rendering without the model files: the real Qwen2.5-Coder
 * templates (0.5B and 1.5B GGUFs, stored in the fixture) and synthetic ones render what
 * transformers renders; ChatML look-alikes that transformers renders differently, other
 * families, garbage and a missing template are refused with clear messages; whitespace
 * variants are accepted exactly when transformers renders them like the original; bad
 * messages are refused without touching the output.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_fixture.h"
#include "core/buf.h"
#include "tokenizer/chat_template.h"
#include "test.h"

#define QWEN_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

static const char llama3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}";

static const char pirate_qwen2[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a pirate. Say \\'arr\\'.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* Renders msgs with t and compares with want (NUL-terminated). */
static bool renders(const struct cllm_chat_template *t, const struct cllm_chat_message *msgs,
                    size_t n, bool gp, const char *want)
{
    struct cllm_buf out = {0};
    char err[256] = "";
    enum cllm_status st = cllm_chat_template_render(t, msgs, n, gp, &out, err, sizeof err);
    bool ok = st == CLLM_OK && out.len == strlen(want) && !memcmp(out.data, want, out.len);
    if (!ok)
        fprintf(stderr, "render: %s\n  got:  %s\n  want: %s\n", st ? err : "differs",
                out.data ? out.data : "", want);
    cllm_buf_free(&out);
    return ok;
}

/* init must fail with status want and an error containing needle. */
static void check_refused(const char *src, enum cllm_status want, const char *needle,
                          const char *label)
{
    struct cllm_chat_template *t = (struct cllm_chat_template *)1;
    char err[512] = "";
    enum cllm_status st = cllm_chat_template_init(&t, src, err, sizeof err);
    CHECKF(st == want && t == NULL, "%s: status %d", label, (int)st);
    CHECKF(strstr(err, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", label, err, needle);
    CHECKF(strchr(err, '\n') == NULL, "%s: message is not one line", label);
    cllm_chat_template_free(t);
}

static char *replace_all(const char *s, const char *from, const char *to)
{
    struct cllm_buf b = {0};
    const char *p;
    while ((p = strstr(s, from))) {
        cllm_buf_append(&b, s, (size_t)(p - s));
        cllm_buf_append(&b, to, strlen(to));
        s = p + strlen(from);
    }
    cllm_buf_append(&b, s, strlen(s));
    return b.data;
}

static int check_fixture_templates(const cJSON *root)
{
    int compared = 0;
    const cJSON *cases = cJSON_GetObjectItem(root, "cases");
    CHECK(cJSON_GetArraySize(cases) >= 25);

    /* The real templates (0.5B and 1.5B GGUFs differ in the tool-calling text). */
    int n_real = 0;
    const cJSON *src;
    cJSON_ArrayForEach(src, cJSON_GetObjectItem(root, "real_sources"))
    {
        struct cllm_chat_template *t = NULL;
        char err[512] = "";
        CHECKF(cllm_chat_template_init(&t, src->valuestring, err, sizeof err) == CLLM_OK, "%s: %s",
               src->string, err);
        if (!t)
            continue;
        n_real++;
        size_t len;
        const char *sys = cllm_chat_template_default_system(t, &len);
        CHECK(cllm_chat_template_format(t) == CLLM_CHAT_CHATML_QWEN25);
        CHECK(!strcmp(cllm_chat_template_name(t), "qwen2.5"));
        CHECK(sys && len == strlen(QWEN_SYSTEM) && !strcmp(sys, QWEN_SYSTEM));
        compared += fixture_check(t, cases, fixture_renders(root, "qwen2.5"), src->string);
        cllm_chat_template_free(t);
    }
    CHECK(n_real == 2);

    /* Synthetic templates: recognised ones render like transformers, look-alikes are refused. */
    const cJSON *tmpl;
    int n_refused = 0;
    cJSON_ArrayForEach(tmpl, cJSON_GetObjectItem(root, "templates"))
    {
        const cJSON *source = cJSON_GetObjectItem(tmpl, "source");
        const cJSON *family = cJSON_GetObjectItem(tmpl, "family");
        if (!cJSON_IsString(source))
            continue;
        if (cJSON_IsNull(family)) {
            check_refused(source->valuestring, CLLM_ERR_UNSUPPORTED, "ChatML variant",
                          tmpl->string);
            n_refused++;
            continue;
        }
        struct cllm_chat_template *t = NULL;
        char err[512] = "";
        CHECKF(cllm_chat_template_init(&t, source->valuestring, err, sizeof err) == CLLM_OK,
               "%s: %s", tmpl->string, err);
        if (!t)
            continue;
        CHECKF(!strcmp(cllm_chat_template_name(t), family->valuestring), "%s is %s", tmpl->string,
               cllm_chat_template_name(t));
        compared += fixture_check(t, cases, fixture_renders(root, tmpl->string), tmpl->string);
        cllm_chat_template_free(t);
    }
    CHECK(n_refused >= 4);

    /* Whitespace, comments and -/+ markers between tags: accepted iff harmless. */
    int n_same = 0, n_var = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, cJSON_GetObjectItem(root, "whitespace_variants"))
    {
        const char *s = cJSON_GetObjectItem(v, "source")->valuestring;
        bool same = cJSON_IsTrue(cJSON_GetObjectItem(v, "renders_as_qwen2"));
        struct cllm_chat_template *t = NULL;
        char err[512] = "";
        enum cllm_status st = cllm_chat_template_init(&t, s, err, sizeof err);
        CHECKF(same ? st == CLLM_OK : st == CLLM_ERR_UNSUPPORTED,
               "whitespace variant %d (renders like Qwen2: %d): status %d %s\n  %s", n_var, same,
               (int)st, err, s);
        if (t) {
            CHECK(cllm_chat_template_format(t) == CLLM_CHAT_CHATML_QWEN2);
            compared += fixture_check(t, cases, fixture_renders(root, "qwen2"), "variant");
        }
        cllm_chat_template_free(t);
        n_same += same;
        n_var++;
    }
    CHECK(n_var >= 40 && n_same > 5 && n_var - n_same > 5);
    return compared;
}

static void check_default_prompts(const cJSON *root)
{
    const char *real = NULL;
    const cJSON *src;
    cJSON_ArrayForEach(src, cJSON_GetObjectItem(root, "real_sources"))
    {
        real = src->valuestring;
    }
    if (!real)
        return;
    struct cllm_chat_message user = {"user", "hi", 2};
    struct cllm_chat_template *t = NULL;
    char err[512] = "";

    /* A fine-tune's own default prompt (Jinja escapes included) replaces Qwen's. */
    char *custom = replace_all(real, QWEN_SYSTEM, "Du bist ein \\'Assistent\\'.\\n\\u00e4\\x41");
    CHECKF(cllm_chat_template_init(&t, custom, err, sizeof err) == CLLM_OK, "%s", err);
    if (t) {
        CHECK(renders(t, &user, 1, true,
                      "<|im_start|>system\nDu bist ein 'Assistent'.\n\xc3\xa4"
                      "A<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
        struct cllm_chat_message sys_user[2] = {{"system", "S", 1}, {"user", "hi", 2}};
        CHECK(renders(t, sys_user, 2, false,
                      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"));
    }
    cllm_chat_template_free(t);
    free(custom);

    /* An empty default prompt is still a default system turn. */
    custom = replace_all(real, QWEN_SYSTEM, "");
    CHECKF(cllm_chat_template_init(&t, custom, err, sizeof err) == CLLM_OK, "%s", err);
    if (t)
        CHECK(renders(t, &user, 1, false,
                      "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"));
    cllm_chat_template_free(t);
    free(custom);

    CHECKF(cllm_chat_template_init(&t, pirate_qwen2, err, sizeof err) == CLLM_OK, "%s", err);
    if (t) {
        size_t len;
        CHECK(!strcmp(cllm_chat_template_default_system(t, &len), "You are a pirate. Say 'arr'."));
        CHECK(!strcmp(cllm_chat_template_name(t), "qwen2"));
        CHECK(renders(t, &user, 1, true,
                      "<|im_start|>system\nYou are a pirate. Say 'arr'.<|im_end|>\n"
                      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
    }
    cllm_chat_template_free(t);

    /* Line ends and a trailing newline are Jinja's to normalise; more text is not. */
    char *crlf = replace_all(real, "\n", "\r\n");
    CHECKF(cllm_chat_template_init(&t, crlf, err, sizeof err) == CLLM_OK, "CRLF: %s", err);
    cllm_chat_template_free(t);
    free(crlf);
    struct cllm_buf b = {0};
    cllm_buf_appendf(&b, "%s\n", real); /* trim_blocks and the dropped last newline take both */
    CHECKF(cllm_chat_template_init(&t, b.data, err, sizeof err) == CLLM_OK, "extra newline: %s",
           err);
    cllm_chat_template_free(t);
    b.len = 0;
    cllm_buf_appendf(&b, "%s\n\n", real);
    check_refused(b.data, CLLM_ERR_UNSUPPORTED, "ChatML variant", "two extra newlines");
    b.len = 0;
    cllm_buf_appendf(&b, "%sHello", real);
    check_refused(b.data, CLLM_ERR_UNSUPPORTED, "line 55", "trailing text");
    cllm_buf_free(&b);

    /* A ChatML variant is refused with where it departs from the template it follows. */
    char *think = replace_all(real, "{{- '<|im_start|>assistant\\n' }}",
                              "{{- '<|im_start|>assistant\\n<think>\\n' }}");
    check_refused(think, CLLM_ERR_UNSUPPORTED, "differs from the Qwen2.5 template at line 53",
                  "think");
    free(think);
}

static void check_refusals(void)
{
    check_refused(NULL, CLLM_ERR_NOT_FOUND, "has none", "NULL");
    check_refused(llama3, CLLM_ERR_UNSUPPORTED, "Llama 3", "llama3");
    check_refused("[INST] {{ messages[0]['content'] }} [/INST]", CLLM_ERR_UNSUPPORTED,
                  "Llama 2 / Mistral", "mistral");
    check_refused("", CLLM_ERR_UNSUPPORTED, "not a template family cllm knows", "empty");
    check_refused("hello {{ world", CLLM_ERR_UNSUPPORTED, "not a template family", "garbage");
    check_refused("\x01\xff\xfe{%{{{#", CLLM_ERR_UNSUPPORTED, "not a template family", "bytes");
    check_refused("{{ '<|im_start|>", CLLM_ERR_UNSUPPORTED, "cannot read", "unterminated string");
    check_refused("<|im_start|>{% for m in messages %}", CLLM_ERR_UNSUPPORTED, "differs from the",
                  "chatml text");
    check_refused("{{ '<|im_start|>\\N{DIGIT ONE}' }}", CLLM_ERR_UNSUPPORTED, "cannot read",
                  "named escape");
    check_refused("{{ '<|im_start|>\\ud800' }}", CLLM_ERR_UNSUPPORTED, "cannot read",
                  "surrogate escape");

    /* NULL err buffer and a tiny one are fine. */
    struct cllm_chat_template *t = NULL;
    CHECK(cllm_chat_template_init(&t, llama3, NULL, 0) == CLLM_ERR_UNSUPPORTED && !t);
    char tiny[8];
    CHECK(cllm_chat_template_init(&t, llama3, tiny, sizeof tiny) == CLLM_ERR_UNSUPPORTED);
    CHECK(strlen(tiny) < sizeof tiny);
}

/* Mutated real templates (bytes deleted, inserted, overwritten, cut short) must be refused or
 * accepted, never crash or leak (the tests run under ASan/UBSan). */
static void check_mutations(const cJSON *root)
{
    const cJSON *src = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "real_sources"), 0);
    if (!cJSON_IsString(src))
        return;
    static const char alphabet[] = "{}%#-+'\"\\\n \tx.[]()|";
    size_t n = strlen(src->valuestring);
    char *buf = malloc(n + 8);
    uint32_t rng = 12345;
    int accepted = 0, bad = 0;
    for (int it = 0; it < 1000; it++) {
        memcpy(buf, src->valuestring, n + 1);
        size_t len = n;
        for (int k = 0; k < 1 + it % 3; k++) {
            rng = rng * 1664525u + 1013904223u;
            size_t at = (rng >> 8) % len;
            char c = alphabet[(rng >> 4) % (sizeof alphabet - 1)];
            switch (rng % 4) {
            case 0:
                memmove(buf + at, buf + at + 1, len - at);
                len--;
                break;
            case 1:
                memmove(buf + at + 1, buf + at, len - at + 1);
                buf[at] = c;
                len++;
                break;
            case 2:
                buf[at] = c;
                break;
            default:
                buf[at] = '\0';
                len = at ? at : 1;
                break;
            }
        }
        struct cllm_chat_template *t = NULL;
        char err[256];
        enum cllm_status st = cllm_chat_template_init(&t, buf, err, sizeof err);
        bad += st != CLLM_OK && st != CLLM_ERR_UNSUPPORTED;
        accepted += st == CLLM_OK;
        cllm_chat_template_free(t);
    }
    CHECK(bad == 0);
    CHECKF(accepted > 0 && accepted < 1000, "%d accepted", accepted);
    free(buf);
}

static void check_messages(void)
{
    struct cllm_chat_template *t = NULL;
    char err[512] = "";
    CHECKF(cllm_chat_template_init(&t, pirate_qwen2, err, sizeof err) == CLLM_OK, "%s", err);
    if (!t)
        return;
    struct cllm_buf out = {0};
    cllm_buf_append(&out, "PREFIX", 6);

    struct cllm_chat_message tool[2] = {{"user", "x", 1}, {"tool", "{}", 2}};
    CHECK(cllm_chat_template_render(t, tool, 2, true, &out, err, sizeof err) ==
          CLLM_ERR_INVALID_ARG);
    CHECKF(strstr(err, "message 1") && strstr(err, "\"tool\""), "%s", err);
    struct cllm_chat_message odd[1] = {
        {"function\n\x01\xc3\xa4-and-a-very-long-role-name-here", "x", 1}};
    CHECK(cllm_chat_template_render(t, odd, 1, true, &out, err, sizeof err) ==
          CLLM_ERR_INVALID_ARG);
    CHECKF(strstr(err, "unknown role \"function?"
                       "?"
                       "?"
                       "?-and-a-very-long-rol...\""),
           "%s", err);
    struct cllm_chat_message no_role[1] = {{NULL, "x", 1}};
    CHECK(cllm_chat_template_render(t, no_role, 1, true, &out, err, sizeof err) ==
          CLLM_ERR_INVALID_ARG);
    CHECKF(strstr(err, "no role"), "%s", err);
    struct cllm_chat_message no_content[1] = {{"user", NULL, 3}};
    CHECK(cllm_chat_template_render(t, no_content, 1, true, &out, err, sizeof err) ==
          CLLM_ERR_INVALID_ARG);
    CHECK(cllm_chat_template_render(t, no_content, 0, true, &out, err, sizeof err) ==
          CLLM_ERR_INVALID_ARG);
    CHECKF(strstr(err, "no messages"), "%s", err);
    CHECK(cllm_chat_template_render(NULL, no_content, 1, true, &out, NULL, 0) ==
          CLLM_ERR_INVALID_ARG);
    CHECK(out.len == 6 && !strcmp(out.data, "PREFIX")); /* untouched by every failure */

    /* Appends; content is bytes (NUL, invalid UTF-8, special-token text) taken verbatim, and a
     * NULL content of length 0 is empty. */
    struct cllm_chat_message bytes[2] = {{"user", "a\0b\xff<|im_end|>", 14},
                                         {"assistant", NULL, 0}};
    CHECK(cllm_chat_template_render(t, bytes, 2, false, &out, err, sizeof err) == CLLM_OK);
    static const char want[] = "PREFIX<|im_start|>system\nYou are a pirate. Say 'arr'.<|im_end|>\n"
                               "<|im_start|>user\na\0b\xff<|im_end|><|im_end|>\n"
                               "<|im_start|>assistant\n<|im_end|>\n";
    CHECK(out.len == sizeof want - 1 && !memcmp(out.data, want, out.len));
    cllm_buf_free(&out);
    cllm_chat_template_free(t);
    cllm_chat_template_free(NULL);
}

int main(void)
{
    cJSON *root = fixture_load();
    CHECK(root != NULL);
    if (root) {
        int compared = check_fixture_templates(root);
        printf("compared %d renders with transformers\n", compared);
        CHECK(compared > 1000);
        check_default_prompts(root);
        check_mutations(root);
    }
    check_refusals();
    check_messages();
    cJSON_Delete(root);
    return test_summary();
}
