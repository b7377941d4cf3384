/*
 * Readers for the JSON files of an HF model folder:
 *   config.json              -> struct cllm_hparams (required)
 *   generation_config.json   -> struct cllm_gen_defaults (optional)
 *   tokenizer_config.json    -> struct cllm_hf_tokenizer_config (optional), plus
 *   chat_template.jinja      (optional; transformers >= 4.43 saves the template there and lets it
 *                            override tokenizer_config.json's "chat_template")
 * Both transformers v4 configs (rope_theta, rope_scaling) and v5 configs (rope_parameters) are
 * read. Errors name the file ("DIR/config.json: ...") and the key.
 */
#ifndef CLLM_MODEL_HF_CONFIG_H
#define CLLM_MODEL_HF_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "model/hparams.h"

/* Size caps for files read whole. */
#define CLLM_HF_MAX_CONFIG (4u * 1024u * 1024u)            /* config / generation_config */
#define CLLM_HF_MAX_TOKENIZER_CONFIG (32u * 1024u * 1024u) /* tokenizer_config, chat template */

/*
 * Reads DIR/config.json. Required: model_type, vocab_size, hidden_size, intermediate_size,
 * num_hidden_layers, num_attention_heads, max_position_embeddings, rms_norm_eps. Optional
 * (null = absent): num_key_value_heads (= heads), head_dim (= hidden / heads), rope_theta
 * (10000; rope_parameters/rope_scaling's own rope_theta wins), tie_word_embeddings (false).
 * Rejects RoPE scaling other than "default", partial rotary factors, sliding-window attention
 * and activations other than silu (the model code implements none of them), then checks
 * cllm_hparams_valid. A missing file is CLLM_ERR_IO with "DIR/config.json: cannot open: ...".
 */
enum cllm_status cllm_hf_read_hparams(const char *dir, struct cllm_hparams *hp, char *err,
                                      size_t err_len);

/*
 * Reads DIR/generation_config.json into *g, starting from cllm_gen_defaults_init; a missing file
 * leaves the defaults and is not an error, null values keep their default. eos_token_id may be
 * an integer or a list of at most CLLM_MAX_EOS_IDS integers.
 */
enum cllm_status cllm_hf_read_gen_defaults(const char *dir, struct cllm_gen_defaults *g, char *err,
                                           size_t err_len);

/* What tokenizer_config.json (and chat_template.jinja) say beyond tokenizer.json. */
struct cllm_hf_tokenizer_config {
    char *chat_template; /* malloc'd Jinja source; NULL if the folder has none */
    char *bos_token;     /* malloc'd token text; NULL if unset or null */
    char *eos_token;
    char *pad_token;
    char *unk_token;
    int add_bos_token; /* 1 / 0 as the file says; -1 if absent (tokenizer.json decides) */
    int add_eos_token; /* likewise */
};

/*
 * Reads DIR/tokenizer_config.json and DIR/chat_template.jinja, both optional (a folder with
 * neither yields an all-NULL struct). "chat_template" may be a string or a list of
 * {"name", "template"} objects (the one named "default", else the first); token fields may be
 * strings, null, or {"content": "..."} objects. On failure *tc holds nothing to free.
 */
enum cllm_status cllm_hf_read_tokenizer_config(const char *dir, struct cllm_hf_tokenizer_config *tc,
                                               char *err, size_t err_len);
void cllm_hf_tokenizer_config_free(struct cllm_hf_tokenizer_config *tc);

#endif
