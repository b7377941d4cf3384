/* The CPU backend: ops on host memory, split over a persistent thread pool. */
#ifndef CLLM_BACKEND_CPU_BACKEND_CPU_H
#define CLLM_BACKEND_CPU_BACKEND_CPU_H

#include "backend/backend.h"

/* o->n_threads <= 0 means one per physical core; o->cpu_weights says how float matrices are
 * held, o->cpu_copy_budget how many of their bytes are copied out of the files at load. */
enum cllm_status cllm_backend_cpu_new(struct cllm_backend **out,
                                      const struct cllm_backend_options *o, char *err,
                                      size_t err_len);

#endif
