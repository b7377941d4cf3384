/* The emulator as a race checker (CLLM_TSAN): small kernels with the bugs racecheck finds on a
 * GPU - a missing __syncthreads before a read or before a tile is overwritten, a shuffle taken
 * for a memory fence, a cp.async destination read before its wait - must each be reported by
 * ThreadSanitizer, and their mended twins must not. Without this test a checker that reports
 * nothing (fibers that share one TSan thread, a barrier that orders too much) would pass every
 * kernel. Built only in a ThreadSanitizer build. */
#include "emu.h"
#include <stdio.h>
#include <vector>

#include "test.h"

/* TSan calls this for each report it prints, on the racing fiber; the test counts them.
 * Atomic: a plain count would itself race between fibers, and be reported from inside a report. */
static int reports;
extern "C" void __tsan_on_report(void *) { __atomic_fetch_add(&reports, 1, __ATOMIC_RELAXED); }
static int reported(void) { return __atomic_load_n(&reports, __ATOMIC_RELAXED); }
/* The races are what this program is for: they must not turn its exit status into 66. */
extern "C" const char *__tsan_default_options(void) { return "exitcode=0"; }

enum { N = 64 };

/* Thread 0 sums what every thread stored; `barrier` is the __syncthreads between. */
static void sum_kernel(const float *in, float *out, bool barrier)
{
    __shared__ float s[N];
    s[threadIdx.x] = in[threadIdx.x];
    if (barrier)
        __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int i = 0; i < N; i++) acc += s[i];
        *out = acc;
    }
}

/* Two rounds over one tile: each thread reads its neighbour's element, then the tile is
 * overwritten; `barrier` is the __syncthreads before the overwrite (the one double-buffered
 * loops forget). */
static void reuse_kernel(const float *in, float *out, bool barrier)
{
    __shared__ float s[N];
    float acc = 0.0f;
    for (int round = 0; round < 2; round++) {
        if (barrier)
            __syncthreads();
        s[threadIdx.x] = in[round * N + threadIdx.x];
        __syncthreads();
        acc += s[(threadIdx.x + 1) % N];
    }
    out[threadIdx.x] = acc;
}

/* A warp exchanges through shared memory; a shuffle in between orders nothing (only
 * __syncwarp does, in CUDA's memory model). */
static void warp_kernel(float *out, bool syncwarp)
{
    __shared__ float s[32];
    const unsigned lane = threadIdx.x & 31;
    s[lane] = (float)lane;
    float v = __shfl_sync(0xffffffffu, (float)lane, 0);
    if (syncwarp)
        __syncwarp();
    out[lane] = s[(lane + 1) & 31] + v;
}

/* Each thread copies 16 bytes in with cp.async and the block reads its neighbour's; `wait_first`
 * puts the wait before the barrier (right), else after it (the neighbour may not have landed). */
static void cp_kernel(const float *in, float *out, bool wait_first)
{
    __shared__ __align__(16) float s[N * 4];
    emu_cp_async(&s[threadIdx.x * 4], &in[threadIdx.x * 4], 16);
    emu_cp_commit();
    if (wait_first)
        emu_cp_wait(0);
    __syncthreads();
    if (!wait_first)
        emu_cp_wait(0);
    out[threadIdx.x] = s[((threadIdx.x + 1) % N) * 4];
}

/* Every thread adds to one counter: atomics do not race. */
static void atomic_kernel(unsigned *counter) { atomicAdd(counter, 1u); }

/* Runs one launch and checks whether it was reported as a race. */
static void expect(const char *what, bool race, const std::function<void()> &launch)
{
    const int before = reported();
    launch();
    const int n = reported() - before;
    const bool got = n > 0;
    printf("  %-48s %s (%d report%s)\n", what, got ? "race" : "clean", n, n == 1 ? "" : "s");
    CHECKF(got == race, "%s: %s expected, %s reported", what, race ? "a race" : "no race",
           got ? "a race" : "none");
}

int main(void)
{
    std::vector<float> in(N * 4), out(N);
    for (int i = 0; i < N * 4; i++) in[i] = (float)i;
    unsigned counter = 0;
    const float *pi = in.data();
    float *po = out.data();
    printf("kernels with and without their barriers, under ThreadSanitizer:\n");
    expect("sum, no __syncthreads before the read", true,
           [=] { emu_launch([=] { sum_kernel(pi, po, false); }, 1, N); });
    expect("sum, __syncthreads before the read", false,
           [=] { emu_launch([=] { sum_kernel(pi, po, true); }, 1, N); });
    expect("tile reused, no __syncthreads before", true,
           [=] { emu_launch([=] { reuse_kernel(pi, po, false); }, 1, N); });
    expect("tile reused, __syncthreads before", false,
           [=] { emu_launch([=] { reuse_kernel(pi, po, true); }, 1, N); });
    expect("warp, a shuffle between write and read", true,
           [=] { emu_launch([=] { warp_kernel(po, false); }, 1, 32); });
    expect("warp, __syncwarp between write and read", false,
           [=] { emu_launch([=] { warp_kernel(po, true); }, 1, 32); });
    expect("cp.async, waited after the barrier", true,
           [=] { emu_launch([=] { cp_kernel(pi, po, false); }, 1, N); });
    expect("cp.async, waited before the barrier", false,
           [=] { emu_launch([=] { cp_kernel(pi, po, true); }, 1, N); });
    expect("atomicAdd from every thread, 4 blocks", false,
           [&] { emu_launch([pc = &counter] { atomic_kernel(pc); }, 4, N); });
    CHECKF(counter == 4 * N, "atomicAdd counted %u, want %d", counter, 4 * N);
    /* Blocks are ordered (they run one after another on the same shared memory): the second
     * block's writes must not be reported against the first's reads. */
    expect("sum with barrier, 8 blocks on one shared array", false,
           [=] { emu_launch([=] { sum_kernel(pi, po, true); }, 8, N); });
    return test_summary();
}
