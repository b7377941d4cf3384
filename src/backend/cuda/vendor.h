/*
 * The one place that names the GPU vendor's runtime. Every file in src/backend/cuda/ includes
 * this first and then speaks CUDA: cuda* / cublas* / __nv_bfloat16. Built with CLLM_MUSA, the
 * same sources compile with the MUSA toolchain (Moore Threads GPUs), and the macros below
 * map each CUDA name used here to its MUSA twin, as llama.cpp's MUSA support does.
 *
 * MUSA status: UNTESTED. No MUSA toolchain or GPU has been available to this project; the
 * mapping follows the MUSA SDK's naming (musa_runtime.h, musa_bf16.h, mublas.h: cuda* ->
 * musa*, cublas* -> mublas*) and must be checked on a real MUSA machine. The BF16 intrinsics
 * (__float2bfloat16_rn, __bfloat162float, ...) are assumed to keep their CUDA names in
 * musa_bf16.h. Every cuda* and cublas* name the .cu files use is mapped below (a grep over
 * src/backend/cuda checks that); add one here whenever a file starts using a new API.
 */
#ifndef CLLM_BACKEND_CUDA_VENDOR_H
#define CLLM_BACKEND_CUDA_VENDOR_H

/* A macro's expansion as a string (symbol and library names). */
#define CLLM_VENDOR_STR2(x) #x
#define CLLM_VENDOR_STR(x) CLLM_VENDOR_STR2(x)

/* A device function kept out of line. Spelled through a macro of ours because the emulator
 * (tests/emu) cannot define __noinline__ itself: libstdc++ 13 writes
 * __attribute__((__noinline__)), which such a macro would break. */
#define CLLM_NOINLINE __noinline__

#if defined(CLLM_MUSA)

#include <musa_runtime.h>
#include <musa_bf16.h>
#ifndef CLLM_NO_BLAS
#include <mublas.h>
#endif

/* runtime */
#define cudaError_t musaError_t
#define cudaSuccess musaSuccess
#define cudaErrorMemoryAllocation musaErrorMemoryAllocation
#define cudaErrorInvalidValue musaErrorInvalidValue
#define cudaGetDevice musaGetDevice
#define cudaStreamCreate musaStreamCreate
#define cudaDevAttrMaxSharedMemoryPerBlockOptin musaDevAttrMaxSharedMemoryPerBlockOptin
#define cudaGetErrorString musaGetErrorString
#define cudaGetLastError musaGetLastError
#define cudaGetDeviceCount musaGetDeviceCount
#define cudaGetDeviceProperties musaGetDeviceProperties
#define cudaDeviceProp musaDeviceProp
#define cudaSetDevice musaSetDevice
#define cudaMemGetInfo musaMemGetInfo
#define cudaMalloc musaMalloc
#define cudaFree musaFree
#define cudaMallocHost musaMallocHost
#define cudaFreeHost musaFreeHost
#define cudaMemcpy musaMemcpy
#define cudaMemcpyAsync musaMemcpyAsync
#define cudaMemcpyKind musaMemcpyKind
#define cudaMemsetAsync musaMemsetAsync
#define cudaMemcpyHostToDevice musaMemcpyHostToDevice
#define cudaMemcpyDeviceToHost musaMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice musaMemcpyDeviceToDevice
#define cudaStream_t musaStream_t
#define cudaStreamCreateWithFlags musaStreamCreateWithFlags
#define cudaStreamNonBlocking musaStreamNonBlocking
#define cudaStreamDestroy musaStreamDestroy
#define cudaStreamSynchronize musaStreamSynchronize
#define cudaEvent_t musaEvent_t
#define cudaEventCreate musaEventCreate
#define cudaEventCreateWithFlags musaEventCreateWithFlags
#define cudaEventElapsedTime musaEventElapsedTime
#define cudaEventDisableTiming musaEventDisableTiming
#define cudaEventRecord musaEventRecord
#define cudaEventSynchronize musaEventSynchronize
#define cudaEventDestroy musaEventDestroy
#define cudaStreamBeginCapture musaStreamBeginCapture
#define cudaStreamEndCapture musaStreamEndCapture
/* llama.cpp's MUSA graphs capture in relaxed mode, the one mode its map names */
#define cudaStreamCaptureModeThreadLocal musaStreamCaptureModeRelaxed
#define cudaGraph_t musaGraph_t
#define cudaGraphExec_t musaGraphExec_t
#define cudaGraphInstantiate musaGraphInstantiate
#define cudaGraphLaunch musaGraphLaunch
#define cudaGraphDestroy musaGraphDestroy
#define cudaGraphExecDestroy musaGraphExecDestroy
#define cudaFuncSetAttribute musaFuncSetAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize musaFuncAttributeMaxDynamicSharedMemorySize
#define cudaDevAttrMultiProcessorCount musaDevAttrMultiProcessorCount
#define cudaDeviceGetAttribute musaDeviceGetAttribute
/* bf16 */
#define __nv_bfloat16 __mt_bfloat16
#define __nv_bfloat162 __mt_bfloat162
/* BLAS: linked (blas.cu); the GEMM goes through mublasGemmEx, the cublasGemmEx twin, in its
 * overload taking a mublasComputeType_t (the signature the SDK's C++ symbol spells out:
 * musaDataType_t operands, mublasComputeType_t, mublasGemmAlgo_t). */
#define cublasHandle_t mublasHandle_t
#define cublasStatus_t mublasStatus_t
#define CUBLAS_STATUS_SUCCESS MUBLAS_STATUS_SUCCESS
#define CUBLAS_STATUS_ALLOC_FAILED MUBLAS_STATUS_ALLOC_FAILED
#define cublasCreate mublasCreate
#define cublasDestroy mublasDestroy
#define cublasSetStream mublasSetStream
#define cublasSetWorkspace mublasSetWorkspace
#define cublasSetMathMode mublasSetMathMode
#define cublasGemmEx mublasGemmEx
#define cublasGetStatusString mublasGetStatusString
#define CUBLAS_OP_N MUBLAS_OP_N
#define CUBLAS_OP_T MUBLAS_OP_T
#define CUBLAS_COMPUTE_32F MUBLAS_COMPUTE_32F
#define CUBLAS_GEMM_DEFAULT MUBLAS_GEMM_DEFAULT
#define CUBLAS_DEFAULT_MATH MUBLAS_DEFAULT_MATH
#define CUDA_R_16BF MUSA_R_16BF
#define CUDA_R_32F MUSA_R_32F
#define cublasOperation_t mublasOperation_t
#define cudaDataType musaDataType_t
#define cublasComputeType_t mublasComputeType_t
#define cublasGemmAlgo_t mublasGemmAlgo_t

#ifdef CLLM_NO_BLAS
/* Built without muBLAS (CMake's CLLM_MUSA_BLAS=OFF: what scripts/build tries when a build
 * fails on muBLAS): the muBLAS names blas.h's table and the BLAS path spell, as stand-ins that
 * are never called (cllm_blas_load finds no library, and our GEMM on CUDA cores, gemm_simt.cu,
 * does every GEMM). The data types are ours, not musaDataType_t: whether the runtime's headers
 * declare that without muBLAS's is not known here. */
typedef struct cllm_no_blas *mublasHandle_t;
typedef enum { MUBLAS_STATUS_SUCCESS, MUBLAS_STATUS_ALLOC_FAILED } mublasStatus_t;
typedef enum { MUBLAS_OP_N, MUBLAS_OP_T } mublasOperation_t;
typedef enum { MUBLAS_COMPUTE_32F } mublasComputeType_t;
typedef enum { MUBLAS_GEMM_DEFAULT } mublasGemmAlgo_t;
typedef enum { CLLM_NO_BLAS_R_32F, CLLM_NO_BLAS_R_16BF } cllm_no_blas_type;
#undef cudaDataType
#define cudaDataType cllm_no_blas_type
#undef CUDA_R_16BF
#define CUDA_R_16BF CLLM_NO_BLAS_R_16BF
#undef CUDA_R_32F
#define CUDA_R_32F CLLM_NO_BLAS_R_32F
#endif

/* QY1/QY2 GPUs (MTT S80, S4000) run 128 threads per hardware warp: warp.h builds ballots from
 * 32-lane shuffles. */
#define CLLM_WIDE_WARPS 1
/* llama.cpp calls MUSA graphs "experimental, unstable" (GGML_MUSA_GRAPHS, off by default):
 * steps are not recorded unless CLLM_MUSA_GRAPHS=1 (backend_cuda.cu). */
#define CLLM_GRAPHS_OPT_IN "CLLM_MUSA_GRAPHS"

/* No programmatic dependent launch: kernels are launched the classic way (see below). */
static __device__ __forceinline__ void cllm_pdl_wait(void)
{
}
template <typename... KArgs, typename... Args>
static inline cudaError_t cllm_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                      cudaStream_t stream, Args... args)
{
    kernel<<<grid, block, smem, stream>>>(static_cast<KArgs>(args)...);
    return cudaGetLastError();
}
#else

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

/* blas.cu opens cuBLAS at run time, by the soname of the version built against. */
#define CLLM_BLAS_LIBRARY "libcublas.so." CLLM_VENDOR_STR(CUBLAS_VER_MAJOR)

/* The tensor-core instruction gemm.cu is built on: d += a * b for one 16 x 8 x 16 tile (BF16
 * in, F32 accumulate), each lane holding its fragments as the PTX ISA lays them out for
 * mma.m16n8k16 (a: 4 registers of 2 BF16, b: 2, d: 4 floats). sm_80 and later. A MUSA build
 * has no PTX: it leaves CLLM_HAVE_MMA undefined and the backend uses the vendor BLAS. */
#define CLLM_HAVE_MMA 1
static __device__ __forceinline__ void cllm_mma_bf16_16816(float d[4], const unsigned a[4],
                                                           const unsigned b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Asynchronous 16-byte copy from global to shared memory (cp.async, sm_80 and later): it does
 * not pass through registers, so a kernel can fetch its next tile while it computes on the
 * current one. Copies issued since the last commit form a group; wait<N> returns once at most
 * N groups are still in flight (then a __syncthreads makes them visible to the block). */
static __device__ __forceinline__ void cllm_cp_async16(void *smem, const void *gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cllm_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cllm_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* Programmatic dependent launch (sm_90 and later): a kernel launched with cllm_launch may be
 * scheduled while the one before it in the stream still runs, which hides the launch gap
 * between the ~250 small kernels of a decode step. Every such kernel must call
 * cllm_pdl_wait() before it touches global memory: it waits until the previous kernel has
 * finished and its writes are visible, then lets the next kernel be scheduled in turn
 * (tests/tools/test_pdl_discipline.py checks the rule). Elsewhere both are no-ops. */
static __device__ __forceinline__ void cllm_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Set by the backend: the device runs programmatic dependent launch (compute 9.0+) and
 * CLLM_NO_PDL is not set. One value per process (all our devices are alike). */
extern bool cllm_cuda_pdl;

template <typename... KArgs, typename... Args>
static inline cudaError_t cllm_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                      cudaStream_t stream, Args... args)
{
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = cllm_cuda_pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

#endif

#include "backend/cuda/portable.h"

#endif
