/*
 * HF folder JSON readers: config.json (Qwen2.5-1.5B's real values, transformers v4 and v5
 * layouts, defaults, every wrong type / missing key / unsupported feature), generation_config.json
 * (eos as int and list, defaults when absent) and tokenizer_config.json / chat_template.jinja
 * (template as string and list, token strings and objects). Folders are written to a mkdtemp dir.
 */
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"
#include "model/hf_config.h"
#include "model/hparams.h"
#include "test.h"

static char tmp[64];
static char dir[128]; /* the model folder each test writes into */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void write_file(const char *name, const char *text)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(text, 1, strlen(text), f) != strlen(text)) {
        fprintf(stderr, "cannot write %s\n", p);
        exit(1);
    }
    fclose(f);
}

static void remove_file(const char *name)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    unlink(p);
}

/* Qwen2.5-1.5B-Instruct's config.json (transformers v4 layout), as key / JSON value pairs. */
static const char *QWEN_CONFIG[][2] = {
    {"architectures", "[\"Qwen2ForCausalLM\"]"},
    {"attention_dropout", "0.0"},
    {"bos_token_id", "151643"},
    {"eos_token_id", "151645"},
    {"hidden_act", "\"silu\""},
    {"hidden_size", "1536"},
    {"initializer_range", "0.02"},
    {"intermediate_size", "8960"},
    {"max_position_embeddings", "32768"},
    {"max_window_layers", "21"},
    {"model_type", "\"qwen2\""},
    {"num_attention_heads", "12"},
    {"num_hidden_layers", "28"},
    {"num_key_value_heads", "2"},
    {"rms_norm_eps", "1e-06"},
    {"rope_theta", "1000000.0"},
    {"sliding_window", "32768"},
    {"tie_word_embeddings", "true"},
    {"torch_dtype", "\"bfloat16\""},
    {"transformers_version", "\"4.43.1\""},
    {"use_cache", "true"},
    {"use_sliding_window", "false"},
    {"vocab_size", "151936"},
};
#define N_QWEN (sizeof QWEN_CONFIG / sizeof QWEN_CONFIG[0])

/*
 * Writes config.json: the Qwen config with overrides given as (key, json) pairs ending in NULL;
 * a NULL json removes the key, an unknown key is appended.
 */
static void write_config(const char *first_key, ...)
{
    const char *keys[16], *vals[16];
    int n = 0;
    va_list ap;
    va_start(ap, first_key);
    for (const char *k = first_key; k && n < 16; k = va_arg(ap, const char *)) {
        keys[n] = k;
        vals[n] = va_arg(ap, const char *);
        n++;
    }
    va_end(ap);
    char buf[8192];
    size_t len = 0;
    bool used[16] = {0};
    len += (size_t)snprintf(buf + len, sizeof buf - len, "{");
    bool comma = false;
    for (size_t i = 0; i < N_QWEN; i++) {
        const char *v = QWEN_CONFIG[i][1];
        for (int j = 0; j < n; j++) {
            if (strcmp(keys[j], QWEN_CONFIG[i][0]) == 0) {
                v = vals[j];
                used[j] = true;
            }
        }
        if (!v)
            continue;
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%s\n  \"%s\": %s", comma ? "," : "",
                                QWEN_CONFIG[i][0], v);
        comma = true;
    }
    for (int j = 0; j < n; j++) {
        if (!used[j] && vals[j]) {
            len += (size_t)snprintf(buf + len, sizeof buf - len, "%s\n  \"%s\": %s",
                                    comma ? "," : "", keys[j], vals[j]);
            comma = true;
        }
    }
    snprintf(buf + len, sizeof buf - len, "\n}\n");
    write_file("config.json", buf);
}

static void check_qwen(const struct cllm_hparams *hp)
{
    CHECK(strcmp(hp->arch, "qwen2") == 0);
    CHECK(hp->n_vocab == 151936 && hp->n_embd == 1536 && hp->n_ff == 8960);
    CHECK(hp->n_layer == 28 && hp->n_head == 12 && hp->n_head_kv == 2 && hp->head_dim == 128);
    CHECK(hp->n_ctx_train == 32768);
    CHECK(hp->rms_eps == 1e-6f && hp->rope_theta == 1000000.0f && hp->tie_embeddings);
}

static void test_config_valid(void)
{
    struct cllm_hparams hp;
    char err[512] = "";
    write_config(NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    check_qwen(&hp);

    /* transformers v5 layout: rope_parameters, layer_types, null sliding_window */
    write_config("rope_theta", NULL, "rope_parameters",
                 "{\"rope_theta\": 1000000.0, \"rope_type\": \"default\"}", "layer_types",
                 "[\"full_attention\", \"full_attention\"]", "sliding_window", "null", NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    check_qwen(&hp);

    /* rope_scaling null or default-typed; its rope_theta wins over the top-level one */
    write_config("rope_scaling", "null", NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    check_qwen(&hp);
    write_config("rope_scaling", "{\"type\": \"default\", \"rope_theta\": 5e5}", NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(hp.rope_theta == 500000.0f);

    /* defaults: kv heads = heads, head_dim = hidden / heads, theta 10000, untied */
    write_config("num_key_value_heads", NULL, "rope_theta", NULL, "tie_word_embeddings", NULL,
                 NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(hp.n_head_kv == 12 && hp.head_dim == 128 && hp.rope_theta == 10000.0f &&
          !hp.tie_embeddings);
    write_config("num_key_value_heads", "null", "head_dim", "null", NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(hp.n_head_kv == 12 && hp.head_dim == 128);

    /* an explicit head_dim is kept even when it differs from hidden / heads */
    write_config("head_dim", "64", "model_type", "\"llama\"", "hidden_act", NULL, NULL);
    CHECKF(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(hp.head_dim == 64 && strcmp(hp.arch, "llama") == 0);

    /* a trailing '/' on the folder is fine */
    char slash[160];
    snprintf(slash, sizeof slash, "%s/", dir);
    write_config(NULL);
    CHECKF(cllm_hf_read_hparams(slash, &hp, err, sizeof err) == CLLM_OK, "%s", err);
    check_qwen(&hp);
}

/* config.json with the given overrides must fail with want and name the file and needle. */
static void expect_config_bad(enum cllm_status want, const char *needle, int line)
{
    struct cllm_hparams hp;
    char err[512] = "", path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    enum cllm_status st = cllm_hf_read_hparams(dir, &hp, err, sizeof err);
    CHECKF(st == want, "line %d: status %s, want %s (%s)", line, cllm_status_str(st),
           cllm_status_str(want), err);
    CHECKF(strstr(err, path) && strstr(err, needle), "line %d: '%s' lacks '%s'", line, err, needle);
}

#define CONFIG_BAD(want, needle, ...)                                                              \
    do {                                                                                           \
        write_config(__VA_ARGS__, NULL);                                                           \
        expect_config_bad(want, needle, __LINE__);                                                 \
    } while (0)

static void test_config_bad(void)
{
    const enum cllm_status F = CLLM_ERR_FORMAT, R = CLLM_ERR_RANGE, U = CLLM_ERR_UNSUPPORTED;

    /* missing file: the exact message */
    remove_file("config.json");
    struct cllm_hparams hp;
    char err[512] = "", want[300];
    CHECK(cllm_hf_read_hparams(dir, &hp, err, sizeof err) == CLLM_ERR_IO);
    snprintf(want, sizeof want, "%s/config.json: cannot open: No such file or directory", dir);
    CHECKF(strcmp(err, want) == 0, "'%s'", err);

    write_file("config.json", "{\"vocab_size\": ");
    expect_config_bad(F, "not valid JSON", __LINE__);
    write_file("config.json", "[1, 2]");
    expect_config_bad(F, "not a JSON object", __LINE__);
    write_file("config.json", "");
    expect_config_bad(F, "not valid JSON", __LINE__);

    CONFIG_BAD(F, "required key \"vocab_size\" is missing", "vocab_size", NULL);
    CONFIG_BAD(F, "required key \"vocab_size\" is missing", "vocab_size", "null");
    CONFIG_BAD(F, "required key \"model_type\"", "model_type", NULL);
    CONFIG_BAD(F, "required key \"hidden_size\"", "hidden_size", NULL);
    CONFIG_BAD(F, "required key \"intermediate_size\"", "intermediate_size", NULL);
    CONFIG_BAD(F, "required key \"num_hidden_layers\"", "num_hidden_layers", NULL);
    CONFIG_BAD(F, "required key \"num_attention_heads\"", "num_attention_heads", NULL);
    CONFIG_BAD(F, "required key \"max_position_embeddings\"", "max_position_embeddings", NULL);
    CONFIG_BAD(F, "required key \"rms_norm_eps\"", "rms_norm_eps", NULL);

    CONFIG_BAD(F, "\"vocab_size\" must be an integer, not a string", "vocab_size", "\"151936\"");
    CONFIG_BAD(F, "\"vocab_size\" must be an integer, not a boolean", "vocab_size", "true");
    CONFIG_BAD(F, "\"hidden_size\" must be an integer, not 1536.5", "hidden_size", "1536.5");
    CONFIG_BAD(F, "\"num_hidden_layers\" must be an integer, not a list", "num_hidden_layers",
               "[28]");
    CONFIG_BAD(R, "\"num_hidden_layers\" is -1, must be at least 1", "num_hidden_layers", "-1");
    CONFIG_BAD(R, "\"num_attention_heads\" is 0", "num_attention_heads", "0");
    CONFIG_BAD(R, "\"vocab_size\" is 10000000000, larger than", "vocab_size", "1e10");
    CONFIG_BAD(R, "\"num_key_value_heads\" is -2", "num_key_value_heads", "-2");
    CONFIG_BAD(F, "\"head_dim\" must be an integer, not a string", "head_dim", "\"128\"");
    CONFIG_BAD(F, "\"rms_norm_eps\" must be a number, not a string", "rms_norm_eps", "\"1e-6\"");
    CONFIG_BAD(R, "\"rms_norm_eps\" is 0", "rms_norm_eps", "0");
    CONFIG_BAD(R, "\"rms_norm_eps\" is -1e-06", "rms_norm_eps", "-1e-6");
    CONFIG_BAD(R, "\"rope_theta\" is -5", "rope_theta", "-5");
    CONFIG_BAD(F, "\"rope_theta\" must be a number, not a string", "rope_theta", "\"1e6\"");
    CONFIG_BAD(F, "\"tie_word_embeddings\" must be true or false, not a number",
               "tie_word_embeddings", "1");
    CONFIG_BAD(F, "\"model_type\" must be a string, not a number", "model_type", "2");
    CONFIG_BAD(F, "\"model_type\" must be 1 to 31 characters", "model_type",
               "\"a-model-type-name-that-is-far-too-long\"");
    CONFIG_BAD(F, "\"model_type\" must be 1 to 31", "model_type", "\"\"");

    CONFIG_BAD(U, "\"rope_scaling\" of type 'linear' is not supported", "rope_scaling",
               "{\"type\": \"linear\", \"factor\": 2.0}");
    CONFIG_BAD(U, "\"rope_scaling\" of type 'yarn'", "rope_scaling",
               "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
               "\"original_max_position_embeddings\": 32768}");
    CONFIG_BAD(U, "\"rope_parameters\" of type 'llama3'", "rope_parameters",
               "{\"rope_type\": \"llama3\", \"rope_theta\": 500000.0}");
    CONFIG_BAD(F, "\"rope_scaling\" must be an object or null, not a string", "rope_scaling",
               "\"linear\"");
    CONFIG_BAD(F, "\"rope_scaling\" type must be a string", "rope_scaling", "{\"type\": 1}");
    CONFIG_BAD(R, "\"rope_parameters.rope_theta\" is 0", "rope_parameters",
               "{\"rope_type\": \"default\", \"rope_theta\": 0}");
    CONFIG_BAD(U, "per-layer RoPE parameters (\"full_attention\")", "rope_parameters",
               "{\"full_attention\": {\"rope_type\": \"default\"}}");
    CONFIG_BAD(U, "partial_rotary_factor 0.5 is not supported", "partial_rotary_factor", "0.5");
    CONFIG_BAD(U, "rope_parameters.partial_rotary_factor 0.25", "rope_parameters",
               "{\"rope_type\": \"default\", \"partial_rotary_factor\": 0.25}");
    CONFIG_BAD(U, "use_sliding_window is true", "use_sliding_window", "true");
    CONFIG_BAD(F, "\"use_sliding_window\" must be true or false", "use_sliding_window", "\"no\"");
    CONFIG_BAD(U, "layer type 'sliding_attention' is not supported", "layer_types",
               "[\"full_attention\", \"sliding_attention\"]");
    CONFIG_BAD(U, "hidden_act 'gelu' is not supported", "hidden_act", "\"gelu\"");

    /* values that parse but fail cllm_hparams_valid */
    CONFIG_BAD(R, "not a multiple of key/value heads", "num_key_value_heads", "5");
    CONFIG_BAD(R, "head dimension 127 is odd", "head_dim", "127");
    CONFIG_BAD(F, "hidden_size 1537 is not a multiple of num_attention_heads 12", "hidden_size",
               "1537");

    /* every prefix of a valid config.json fails and never crashes */
    write_config(NULL);
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    char full[8192];
    size_t n = fread(full, 1, sizeof full - 1, f);
    fclose(f);
    full[n] = '\0';
    int failed = 0;
    /* the last bytes are "}\n": dropping only the newline leaves a valid object */
    for (size_t len = 0; len + 1 < n; len++) {
        char saved = full[len];
        full[len] = '\0';
        write_file("config.json", full);
        full[len] = saved;
        if (cllm_hf_read_hparams(dir, &hp, err, sizeof err) != CLLM_OK && strstr(err, path))
            failed++;
    }
    CHECKF(failed == (int)n - 1, "%d of %zu prefixes failed", failed, n - 1);
}

static void test_gen_defaults(void)
{
    struct cllm_gen_defaults g;
    char err[512] = "";

    cllm_gen_defaults_init(&g);
    CHECK(!g.do_sample && g.temperature == 1.0f && g.top_p == 1.0f && g.top_k == 50);
    CHECK(g.repetition_penalty == 1.0f && g.max_new_tokens == 0 && g.n_eos == 0);
    CHECK(g.bos_id == -1 && g.pad_id == -1);

    /* absent file: defaults, not an error */
    remove_file("generation_config.json");
    memset(&g, 0x55, sizeof g);
    CHECKF(cllm_hf_read_gen_defaults(dir, &g, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(!g.do_sample && g.temperature == 1.0f && g.top_k == 50 && g.n_eos == 0 && g.bos_id == -1);

    /* Qwen2.5-1.5B-Instruct's generation_config.json */
    write_file("generation_config.json",
               "{\n  \"bos_token_id\": 151643,\n  \"pad_token_id\": 151643,\n"
               "  \"do_sample\": true,\n  \"eos_token_id\": [\n    151645,\n    151643\n  ],\n"
               "  \"repetition_penalty\": 1.1,\n  \"temperature\": 0.7,\n  \"top_p\": 0.8,\n"
               "  \"top_k\": 20,\n  \"transformers_version\": \"4.37.0\"\n}\n");
    CHECKF(cllm_hf_read_gen_defaults(dir, &g, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(g.do_sample && g.temperature == 0.7f && g.top_p == 0.8f && g.top_k == 20);
    CHECK(g.repetition_penalty == 1.1f && g.max_new_tokens == 0);
    CHECK(g.n_eos == 2 && g.eos_ids[0] == 151645 && g.eos_ids[1] == 151643);
    CHECK(g.bos_id == 151643 && g.pad_id == 151643);

    /* eos as one int; nulls and unknown keys keep the defaults */
    write_file("generation_config.json",
               "{\"eos_token_id\": 151643, \"temperature\": null, \"max_new_tokens\": 512, "
               "\"max_length\": 32768, \"bos_token_id\": null}");
    CHECKF(cllm_hf_read_gen_defaults(dir, &g, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(g.n_eos == 1 && g.eos_ids[0] == 151643 && g.temperature == 1.0f);
    CHECK(g.max_new_tokens == 512 && g.bos_id == -1 && !g.do_sample);
    write_file("generation_config.json", "{\"eos_token_id\": []}");
    CHECKF(cllm_hf_read_gen_defaults(dir, &g, err, sizeof err) == CLLM_OK && g.n_eos == 0, "%s",
           err);
    write_file("generation_config.json", "{\"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8]}");
    CHECKF(cllm_hf_read_gen_defaults(dir, &g, err, sizeof err) == CLLM_OK && g.n_eos == 8 &&
               g.eos_ids[7] == 8,
           "%s", err);

    static const struct {
        const char *json;
        enum cllm_status want;
        const char *needle;
    } bad[] = {
        {"{\"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8, 9]}", CLLM_ERR_RANGE,
         "lists 9 ids, at most 8"},
        {"{\"eos_token_id\": \"</s>\"}", CLLM_ERR_FORMAT,
         "\"eos_token_id\" must be an integer or a list of integers, not a string"},
        {"{\"eos_token_id\": [1, -1]}", CLLM_ERR_RANGE, "\"eos_token_id\" is -1"},
        {"{\"eos_token_id\": [1, 2.5]}", CLLM_ERR_FORMAT, "must be an integer, not 2.5"},
        {"{\"eos_token_id\": [1, \"x\"]}", CLLM_ERR_FORMAT, "must be an integer, not a string"},
        {"{\"top_p\": 1.5}", CLLM_ERR_RANGE, "\"top_p\" is 1.5"},
        {"{\"temperature\": -1}", CLLM_ERR_RANGE, "\"temperature\" is -1"},
        {"{\"temperature\": \"hot\"}", CLLM_ERR_FORMAT, "\"temperature\" must be a number"},
        {"{\"top_k\": -1}", CLLM_ERR_RANGE, "\"top_k\" is -1"},
        {"{\"top_k\": 2.5}", CLLM_ERR_FORMAT, "\"top_k\" must be an integer"},
        {"{\"repetition_penalty\": 0}", CLLM_ERR_RANGE, "\"repetition_penalty\" is 0"},
        {"{\"do_sample\": \"yes\"}", CLLM_ERR_FORMAT, "\"do_sample\" must be true or false"},
        {"{\"max_new_tokens\": -5}", CLLM_ERR_RANGE, "\"max_new_tokens\" is -5"},
        {"{\"pad_token_id\": \"x\"}", CLLM_ERR_FORMAT, "\"pad_token_id\" must be an integer"},
        {"{\"top_k\": ", CLLM_ERR_FORMAT, "not valid JSON"},
        {"7", CLLM_ERR_FORMAT, "not a JSON object"},
    };
    char path[256];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file("generation_config.json", bad[i].json);
        err[0] = '\0';
        enum cllm_status st = cllm_hf_read_gen_defaults(dir, &g, err, sizeof err);
        CHECKF(st == bad[i].want, "%s: status %s (%s)", bad[i].json, cllm_status_str(st), err);
        CHECKF(strstr(err, path) && strstr(err, bad[i].needle), "%s: '%s' lacks '%s'", bad[i].json,
               err, bad[i].needle);
        /* a failed read leaves the defaults, not half a file */
        CHECK(g.top_k == 50 && g.n_eos == 0 && g.temperature == 1.0f);
    }
    remove_file("generation_config.json");
}

static void test_tokenizer_config(void)
{
    struct cllm_hf_tokenizer_config tc;
    char err[512] = "", path[256];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);

    /* neither file: nothing set, not an error */
    remove_file("tokenizer_config.json");
    remove_file("chat_template.jinja");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(!tc.chat_template && !tc.bos_token && !tc.eos_token && !tc.pad_token && !tc.unk_token);
    CHECK(tc.add_bos_token == -1 && tc.add_eos_token == -1);
    cllm_hf_tokenizer_config_free(&tc);

    /* Qwen2.5's shape: template string with escapes, null bos/unk, string eos/pad */
    write_file("tokenizer_config.json",
               "{\"add_prefix_space\": false, \"added_tokens_decoder\": {\"151643\": "
               "{\"content\": \"<|endoftext|>\", \"special\": true}}, \"bos_token\": null, "
               "\"chat_template\": \"{%- for m in messages %}{{ '<|im_start|>' + m.role + "
               "'\\\\n' }}{%- endfor %}\\n\", \"eos_token\": \"<|im_end|>\", "
               "\"pad_token\": \"<|endoftext|>\", \"unk_token\": null, "
               "\"model_max_length\": 131072, \"tokenizer_class\": \"Qwen2Tokenizer\"}");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(tc.chat_template && strcmp(tc.chat_template, "{%- for m in messages %}{{ "
                                                       "'<|im_start|>' + m.role + '\\n' }}{%- "
                                                       "endfor %}\n") == 0);
    CHECK(tc.eos_token && strcmp(tc.eos_token, "<|im_end|>") == 0);
    CHECK(tc.pad_token && strcmp(tc.pad_token, "<|endoftext|>") == 0);
    CHECK(!tc.bos_token && !tc.unk_token && tc.add_bos_token == -1);
    cllm_hf_tokenizer_config_free(&tc);
    CHECK(!tc.chat_template && !tc.eos_token);
    cllm_hf_tokenizer_config_free(&tc); /* twice is harmless */

    /* list templates ("default" wins, else the first); AddedToken objects; flags */
    write_file("tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T1\"}, "
               "{\"name\": \"default\", \"template\": \"T2\"}], "
               "\"bos_token\": {\"__type\": \"AddedToken\", \"content\": \"<s>\", "
               "\"lstrip\": false}, \"eos_token\": \"</s>\", \"unk_token\": \"<unk>\", "
               "\"add_bos_token\": true, \"add_eos_token\": false}");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(tc.chat_template && strcmp(tc.chat_template, "T2") == 0);
    CHECK(tc.bos_token && strcmp(tc.bos_token, "<s>") == 0);
    CHECK(tc.unk_token && strcmp(tc.unk_token, "<unk>") == 0);
    CHECK(tc.add_bos_token == 1 && tc.add_eos_token == 0);
    cllm_hf_tokenizer_config_free(&tc);
    write_file("tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"a\", \"template\": \"A\"}, "
               "{\"name\": \"b\", \"template\": \"B\"}]}");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(tc.chat_template && strcmp(tc.chat_template, "A") == 0);
    cllm_hf_tokenizer_config_free(&tc);

    /* chat_template.jinja overrides the config's template, and works without the config */
    write_file("chat_template.jinja", "{{ jinja }}\n");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(tc.chat_template && strcmp(tc.chat_template, "{{ jinja }}\n") == 0);
    cllm_hf_tokenizer_config_free(&tc);
    remove_file("tokenizer_config.json");
    CHECKF(cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(tc.chat_template && strcmp(tc.chat_template, "{{ jinja }}\n") == 0 && !tc.eos_token);
    cllm_hf_tokenizer_config_free(&tc);
    remove_file("chat_template.jinja");

    static const struct {
        const char *json;
        const char *needle;
    } bad[] = {
        {"{\"chat_template\": 5}", "\"chat_template\" must be a string or a list, not a number"},
        {"{\"chat_template\": []}", "\"chat_template\" is an empty list"},
        {"{\"chat_template\": [{\"name\": \"default\"}]}", "\"chat_template\"[0] is not"},
        {"{\"chat_template\": [{\"name\": \"a\", \"template\": \"A\"}, \"B\"]}",
         "\"chat_template\"[1] is not"},
        {"{\"eos_token\": 7}", "\"eos_token\" must be a string or an object"},
        {"{\"pad_token\": {\"lstrip\": true}}", "\"pad_token\".content is missing"},
        {"{\"bos_token\": [\"<s>\"]}", "\"bos_token\" must be a string"},
        {"{\"add_bos_token\": \"yes\"}", "\"add_bos_token\" must be true or false"},
        {"{\"eos_token\": \"</s>\", ", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file("tokenizer_config.json", bad[i].json);
        err[0] = '\0';
        enum cllm_status st = cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err);
        CHECKF(st == CLLM_ERR_FORMAT, "%s: status %s (%s)", bad[i].json, cllm_status_str(st), err);
        CHECKF(strstr(err, path) && strstr(err, bad[i].needle), "%s: '%s' lacks '%s'", bad[i].json,
               err, bad[i].needle);
        /* nothing left to free on failure */
        CHECK(!tc.chat_template && !tc.bos_token && !tc.eos_token && !tc.pad_token);
    }
    remove_file("tokenizer_config.json");
}

static void test_hparams_valid(void)
{
    struct cllm_hparams hp = {.arch = "qwen2",
                              .n_vocab = 151936,
                              .n_embd = 1536,
                              .n_ff = 8960,
                              .n_layer = 28,
                              .n_head = 12,
                              .n_head_kv = 2,
                              .head_dim = 128,
                              .n_ctx_train = 32768,
                              .rms_eps = 1e-6f,
                              .rope_theta = 1e6f,
                              .tie_embeddings = true};
    char err[256];
    CHECK(cllm_hparams_valid(&hp, err, sizeof err));
    struct cllm_hparams h = hp;
    h.n_vocab = 0;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "vocab size is 0"));
    h = hp;
    h.n_layer = -3;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "layer count is -3"));
    h = hp;
    h.n_head_kv = 0;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "key/value head count"));
    h = hp;
    h.n_head_kv = 5;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "not a multiple"));
    h = hp;
    h.head_dim = 63;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "odd"));
    h = hp;
    h.rms_eps = 0.0f;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "epsilon"));
    h = hp;
    h.rope_theta = -1.0f;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "theta"));
    h = hp;
    h.n_ctx_train = 0;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "context length"));
    h = hp;
    h.arch[0] = '\0';
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "architecture"));
    h = hp;
    h.n_head = 1 << 20;
    h.n_head_kv = 1;
    h.head_dim = 1 << 12;
    CHECK(!cllm_hparams_valid(&h, err, sizeof err) && strstr(err, "overflows"));
}

int main(void)
{
    snprintf(tmp, sizeof tmp, "/tmp/cllm_test_hf_XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(dir, sizeof dir, "%s/model", tmp);
    mkdir(dir, 0700);
    test_hparams_valid();
    test_config_valid();
    test_config_bad();
    test_gen_defaults();
    test_tokenizer_config();
    nftw(tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    struct stat sb;
    CHECK(stat(tmp, &sb) != 0);
    return test_summary();
}
