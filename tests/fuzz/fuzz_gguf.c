/*
 * Fuzz target: a GGUF file. The reader (model/gguf.c) must reject anything malformed with an
 * error text, and what it accepts must be safe to walk: every metadata value and array element
 * read, every tensor's bytes inside the file. Then the whole model opening on top of it
 * (hyperparameters, the tokenizer from metadata, the chat template, the tensor checks), which
 * trusts what the reader accepted, and a model that passes them is loaded on the CPU backend
 * and runs a forward step: any weight bytes (NaN or infinite scales included) must give
 * logits, never a crash, and an argmax inside the vocabulary.
 */
#include "fuzz.h"

#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model.h"
#include "model/model_files.h"
#include "sampling/sampling.h"
#include "tokenizer/chat_template.h"

/* the GGUF reader, the model's files, the tensor checks, a forward step */
const int fuzz_full_stage = 4;

static struct cllm_backend *cpu;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const struct cllm_backend_options o = {CLLM_BACKEND_CPU,        1, 0,
                                           CLLM_CPU_WEIGHTS_STORED, 0, false};
    char err[256];
    FUZZ_ASSERT(cllm_backend_new(&cpu, &o, err, sizeof err) == CLLM_OK, "CPU backend: %s", err);
    return 0;
}

/* Three tokens of one sequence through the model: logits for the last two. Only small models
 * (the seeds' size): a mutated file may claim a huge one, which would just be slow. */
static void forward_step(const struct cllm_model_files *mf)
{
    const struct cllm_hparams *hp = &mf->hp;
    if ((int64_t)hp->n_embd * hp->n_ff * hp->n_layer > (1 << 20) || hp->n_vocab > 4096 ||
        (int64_t)hp->n_head * hp->head_dim > 4096)
        return;
    char err[512];
    struct cllm_model *m = NULL;
    struct cllm_kv_cache kv = {0};
    if (cllm_model_init(&m, mf, cpu, 8, 8, err, sizeof err) != CLLM_OK) {
        FUZZ_ASSERT(m == NULL && err[0], "a model refused without an error text");
        return;
    }
    FUZZ_ASSERT(cllm_kv_cache_init(&kv, m, 1, 16, err, sizeof err) == CLLM_OK, "KV cache: %s", err);
    const int32_t tokens[3] = {0, hp->n_vocab - 1, hp->n_vocab / 2}, pos[3] = {0, 1, 2},
                  seq[3] = {0, 0, 0}, slot[3] = {0, 1, 2}, table[1] = {0}, outs[2] = {1, 2};
    const struct cllm_step s = {3, tokens, pos, seq, slot, table, 1, 1, 2, outs};
    const float *logits = NULL;
    FUZZ_ASSERT(cllm_model_forward(m, &kv, &s, &logits) == CLLM_OK && logits, "forward failed");
    for (int i = 0; i < 2; i++) {
        const int32_t t = cllm_argmax(logits + (size_t)i * (size_t)hp->n_vocab, hp->n_vocab);
        FUZZ_ASSERT(t >= 0 && t < hp->n_vocab, "argmax %d", t);
    }
    fuzz_stage++;
    cllm_kv_cache_free(&kv, m);
    cllm_model_free(m);
}

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
    if (cllm_model_files_check_tensors(mf, err, sizeof err) == CLLM_OK) {
        fuzz_stage++;
        forward_step(mf);
    }
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
    enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
    if (fuzz_accepted(st, err, g == NULL, "the GGUF reader")) {
        walk_gguf(g);
        cllm_gguf_free(g);
    }
    struct cllm_model_files *mf = NULL;
    err[0] = 0;
    st = cllm_model_files_open(&mf, path, err, sizeof err);
    if (fuzz_accepted(st, err, mf == NULL, "opening the model")) {
        use_model_files(mf);
        cllm_model_files_free(mf);
    }
    close(fd);
    return 0;
}
