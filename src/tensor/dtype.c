/* The dtype traits table and the mappings from GGUF type ids and safetensors dtype names. */
#include "tensor/dtype.h"

#include <string.h>

#include "core/alloc.h"

static const struct cllm_dtype_traits traits[CLLM_DTYPE_COUNT] = {
    [CLLM_DTYPE_F32] = {"F32", 1, 4, false, 0},
    [CLLM_DTYPE_F16] = {"F16", 1, 2, false, 1},
    [CLLM_DTYPE_BF16] = {"BF16", 1, 2, false, 30},
    [CLLM_DTYPE_Q8_0] = {"Q8_0", 32, 34, true, 8},
    [CLLM_DTYPE_Q4_0] = {"Q4_0", 32, 18, true, 2},
    [CLLM_DTYPE_Q4_1] = {"Q4_1", 32, 20, true, 3},
    [CLLM_DTYPE_Q5_0] = {"Q5_0", 32, 22, true, 6},
    [CLLM_DTYPE_Q5_1] = {"Q5_1", 32, 24, true, 7},
    [CLLM_DTYPE_Q4_K] = {"Q4_K", 256, 144, true, 12},
    [CLLM_DTYPE_Q5_K] = {"Q5_K", 256, 176, true, 13},
    [CLLM_DTYPE_Q6_K] = {"Q6_K", 256, 210, true, 14},
};

const struct cllm_dtype_traits *cllm_dtype_traits(enum cllm_dtype t)
{
    if ((unsigned)t >= CLLM_DTYPE_COUNT)
        return NULL;
    return &traits[t];
}

const char *cllm_dtype_name(enum cllm_dtype t)
{
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(t);
    return tr ? tr->name : "?";
}

bool cllm_dtype_from_ggml(uint32_t ggml_type, enum cllm_dtype *out)
{
    for (int t = 0; t < CLLM_DTYPE_COUNT; t++) {
        if (traits[t].ggml_type == ggml_type) {
            *out = (enum cllm_dtype)t;
            return true;
        }
    }
    return false;
}

const char *cllm_ggml_type_name(uint32_t ggml_type)
{
    /* ggml's type ids, for naming what we reject. */
    static const char *const names[] = {
        "F32",     "F16",    "Q4_0",  "Q4_1",  "Q4_2",  "Q4_3",   "Q5_0",    "Q5_1",
        "Q8_0",    "Q8_1",   "Q2_K",  "Q3_K",  "Q4_K",  "Q5_K",   "Q6_K",    "Q8_K",
        "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S",  "IQ4_XS",
        "I8",      "I16",    "I32",   "I64",   "F64",   "IQ1_M",  "BF16",
    };
    if (ggml_type < sizeof names / sizeof names[0])
        return names[ggml_type];
    return "unknown";
}

bool cllm_dtype_from_safetensors(const char *s, enum cllm_dtype *out)
{
    static const struct {
        const char *name;
        enum cllm_dtype t;
    } map[] = {{"F32", CLLM_DTYPE_F32}, {"F16", CLLM_DTYPE_F16}, {"BF16", CLLM_DTYPE_BF16}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (strcmp(s, map[i].name) == 0) {
            *out = map[i].t;
            return true;
        }
    }
    return false;
}

bool cllm_dtype_row_bytes(enum cllm_dtype t, int64_t n, uint64_t *out)
{
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(t);
    if (!tr || n < 0 || (uint64_t)n % tr->block_size != 0)
        return false;
    return cllm_mul_u64((uint64_t)n / tr->block_size, tr->type_size, out);
}
