/*
 * Element types of weights and activations, their block layouts and row dequantizers.
 *
 * Quantized types store a row as consecutive blocks of block_size elements, each type_size
 * bytes, exactly as ggml lays them out in GGUF files (the structs in quant.h are pinned with
 * static_assert). Enum values are our own; cllm_dtype_from_ggml maps GGUF type ids.
 */
#ifndef CLLM_TENSOR_DTYPE_H
#define CLLM_TENSOR_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum cllm_dtype {
    CLLM_DTYPE_F32 = 0,
    CLLM_DTYPE_F16,
    CLLM_DTYPE_BF16,
    CLLM_DTYPE_Q8_0,
    CLLM_DTYPE_Q4_0,
    CLLM_DTYPE_Q4_1,
    CLLM_DTYPE_Q5_0,
    CLLM_DTYPE_Q5_1,
    CLLM_DTYPE_Q4_K,
    CLLM_DTYPE_Q5_K,
    CLLM_DTYPE_Q6_K,
    CLLM_DTYPE_COUNT
};

struct cllm_dtype_traits {
    const char *name;             /* as ggml/safetensors spell it: "F32", "Q4_K", ... */
    uint32_t block_size;          /* elements per block (1 for plain floats) */
    uint32_t type_size;           /* bytes per block */
    bool quantized;               /* true for block-quantized types */
    uint32_t ggml_type;           /* the GGUF/ggml type id */
};

/* Traits of a valid dtype; NULL for an out-of-range value. */
const struct cllm_dtype_traits *cllm_dtype_traits(enum cllm_dtype t);
/* "Q4_K" etc.; "?" for an invalid value. */
const char *cllm_dtype_name(enum cllm_dtype t);

/* Maps a GGUF/ggml type id to our dtype; false for an id we do not support. */
bool cllm_dtype_from_ggml(uint32_t ggml_type, enum cllm_dtype *out);
/* The ggml type name of an id, known or not ("IQ2_XXS", ...), for error messages; "unknown" else. */
const char *cllm_ggml_type_name(uint32_t ggml_type);
/* Maps a safetensors dtype string ("BF16", "F16", "F32"); false for any other. */
bool cllm_dtype_from_safetensors(const char *s, enum cllm_dtype *out);

/* Bytes of a row of n elements into *out; false if n is not a multiple of the block size or
 * the size overflows. */
bool cllm_dtype_row_bytes(enum cllm_dtype t, int64_t n, uint64_t *out);

/* Dequantizes one row of n elements to F32 (dequant.c); returns false (and writes nothing) if
 * n is not a positive multiple of the block size or t is invalid. Bit-exact with ggml/gguf-py. */
bool cllm_dequant_row(enum cllm_dtype t, const void *src, float *dst, int64_t n);

#endif
