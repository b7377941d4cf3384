/*
 * What a model folder or GGUF file says about the model, in one format-neutral form:
 * architecture hyperparameters, generation defaults and tokenizer/template settings.
 * Filled from config.json / generation_config.json / tokenizer_config.json (hf_config.c) or
 * from GGUF metadata (model_files.c).
 */
#ifndef CLLM_MODEL_HPARAMS_H
#define CLLM_MODEL_HPARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CLLM_MAX_EOS_IDS 8

/* Architecture hyperparameters (Qwen2 and Llama-family decoders). */
struct cllm_hparams {
    char arch[32];             /* "qwen2", "llama", ... (model_type / general.architecture) */
    int32_t n_vocab;           /* rows of the embedding matrix */
    int32_t n_embd;            /* hidden_size */
    int32_t n_ff;              /* intermediate_size */
    int32_t n_layer;           /* num_hidden_layers */
    int32_t n_head;            /* num_attention_heads */
    int32_t n_head_kv;         /* num_key_value_heads (== n_head without GQA) */
    int32_t head_dim;          /* n_embd / n_head unless the config says otherwise */
    int32_t n_ctx_train;       /* max_position_embeddings */
    float rms_eps;             /* rms_norm_eps */
    float rope_theta;          /* rope_theta (base of the rotary frequencies) */
    bool tie_embeddings;       /* LM head shares the token embedding matrix */
};

/* Sampling defaults and stop tokens, as transformers' generate() takes them from
 * generation_config.json. Fields a file does not set keep the values of
 * cllm_gen_defaults_init: greedy off, temperature 1, top_p 1, top_k 50 (transformers' own). */
struct cllm_gen_defaults {
    bool do_sample;
    float temperature;
    float top_p;
    int32_t top_k;             /* 0 = disabled */
    float repetition_penalty;  /* 1 = off */
    int32_t max_new_tokens;    /* 0 = not set */
    int32_t eos_ids[CLLM_MAX_EOS_IDS]; /* generation stops at any of these */
    int32_t n_eos;
    int32_t bos_id;            /* -1 if none */
    int32_t pad_id;            /* -1 if none */
};

void cllm_gen_defaults_init(struct cllm_gen_defaults *g);

/* Checks the hyperparameters are usable (positive sizes, heads divide, ...); fills err. */
bool cllm_hparams_valid(const struct cllm_hparams *hp, char *err, size_t err_len);

#endif
