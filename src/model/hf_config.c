/*
 * config.json, generation_config.json, tokenizer_config.json and chat_template.jinja of an HF
 * model folder, parsed with cJSON into the format-neutral structs of hparams.h. Every value is
 * type-checked (JSON numbers must be integral where transformers expects an int) so a broken
 * export fails at load with the file and key named, never later with a wrong shape.
 */
#include "model/hf_config.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/mmap.h"
#include "core/path.h"
#include "core/status.h"

static bool file_missing(const char *path)
{
    struct stat sb;
    return stat(path, &sb) != 0 && errno == ENOENT;
}

/*
 * Reads and parses DIR/name into *root (a JSON object) and *path (malloc'd, for messages; the
 * caller frees both). If optional and the file does not exist, *root is NULL and the result OK.
 */
static enum cllm_status load_json(const char *dir, const char *name, size_t cap, bool optional,
                                  cJSON **root, char **path, char *err, size_t err_len)
{
    *root = NULL;
    *path = cllm_path_join(dir, name);
    if (!*path)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", dir);
    if (optional && file_missing(*path))
        return CLLM_OK;
    char *text = NULL;
    size_t len = 0;
    enum cllm_status st = cllm_read_file(*path, cap, &text, &len, err, err_len);
    if (st)
        return st;
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!*root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        st =
            cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", *path, at);
    } else if (!cJSON_IsObject(*root)) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: not a JSON object", *path);
        cJSON_Delete(*root);
        *root = NULL;
    }
    free(text);
    return st;
}

static const char *type_name(const cJSON *v)
{
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsArray(v))
        return "a list";
    if (cJSON_IsObject(v))
        return "an object";
    return "null";
}

/* obj[key], with null treated as absent (transformers writes null for unset options). */
static const cJSON *get(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static enum cllm_status missing(const char *path, const char *key, char *err, size_t err_len)
{
    return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: required key \"%s\" is missing", path,
                     key);
}

/* An integral JSON number in [lo, INT32_MAX] from v (non-NULL), named key in messages. */
static enum cllm_status as_int(const char *path, const char *key, const cJSON *v, int64_t lo,
                               int32_t *out, char *err, size_t err_len)
{
    if (!cJSON_IsNumber(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"%s\" must be an integer, not %s",
                         path, key, type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"%s\" must be an integer, not %g",
                         path, key, d);
    if (d < (double)lo)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s: \"%s\" is %.0f, must be at least %lld",
                         path, key, d, (long long)lo);
    if (d > (double)INT32_MAX)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s: \"%s\" is %.0f, larger than %d", path,
                         key, d, INT32_MAX);
    *out = (int32_t)d;
    return CLLM_OK;
}

/* obj[key] as an integer >= lo; absent leaves *out untouched unless required. */
static enum cllm_status get_int(const char *path, const cJSON *obj, const char *key, bool required,
                                int64_t lo, int32_t *out, char *err, size_t err_len)
{
    const cJSON *v = get(obj, key);
    if (!v)
        return required ? missing(path, key, err, err_len) : CLLM_OK;
    return as_int(path, key, v, lo, out, err, err_len);
}

/* A finite JSON number in [lo, hi] (lo excluded if lo_open) from v (non-NULL). */
static enum cllm_status as_num(const char *path, const char *key, const cJSON *v, double lo,
                               bool lo_open, double hi, float *out, char *err, size_t err_len)
{
    if (!cJSON_IsNumber(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"%s\" must be a number, not %s", path,
                         key, type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || (lo_open && d == lo) || d > hi)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s: \"%s\" is %g, must be in %c%g, %g]",
                         path, key, d, lo_open ? '(' : '[', lo, hi);
    *out = (float)d;
    return CLLM_OK;
}

/* obj[key] as in as_num; absent leaves *out untouched unless required. */
static enum cllm_status get_num(const char *path, const cJSON *obj, const char *key, bool required,
                                double lo, bool lo_open, double hi, float *out, char *err,
                                size_t err_len)
{
    const cJSON *v = get(obj, key);
    if (!v)
        return required ? missing(path, key, err, err_len) : CLLM_OK;
    return as_num(path, key, v, lo, lo_open, hi, out, err, err_len);
}

static enum cllm_status get_bool(const char *path, const cJSON *obj, const char *key, bool *out,
                                 char *err, size_t err_len)
{
    const cJSON *v = get(obj, key);
    if (!v)
        return CLLM_OK;
    if (!cJSON_IsBool(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"%s\" must be true or false, not %s",
                         path, key, type_name(v));
    *out = cJSON_IsTrue(v);
    return CLLM_OK;
}

/* A partial_rotary_factor other than 1 rotates only part of each head: not implemented. */
static enum cllm_status check_rotary_factor(const char *path, const char *where, const cJSON *obj,
                                            char *err, size_t err_len)
{
    const cJSON *v = get(obj, "partial_rotary_factor");
    if (!v)
        return CLLM_OK;
    if (!cJSON_IsNumber(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: %spartial_rotary_factor must be a number, not %s", path, where,
                         type_name(v));
    if (v->valuedouble != 1.0)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: %spartial_rotary_factor %g is not supported (only 1)", path, where,
                         v->valuedouble);
    return CLLM_OK;
}

/*
 * rope_scaling (transformers v4) or rope_parameters (v5): an object whose "rope_type" (or older
 * "type") must be "default" (or "none"); its rope_theta, if any, goes to *theta.
 */
static enum cllm_status check_rope(const char *path, const cJSON *root, const char *key,
                                   float *theta, bool *have_theta, char *err, size_t err_len)
{
    const cJSON *r = get(root, key);
    if (!r)
        return CLLM_OK;
    if (!cJSON_IsObject(r))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"%s\" must be an object or null, not %s", path, key, type_name(r));
    for (const cJSON *c = r->child; c; c = c->next)
        if (cJSON_IsObject(c))
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "%s: \"%s\" has per-layer RoPE parameters (\"%s\"), which are not "
                             "supported",
                             path, key, c->string);
    const cJSON *type = get(r, "rope_type");
    if (!type)
        type = get(r, "type");
    if (type) {
        if (!cJSON_IsString(type))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"%s\" type must be a string, not %s", path, key,
                             type_name(type));
        if (strcmp(type->valuestring, "default") != 0 && strcmp(type->valuestring, "none") != 0)
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "%s: \"%s\" of type '%s' is not supported (only default RoPE)", path,
                             key, type->valuestring);
    }
    char where[64];
    snprintf(where, sizeof where, "%s.", key);
    enum cllm_status st = check_rotary_factor(path, where, r, err, err_len);
    if (st)
        return st;
    const cJSON *t = get(r, "rope_theta");
    if (t && !*have_theta) {
        snprintf(where, sizeof where, "%s.rope_theta", key);
        if ((st = as_num(path, where, t, 0.0, true, INFINITY, theta, err, err_len)))
            return st;
        *have_theta = true;
    }
    return CLLM_OK;
}

/* Features of some Qwen2/Llama configs the forward pass does not implement. */
static enum cllm_status check_unsupported(const char *path, const cJSON *root, char *err,
                                          size_t err_len)
{
    bool sliding = false;
    enum cllm_status st = get_bool(path, root, "use_sliding_window", &sliding, err, err_len);
    if (st)
        return st;
    if (sliding)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: use_sliding_window is true; sliding-window attention is not "
                         "supported",
                         path);
    const cJSON *lt = get(root, "layer_types");
    if (lt) {
        if (!cJSON_IsArray(lt))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"layer_types\" must be a list, not %s", path, type_name(lt));
        for (const cJSON *c = lt->child; c; c = c->next) {
            if (!cJSON_IsString(c))
                return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                                 "%s: \"layer_types\" holds %s, not a string", path, type_name(c));
            if (strcmp(c->valuestring, "full_attention") != 0)
                return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                                 "%s: layer type '%s' is not supported (only full_attention)", path,
                                 c->valuestring);
        }
    }
    const cJSON *act = get(root, "hidden_act");
    if (act) {
        if (!cJSON_IsString(act))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"hidden_act\" must be a string, not %s", path, type_name(act));
        if (strcmp(act->valuestring, "silu") != 0)
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "%s: hidden_act '%s' is not supported (only silu)", path,
                             act->valuestring);
    }
    return check_rotary_factor(path, "", root, err, err_len);
}

static enum cllm_status parse_hparams(const char *path, const cJSON *root, struct cllm_hparams *hp,
                                      char *err, size_t err_len)
{
    memset(hp, 0, sizeof *hp);
    const cJSON *mt = get(root, "model_type");
    if (!mt)
        return missing(path, "model_type", err, err_len);
    if (!cJSON_IsString(mt))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"model_type\" must be a string, not %s", path, type_name(mt));
    size_t n = strlen(mt->valuestring);
    if (n == 0 || n >= sizeof hp->arch)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"model_type\" must be 1 to %zu characters", path,
                         sizeof hp->arch - 1);
    memcpy(hp->arch, mt->valuestring, n + 1);

    enum cllm_status st;
    if ((st = get_int(path, root, "vocab_size", true, 1, &hp->n_vocab, err, err_len)) ||
        (st = get_int(path, root, "hidden_size", true, 1, &hp->n_embd, err, err_len)) ||
        (st = get_int(path, root, "intermediate_size", true, 1, &hp->n_ff, err, err_len)) ||
        (st = get_int(path, root, "num_hidden_layers", true, 1, &hp->n_layer, err, err_len)) ||
        (st = get_int(path, root, "num_attention_heads", true, 1, &hp->n_head, err, err_len)) ||
        (st = get_int(path, root, "max_position_embeddings", true, 1, &hp->n_ctx_train, err,
                      err_len)))
        return st;
    hp->n_head_kv = hp->n_head;
    if ((st = get_int(path, root, "num_key_value_heads", false, 1, &hp->n_head_kv, err, err_len)))
        return st;
    if (get(root, "head_dim")) {
        if ((st = get_int(path, root, "head_dim", false, 1, &hp->head_dim, err, err_len)))
            return st;
    } else if (hp->n_embd % hp->n_head != 0) {
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: hidden_size %d is not a multiple of num_attention_heads %d and "
                         "head_dim is not given",
                         path, (int)hp->n_embd, (int)hp->n_head);
    } else {
        hp->head_dim = hp->n_embd / hp->n_head;
    }
    if ((st =
             get_num(path, root, "rms_norm_eps", true, 0.0, true, 1.0, &hp->rms_eps, err, err_len)))
        return st;

    /* RoPE base: rope_scaling's, else rope_parameters' (v5), else top-level, else 10000. */
    bool have_theta = false;
    if ((st = check_rope(path, root, "rope_scaling", &hp->rope_theta, &have_theta, err, err_len)) ||
        (st =
             check_rope(path, root, "rope_parameters", &hp->rope_theta, &have_theta, err, err_len)))
        return st;
    if (!have_theta) {
        hp->rope_theta = 10000.0f;
        if ((st = get_num(path, root, "rope_theta", false, 0.0, true, INFINITY, &hp->rope_theta,
                          err, err_len)))
            return st;
    }
    hp->tie_embeddings = false;
    if ((st = get_bool(path, root, "tie_word_embeddings", &hp->tie_embeddings, err, err_len)))
        return st;
    if ((st = check_unsupported(path, root, err, err_len)))
        return st;

    char why[256];
    if (!cllm_hparams_valid(hp, why, sizeof why))
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s: %s", path, why);
    return CLLM_OK;
}

enum cllm_status cllm_hf_read_hparams(const char *dir, struct cllm_hparams *hp, char *err,
                                      size_t err_len)
{
    cJSON *root;
    char *path;
    enum cllm_status st =
        load_json(dir, "config.json", CLLM_HF_MAX_CONFIG, false, &root, &path, err, err_len);
    if (!st)
        st = parse_hparams(path, root, hp, err, err_len);
    cJSON_Delete(root);
    free(path);
    return st;
}

static enum cllm_status parse_eos(const char *path, const cJSON *root, struct cllm_gen_defaults *g,
                                  char *err, size_t err_len)
{
    const cJSON *v = get(root, "eos_token_id");
    if (!v)
        return CLLM_OK;
    if (cJSON_IsNumber(v)) {
        g->n_eos = 1;
        return as_int(path, "eos_token_id", v, 0, &g->eos_ids[0], err, err_len);
    }
    if (!cJSON_IsArray(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"eos_token_id\" must be an integer or a list of integers, not %s",
                         path, type_name(v));
    int n = cJSON_GetArraySize(v);
    if (n > CLLM_MAX_EOS_IDS)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "%s: \"eos_token_id\" lists %d ids, at most %d are supported", path, n,
                         CLLM_MAX_EOS_IDS);
    g->n_eos = 0;
    for (const cJSON *c = v->child; c; c = c->next) {
        enum cllm_status st =
            as_int(path, "eos_token_id", c, 0, &g->eos_ids[g->n_eos], err, err_len);
        if (st)
            return st;
        g->n_eos++;
    }
    return CLLM_OK;
}

static enum cllm_status parse_gen(const char *path, const cJSON *root, struct cllm_gen_defaults *g,
                                  char *err, size_t err_len)
{
    enum cllm_status st;
    if ((st = get_bool(path, root, "do_sample", &g->do_sample, err, err_len)) ||
        (st = get_num(path, root, "temperature", false, 0.0, false, INFINITY, &g->temperature, err,
                      err_len)) ||
        (st = get_num(path, root, "top_p", false, 0.0, false, 1.0, &g->top_p, err, err_len)) ||
        (st = get_int(path, root, "top_k", false, 0, &g->top_k, err, err_len)) ||
        (st = get_num(path, root, "repetition_penalty", false, 0.0, true, INFINITY,
                      &g->repetition_penalty, err, err_len)) ||
        (st = get_int(path, root, "max_new_tokens", false, 0, &g->max_new_tokens, err, err_len)) ||
        (st = get_int(path, root, "bos_token_id", false, 0, &g->bos_id, err, err_len)) ||
        (st = get_int(path, root, "pad_token_id", false, 0, &g->pad_id, err, err_len)))
        return st;
    return parse_eos(path, root, g, err, err_len);
}

enum cllm_status cllm_hf_read_gen_defaults(const char *dir, struct cllm_gen_defaults *g, char *err,
                                           size_t err_len)
{
    cllm_gen_defaults_init(g);
    cJSON *root;
    char *path;
    enum cllm_status st = load_json(dir, "generation_config.json", CLLM_HF_MAX_CONFIG, true, &root,
                                    &path, err, err_len);
    if (!st && root) {
        st = parse_gen(path, root, g, err, err_len);
        if (st)
            cllm_gen_defaults_init(g);
    }
    cJSON_Delete(root);
    free(path);
    return st;
}

void cllm_hf_tokenizer_config_free(struct cllm_hf_tokenizer_config *tc)
{
    free(tc->chat_template);
    free(tc->bos_token);
    free(tc->eos_token);
    free(tc->pad_token);
    free(tc->unk_token);
    tc->chat_template = tc->bos_token = tc->eos_token = tc->pad_token = tc->unk_token = NULL;
    tc->add_bos_token = tc->add_eos_token = -1;
}

static enum cllm_status dup_string(const char *path, const char *s, char **out, char *err,
                                   size_t err_len)
{
    *out = strdup(s);
    return *out ? CLLM_OK : cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
}

/* A special token: "text", {"content": "text", ...} (an AddedToken) or null. */
static enum cllm_status get_token(const char *path, const cJSON *root, const char *key, char **out,
                                  char *err, size_t err_len)
{
    const cJSON *v = get(root, key);
    if (!v)
        return CLLM_OK;
    if (cJSON_IsObject(v)) {
        const cJSON *c = get(v, "content");
        if (!cJSON_IsString(c))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"%s\".content is missing or not a string", path, key);
        v = c;
    } else if (!cJSON_IsString(v)) {
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"%s\" must be a string or an object with \"content\", not %s", path,
                         key, type_name(v));
    }
    return dup_string(path, v->valuestring, out, err, err_len);
}

static enum cllm_status get_flag(const char *path, const cJSON *root, const char *key, int *out,
                                 char *err, size_t err_len)
{
    bool b = false;
    if (!get(root, key))
        return CLLM_OK;
    enum cllm_status st = get_bool(path, root, key, &b, err, err_len);
    if (!st)
        *out = b ? 1 : 0;
    return st;
}

/* "chat_template": a string, or [{"name": ..., "template": ...}, ...] (take "default", else the
 * first). */
static enum cllm_status get_template(const char *path, const cJSON *root, char **out, char *err,
                                     size_t err_len)
{
    const cJSON *v = get(root, "chat_template");
    if (!v)
        return CLLM_OK;
    if (cJSON_IsString(v))
        return dup_string(path, v->valuestring, out, err, err_len);
    if (!cJSON_IsArray(v))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: \"chat_template\" must be a string or a list, not %s", path,
                         type_name(v));
    const char *first = NULL, *def = NULL;
    int i = 0;
    for (const cJSON *c = v->child; c; c = c->next, i++) {
        const cJSON *name = cJSON_IsObject(c) ? get(c, "name") : NULL;
        const cJSON *tpl = cJSON_IsObject(c) ? get(c, "template") : NULL;
        if (!cJSON_IsString(name) || !cJSON_IsString(tpl))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"chat_template\"[%d] is not {\"name\": string, \"template\": "
                             "string}",
                             path, i);
        if (!first)
            first = tpl->valuestring;
        if (!def && strcmp(name->valuestring, "default") == 0)
            def = tpl->valuestring;
    }
    const char *pick = def ? def : first;
    if (!pick)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"chat_template\" is an empty list",
                         path);
    return dup_string(path, pick, out, err, err_len);
}

enum cllm_status cllm_hf_read_tokenizer_config(const char *dir, struct cllm_hf_tokenizer_config *tc,
                                               char *err, size_t err_len)
{
    memset(tc, 0, sizeof *tc);
    tc->add_bos_token = tc->add_eos_token = -1;
    cJSON *root;
    char *path;
    enum cllm_status st = load_json(dir, "tokenizer_config.json", CLLM_HF_MAX_TOKENIZER_CONFIG,
                                    true, &root, &path, err, err_len);
    if (st)
        goto done;

    /* transformers lets chat_template.jinja override the config's template. */
    char *jinja = cllm_path_join(dir, "chat_template.jinja");
    if (!jinja) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    if (!file_missing(jinja))
        st = cllm_read_file(jinja, CLLM_HF_MAX_TOKENIZER_CONFIG, &tc->chat_template, NULL, err,
                            err_len);
    free(jinja);
    if (st || !root)
        goto done;

    if (!tc->chat_template)
        st = get_template(path, root, &tc->chat_template, err, err_len);
    if (!st)
        st = get_token(path, root, "bos_token", &tc->bos_token, err, err_len);
    if (!st)
        st = get_token(path, root, "eos_token", &tc->eos_token, err, err_len);
    if (!st)
        st = get_token(path, root, "pad_token", &tc->pad_token, err, err_len);
    if (!st)
        st = get_token(path, root, "unk_token", &tc->unk_token, err, err_len);
    if (!st)
        st = get_flag(path, root, "add_bos_token", &tc->add_bos_token, err, err_len);
    if (!st)
        st = get_flag(path, root, "add_eos_token", &tc->add_eos_token, err, err_len);
done:
    if (st)
        cllm_hf_tokenizer_config_free(tc);
    cJSON_Delete(root);
    free(path);
    return st;
}
