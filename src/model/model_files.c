/*
 * Format dispatch for opening a model: GGUF metadata keys ("qwen2.block_count", ...) and HF
 * JSON files are both turned into cllm_hparams / cllm_gen_defaults, and both tokenizer sources
 * into a cllm_tokenizer.
 */
#include "model/model_files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/alloc.h"
#include "core/path.h"
#include "core/status.h"
#include "model/gguf.h"
#include "model/hf_config.h"
#include "model/qwen2.h"
#include "model/safetensors.h"
#include "model/vocab_load.h"

/* Reads "<arch>.<suffix>" as a positive int32; false if missing or not one. */
static bool gguf_arch_i32(const struct cllm_gguf *g, const char *arch, const char *suffix,
                          int32_t *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return cllm_gguf_get_i32(g, key, out) && *out > 0;
}

static bool gguf_arch_f32(const struct cllm_gguf *g, const char *arch, const char *suffix,
                          float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return cllm_gguf_get_f32(g, key, out);
}

static enum cllm_status gguf_hparams(const struct cllm_gguf *g, struct cllm_hparams *hp,
                                     char *err, size_t err_len)
{
    const char *path = cllm_gguf_path(g);
    struct cllm_gguf_str arch;
    memset(hp, 0, sizeof *hp);
    if (!cllm_gguf_get_str(g, "general.architecture", &arch) || arch.len == 0 ||
        arch.len >= sizeof hp->arch)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: general.architecture is missing or not a short string", path);
    memcpy(hp->arch, arch.ptr, (size_t)arch.len);
    hp->arch[arch.len] = '\0';
    if (strcmp(hp->arch, "qwen2") != 0 && strcmp(hp->arch, "llama") != 0)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: architecture \"%s\" is not supported (qwen2, llama)", path, hp->arch);
    static const struct {
        const char *suffix;
        size_t offset;
    } ints[] = {
        {"block_count", offsetof(struct cllm_hparams, n_layer)},
        {"context_length", offsetof(struct cllm_hparams, n_ctx_train)},
        {"embedding_length", offsetof(struct cllm_hparams, n_embd)},
        {"feed_forward_length", offsetof(struct cllm_hparams, n_ff)},
        {"attention.head_count", offsetof(struct cllm_hparams, n_head)},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (!gguf_arch_i32(g, hp->arch, ints[i].suffix, (int32_t *)((char *)hp + ints[i].offset)))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: %s.%s is missing or not a positive integer", path, hp->arch,
                             ints[i].suffix);
    if (!gguf_arch_i32(g, hp->arch, "attention.head_count_kv", &hp->n_head_kv))
        hp->n_head_kv = hp->n_head;
    if (!gguf_arch_i32(g, hp->arch, "attention.key_length", &hp->head_dim))
        hp->head_dim = hp->n_embd / hp->n_head;
    if (!gguf_arch_f32(g, hp->arch, "attention.layer_norm_rms_epsilon", &hp->rms_eps))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: %s.attention.layer_norm_rms_epsilon is missing", path, hp->arch);
    if (!gguf_arch_f32(g, hp->arch, "rope.freq_base", &hp->rope_theta))
        hp->rope_theta = 10000.0f;
    const struct cllm_tensor *embd = cllm_gguf_find_tensor(g, "token_embd.weight");
    if (!embd || embd->n_dims != 2 || embd->ne[1] > INT32_MAX)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor token_embd.weight is missing or not 2-D", path);
    hp->n_vocab = (int32_t)embd->ne[1];
    hp->tie_embeddings = cllm_gguf_find_tensor(g, "output.weight") == NULL;
    char why[200];
    if (!cllm_hparams_valid(hp, why, sizeof why))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: %s", path, why);
    return CLLM_OK;
}

static void gguf_gen_defaults(const struct cllm_gguf *g, struct cllm_gen_defaults *gen)
{
    cllm_gen_defaults_init(gen);
    int32_t id;
    /* GGUF carries stop tokens but no sampling settings: those keep transformers' defaults. */
    if (cllm_gguf_get_i32(g, "tokenizer.ggml.eos_token_id", &id))
        gen->eos_ids[gen->n_eos++] = id;
    if (cllm_gguf_get_i32(g, "tokenizer.ggml.eot_token_id", &id) && id != gen->eos_ids[0])
        gen->eos_ids[gen->n_eos++] = id;
    if (cllm_gguf_get_i32(g, "tokenizer.ggml.bos_token_id", &id))
        gen->bos_id = id;
    if (cllm_gguf_get_i32(g, "tokenizer.ggml.padding_token_id", &id))
        gen->pad_id = id;
}

static enum cllm_status open_gguf(struct cllm_model_files *mf, char *err, size_t err_len)
{
    enum cllm_status st;
    if ((st = cllm_gguf_open(&mf->gguf, mf->path, err, err_len)) ||
        (st = gguf_hparams(mf->gguf, &mf->hp, err, err_len)) ||
        (st = cllm_vocab_load_gguf(&mf->tok, mf->gguf, err, err_len)))
        return st;
    gguf_gen_defaults(mf->gguf, &mf->gen);
    struct cllm_gguf_str tmpl;
    if (cllm_gguf_get_str(mf->gguf, "tokenizer.chat_template", &tmpl)) {
        mf->chat_template = cllm_strndup(tmpl.ptr, (size_t)tmpl.len);
        if (!mf->chat_template)
            return CLLM_ERR_NOMEM;
    }
    return CLLM_OK;
}

static enum cllm_status open_hf(struct cllm_model_files *mf, char *err, size_t err_len)
{
    enum cllm_status st;
    struct cllm_hf_tokenizer_config tc;
    char *tok_path = cllm_path_join(mf->path, "tokenizer.json");
    if (!tok_path)
        return CLLM_ERR_NOMEM;
    if ((st = cllm_hf_read_hparams(mf->path, &mf->hp, err, err_len)) ||
        (st = cllm_hf_read_gen_defaults(mf->path, &mf->gen, err, err_len)) ||
        (st = cllm_st_open_dir(&mf->st, mf->path, err, err_len)) ||
        (st = cllm_vocab_load_json(&mf->tok, tok_path, err, err_len)) ||
        (st = cllm_hf_read_tokenizer_config(mf->path, &tc, err, err_len))) {
        free(tok_path);
        return st;
    }
    free(tok_path);
    mf->chat_template = tc.chat_template;
    tc.chat_template = NULL;
    cllm_hf_tokenizer_config_free(&tc);
    return CLLM_OK;
}

enum cllm_status cllm_model_files_open(struct cllm_model_files **out, const char *path, char *err,
                                       size_t err_len)
{
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return cllm_fail(err, err_len, CLLM_ERR_IO, "%s: %s", path, strerror(errno));
    struct cllm_model_files *mf = calloc(1, sizeof *mf);
    if (!mf || !(mf->path = cllm_strndup(path, strlen(path)))) {
        free(mf);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    }
    mf->format = S_ISDIR(sb.st_mode) ? CLLM_MODEL_FORMAT_HF : CLLM_MODEL_FORMAT_GGUF;
    enum cllm_status st = mf->format == CLLM_MODEL_FORMAT_HF ? open_hf(mf, err, err_len)
                                                             : open_gguf(mf, err, err_len);
    if (st == CLLM_OK && cllm_tokenizer_n_vocab(mf->tok) > mf->hp.n_vocab)
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                       "%s: the tokenizer has %d tokens but the model only %d embedding rows", path,
                       (int)cllm_tokenizer_n_vocab(mf->tok), (int)mf->hp.n_vocab);
    if (st) {
        if (st == CLLM_ERR_NOMEM)
            cllm_fail(err, err_len, st, "%s: out of memory", path);
        cllm_model_files_free(mf);
        return st;
    }
    *out = mf;
    return CLLM_OK;
}

void cllm_model_files_free(struct cllm_model_files *mf)
{
    if (!mf)
        return;
    cllm_tokenizer_free(mf->tok);
    cllm_gguf_free(mf->gguf);
    cllm_st_free(mf->st);
    free(mf->chat_template);
    free(mf->path);
    free(mf);
}

const struct cllm_tensor *cllm_model_files_tensor(const struct cllm_model_files *mf,
                                                  const char *name)
{
    if (mf->gguf)
        return cllm_gguf_find_tensor(mf->gguf, name);
    char hf[256];
    if (!cllm_qwen2_hf_name(name, hf, sizeof hf))
        return NULL;
    return cllm_st_find(mf->st, hf);
}

size_t cllm_model_files_n_tensors(const struct cllm_model_files *mf)
{
    return mf->gguf ? (size_t)cllm_gguf_n_tensors(mf->gguf) : cllm_st_count(mf->st);
}

const struct cllm_tensor *cllm_model_files_tensor_at(const struct cllm_model_files *mf, size_t i)
{
    return mf->gguf ? cllm_gguf_tensor(mf->gguf, i) : cllm_st_tensor(mf->st, i);
}

/* Requires tensor `name` with dims {d0, d1} (d1 == 0 for a vector). */
static enum cllm_status need(const struct cllm_model_files *mf, const char *name, int64_t d0,
                             int64_t d1, char *err, size_t err_len)
{
    const struct cllm_tensor *t = cllm_model_files_tensor(mf, name);
    if (!t)
        return cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND, "%s: tensor %s is missing", mf->path,
                         name);
    int want_dims = d1 ? 2 : 1;
    if (t->n_dims != want_dims || t->ne[0] != d0 || (d1 && t->ne[1] != d1))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor %s has shape {%lld, %lld}, expected {%lld, %lld}", mf->path,
                         name, (long long)t->ne[0], (long long)t->ne[1], (long long)d0,
                         (long long)(d1 ? d1 : 1));
    return CLLM_OK;
}

enum cllm_status cllm_model_files_check_tensors(const struct cllm_model_files *mf, char *err,
                                                size_t err_len)
{
    const struct cllm_hparams *hp = &mf->hp;
    int64_t q = (int64_t)hp->n_head * hp->head_dim, kv = (int64_t)hp->n_head_kv * hp->head_dim;
    enum cllm_status st;
    if ((st = need(mf, "token_embd.weight", hp->n_embd, hp->n_vocab, err, err_len)) ||
        (st = need(mf, "output_norm.weight", hp->n_embd, 0, err, err_len)))
        return st;
    if (!hp->tie_embeddings &&
        (st = need(mf, "output.weight", hp->n_embd, hp->n_vocab, err, err_len)))
        return st;
    bool biases = strcmp(hp->arch, "qwen2") == 0;
    for (int l = 0; l < hp->n_layer; l++) {
        const struct {
            const char *name;
            int64_t d0, d1;
            bool needed;
        } layer[] = {
            {"attn_norm.weight", hp->n_embd, 0, true},  {"attn_q.weight", hp->n_embd, q, true},
            {"attn_k.weight", hp->n_embd, kv, true},    {"attn_v.weight", hp->n_embd, kv, true},
            {"attn_q.bias", q, 0, biases},              {"attn_k.bias", kv, 0, biases},
            {"attn_v.bias", kv, 0, biases},             {"attn_output.weight", q, hp->n_embd, true},
            {"ffn_norm.weight", hp->n_embd, 0, true},   {"ffn_gate.weight", hp->n_embd, hp->n_ff, true},
            {"ffn_up.weight", hp->n_embd, hp->n_ff, true}, {"ffn_down.weight", hp->n_ff, hp->n_embd, true},
        };
        for (size_t i = 0; i < sizeof layer / sizeof layer[0]; i++) {
            if (!layer[i].needed)
                continue;
            char name[64];
            snprintf(name, sizeof name, "blk.%d.%s", l, layer[i].name);
            if ((st = need(mf, name, layer[i].d0, layer[i].d1, err, err_len)))
                return st;
        }
    }
    return CLLM_OK;
}
