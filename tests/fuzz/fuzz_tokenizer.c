/*
 * Fuzz target: the tokenizer on what users send -- any bytes as prompt text -- and the
 * decoders on any id sequence, with the real Qwen2 vocabulary of the model named by
 * CLLM_FUZZ_MODEL (a GGUF file or an HF folder). Properties (HF tokenizers is the reference
 * for ids; the golden tests hold us to it, these hold on every input):
 *   - ids are in range and never an unused slot;
 *   - invalid UTF-8 is replaced before anything else: the text and its sanitised form give
 *     the same ids;
 *   - decoding gives the sanitised text back whenever NFC leaves that text as it is;
 *   - the streaming decoder, fed one id at a time, emits exactly the lossy decode of the
 *     ids' bytes (U+FFFD per ill-formed subpart, as HF does), for the text's ids and for the
 *     input read as arbitrary ids, with and without special tokens.
 */
#include "fuzz.h"

#include <string.h>
#include <utf8proc.h>

#include "model/model_files.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

const int fuzz_full_stage = 1;

static struct cllm_model_files *model;
static const struct cllm_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *path = getenv("CLLM_FUZZ_MODEL");
    if (!path || !*path) {
        fprintf(stderr, "fuzz_tokenizer: set CLLM_FUZZ_MODEL to a GGUF file or HF folder\n");
        exit(2);
    }
    char err[512];
    if (cllm_model_files_open(&model, path, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        exit(2);
    }
    tok = model->tok;
    return 0;
}

static bool same(const struct cllm_buf *a, const struct cllm_buf *b)
{
    return a->len == b->len && (a->len == 0 || memcmp(a->data, b->data, a->len) == 0);
}

/* The streaming decoder's output for ids must equal the lossy decode of their bytes. */
static void check_stream(const int32_t *ids, size_t n, bool skip_special)
{
    struct cllm_buf raw = {0}, lossy = {0}, streamed = {0};
    FUZZ_ASSERT(cllm_detokenize(tok, ids, n, skip_special, &raw) == CLLM_OK, "decode failed");
    FUZZ_ASSERT(cllm_utf8_sanitize(raw.data, raw.len, &lossy) == CLLM_OK, "sanitize failed");
    struct cllm_detok_stream s;
    cllm_detok_stream_init(&s, tok, skip_special);
    for (size_t i = 0; i < n; i++) {
        const size_t before = streamed.len;
        FUZZ_ASSERT(cllm_detok_stream_push(&s, ids[i], &streamed) == CLLM_OK, "push failed");
        FUZZ_ASSERT(streamed.len == before ||
                        cllm_utf8_valid(streamed.data + before, streamed.len - before),
                    "the stream emitted part of a character after id %d", ids[i]);
    }
    FUZZ_ASSERT(cllm_detok_stream_flush(&s, &streamed) == CLLM_OK, "flush failed");
    FUZZ_ASSERT(same(&streamed, &lossy),
                "streamed decode (%zu bytes) differs from the lossy decode (%zu bytes)",
                streamed.len, lossy.len);
    cllm_buf_free(&raw);
    cllm_buf_free(&lossy);
    cllm_buf_free(&streamed);
}

static bool nfc_stable(const struct cllm_buf *text)
{
    if (cllm_tokenizer_normalizer(tok) != CLLM_NORMALIZER_NFC || text->len == 0)
        return true;
    utf8proc_uint8_t *nfc = NULL;
    const utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)text->data,
                                            (utf8proc_ssize_t)text->len, &nfc,
                                            UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    const bool stable = n >= 0 && (size_t)n == text->len && memcmp(nfc, text->data, text->len) == 0;
    free(nfc);
    return stable;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    const int32_t n_vocab = cllm_tokenizer_n_vocab(tok);

    struct cllm_ids ids = {0}, ids_clean = {0};
    FUZZ_ASSERT(cllm_tokenize(tok, text, size, &ids) == CLLM_OK, "tokenize failed");
    for (size_t i = 0; i < ids.n; i++)
        FUZZ_ASSERT(ids.v[i] >= 0 && ids.v[i] < n_vocab &&
                        cllm_tokenizer_kind(tok, ids.v[i]) != CLLM_TOKEN_UNUSED,
                    "id %d at %zu", ids.v[i], i);

    struct cllm_buf clean = {0}, back = {0};
    FUZZ_ASSERT(cllm_utf8_sanitize(text, size, &clean) == CLLM_OK, "sanitize failed");
    FUZZ_ASSERT(cllm_tokenize(tok, clean.data, clean.len, &ids_clean) == CLLM_OK, "tokenize failed");
    FUZZ_ASSERT(ids.n == ids_clean.n &&
                    (ids.n == 0 || memcmp(ids.v, ids_clean.v, ids.n * sizeof *ids.v) == 0),
                "the text and its sanitised form give different ids (%zu vs %zu)", ids.n,
                ids_clean.n);

    FUZZ_ASSERT(cllm_detokenize(tok, ids.v, ids.n, false, &back) == CLLM_OK, "decode failed");
    if (nfc_stable(&clean))
        FUZZ_ASSERT(same(&back, &clean), "decode(encode(text)) is not the text (%zu vs %zu bytes)",
                    back.len, clean.len);
    check_stream(ids.v, ids.n, false);
    check_stream(ids.v, ids.n, true);

    /* the input as arbitrary ids: 3 bytes each (little-endian) modulo the vocabulary */
    const size_t n_raw = size / 3;
    int32_t *raw = malloc((n_raw ? n_raw : 1) * sizeof *raw);
    FUZZ_ASSERT(raw != NULL, "out of memory");
    for (size_t i = 0; i < n_raw; i++) {
        const uint32_t v = data[3 * i] | (uint32_t)data[3 * i + 1] << 8 | (uint32_t)data[3 * i + 2] << 16;
        raw[i] = (int32_t)(v % (uint32_t)n_vocab);
    }
    check_stream(raw, n_raw, false);
    check_stream(raw, n_raw, true);
    free(raw);

    cllm_ids_free(&ids);
    cllm_ids_free(&ids_clean);
    cllm_buf_free(&clean);
    cllm_buf_free(&back);
    fuzz_stage = 1;
    return 0;
}
