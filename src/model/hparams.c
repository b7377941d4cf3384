/*
 * Format-neutral checks and defaults for what hparams.h describes: the generation defaults
 * transformers uses when generation_config.json is silent, and the sanity checks every loader
 * (HF folder or GGUF) runs before the model code trusts a size.
 */
#include "model/hparams.h"

#include <math.h>
#include <string.h>

#include "core/status.h"

void cllm_gen_defaults_init(struct cllm_gen_defaults *g)
{
    /* GenerationConfig._get_default_generation_params() in transformers. */
    memset(g, 0, sizeof *g);
    g->do_sample = false;
    g->temperature = 1.0f;
    g->top_p = 1.0f;
    g->top_k = 50;
    g->repetition_penalty = 1.0f;
    g->max_new_tokens = 0;
    g->n_eos = 0;
    g->bos_id = -1;
    g->pad_id = -1;
}

static bool positive(const char *what, int32_t v, char *err, size_t err_len)
{
    if (v > 0)
        return true;
    cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s is %d, must be positive", what, (int)v);
    return false;
}

bool cllm_hparams_valid(const struct cllm_hparams *hp, char *err, size_t err_len)
{
    if (hp->arch[0] == '\0' || memchr(hp->arch, '\0', sizeof hp->arch) == NULL) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE, "architecture name is empty or unterminated");
        return false;
    }
    if (!positive("vocab size", hp->n_vocab, err, err_len) ||
        !positive("hidden size", hp->n_embd, err, err_len) ||
        !positive("intermediate size", hp->n_ff, err, err_len) ||
        !positive("layer count", hp->n_layer, err, err_len) ||
        !positive("attention head count", hp->n_head, err, err_len) ||
        !positive("key/value head count", hp->n_head_kv, err, err_len) ||
        !positive("head dimension", hp->head_dim, err, err_len) ||
        !positive("context length", hp->n_ctx_train, err, err_len))
        return false;
    if (hp->n_head % hp->n_head_kv != 0) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE,
                  "attention heads (%d) are not a multiple of key/value heads (%d)",
                  (int)hp->n_head, (int)hp->n_head_kv);
        return false;
    }
    /* RoPE rotates pairs of dimensions. */
    if (hp->head_dim % 2 != 0) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE, "head dimension %d is odd", (int)hp->head_dim);
        return false;
    }
    /* The model code sizes Q and K/V rows as heads * head_dim in 32-bit ints. */
    if ((int64_t)hp->n_head * hp->head_dim > INT32_MAX) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE, "attention heads * head dimension overflows");
        return false;
    }
    if (!(hp->rms_eps > 0.0f) || !isfinite(hp->rms_eps)) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE, "RMS norm epsilon %g must be positive and finite",
                  (double)hp->rms_eps);
        return false;
    }
    if (!(hp->rope_theta > 0.0f) || !isfinite(hp->rope_theta)) {
        cllm_fail(err, err_len, CLLM_ERR_RANGE, "RoPE theta %g must be positive and finite",
                  (double)hp->rope_theta);
        return false;
    }
    return true;
}
