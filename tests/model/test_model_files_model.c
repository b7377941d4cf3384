/*
 * The two formats of one model agree: the small real GGUF and the HF folder transformers made
 * from it (tests/fixtures/make_hf_folder.py) give the same hyperparameters, chat template and
 * tokenizer, and every GGUF tensor, dequantized by cllm, is bit-identical to the F32 tensor
 * transformers wrote (it dequantizes with gguf-py).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "model/model_files.h"
#include "model/qwen2.h"
#include "test.h"

static void compare_hparams(const struct cllm_hparams *a, const struct cllm_hparams *b)
{
    CHECK(strcmp(a->arch, b->arch) == 0);
    CHECK(a->n_vocab == b->n_vocab);
    CHECK(a->n_embd == b->n_embd);
    CHECK(a->n_ff == b->n_ff);
    CHECK(a->n_layer == b->n_layer);
    CHECK(a->n_head == b->n_head);
    CHECK(a->n_head_kv == b->n_head_kv);
    CHECK(a->head_dim == b->head_dim);
    CHECK(a->n_ctx_train == b->n_ctx_train);
    CHECKF(a->rms_eps == b->rms_eps, "%g vs %g", (double)a->rms_eps, (double)b->rms_eps);
    CHECK(a->rope_theta == b->rope_theta);
    CHECK(a->tie_embeddings == b->tie_embeddings);
}

/* Dequantizes every row of g and compares it bit for bit with the F32 tensor h. */
static bool same_weights(const struct cllm_tensor *g, const struct cllm_tensor *h)
{
    if (h->dtype != CLLM_DTYPE_F32 || g->n_dims != h->n_dims)
        return false;
    for (int d = 0; d < CLLM_MAX_DIMS; d++)
        if (g->ne[d] != h->ne[d])
            return false;
    int64_t cols = g->ne[0], rows = cllm_tensor_nrows(g);
    uint64_t row_bytes;
    if (!cllm_dtype_row_bytes(g->dtype, cols, &row_bytes))
        return false;
    float *row = cllm_malloc_array((size_t)cols, sizeof *row);
    bool same = row != NULL;
    for (int64_t r = 0; same && r < rows; r++) {
        same = cllm_dequant_row(g->dtype, (const char *)g->data + (uint64_t)r * row_bytes, row, cols) &&
               memcmp(row, (const float *)h->data + r * cols, (size_t)cols * sizeof *row) == 0;
    }
    free(row);
    return same;
}

int main(void)
{
    char err[1024] = "";
    struct cllm_model_files *g = NULL, *h = NULL;
    CHECKF(cllm_model_files_open(&g, test_env("CLLM_TEST_GGUF"), err, sizeof err) == CLLM_OK, "%s", err);
    CHECKF(cllm_model_files_open(&h, test_env("CLLM_TEST_HF"), err, sizeof err) == CLLM_OK, "%s", err);
    if (!g || !h)
        return test_summary();
    CHECK(g->format == CLLM_MODEL_FORMAT_GGUF && h->format == CLLM_MODEL_FORMAT_HF);
    CHECKF(cllm_model_files_check_tensors(g, err, sizeof err) == CLLM_OK, "%s", err);
    CHECKF(cllm_model_files_check_tensors(h, err, sizeof err) == CLLM_OK, "%s", err);
    compare_hparams(&g->hp, &h->hp);
    CHECK(g->hp.n_layer == 24 && g->hp.n_embd == 896 && g->hp.n_head_kv == 2);
    CHECK(g->chat_template && h->chat_template && strcmp(g->chat_template, h->chat_template) == 0);
    CHECK(g->gen.n_eos >= 1 && h->gen.n_eos >= 1 && g->gen.eos_ids[0] == 151645);
    bool eos_shared = false;
    for (int i = 0; i < h->gen.n_eos; i++)
        eos_shared |= h->gen.eos_ids[i] == g->gen.eos_ids[0];
    CHECK(eos_shared);
    CHECK(cllm_tokenizer_n_vocab(g->tok) == cllm_tokenizer_n_vocab(h->tok));

    size_t n = cllm_model_files_n_tensors(g), compared = 0, differ = 0;
    for (size_t i = 0; i < n; i++) {
        const struct cllm_tensor *gt = cllm_model_files_tensor_at(g, i);
        const struct cllm_tensor *ht = cllm_model_files_tensor(h, gt->name);
        bool same = ht && same_weights(gt, ht);
        if (!same && differ++ < 5)
            fprintf(stderr, "tensor %s (%s) differs from the HF folder's%s\n", gt->name,
                    cllm_dtype_name(gt->dtype), ht ? "" : " (missing there)");
        compared++;
    }
    printf("compared %zu tensors, %zu differ\n", compared, differ);
    CHECK(compared == 291 && differ == 0);
    CHECK(cllm_model_files_n_tensors(h) == n);

    char name[128];
    CHECK(cllm_qwen2_hf_name("blk.23.ffn_down.weight", name, sizeof name) &&
          strcmp(name, "model.layers.23.mlp.down_proj.weight") == 0);
    CHECK(cllm_qwen2_gguf_name("model.layers.7.self_attn.k_proj.bias", name, sizeof name) &&
          strcmp(name, "blk.7.attn_k.bias") == 0);
    CHECK(!cllm_qwen2_hf_name("blk.07.ffn_down.weight", name, sizeof name));
    CHECK(!cllm_qwen2_hf_name("blk.1.unknown.weight", name, sizeof name));
    CHECK(!cllm_qwen2_gguf_name("model.layers.x.mlp.up_proj.weight", name, sizeof name));
    cllm_model_files_free(g);
    cllm_model_files_free(h);
    return test_summary();
}
