/*
 * Tensor names of the Qwen2 architecture. cllm names tensors the GGUF way
 * ("blk.3.attn_q.weight"); HF folders use transformers' names
 * ("model.layers.3.self_attn.q_proj.weight"). This table is the one place that maps them.
 */
#ifndef CLLM_MODEL_QWEN2_H
#define CLLM_MODEL_QWEN2_H

#include <stdbool.h>
#include <stddef.h>

/* Writes the HF name of a GGUF-style tensor name into out; false if the name is not a Qwen2
 * tensor or does not fit. */
bool cllm_qwen2_hf_name(const char *gguf_name, char *out, size_t out_len);

/* Writes the GGUF-style name of an HF tensor name; false if it is not a Qwen2 tensor. */
bool cllm_qwen2_gguf_name(const char *hf_name, char *out, size_t out_len);

#endif
