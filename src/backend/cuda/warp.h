/*
 * Warp collectives over 32 lanes, whatever the hardware's warp width. Our kernels are written
 * for 32-lane warps (lane = threadIdx.x % 32, warp = threadIdx.x / 32). On NVIDIA that is the
 * warp; Moore Threads' QY1/QY2 GPUs (MTT S80, S4000) run 128 threads per hardware warp, where a
 * shuffle without a width would index all 128 lanes (a broadcast from lane j would read the
 * first 32-lane group's j for every group). So every shuffle here names width 32, as
 * llama.cpp's MUSA-portable kernels do, and a ballot - whose result width on such a warp is
 * not documented - is built from 32-lane shuffles there (CLLM_WIDE_WARPS, set by vendor.h).
 * tests/tools/test_vendor_map.py checks that no kernel calls the raw intrinsics.
 */
#ifndef CLLM_BACKEND_CUDA_WARP_H
#define CLLM_BACKEND_CUDA_WARP_H

#include "backend/cuda/vendor.h"

#define CLLM_WARP 32
#define CLLM_WARP_LANES 0xffffffffu /* all 32 lanes of the group take part */

/* Macros rather than functions: the CUDA emulator checks that a collective's lanes all arrive
 * from one source line, and a macro keeps that line the caller's. */

/* v of lane `src` of this thread's 32-lane group. */
#define cllm_shfl(v, src) __shfl_sync(CLLM_WARP_LANES, (v), (src), CLLM_WARP)
/* v of lane (lane ^ mask), mask < 32. */
#define cllm_shfl_xor(v, mask) __shfl_xor_sync(CLLM_WARP_LANES, (v), (mask), CLLM_WARP)
/* v of lane (lane - d); lanes below d get their own v. */
#define cllm_shfl_up(v, d) __shfl_up_sync(CLLM_WARP_LANES, (v), (d), CLLM_WARP)

/* Bit l set when lane l of the group has p. */
#ifdef CLLM_WIDE_WARPS
static __device__ __forceinline__ unsigned cllm_ballot_by_shuffles(bool p)
{
    unsigned bits = p ? 1u << (threadIdx.x % CLLM_WARP) : 0u;
    for (int o = CLLM_WARP / 2; o > 0; o >>= 1)
        bits |= cllm_shfl_xor(bits, o);
    return bits;
}
#define cllm_ballot(p) cllm_ballot_by_shuffles(p)
#else
#define cllm_ballot(p) __ballot_sync(CLLM_WARP_LANES, (p))
#endif

#endif
