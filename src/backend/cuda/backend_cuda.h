/* The CUDA backend (backend_cuda.cu): BF16 weights, activations and KV cache on one GPU. */
#ifndef CLLM_BACKEND_CUDA_BACKEND_CUDA_H
#define CLLM_BACKEND_CUDA_BACKEND_CUDA_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Opens GPU `device` (with every GEMM on CUDA cores: gemm_on_cores). CLLM_ERR_DEVICE (err
 * says why) when there is no usable GPU. */
enum cllm_status cllm_backend_cuda_new(struct cllm_backend **out, int32_t device,
                                       bool gemm_on_cores, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
