/*
 * Builds a cllm_tokenizer from what a model ships: an HF tokenizer.json, or the
 * tokenizer.ggml.* metadata of a GGUF file. Only the Qwen2 byte-level BPE setup is accepted;
 * anything else is a clear CLLM_ERR_UNSUPPORTED naming the part we do not handle.
 */
#ifndef CLLM_MODEL_VOCAB_LOAD_H
#define CLLM_MODEL_VOCAB_LOAD_H

#include <stddef.h>

#include "cllm.h"
#include "model/gguf.h"
#include "tokenizer/tokenizer.h"

/* From tokenizer.json at path. */
enum cllm_status cllm_vocab_load_json(struct cllm_tokenizer **out, const char *path, char *err,
                                      size_t err_len);
/* From the metadata of an open GGUF file (g must stay open only during the call). */
enum cllm_status cllm_vocab_load_gguf(struct cllm_tokenizer **out, const struct cllm_gguf *g,
                                      char *err, size_t err_len);

#endif
