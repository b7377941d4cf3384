/*
 * The GGUF reader on the real small model (CLLM_TEST_GGUF, Qwen2.5-Coder-0.5B-Instruct Q4_K_M).
 * Every expected value was read with gguf-py's GGUFReader from the same file. Prints how long
 * open and a walk over the vocabulary take (not asserted).
 */
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "test.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static bool str_is(struct cllm_gguf_str s, const char *want)
{
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

static void check_tensor(const struct cllm_gguf *g, const char *name, int n_dims, int64_t ne0,
                         int64_t ne1, enum cllm_dtype dtype, uint64_t file_offset, uint64_t nbytes)
{
    const struct cllm_tensor *t = cllm_gguf_find_tensor(g, name);
    CHECKF(t != NULL, "%s missing", name);
    if (!t)
        return;
    CHECKF(t->n_dims == n_dims && t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == 1 &&
               t->ne[3] == 1,
           "%s: n_dims %d ne {%lld, %lld, %lld, %lld}", name, t->n_dims, (long long)t->ne[0],
           (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    CHECKF(t->dtype == dtype, "%s: %s", name, cllm_dtype_name(t->dtype));
    CHECKF(t->nbytes == nbytes, "%s: %llu bytes", name, (unsigned long long)t->nbytes);
    uint64_t i = (uint64_t)(t - cllm_gguf_tensor(g, 0));
    CHECKF(cllm_gguf_tensor_file_offset(g, i) == file_offset, "%s: offset %llu", name,
           (unsigned long long)cllm_gguf_tensor_file_offset(g, i));
}

int main(void)
{
    const char *path = test_env("CLLM_TEST_GGUF");
    char err[512] = "";
    struct cllm_gguf *g = NULL;
    double t0 = now_ms();
    enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
    double t_open = now_ms() - t0;
    CHECKF(st == CLLM_OK, "%s", err);
    if (!g)
        return test_summary();
    printf("open: %.2f ms\n", t_open);

    CHECK(cllm_gguf_version(g) == 3);
    CHECK(cllm_gguf_n_tensors(g) == 291);
    CHECK(cllm_gguf_n_kv(g) == 26);
    CHECK(cllm_gguf_file_size(g) == 491400064ull);
    CHECK(cllm_gguf_alignment(g) == 32);
    CHECK(cllm_gguf_data_offset(g) == 5947776ull);

    struct cllm_gguf_str s;
    uint32_t u32;
    float f32;
    bool b;
    CHECK(cllm_gguf_get_str(g, "general.architecture", &s) && str_is(s, "qwen2"));
    CHECK(cllm_gguf_get_str(g, "tokenizer.ggml.model", &s) && str_is(s, "gpt2"));
    CHECK(cllm_gguf_get_str(g, "tokenizer.ggml.pre", &s) && str_is(s, "qwen2"));
    CHECK(cllm_gguf_get_str(g, "tokenizer.chat_template", &s) && s.len == 2507);
    CHECK(cllm_gguf_get_u32(g, "qwen2.block_count", &u32) && u32 == 24);
    CHECK(cllm_gguf_get_u32(g, "qwen2.embedding_length", &u32) && u32 == 896);
    CHECK(cllm_gguf_get_u32(g, "qwen2.context_length", &u32) && u32 == 32768);
    CHECK(cllm_gguf_get_u32(g, "qwen2.feed_forward_length", &u32) && u32 == 4864);
    CHECK(cllm_gguf_get_u32(g, "qwen2.attention.head_count", &u32) && u32 == 14);
    CHECK(cllm_gguf_get_u32(g, "qwen2.attention.head_count_kv", &u32) && u32 == 2);
    CHECK(cllm_gguf_get_f32(g, "qwen2.rope.freq_base", &f32) && f32 == 1e6f);
    CHECK(cllm_gguf_get_f32(g, "qwen2.attention.layer_norm_rms_epsilon", &f32) && f32 == 1e-6f);
    CHECK(cllm_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &u32) && u32 == 151645);
    CHECK(cllm_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &u32) && u32 == 151643);
    CHECK(cllm_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b) && !b);

    /* The vocabulary: a walk with the iterator, then the table. */
    struct cllm_gguf_array a;
    CHECK(cllm_gguf_get_array(g, "tokenizer.ggml.tokens", CLLM_GGUF_TYPE_STRING, &a));
    CHECK(a.count == 151936);
    t0 = now_ms();
    struct cllm_gguf_iter it;
    struct cllm_gguf_value v;
    uint64_t n = 0, total = 0;
    bool im_start = false, first = false;
    cllm_gguf_iter_init(&it, &a);
    while (cllm_gguf_iter_next(&it, &v)) {
        if (n == 0)
            first = str_is(v.str, "!");
        if (n == 151644)
            im_start = str_is(v.str, "<|im_start|>");
        total += v.str.len;
        n++;
    }
    printf("walk of %llu tokens (%llu bytes): %.2f ms\n", (unsigned long long)n,
           (unsigned long long)total, now_ms() - t0);
    CHECK(n == 151936 && first && im_start);

    struct cllm_gguf_str *tab = NULL;
    uint64_t count = 0;
    t0 = now_ms();
    st = cllm_gguf_get_str_array(g, "tokenizer.ggml.merges", &tab, &count, err, sizeof err);
    printf("merges table: %.2f ms\n", now_ms() - t0);
    CHECKF(st == CLLM_OK, "%s", err);
    CHECK(count == 151387);
    if (tab && count == 151387) {
        CHECK(str_is(tab[0], "\xc4\xa0 \xc4\xa0"));                 /* "Ġ Ġ" */
        CHECK(str_is(tab[count - 1], "\xc3\xa2\xc2\xbd \xc4\xb9")); /* "â½ Ĺ" */
    }
    free(tab);
    st = cllm_gguf_get_str_array(g, "tokenizer.ggml.tokens", &tab, &count, err, sizeof err);
    CHECK(st == CLLM_OK && count == 151936);
    if (tab && count == 151936) {
        CHECK(str_is(tab[151645], "<|im_end|>"));
        CHECK(str_is(tab[151935], "[PAD151935]"));
    }
    free(tab);

    CHECK(cllm_gguf_get_array(g, "tokenizer.ggml.token_type", CLLM_GGUF_TYPE_I32, &a));
    CHECK(a.count == 151936);
    int32_t tt;
    CHECK(cllm_gguf_array_at(&a, 0, &v) && cllm_gguf_value_i32(&v, &tt) && tt == 1);
    CHECK(cllm_gguf_array_at(&a, 151645, &v) && cllm_gguf_value_i32(&v, &tt) && tt == 3);
    CHECK(cllm_gguf_array_at(&a, 151935, &v) && cllm_gguf_value_i32(&v, &tt) && tt == 5);

    /* Tensors: placement and types as gguf-py reports them (offsets are file offsets). */
    check_tensor(g, "output.weight", 2, 896, 151936, CLLM_DTYPE_Q8_0, 5947776ull, 144643072ull);
    check_tensor(g, "token_embd.weight", 2, 896, 151936, CLLM_DTYPE_Q5_0, 150590848ull,
                 93592576ull);
    check_tensor(g, "blk.0.attn_q.weight", 2, 896, 896, CLLM_DTYPE_Q5_0, 254392960ull, 551936ull);
    check_tensor(g, "blk.23.ffn_down.weight", 2, 4864, 896, CLLM_DTYPE_Q4_K, 407829120ull,
                 2451456ull);
    check_tensor(g, "output_norm.weight", 1, 896, 1, CLLM_DTYPE_F32, 491396480ull, 3584ull);
    CHECK(strcmp(cllm_gguf_tensor(g, 0)->name, "output.weight") == 0);
    CHECK(strcmp(cllm_gguf_tensor(g, 290)->name, "output_norm.weight") == 0);
    const struct cllm_tensor *norm = cllm_gguf_find_tensor(g, "blk.0.attn_norm.weight");
    CHECK(norm && norm->dtype == CLLM_DTYPE_F32);
    if (norm) {
        float w[2];
        memcpy(w, norm->data, sizeof w);
        CHECK(w[0] == -0.06427001953125f && w[1] == 0.078125f);
    }
    int per_type[CLLM_DTYPE_COUNT] = {0};
    for (uint64_t i = 0; i < cllm_gguf_n_tensors(g); i++)
        per_type[cllm_gguf_tensor(g, i)->dtype]++;
    CHECK(per_type[CLLM_DTYPE_F32] == 121 && per_type[CLLM_DTYPE_Q5_0] == 133);
    CHECK(per_type[CLLM_DTYPE_Q8_0] == 13 && per_type[CLLM_DTYPE_Q4_K] == 12);
    CHECK(per_type[CLLM_DTYPE_Q6_K] == 12);

    cllm_gguf_free(g);
    return test_summary();
}
