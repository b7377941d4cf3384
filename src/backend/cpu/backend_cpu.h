/* The CPU backend: ops on host memory, split over a persistent thread pool. */
#ifndef CLLM_BACKEND_CPU_BACKEND_CPU_H
#define CLLM_BACKEND_CPU_BACKEND_CPU_H

#include "backend/backend.h"

/* n_threads <= 0 means one per physical core; weights says how float matrices are held. */
enum cllm_status cllm_backend_cpu_new(struct cllm_backend **out, int32_t n_threads,
                                      enum cllm_cpu_weights weights, char *err, size_t err_len);

#endif
