/*
 * Stand-in for the MUSA SDK's musa_runtime.h, for tests/tools/test_musa_frontend.py only: the
 * MUSA runtime mirrors CUDA's (musaMalloc is cudaMalloc's twin), so each MUSA name that
 * src/backend/cuda/vendor.h maps to is spelled here as its CUDA 11.8 twin. CUDA 11.8 because
 * MUSA SDK 3.1 follows the CUDA 11 API where CUDA 12 changed it (musaGraphInstantiate takes
 * CUDA 11's five arguments in torch_musa and the MUSA ports of XLA and onnxruntime). A name
 * missing here stays undefined and fails the check: add one only where public MUSA code uses it.
 * (With vendor.h's own macros, cudaMalloc -> musaMalloc -> cudaMalloc stops there: a macro is
 * not expanded inside its own expansion, so the code reaches the CUDA function.)
 */
#ifndef CLLM_MUSA_STANDIN_RUNTIME_H
#define CLLM_MUSA_STANDIN_RUNTIME_H
#include <cuda_runtime.h>

#define musaError_t cudaError_t
#define musaSuccess cudaSuccess
#define musaErrorMemoryAllocation cudaErrorMemoryAllocation
#define musaErrorInvalidValue cudaErrorInvalidValue
#define musaGetDevice cudaGetDevice
#define musaStreamCreate cudaStreamCreate
#define musaDevAttrMaxSharedMemoryPerBlockOptin cudaDevAttrMaxSharedMemoryPerBlockOptin
#define musaGetErrorString cudaGetErrorString
#define musaGetLastError cudaGetLastError
#define musaGetDeviceCount cudaGetDeviceCount
#define musaGetDeviceProperties cudaGetDeviceProperties
#define musaDeviceProp cudaDeviceProp
#define musaSetDevice cudaSetDevice
#define musaMemGetInfo cudaMemGetInfo
#define musaMalloc cudaMalloc
#define musaFree cudaFree
#define musaMallocHost cudaMallocHost
#define musaFreeHost cudaFreeHost
#define musaMemcpy cudaMemcpy
#define musaMemcpyAsync cudaMemcpyAsync
#define musaMemcpyKind cudaMemcpyKind
#define musaMemsetAsync cudaMemsetAsync
#define musaMemcpyHostToDevice cudaMemcpyHostToDevice
#define musaMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define musaMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define musaStream_t cudaStream_t
#define musaStreamCreateWithFlags cudaStreamCreateWithFlags
#define musaStreamDestroy cudaStreamDestroy
#define musaStreamSynchronize cudaStreamSynchronize
#define musaEvent_t cudaEvent_t
#define musaEventCreate cudaEventCreate
#define musaEventCreateWithFlags cudaEventCreateWithFlags
#define musaEventElapsedTime cudaEventElapsedTime
#define musaEventRecord cudaEventRecord
#define musaEventSynchronize cudaEventSynchronize
#define musaEventDestroy cudaEventDestroy
#define musaStreamBeginCapture cudaStreamBeginCapture
#define musaStreamEndCapture cudaStreamEndCapture
#define musaStreamCaptureModeRelaxed cudaStreamCaptureModeRelaxed
#define musaGraph_t cudaGraph_t
#define musaGraphExec_t cudaGraphExec_t
#define musaGraphInstantiate cudaGraphInstantiate
#define musaGraphLaunch cudaGraphLaunch
#define musaGraphDestroy cudaGraphDestroy
#define musaGraphExecDestroy cudaGraphExecDestroy
#define musaFuncSetAttribute cudaFuncSetAttribute
#define musaFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define musaDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define musaDeviceGetAttribute cudaDeviceGetAttribute

/* CUDA's flags are macros, as the SDK's twins are: their values, and CUDA's names gone, as
 * they would be in a MUSA build (vendor.h defines them). */
#define musaStreamNonBlocking 0x01
#define musaEventDisableTiming 0x02
#undef cudaStreamNonBlocking
#undef cudaEventDisableTiming

#endif
