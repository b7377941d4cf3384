/*
 * tokenizer.json layout we read: {"normalizer": null | {"type":"NFC"} | Sequence of those,
 * "pre_tokenizer": Sequence[Split(Qwen2 regex, Isolated), ByteLevel(use_regex=false)],
 * "model": {"type":"BPE", "vocab": {text: id}, "merges": ["a b", ...] or [["a","b"], ...]},
 * "added_tokens": [{"id", "content", "special", "lstrip", "rstrip", "single_word", ...}]}.
 * GGUF keys: tokenizer.ggml.model ("gpt2"), .pre ("qwen2"), .tokens, .token_type, .merges.
 */
#include "model/vocab_load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/mmap.h"
#include "core/status.h"

#define MAX_TOKENIZER_JSON (256u << 20)

static const char QWEN2_SPLIT_REGEX[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static bool json_is_type(const cJSON *obj, const char *type)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(t) && strcmp(t->valuestring, type) == 0;
}

/* normalizer: null, NFC, or a Sequence holding only NFC. */
static enum cllm_status parse_normalizer(const cJSON *n, enum cllm_normalizer *out, const char *path,
                                         char *err, size_t err_len)
{
    *out = CLLM_NORMALIZER_NONE;
    if (!n || cJSON_IsNull(n))
        return CLLM_OK;
    if (json_is_type(n, "NFC")) {
        *out = CLLM_NORMALIZER_NFC;
        return CLLM_OK;
    }
    if (json_is_type(n, "Sequence")) {
        const cJSON *item;
        cJSON_ArrayForEach(item, cJSON_GetObjectItemCaseSensitive(n, "normalizers"))
        {
            enum cllm_status st = parse_normalizer(item, out, path, err, err_len);
            if (st)
                return st;
        }
        return CLLM_OK;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(n, "type");
    return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "%s: normalizer %s is not supported (only NFC)",
                     path, cJSON_IsString(t) ? t->valuestring : "?");
}

/* The pre-tokenizer must be Qwen2's: the split regex, then byte-level without its own regex. */
static enum cllm_status check_pre_tokenizer(const cJSON *p, const char *path, char *err,
                                            size_t err_len)
{
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
    const cJSON *split = cJSON_GetArrayItem(seq, 0), *bl = cJSON_GetArrayItem(seq, 1);
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(split, "pattern");
    const cJSON *regex = cJSON_GetObjectItemCaseSensitive(pattern, "Regex");
    const cJSON *behavior = cJSON_GetObjectItemCaseSensitive(split, "behavior");
    const cJSON *invert = cJSON_GetObjectItemCaseSensitive(split, "invert");
    const cJSON *use_regex = cJSON_GetObjectItemCaseSensitive(bl, "use_regex");
    const cJSON *prefix = cJSON_GetObjectItemCaseSensitive(bl, "add_prefix_space");
    bool ok = json_is_type(p, "Sequence") && cJSON_GetArraySize(seq) == 2 &&
              json_is_type(split, "Split") && cJSON_IsString(regex) &&
              strcmp(regex->valuestring, QWEN2_SPLIT_REGEX) == 0 && cJSON_IsString(behavior) &&
              strcmp(behavior->valuestring, "Isolated") == 0 && !cJSON_IsTrue(invert) &&
              json_is_type(bl, "ByteLevel") && cJSON_IsFalse(use_regex) && !cJSON_IsTrue(prefix);
    if (!ok)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: pre_tokenizer is not Qwen2's (Split with the Qwen2 regex, then "
                         "ByteLevel); no other pre-tokenizer is supported",
                         path);
    return CLLM_OK;
}

/* model.{byte_fallback, ignore_merges, continuing_subword_prefix, end_of_word_suffix} must be
 * off: the Qwen2 BPE uses none of them. */
static enum cllm_status check_bpe_options(const cJSON *model, const char *path, char *err,
                                          size_t err_len)
{
    if (!json_is_type(model, "BPE"))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "%s: model.type is not BPE", path);
    static const char *const flags[] = {"byte_fallback", "ignore_merges"};
    for (size_t i = 0; i < 2; i++)
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(model, flags[i])))
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "%s: model.%s is not supported",
                             path, flags[i]);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(model, affixes[i]);
        if (a && !cJSON_IsNull(a) && !(cJSON_IsString(a) && a->valuestring[0] == '\0'))
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED, "%s: model.%s is not supported",
                             path, affixes[i]);
    }
    return CLLM_OK;
}

/* Largest id in vocab and added_tokens, or -1 with err filled on a malformed entry. */
static int64_t max_token_id(const cJSON *vocab, const cJSON *added, const char *path, char *err,
                            size_t err_len)
{
    int64_t max = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab)
    {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > 1e8 ||
            e->valuedouble != (double)(int64_t)e->valuedouble) {
            cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: model.vocab[\"%.40s\"] is not a valid id",
                      path, e->string ? e->string : "?");
            return -1;
        }
        if ((int64_t)e->valuedouble > max)
            max = (int64_t)e->valuedouble;
    }
    cJSON_ArrayForEach(e, added)
    {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > 1e8 ||
            id->valuedouble != (double)(int64_t)id->valuedouble) {
            cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: an added_tokens entry has no valid id",
                      path);
            return -1;
        }
        if ((int64_t)id->valuedouble > max)
            max = (int64_t)id->valuedouble;
    }
    if (max < 0)
        cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: the vocabulary is empty", path);
    return max;
}

static enum cllm_status add_json_merges(struct cllm_tokenizer *t, const cJSON *merges,
                                        const char *path, char *err, size_t err_len)
{
    char inner[200];
    const cJSON *m;
    cJSON_ArrayForEach(m, merges)
    {
        const char *l, *r;
        size_t llen, rlen;
        if (cJSON_IsString(m)) { /* "left right" */
            const char *sp = strchr(m->valuestring, ' ');
            if (!sp || strchr(sp + 1, ' '))
                return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                                 "%s: merge \"%.40s\" is not two tokens separated by a space", path,
                                 m->valuestring);
            l = m->valuestring;
            llen = (size_t)(sp - l);
            r = sp + 1;
            rlen = strlen(r);
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(m, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(m, 1))) {
            l = cJSON_GetArrayItem(m, 0)->valuestring;
            r = cJSON_GetArrayItem(m, 1)->valuestring;
            llen = strlen(l);
            rlen = strlen(r);
        } else {
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: model.merges holds an entry that is neither \"a b\" nor [a, b]",
                             path);
        }
        enum cllm_status st = cllm_tokenizer_add_merge(t, l, llen, r, rlen, inner, sizeof inner);
        if (st)
            return cllm_fail(err, err_len, st, "%s: %s", path, inner);
    }
    return CLLM_OK;
}

static enum cllm_status add_json_tokens(struct cllm_tokenizer *t, const cJSON *vocab,
                                        const cJSON *added, const char *path, char *err,
                                        size_t err_len)
{
    char inner[200];
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab)
    {
        enum cllm_status st =
            cllm_tokenizer_set_token(t, (int32_t)e->valuedouble, e->string, strlen(e->string),
                                     CLLM_TOKEN_NORMAL, inner, sizeof inner);
        if (st)
            return cllm_fail(err, err_len, st, "%s: %s", path, inner);
    }
    cJSON_ArrayForEach(e, added)
    {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(content))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: an added_tokens entry has no content string", path);
        static const char *const unsupported[] = {"lstrip", "rstrip", "single_word"};
        for (size_t i = 0; i < 3; i++)
            if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, unsupported[i])))
                return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                                 "%s: added token \"%.40s\" uses %s, which is not supported", path,
                                 content->valuestring, unsupported[i]);
        bool special = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "special"));
        int32_t id = (int32_t)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
        enum cllm_status st = cllm_tokenizer_set_token(
            t, id, content->valuestring, strlen(content->valuestring),
            special ? CLLM_TOKEN_SPECIAL : CLLM_TOKEN_ADDED, inner, sizeof inner);
        if (st)
            return cllm_fail(err, err_len, st, "%s: %s", path, inner);
    }
    return CLLM_OK;
}

enum cllm_status cllm_vocab_load_json(struct cllm_tokenizer **out, const char *path, char *err,
                                      size_t err_len)
{
    *out = NULL;
    char *text = NULL, inner[200];
    size_t len;
    struct cllm_tokenizer *t = NULL;
    cJSON *root = NULL;
    enum cllm_status st = cllm_read_file(path, MAX_TOKENIZER_JSON, &text, &len, err, err_len);
    if (st)
        return st;
    root = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsObject(root)) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: not a JSON object", path);
        goto free_json;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges) || (added && !cJSON_IsArray(added))) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                       "%s: expected model.vocab (object), model.merges (array) and "
                       "added_tokens (array)",
                       path);
        goto free_json;
    }
    enum cllm_normalizer norm;
    if ((st = check_bpe_options(model, path, err, err_len)) ||
        (st = check_pre_tokenizer(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), path,
                                  err, err_len)) ||
        (st = parse_normalizer(cJSON_GetObjectItemCaseSensitive(root, "normalizer"), &norm, path,
                               err, err_len)))
        goto free_json;
    int64_t max_id = max_token_id(vocab, added, path, err, err_len);
    if (max_id < 0) {
        st = CLLM_ERR_FORMAT;
        goto free_json;
    }
    if ((st = cllm_tokenizer_new(&t, (int32_t)max_id + 1)))
        goto free_json;
    cllm_tokenizer_set_normalizer(t, norm);
    if ((st = add_json_tokens(t, vocab, added, path, err, err_len)) ||
        (st = add_json_merges(t, merges, path, err, err_len)))
        goto free_tok;
    if ((st = cllm_tokenizer_finish(t, inner, sizeof inner))) {
        cllm_fail(err, err_len, st, "%s: %s", path, inner);
        goto free_tok;
    }
    *out = t;
    t = NULL;
free_tok:
    cllm_tokenizer_free(t);
free_json:
    cJSON_Delete(root);
    free(text);
    return st;
}

/* GGUF token types (llama.cpp's llama_token_type). */
enum { GGUF_TOK_NORMAL = 1, GGUF_TOK_UNKNOWN, GGUF_TOK_CONTROL, GGUF_TOK_USER, GGUF_TOK_UNUSED, GGUF_TOK_BYTE };

static bool gguf_str_is(struct cllm_gguf_str s, const char *want)
{
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

enum cllm_status cllm_vocab_load_gguf(struct cllm_tokenizer **out, const struct cllm_gguf *g,
                                      char *err, size_t err_len)
{
    *out = NULL;
    const char *path = cllm_gguf_path(g);
    struct cllm_gguf_str model, pre, *tokens = NULL, *merges = NULL;
    uint64_t n_tokens = 0, n_merges = 0;
    struct cllm_gguf_array types;
    struct cllm_tokenizer *t = NULL;
    char inner[200];
    enum cllm_status st;

    if (!cllm_gguf_get_str(g, "tokenizer.ggml.model", &model) || !gguf_str_is(model, "gpt2"))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: tokenizer.ggml.model is missing or not \"gpt2\" (byte-level BPE)",
                         path);
    if (!cllm_gguf_get_str(g, "tokenizer.ggml.pre", &pre) || !gguf_str_is(pre, "qwen2"))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: tokenizer.ggml.pre is missing or not \"qwen2\"; only the Qwen2 "
                         "pre-tokenizer is supported",
                         path);
    if ((st = cllm_gguf_get_str_array(g, "tokenizer.ggml.tokens", &tokens, &n_tokens, err,
                                      err_len)) ||
        (st = cllm_gguf_get_str_array(g, "tokenizer.ggml.merges", &merges, &n_merges, err,
                                      err_len)))
        goto free_arrays;
    bool have_types = cllm_gguf_get_array(g, "tokenizer.ggml.token_type", CLLM_GGUF_TYPE_I32, &types);
    if (!have_types || types.count != n_tokens || n_tokens == 0 || n_tokens > INT32_MAX) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                       "%s: tokenizer.ggml.token_type must be an i32 array as long as "
                       "tokenizer.ggml.tokens (%llu)",
                       path, (unsigned long long)n_tokens);
        goto free_arrays;
    }
    if ((st = cllm_tokenizer_new(&t, (int32_t)n_tokens)))
        goto free_arrays;
    for (uint64_t i = 0; i < n_tokens; i++) {
        struct cllm_gguf_value v;
        cllm_gguf_array_at(&types, i, &v);
        enum cllm_token_kind kind;
        switch (v.i) {
        case GGUF_TOK_NORMAL: kind = CLLM_TOKEN_NORMAL; break;
        case GGUF_TOK_CONTROL: kind = CLLM_TOKEN_SPECIAL; break;
        case GGUF_TOK_USER: kind = CLLM_TOKEN_ADDED; break;
        case GGUF_TOK_UNUSED: kind = CLLM_TOKEN_UNUSED; break;
        default:
            st = cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                           "%s: token %llu has token type %lld, which byte-level BPE does not use",
                           path, (unsigned long long)i, (long long)v.i);
            goto free_tok;
        }
        if ((st = cllm_tokenizer_set_token(t, (int32_t)i, tokens[i].ptr, (size_t)tokens[i].len,
                                           kind, inner, sizeof inner))) {
            cllm_fail(err, err_len, st, "%s: %s", path, inner);
            goto free_tok;
        }
    }
    for (uint64_t i = 0; i < n_merges; i++) {
        const char *s = merges[i].ptr;
        const char *sp = memchr(s, ' ', (size_t)merges[i].len);
        if (!sp) {
            st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                           "%s: tokenizer.ggml.merges[%llu] has no space between its tokens", path,
                           (unsigned long long)i);
            goto free_tok;
        }
        size_t llen = (size_t)(sp - s);
        if ((st = cllm_tokenizer_add_merge(t, s, llen, sp + 1, (size_t)merges[i].len - llen - 1,
                                           inner, sizeof inner))) {
            cllm_fail(err, err_len, st, "%s: %s", path, inner);
            goto free_tok;
        }
    }
    if ((st = cllm_tokenizer_finish(t, inner, sizeof inner))) {
        cllm_fail(err, err_len, st, "%s: %s", path, inner);
        goto free_tok;
    }
    *out = t;
    t = NULL;
free_tok:
    cllm_tokenizer_free(t);
free_arrays:
    free(tokens);
    free(merges);
    return st;
}
