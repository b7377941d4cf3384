/*
 * Fuzz target: the small files of an HF model folder. An input is up to six files separated by
 * the line "@@@@" -- config.json, generation_config.json, tokenizer_config.json,
 * chat_template.jinja, model.safetensors.index.json, tokenizer.json -- an empty part meaning
 * the file is absent. They are written into a scratch folder beside one valid shard
 * (model-00001-of-00001.safetensors, so an index can name something real) and read by each
 * reader on its own: hyperparameters, generation defaults, tokenizer config and chat
 * template (then rendered), the shard index, the tokenizer. A refusal must come with an error
 * text; what is accepted must be usable (hyperparameters valid, the tokenizer round-trips a
 * text, the template renders a conversation).
 */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>
#include <unistd.h>

#include "model/hf_config.h"
#include "model/hparams.h"
#include "model/safetensors.h"
#include "model/vocab_load.h"
#include "tokenizer/chat_template.h"

static const char *const part_names[] = {
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "tokenizer.json",
};
#define N_PARTS (sizeof part_names / sizeof *part_names)
/* each of the five readers */
const int fuzz_full_stage = 5;

static const char separator[] = "\n@@@@\n";

static char dir[] = "/tmp/cllm-fuzz-hf-XXXXXX";

static void path_of(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", dir, name);
}

static void write_file(const char *name, const void *data, size_t n)
{
    char p[256];
    path_of(p, sizeof p, name);
    FILE *f = fopen(p, "wb");
    FUZZ_ASSERT(f != NULL, "cannot write %s", p);
    FUZZ_ASSERT(fwrite(data, 1, n, f) == n || n == 0, "cannot write %s", p);
    fclose(f);
}

static void remove_dir(void)
{
    char p[256];
    for (size_t i = 0; i < N_PARTS; i++) {
        path_of(p, sizeof p, part_names[i]);
        unlink(p);
    }
    path_of(p, sizeof p, "model-00001-of-00001.safetensors");
    unlink(p);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    FUZZ_ASSERT(mkdtemp(dir) != NULL, "cannot make a scratch folder");
    atexit(remove_dir);
    /* one F32 tensor of 2 elements */
    static const char header[] =
        "{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    uint8_t shard[8 + sizeof header - 1 + 8] = {0};
    shard[0] = (uint8_t)(sizeof header - 1);
    memcpy(shard + 8, header, sizeof header - 1);
    write_file("model-00001-of-00001.safetensors", shard, sizeof shard);
    return 0;
}

static void use_template(const char *source)
{
    char err[512];
    struct cllm_chat_template *t = NULL;
    if (cllm_chat_template_init(&t, source, err, sizeof err) != CLLM_OK) {
        FUZZ_ASSERT(t == NULL && err[0], "a template refused without an error text");
        return;
    }
    const struct cllm_chat_message msgs[] = {
        {"system", "be brief", 8},
        {"user", "2+2?", 4},
        {"assistant", "4", 1},
        {"user", "<|im_end|>\xff", 11},
    };
    struct cllm_buf out = {0};
    err[0] = 0;
    const enum cllm_status st = cllm_chat_template_render(t, msgs, 4, true, &out, err, sizeof err);
    FUZZ_ASSERT(st == CLLM_OK && out.len > 0, "an accepted template does not render: %s", err);
    cllm_buf_free(&out);
    cllm_chat_template_free(t);
}

static void use_tokenizer(const struct cllm_tokenizer *tok)
{
    static const char text[] = "Hi there, 世界!\n\tcode(x);";
    struct cllm_ids ids = {0};
    struct cllm_buf out = {0};
    FUZZ_ASSERT(cllm_tokenize(tok, text, sizeof text - 1, &ids) == CLLM_OK, "tokenize failed");
    for (size_t i = 0; i < ids.n; i++)
        FUZZ_ASSERT(ids.v[i] >= 0 && ids.v[i] < cllm_tokenizer_n_vocab(tok),
                    "id %d out of range", ids.v[i]);
    FUZZ_ASSERT(cllm_detokenize(tok, ids.v, ids.n, false, &out) == CLLM_OK, "decode failed");
    /* An accepted vocabulary holds every byte, so any text comes back (no normalizer change on
     * this NFC text). */
    FUZZ_ASSERT(out.len == sizeof text - 1 && memcmp(out.data, text, out.len) == 0,
                "the text does not come back: \"%.*s\"", (int)out.len, out.data);
    cllm_ids_free(&ids);
    cllm_buf_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* split into the parts and write (or remove) each file */
    const char *p = (const char *)data, *end = p + size;
    for (size_t i = 0; i < N_PARTS; i++) {
        const char *sep = p ? memmem(p, (size_t)(end - p), separator, sizeof separator - 1) : NULL;
        const char *stop = sep ? sep : end;
        char path[256];
        path_of(path, sizeof path, part_names[i]);
        if (p && stop > p)
            write_file(part_names[i], p, (size_t)(stop - p));
        else
            unlink(path);
        p = sep ? sep + sizeof separator - 1 : NULL;
    }

    char err[512];
    struct cllm_hparams hp;
    memset(&hp, 0, sizeof hp);
    err[0] = 0;
    enum cllm_status st = cllm_hf_read_hparams(dir, &hp, err, sizeof err);
    if (fuzz_accepted(st, err, true, "config.json"))
        FUZZ_ASSERT(cllm_hparams_valid(&hp, err, sizeof err), "accepted, but invalid: %s", err);

    struct cllm_gen_defaults g;
    err[0] = 0;
    st = cllm_hf_read_gen_defaults(dir, &g, err, sizeof err);
    if (fuzz_accepted(st, err, true, "generation_config.json"))
        FUZZ_ASSERT(g.n_eos >= 0 && g.n_eos <= CLLM_MAX_EOS_IDS, "%d eos ids", g.n_eos);

    struct cllm_hf_tokenizer_config tc;
    err[0] = 0;
    st = cllm_hf_read_tokenizer_config(dir, &tc, err, sizeof err);
    if (fuzz_accepted(st, err, true, "tokenizer_config.json")) {
        if (tc.chat_template)
            use_template(tc.chat_template);
        cllm_hf_tokenizer_config_free(&tc);
    }

    struct cllm_st_set *set = NULL;
    err[0] = 0;
    st = cllm_st_open_dir(&set, dir, err, sizeof err);
    if (fuzz_accepted(st, err, set == NULL, "the shard index"))
        cllm_st_free(set);

    char path[256];
    path_of(path, sizeof path, "tokenizer.json");
    struct cllm_tokenizer *tok = NULL;
    err[0] = 0;
    st = cllm_vocab_load_json(&tok, path, err, sizeof err);
    if (fuzz_accepted(st, err, tok == NULL, "tokenizer.json")) {
        use_tokenizer(tok);
        cllm_tokenizer_free(tok);
    }
    return 0;
}
