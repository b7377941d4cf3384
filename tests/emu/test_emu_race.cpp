/* The emulator as a race checker (CLLM_TSAN): small kernels and host code with the bugs
 * racecheck finds on a GPU - a missing __syncthreads before a read or before a tile is
 * overwritten, a shuffle taken for a memory fence, a cp.async destination read before its
 * wait - and those it does not: two blocks writing the same bytes, a last-block merge without
 * its __threadfence, a kernel reading its predecessor's output before cllm_pdl_wait, a host
 * reading results or rewriting a pinned buffer before waiting for the device, a kernel on a
 * non-blocking stream reading what a synchronous cudaMemcpy may not have landed yet. Each must
 * be reported by ThreadSanitizer, and its mended twin must not. Without this test a checker
 * that reports nothing (fibers that share one TSan thread, a barrier that orders too much)
 * would pass every kernel. Built only in a ThreadSanitizer build, through tests/emu/prep.py. */
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

/* Thread 0 of every block writes out[0] (`shared_out`: two blocks race), else out[blockIdx]. */
static void per_block_kernel(const float *in, float *out, bool shared_out)
{
    __shared__ float s[N];
    s[threadIdx.x] = in[threadIdx.x] + (float)blockIdx.x;
    __syncthreads();
    if (threadIdx.x == 0)
        out[shared_out ? 0 : blockIdx.x] = s[N - 1];
}

/* The split attention's merge: each block writes its part, counts itself in, and the last one
 * resets the count and sums every part. `fence`: the __threadfence between a block's part and
 * its count; `atomic_reset`: the reset an atomicExch, not a plain store (which races with the
 * others' atomicAdd: nothing orders them before it). */
static void merge_kernel(float *parts, float *out, int *count, bool fence, bool atomic_reset = true)
{
    __shared__ bool last;
    parts[blockIdx.x * N + threadIdx.x] = (float)(blockIdx.x * N + threadIdx.x);
    if (fence)
        __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(count, 1) == (int)gridDim.x - 1;
        if (last && atomic_reset)
            atomicExch(count, 0);
        else if (last)
            *count = 0;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    float acc = 0.0f;
    for (unsigned b = 0; b < gridDim.x; b++)
        acc += parts[b * N + threadIdx.x];
    out[threadIdx.x] = acc;
}

/* A kernel launched for programmatic dependent launch reads what the kernel before it wrote:
 * after emu_pdl_wait (cllm_pdl_wait), or before it (a race on sm_90). */
static void write_kernel(float *buf) { buf[blockIdx.x * N + threadIdx.x] = (float)threadIdx.x; }
static void pdl_read_kernel(const float *buf, float *out, bool wait_first)
{
    if (wait_first)
        emu_pdl_wait();
    const float v = buf[blockIdx.x * N + threadIdx.x];
    if (!wait_first)
        emu_pdl_wait();
    out[blockIdx.x * N + threadIdx.x] = v;
}

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
    std::vector<float> in(N * 4), out(N * 8), parts(N * 8);
    for (int i = 0; i < N * 4; i++) in[i] = (float)i;
    unsigned counter = 0;
    int count = 0;
    const float *pi = in.data();
    float *po = out.data(), *pp = parts.data();
    int *pc = &count;
    /* First the kernels alone, the host ordered after each (as test_emu_kernels runs them). */
    emu_host_waits(true);
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
           [&] { emu_launch([pcount = &counter] { atomic_kernel(pcount); }, 4, N); });
    CHECKF(counter == 4 * N, "atomicAdd counted %u, want %d", counter, 4 * N);
    printf("blocks of one launch (not ordered but by __threadfence):\n");
    /* The blocks' shared array is not shared between blocks (each slot has its own). */
    expect("8 blocks, each its own output", false,
           [=] { emu_launch([=] { per_block_kernel(pi, po, false); }, 8, N); });
    expect("8 blocks writing one output", true,
           [=] { emu_launch([=] { per_block_kernel(pi, po, true); }, 8, N); });
    expect("last block merges, __threadfence before the count", false,
           [=] { emu_launch([=] { merge_kernel(pp, po, pc, true); }, 8, N); });
    CHECKF(count == 0, "the merge left its count at %d, want 0", count);
    CHECKF(out[5] == 8 * 5 + N * 28, "the merge summed %g, want %d", out[5], 8 * 5 + N * 28);
    expect("last block merges, no __threadfence before the count", true,
           [=] { emu_launch([=] { merge_kernel(pp, po, pc, false); }, 8, N); });
    expect("last block merges, resets the count with a plain store", true,
           [=] { emu_launch([=] { merge_kernel(pp, po, pc, true, false); }, 8, N); });

    /* Then as code written for a GPU runs: the host ordered after the device only where CUDA
     * orders it. Each case ends by waiting for the device, so that it leaves nothing behind. */
    emu_host_waits(false);
    float *dev = NULL, *dev2 = NULL, *pinned = NULL;
    CHECK(cudaMalloc((void **)&dev, N * 8 * sizeof(float)) == cudaSuccess);
    CHECK(cudaMalloc((void **)&dev2, N * 8 * sizeof(float)) == cudaSuccess);
    CHECK(cudaMallocHost((void **)&pinned, N * 8 * sizeof(float)) == cudaSuccess);
    cudaStream_t nonblocking = NULL, blocking = NULL;
    CHECK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking) == cudaSuccess);
    CHECK(cudaStreamCreate(&blocking) == cudaSuccess);
    cudaEvent_t ev = NULL;
    CHECK(cudaEventCreate(&ev) == cudaSuccess);
    auto on_gpu = [&](const char *what, bool race, const std::function<void()> &run) {
        expect(what, race, [&] {
            run();
            cudaDeviceSynchronize();
        });
    };
    printf("kernels after kernels (programmatic dependent launch):\n");
    on_gpu("PDL kernel reads the last one's output, then waits", true, [=] {
        emu_launch([=] { write_kernel(dev); }, 8, N, 0, nonblocking, true);
        emu_launch([=] { pdl_read_kernel(dev, dev2, false); }, 8, N, 0, nonblocking, true);
    });
    on_gpu("PDL kernel waits, then reads the last one's output", false, [=] {
        emu_launch([=] { write_kernel(dev); }, 8, N, 0, nonblocking, true);
        emu_launch([=] { pdl_read_kernel(dev, dev2, true); }, 8, N, 0, nonblocking, true);
    });
    on_gpu("plain launch reads the last one's output", false, [=] {
        emu_launch([=] { write_kernel(dev); }, 8, N, 0, nonblocking, true);
        emu_launch([=] { pdl_read_kernel(dev, dev2, false); }, 8, N, 0, nonblocking, false);
    });
    on_gpu("PDL kernel after a copy reads the copy", false, [=] {
        cudaMemcpyAsync(dev, dev2, N * sizeof(float), cudaMemcpyDeviceToDevice, nonblocking);
        emu_launch([=] { pdl_read_kernel(dev, dev2 + N, false); }, 1, N, 0, nonblocking, true);
    });
    printf("the host and the device:\n");
    on_gpu("host reads a kernel's output before waiting", true, [=] {
        emu_launch([=] { write_kernel(dev); }, 1, N, 0, nonblocking);
        volatile float v = dev[3];
        (void)v;
    });
    on_gpu("host reads a kernel's output after cudaStreamSynchronize", false, [=] {
        emu_launch([=] { write_kernel(dev); }, 1, N, 0, nonblocking);
        cudaStreamSynchronize(nonblocking);
        volatile float v = dev[3];
        (void)v;
    });
    on_gpu("host rewrites a pinned buffer a queued copy reads", true, [=] {
        pinned[0] = 1.0f;
        cudaMemcpyAsync(dev, pinned, N * sizeof(float), cudaMemcpyHostToDevice, nonblocking);
        pinned[0] = 2.0f;
    });
    on_gpu("host rewrites a pinned buffer after the copy's event", false, [=] {
        pinned[0] = 1.0f;
        cudaMemcpyAsync(dev, pinned, N * sizeof(float), cudaMemcpyHostToDevice, nonblocking);
        cudaEventRecord(ev, nonblocking);
        cudaEventSynchronize(ev);
        pinned[0] = 2.0f;
    });
    on_gpu("host rewrites a pageable buffer a queued copy read (staged)", false, [=] {
        static float pageable[N];
        pageable[0] = 1.0f;
        cudaMemcpyAsync(dev, pageable, N * sizeof(float), cudaMemcpyHostToDevice, nonblocking);
        pageable[0] = 2.0f;
    });
    on_gpu("host reads a pinned copy of a kernel's output before its event", true, [=] {
        emu_launch([=] { write_kernel(dev); }, 1, N, 0, nonblocking);
        cudaMemcpyAsync(pinned, dev, N * sizeof(float), cudaMemcpyDeviceToHost, nonblocking);
        cudaEventRecord(ev, nonblocking);
        volatile float v = pinned[3];
        (void)v;
    });
    on_gpu("host reads a pinned copy of a kernel's output after its event", false, [=] {
        emu_launch([=] { write_kernel(dev); }, 1, N, 0, nonblocking);
        cudaMemcpyAsync(pinned, dev, N * sizeof(float), cudaMemcpyDeviceToHost, nonblocking);
        cudaEventRecord(ev, nonblocking);
        cudaEventSynchronize(ev);
        volatile float v = pinned[3];
        (void)v;
    });
    printf("the legacy stream and the others:\n");
    static float weights[N];
    on_gpu("non-blocking stream reads what cudaMemcpy from pageable memory wrote", true, [=] {
        cudaMemcpy(dev, weights, N * sizeof(float), cudaMemcpyHostToDevice);
        emu_launch([=] { pdl_read_kernel(dev, dev2, true); }, 1, N, 0, nonblocking);
    });
    on_gpu("... after cudaDeviceSynchronize", false, [=] {
        cudaMemcpy(dev, weights, N * sizeof(float), cudaMemcpyHostToDevice);
        cudaDeviceSynchronize();
        emu_launch([=] { pdl_read_kernel(dev, dev2, true); }, 1, N, 0, nonblocking);
    });
    on_gpu("blocking stream reads what cudaMemcpy from pageable memory wrote", false, [=] {
        cudaMemcpy(dev, weights, N * sizeof(float), cudaMemcpyHostToDevice);
        emu_launch([=] { pdl_read_kernel(dev, dev2, true); }, 1, N, 0, blocking);
    });
    cudaEventDestroy(ev);
    cudaStreamDestroy(blocking);
    cudaStreamDestroy(nonblocking);
    cudaFreeHost(pinned);
    cudaFree(dev2);
    cudaFree(dev);
    return test_summary();
}
