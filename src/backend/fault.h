/* A lost device, on demand, for tests of what the engine and server do when the GPU stops
 * answering (a CUDA error that sticks, such as an illegal address, fails every later call). */
#ifndef CLLM_BACKEND_FAULT_H
#define CLLM_BACKEND_FAULT_H

#include "backend/backend.h"

/* Wraps *be: it works as before until a sync finds the file `trigger` present; from then on
 * every sync, upload and download fails with CLLM_ERR_DEVICE (with CLLM_FAULT_ONCE=1, that
 * one sync fails and removes the file: an error that does not stick; with CLLM_FAULT_STALL=1
 * a sync waits as long as the file exists: a device that hangs; with CLLM_FAULT_CRASH=1 the
 * sync removes the file and aborts the process: a driver that crashes it; with
 * CLLM_FAULT_NOMEM_TOKENS=N, while the file exists a matmul over more than N tokens fails with
 * CLLM_ERR_NOMEM: a device short of memory for large steps; with CLLM_FAULT_WRONG_MATMUL=1,
 * while the file exists a matmul does nothing and succeeds: a device that computes wrong,
 * whichever way its GEMMs run). The wrapper keeps the
 * backend's name, or takes CLLM_FAULT_NAME's (a CPU backend passing for a GPU: the engine
 * checks it at start and, under --device auto, moves to the CPU when it is lost). On success
 * *be is the wrapper, which owns (and frees) the original; on failure *be is unchanged. */
enum cllm_status cllm_backend_fault_wrap(struct cllm_backend **be, const char *trigger);

#endif
