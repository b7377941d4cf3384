/*
 * A distinct token a request has seen and how often it generated it: the penalties' memory.
 * Here in core because two layers share it without depending on each other: the sampler
 * (sampling/) keeps its table in it, and the device interface (backend/) takes a step's
 * tables in it for a GPU to apply the same penalties.
 */
#ifndef CLLM_CORE_TOKEN_COUNT_H
#define CLLM_CORE_TOKEN_COUNT_H

#include <stdint.h>

struct cllm_token_count {
    int32_t token;
    uint32_t count; /* times generated; 0 for a token seen only in the prompt */
};

#endif
