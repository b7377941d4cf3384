/*
 * The GPU tried in a child process before the server uses it (--device auto). A GPU whose
 * driver or kernels crash or hang would otherwise take the server down at start, or keep it
 * from ever answering its health check: a device check (engine/device_check.h) catches wrong
 * numbers, not a process that dies or never returns. The child is this same binary
 * (`cllm probe-device`): it starts an engine as the server would, which runs the device
 * check, generates a few tokens through it and exits. The server then starts its own engine
 * on the GPU if the child's got there, else on the CPU.
 */
#ifndef CLLM_SERVER_PROBE_H
#define CLLM_SERVER_PROBE_H

#include <stdatomic.h>
#include <stddef.h>

#include "engine/engine.h"

/* The child's exit status: 0 when its engine ran on a GPU; these when it found no GPU, or
 * one that failed the device check (its engine moved to the CPU), or one that passed the check
 * only with every GEMM on CUDA cores (engine.h, gemm_on_cores: the server's engine must then
 * run so too). */
#define CLLM_PROBE_EXIT_NO_GPU 3
#define CLLM_PROBE_EXIT_CHECK_FAILED 4
#define CLLM_PROBE_EXIT_GPU_ON_CORES 5

enum cllm_probe_result {
    CLLM_PROBE_GPU,          /* the child ran on a GPU that passed its check */
    CLLM_PROBE_GPU_ON_CORES, /* ... that passed it with every GEMM on CUDA cores */
    CLLM_PROBE_NO_GPU,       /* no GPU started in the child */
    CLLM_PROBE_FAILED,       /* the GPU failed its check, or the child crashed, failed or ran past
                                the timeout (killed): why says */
};

/* Runs `exe probe-device --model model_path` with the engine settings of c that shape the
 * device's work (threads, batch tokens, sequences, GPU memory share, whether the device
 * check runs), waits for it up to timeout_s seconds (or until *stop), and says how it went. */
enum cllm_probe_result cllm_probe_device(const char *exe, const char *model_path,
                                         const struct cllm_engine_config *c, double timeout_s,
                                         const atomic_bool *stop, char *why, size_t why_len);

#endif
