/*
 * Reader for safetensors files and HF model folders (one file or shards plus an index).
 *
 * File layout (all little-endian):
 *   u64 N                      header length in bytes (at most 100 MB)
 *   u8  header[N]              a JSON object: {"__metadata__": {str: str},
 *                              "<name>": {"dtype": "BF16", "shape": [outer, .., inner],
 *                              "data_offsets": [begin, end]}, ...}, space-padded
 *   u8  data[]                 tensor bytes; offsets are relative to the start of data[]
 * Files are mmap'd; tensors point into the mapping. Shapes are reversed into ne[] (innermost
 * first), so ggml-style code reads HF and GGUF weights alike.
 */
#ifndef CLLM_MODEL_SAFETENSORS_H
#define CLLM_MODEL_SAFETENSORS_H

#include <stddef.h>

#include "cllm.h"
#include "tensor/tensor.h"

/* Caps that keep a lying file from making us allocate without bound. */
#define CLLM_ST_MAX_HEADER (100u * 1000u * 1000u) /* same cap as the safetensors crate */
#define CLLM_ST_MAX_INDEX (64u * 1024u * 1024u)   /* model.safetensors.index.json */

/* The tensors of one file or of all shards of a folder, and the mappings they live in. */
struct cllm_st_set;

/*
 * Opens the weights of an HF model folder: model.safetensors if present (transformers checks it
 * first), else model.safetensors.index.json and every shard it names (each opened once; names
 * may not contain '/' or be "." / ".."). Every tensor the index lists must be in the shard it
 * names; tensors of all shards form one set and a name may appear only once.
 */
enum cllm_status cllm_st_open_dir(struct cllm_st_set **out, const char *dir, char *err,
                                  size_t err_len);

/* Opens one .safetensors file. */
enum cllm_status cllm_st_open_file(struct cllm_st_set **out, const char *path, char *err,
                                   size_t err_len);

/* The tensor called name, or NULL. The pointer (and the tensor's name and data) stays valid until
 * cllm_st_free. Data is not guaranteed to be aligned beyond what the file gives. */
const struct cllm_tensor *cllm_st_find(const struct cllm_st_set *set, const char *name);

/* Number of tensors, and the i-th in file order (shards in order of first mention in the
 * index); NULL if i is out of range. */
size_t cllm_st_count(const struct cllm_st_set *set);
const struct cllm_tensor *cllm_st_tensor(const struct cllm_st_set *set, size_t i);

/* The path of the file that holds t (a tensor of this set), for error messages; "?" else. */
const char *cllm_st_tensor_path(const struct cllm_st_set *set, const struct cllm_tensor *t);

/* Unmaps every file; NULL is a no-op. */
void cllm_st_free(struct cllm_st_set *set);

#endif
