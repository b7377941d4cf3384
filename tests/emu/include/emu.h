/* CPU emulation of the CUDA device side: each CUDA thread is a green thread (ucontext); blocks
 * run one at a time; __syncthreads and warp collectives are barriers that also check that all
 * participants arrive from the same call site. Static __shared__ variables become statics. */
#ifndef EMU_H
#define EMU_H
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
/* (No __noinline__: libstdc++ 13 spells __attribute__((__noinline__)), which that macro would
 * break; the kernels say CLLM_NOINLINE, which vendor.h's stand-in defines.) */
#define __launch_bounds__(...)
/* Static __shared__ variables: tests/emu/prep.py gives each a copy per block slot (below); left
 * as statics in code it does not process. */
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

/* Under ThreadSanitizer the emulator is a race checker (emu.cpp): then blocks run in EMU_SLOTS
 * slots, each with its own TSan fibers and shared memory, so that blocks in different slots
 * are not ordered (EMU_SETS slots a launch, two launches' worth). */
#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMU_TSAN 1
#endif
#endif
#if EMU_TSAN
enum { EMU_SETS = 2, EMU_SLOTS = 2 * EMU_SETS };
#else
enum { EMU_SETS = 1, EMU_SLOTS = 1 };
#endif
extern unsigned emu_slot; /* the running block's slot */

/* vector types */
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { uint4 r = {x, y, z, w}; return r; }
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { float2 r = {x, y}; return r; }
static inline float4 make_float4(float x, float y, float z, float w)
{
    float4 r = {x, y, z, w};
    return r;
}

/* BF16: a 16-bit struct; conversions as cuda_bf16.h (round to nearest even, NaN kept quiet) */
struct __nv_bfloat16 { unsigned short __x; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
static inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.__x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    uint32_t u; memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.__x = 0x7fff; return r; } /* canonical NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    r.__x = (unsigned short)(u >> 16);
    return r;
}
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { float2 r = {__bfloat162float(v.x), __bfloat162float(v.y)}; return r; }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }

struct emu_uint3 { unsigned x, y, z; };
struct emu_thread;
extern emu_thread *emu_cur;
struct emu_thread_pub { emu_uint3 tid; };
#define threadIdx (((emu_thread_pub *)emu_cur)->tid)
extern emu_uint3 emu_blockIdx, emu_blockDim, emu_gridDim;
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

void emu_syncthreads_at(void *site);
void emu_warp_exchange(uint64_t v, uint64_t *all, void *site); /* all[32] gets every lane's v */
void emu_warp_collective(uint64_t v, uint64_t *all, void *site, bool orders_memory);
void emu_syncwarp_at(void *site);
void *emu_dyn_smem(void);
/* cp.async for the calling thread: copies queue up, commit closes a group, wait(n) performs
 * all but the newest n groups. */
void emu_cp_async(void *dst, const void *src, size_t n);
void emu_cp_commit(void);
void emu_cp_wait(int n);
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
/* `pdl`: launched for programmatic dependent launch (vendor.h's cllm_launch): until the
 * kernel's emu_pdl_wait it is not ordered after the kernel before it in the stream. `func`:
 * the kernel, whose own shared-memory limit (cudaFuncSetAttribute) the launch is held to, as
 * CUDA's are; NULL (<<<>>> launches) holds it to the limit set last, whichever kernel's. */
void emu_launch(std::function<void()> body, dim3 grid, dim3 block, size_t smem = 0,
                cudaStream_t s = 0, bool pdl = false, const void *func = NULL);
void emu_pdl_wait(void);
/* Device work on a stream that is not a kernel (the emulated BLAS): now, or at the replay of
 * the graph being captured; under TSan on the stream's own fiber, ordered as a kernel would be. */
void emu_on_stream(cudaStream_t s, const std::function<void()> &op);
/* Whether the host is ordered after every piece of device work as it completes (true: what
 * tests that call kernels on host memory and read it back at once expect) or only where CUDA
 * orders it: a synchronize, a synchronous copy, an event waited for (false, the default: what
 * code written for a GPU must get right). Only a TSan build tells the difference. */
void emu_host_waits(bool every_op);
/* A device-wide sequentially consistent fence, as __threadfence is (CUDA's programming guide):
 * under TSan each fence is ordered after every fence before it. */
void emu_threadfence(void);

/* Call sites are source lines: the compiler may duplicate code, never lines. */
#define EMU_SITE ((void *)(uintptr_t)__LINE__)
#define __syncthreads() emu_syncthreads_at(EMU_SITE)
#define __syncwarp(...) emu_syncwarp_at(EMU_SITE)

template <class T> static inline uint64_t emu_bits(T v) { uint64_t b = 0; memcpy(&b, &v, sizeof v); return b; }
template <class T> static inline T emu_from(uint64_t b) { T v; memcpy(&v, &b, sizeof v); return v; }

#define EMU_LANE ((int)(threadIdx.x & 31))
/* Shuffles over groups of `width` lanes (a power of two, at most 32), as CUDA defines them: a
 * source lane is taken within the caller's group; shfl_up / shfl_down keep their own value past
 * the group's edge, shfl_xor past its end. */
static inline int emu_width(int width)
{
    if (width < 1 || width > 32 || (width & (width - 1))) {
        fprintf(stderr, "emu: shuffle width %d\n", width);
        abort();
    }
    return width;
}
static inline void emu_full_mask(unsigned mask)
{
    if (mask != 0xffffffffu) {
        fprintf(stderr, "emu: partial shuffle mask\n");
        abort();
    }
}
/* The one exchange behind every shuffle: lane src's v, or the caller's own where src is -1. */
template <class T> static T emu_shfl_from(void *site, unsigned mask, T v, int src)
{
    emu_full_mask(mask);
    uint64_t a[32];
    emu_warp_exchange(emu_bits(v), a, site);
    return src < 0 ? v : emu_from<T>(a[src]);
}
template <class T> static T emu__shfl_sync(void *site, unsigned mask, T v, int src, int width = 32)
{
    const int w = emu_width(width);
    return emu_shfl_from(site, mask, v, (EMU_LANE & ~(w - 1)) + (src & (w - 1)));
}
template <class T> static T emu__shfl_up_sync(void *site, unsigned mask, T v, unsigned d, int width = 32)
{
    const int w = emu_width(width);
    return emu_shfl_from(site, mask, v, (EMU_LANE & (w - 1)) < (int)d ? -1 : EMU_LANE - (int)d);
}
template <class T> static T emu__shfl_down_sync(void *site, unsigned mask, T v, unsigned d, int width = 32)
{
    const int w = emu_width(width);
    return emu_shfl_from(site, mask, v, (EMU_LANE & (w - 1)) + (int)d >= w ? -1 : EMU_LANE + (int)d);
}
template <class T> static T emu__shfl_xor_sync(void *site, unsigned mask, T v, int x, int width = 32)
{
    const int w = emu_width(width), s = EMU_LANE ^ x;
    return emu_shfl_from(site, mask, v, s < 0 || s > 31 || (s & ~(w - 1)) > (EMU_LANE & ~(w - 1)) ? -1 : s);
}
static unsigned emu__ballot_sync(void *site, unsigned mask, int p)
{
    emu_full_mask(mask);
    uint64_t a[32];
    emu_warp_exchange(p ? 1 : 0, a, site);
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= (a[i] ? 1u : 0u) << i;
    return r;
}
#define __shfl_sync(...) emu__shfl_sync(EMU_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) emu__shfl_up_sync(EMU_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) emu__shfl_down_sync(EMU_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) emu__shfl_xor_sync(EMU_SITE, __VA_ARGS__)
#define __ballot_sync(...) emu__ballot_sync(EMU_SITE, __VA_ARGS__)
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline int __clz(int x) { return __clz((unsigned)x); }

/* Atomic to ThreadSanitizer too (CLLM_TSAN): concurrent atomics are not races. */
static inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }

static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned long long __double2ull_rn(double d) { return (unsigned long long)nearbyint(d); }

template <class T> static inline T __ldg(const T *p) { return *p; }
template <class T> static inline T __ldcg(const T *p) { return *p; }
static inline void __threadfence(void) { emu_threadfence(); }

using std::isfinite;
using std::isnan;

template <class F> static inline cudaError_t cudaFuncSetAttribute(F *f, enum cudaFuncAttribute a, int v)
{
    return emu_func_set_attribute((const void *)f, a, v);
}
#endif
