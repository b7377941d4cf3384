/*
 * A model on disk, whatever its format: a GGUF file or an HF folder (config.json,
 * safetensors, tokenizer.json, ...). Opening maps the weights (no copies), reads the
 * hyperparameters, generation defaults, chat template and builds the tokenizer, so the layers
 * above never see which format it was. Tensors are looked up by GGUF-style names.
 */
#ifndef CLLM_MODEL_MODEL_FILES_H
#define CLLM_MODEL_MODEL_FILES_H

#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "model/hparams.h"
#include "tensor/tensor.h"
#include "tokenizer/tokenizer.h"

enum cllm_model_format {
    CLLM_MODEL_FORMAT_GGUF,
    CLLM_MODEL_FORMAT_HF,
};

struct cllm_model_files {
    enum cllm_model_format format;
    char *path;                      /* as given to open */
    struct cllm_hparams hp;          /* architecture */
    struct cllm_gen_defaults gen;    /* sampling defaults and stop ids */
    char *chat_template;             /* Jinja source, NULL if the model has none */
    struct cllm_tokenizer *tok;      /* owned */
    struct cllm_gguf *gguf;          /* set for GGUF */
    struct cllm_st_set *st;          /* set for HF folders */
};

/* Opens path: a directory is read as an HF folder, a file as GGUF. Errors name the file and
 * the problem. */
enum cllm_status cllm_model_files_open(struct cllm_model_files **out, const char *path, char *err,
                                       size_t err_len);
void cllm_model_files_free(struct cllm_model_files *mf);

/* The tensor with GGUF-style name (e.g. "blk.0.attn_q.weight"), or NULL. */
const struct cllm_tensor *cllm_model_files_tensor(const struct cllm_model_files *mf,
                                                  const char *name);
/* All tensors, in file order (names as the file has them). */
size_t cllm_model_files_n_tensors(const struct cllm_model_files *mf);
const struct cllm_tensor *cllm_model_files_tensor_at(const struct cllm_model_files *mf, size_t i);

/* Checks that every tensor the Qwen2 forward pass needs is present with the shape the
 * hyperparameters imply; err names the first missing or misshapen tensor. */
enum cllm_status cllm_model_files_check_tensors(const struct cllm_model_files *mf, char *err,
                                                size_t err_len);

#endif
