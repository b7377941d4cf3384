/*
 * Fuzz target: a GGUF file. The reader (model/gguf.c) must reject anything malformed with an
 * error text, and what it accepts must be safe to walk: every metadata value and array element
 * read, every tensor's bytes inside the file. Then the whole model opening on top of it
 * (hyperparameters, the tokenizer from metadata, the chat template, the tensor checks), which
 * trusts what the reader accepted.
 */
#include "fuzz.h"

#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model_files.h"
#include "tokenizer/chat_template.h"

/* the GGUF reader, the model's files, the tensor checks */
const int fuzz_full_stage = 3;

static uint64_t sink; /* keeps the reads of values from being optimised away */

/* Fixed-size values compared by their own member (a BOOL leaves the union's other bytes unset). */
static bool same_scalar(const struct cllm_gguf_value *a, const struct cllm_gguf_value *b)
{
    if (a->type != b->type)
        return false;
    switch (a->type) {
    case CLLM_GGUF_TYPE_BOOL:
        return a->b == b->b;
    case CLLM_GGUF_TYPE_F32:
    case CLLM_GGUF_TYPE_F64:
        return memcmp(&a->f, &b->f, sizeof a->f) == 0;
    default:
        return a->u == b->u;
    }
}

static void walk_value(const struct cllm_gguf_value *v, int depth)
{
    FUZZ_ASSERT(depth <= CLLM_GGUF_MAX_DEPTH, "arrays nested %d deep were accepted", depth);
    switch (v->type) {
    case CLLM_GGUF_TYPE_STRING:
        for (uint64_t i = 0; i < v->str.len; i++)
            sink += (uint8_t)v->str.ptr[i];
        break;
    case CLLM_GGUF_TYPE_ARRAY: {
        struct cllm_gguf_iter it;
        struct cllm_gguf_value e;
        uint64_t n = 0;
        cllm_gguf_iter_init(&it, &v->arr);
        while (cllm_gguf_iter_next(&it, &e)) {
            walk_value(&e, depth + 1);
            struct cllm_gguf_value at;
            if (cllm_gguf_array_at(&v->arr, n, &at))
                FUZZ_ASSERT(same_scalar(&at, &e), "element %llu read two ways differs",
                            (unsigned long long)n);
            n++;
        }
        FUZZ_ASSERT(n == v->arr.count, "iterated %llu of %llu elements", (unsigned long long)n,
                    (unsigned long long)v->arr.count);
        break;
    }
    case CLLM_GGUF_TYPE_BOOL:
        sink += v->b;
        break;
    default:
        sink += v->u;
    }
}

static void walk_gguf(const struct cllm_gguf *g)
{
    for (uint64_t i = 0; i < cllm_gguf_n_kv(g); i++) {
        const struct cllm_gguf_kv *kv = cllm_gguf_kv_at(g, i);
        walk_value(&kv->value, 0);
        FUZZ_ASSERT(cllm_gguf_find(g, kv->key) != NULL, "key %s not found", kv->key);
    }
    const uint64_t file_size = cllm_gguf_file_size(g);
    for (uint64_t i = 0; i < cllm_gguf_n_tensors(g); i++) {
        const struct cllm_tensor *t = cllm_gguf_tensor(g, i);
        const uint64_t off = cllm_gguf_tensor_file_offset(g, i);
        FUZZ_ASSERT(off <= file_size && t->nbytes <= file_size - off,
                    "tensor %s (%llu bytes at %llu) passes the end of the file (%llu)", t->name,
                    (unsigned long long)t->nbytes, (unsigned long long)off,
                    (unsigned long long)file_size);
        FUZZ_ASSERT(cllm_gguf_find_tensor(g, t->name) != NULL, "tensor %s not found", t->name);
        if (t->nbytes)
            sink += ((const uint8_t *)t->data)[t->nbytes - 1];
    }
}

static void use_model_files(const struct cllm_model_files *mf)
{
    char err[512];
    if (cllm_model_files_check_tensors(mf, err, sizeof err) == CLLM_OK)
        fuzz_stage++;
    if (mf->tok) {
        static const char text[] = "Hello, 世界! <|im_start|>user\n  x = 1;\xff";
        struct cllm_ids ids = {0};
        struct cllm_buf out = {0};
        if (cllm_tokenize(mf->tok, text, sizeof text - 1, &ids) == CLLM_OK)
            cllm_detokenize(mf->tok, ids.v, ids.n, false, &out);
        cllm_ids_free(&ids);
        cllm_buf_free(&out);
    }
    struct cllm_chat_template *ct = NULL;
    if (cllm_chat_template_init(&ct, mf->chat_template, err, sizeof err) == CLLM_OK)
        cllm_chat_template_free(ct);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64], err[512];
    const int fd = fuzz_memfile(data, size, path, sizeof path);
    if (fd < 0)
        return 0;
    struct cllm_gguf *g = NULL;
    err[0] = 0;
    if (cllm_gguf_open(&g, path, err, sizeof err) == CLLM_OK) {
        fuzz_stage++;
        walk_gguf(g);
        cllm_gguf_free(g);
    } else {
        FUZZ_ASSERT(g == NULL && err[0], "a refusal without an error text");
    }
    struct cllm_model_files *mf = NULL;
    err[0] = 0;
    if (cllm_model_files_open(&mf, path, err, sizeof err) == CLLM_OK) {
        fuzz_stage++;
        use_model_files(mf);
        cllm_model_files_free(mf);
    } else {
        FUZZ_ASSERT(mf == NULL && err[0], "a refusal without an error text");
    }
    close(fd);
    return 0;
}
