/* The emulator's runtime: green threads, barriers, a fake device. */
#include "emu.h"
#include <ucontext.h>
#include <sys/mman.h>
#include <vector>
#include <algorithm>
#include <random>
#include <chrono>

/* Under ThreadSanitizer (CLLM_TSAN) the emulator is also a race checker for the kernels, as
 * compute-sanitizer's racecheck is on a GPU: each CUDA thread is a TSan fiber, switched to
 * without implied ordering, and only what orders memory on a GPU orders it here -
 * __syncthreads, __syncwarp, the start and the end of a block (blocks run one after another
 * and their shared memory is reused, so consecutive blocks are ordered: races between blocks
 * are not checked). TSan then reports any two accesses to the same bytes, at least one a
 * write, by two threads of a block with no barrier between them: shared or global memory,
 * whatever order the green threads happened to run in. The emulator's own bookkeeping is
 * hidden from TSan: ignored accesses (emu_quiet), uninstrumented switches (EMU_UNCHECKED).
 * tests/emu/test_emu_race.cpp checks that the races this should find are found. */
#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMU_TSAN 1
#endif
#endif
#if EMU_TSAN
#define EMU_UNCHECKED __attribute__((no_sanitize("thread")))
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin(void);
extern "C" void __tsan_ignore_thread_end(void);
struct emu_quiet {
    emu_quiet() { __tsan_ignore_thread_begin(); }
    ~emu_quiet() { __tsan_ignore_thread_end(); }
};
static void emu_hb_release(void *sync) { __tsan_release(sync); }
static void emu_hb_acquire(void *sync) { __tsan_acquire(sync); }
static void emu_hb_read(const void *p, size_t n) { __tsan_read_range((void *)p, n); }
#else
#define EMU_UNCHECKED
struct emu_quiet {};
static void emu_hb_release(void *) {}
static void emu_hb_acquire(void *) {}
static void emu_hb_read(const void *, size_t) {}
#endif
/* Sync objects: their addresses name them to TSan. A barrier uses one of two by generation,
 * so a thread released from barrier k is not ordered after what others did past it. */
static char sync_block_start, sync_block_end, sync_bar[2];

struct emu_thread {
    emu_thread_pub pub;
    void *sp;
    bool done;
    void *fiber; /* its TSan fiber (EMU_TSAN) */
};
/* A context switch without the signal-mask syscall of swapcontext: callee-saved registers,
 * MXCSR and the x87 control word go on the stack. */
extern "C" void emu_ctx_switch(void **from_sp, void *to_sp);
asm(R"(
.text
.globl emu_ctx_switch
.type emu_ctx_switch, @function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
static void *sched_sp;
emu_thread *emu_cur;
emu_uint3 emu_blockIdx, emu_blockDim, emu_gridDim;

static std::vector<emu_thread> threads;
static std::vector<char *> stacks;
static const size_t STACK = 256 * 1024;
static std::function<void()> *body_fn;
static unsigned nthreads;
static uint64_t progress;
static std::vector<unsigned char> dyn;
static const int SMEM_DEFAULT = 48 * 1024; /* dynamic shared memory a launch gets unasked */
static size_t dyn_max = SMEM_DEFAULT;
static cudaError_t last_error = cudaSuccess;
static std::mt19937_64 rng(12345);

/* block barrier */
static unsigned bar_count, bar_gen;
static void *bar_site;
/* warp barriers */
struct warp_state { unsigned count, gen, expect; void *site; uint64_t stage[32], out[32]; char sync[2]; };
static std::vector<warp_state> warps;

#if EMU_TSAN
/* The launching thread's fiber, while a block runs. Atomic: fibers read it after their last
 * release, and the next launch writes it. */
static void *host_fiber;
/* The switches are not instrumented: a function entered on one fiber and left on another
 * would push one fiber's shadow stack and pop the other's. */
EMU_UNCHECKED static void fiber_to_host()
{
    __tsan_switch_to_fiber(__atomic_load_n(&host_fiber, __ATOMIC_RELAXED), __tsan_switch_to_fiber_no_sync);
}
EMU_UNCHECKED static void host_to_fiber(emu_thread &t) { __tsan_switch_to_fiber(t.fiber, __tsan_switch_to_fiber_no_sync); }
#else
static void fiber_to_host() {}
static void host_to_fiber(emu_thread &) {}
#endif

static void yield_now()
{
    fiber_to_host();
    emu_ctx_switch(&emu_cur->sp, sched_sp);
}

void emu_syncthreads_at(void *site)
{
    emu_quiet q;
    if (bar_count == 0)
        bar_site = site;
    else if (bar_site != site) {
        fprintf(stderr, "emu: __syncthreads from different sites (block %u thread %u): %p vs %p\n", emu_blockIdx.x, emu_cur->pub.tid.x, site, bar_site);
        abort();
    }
    unsigned g = bar_gen;
    progress++;
    emu_hb_release(&sync_bar[g & 1]);
    if (++bar_count == nthreads) {
        bar_count = 0;
        bar_gen++;
    } else {
        while (bar_gen == g)
            yield_now();
    }
    emu_hb_acquire(&sync_bar[g & 1]);
}

void emu_warp_exchange(uint64_t v, uint64_t *all, void *site) { emu_warp_collective(v, all, site, false); }
void emu_syncwarp_at(void *site)
{
    uint64_t all[32];
    emu_warp_collective(0, all, site, true);
}

/* Shuffles, ballots and the MMA exchange values; only __syncwarp orders memory (CUDA's
 * programming guide promises memory ordering for __syncwarp alone). */
void emu_warp_collective(uint64_t v, uint64_t *all, void *site, bool orders_memory)
{
    emu_quiet q;
    warp_state &w = warps[emu_cur->pub.tid.x / 32];
    unsigned lane = emu_cur->pub.tid.x & 31;
    if (w.count == 0)
        w.site = site;
    else if (w.site != site) {
        fprintf(stderr, "emu: warp collective from different sites (block %u thread %u)\n", emu_blockIdx.x, emu_cur->pub.tid.x);
        abort();
    }
    w.stage[lane] = v;
    unsigned g = w.gen;
    progress++;
    char *sync = &w.sync[(g >> 1) & 1]; /* gen moves by two per exchange */
    if (orders_memory)
        emu_hb_release(sync);
    if (++w.count == w.expect) {
        memcpy(w.out, w.stage, sizeof w.out);
        w.count = 0;
        w.gen++;
    } else {
        while (w.gen == g)
            yield_now();
    }
    if (orders_memory)
        emu_hb_acquire(sync);
    memcpy(all, w.out, sizeof w.out);
    /* everyone must read out before the next exchange overwrites it: a second barrier */
    unsigned g2 = w.gen;
    if (++w.count == w.expect) {
        w.count = 0;
        w.gen++;
    } else {
        while (w.gen == g2)
            yield_now();
    }
}

void *emu_dyn_smem(void) { return dyn.data(); }

/* cp.async groups per thread of the running block: [0] is the oldest committed group, the
 * last one is still open (there always is one). */
struct cp_copy { void *dst; const void *src; size_t n; };
static std::vector<std::vector<std::vector<cp_copy>>> cp_groups;

void emu_cp_async(void *dst, const void *src, size_t n)
{
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) {
        fprintf(stderr, "emu: cp.async of %zu bytes misaligned (dst %p src %p)\n", n, dst, src);
        abort();
    }
    /* On a GPU the bytes land at any time until the wait: the destination is written (with
     * bytes that read as NaN) and the source read now, and the copy is made at the wait. */
    memset(dst, 0xff, n);
    emu_hb_read(src, n);
    emu_quiet q;
    cp_groups[emu_cur->pub.tid.x].back().push_back({dst, src, n});
}

void emu_cp_commit(void)
{
    emu_quiet q;
    cp_groups[emu_cur->pub.tid.x].emplace_back();
}

void emu_cp_wait(int n)
{
    std::vector<cp_copy> done;
    {
        emu_quiet q;
        auto &g = cp_groups[emu_cur->pub.tid.x];
        size_t committed = g.size() - 1; /* all but the open last one */
        while (committed > (size_t)n) {
            done.insert(done.end(), g.front().begin(), g.front().end());
            g.erase(g.begin());
            committed--;
        }
    }
    for (const cp_copy &c : done)
        memcpy(c.dst, c.src, c.n);
}

/* A green thread's first frame. It never returns, so it is not instrumented: TSan's shadow
 * stack of a fiber would grow by its frame with every block the fiber runs. */
EMU_UNCHECKED static void trampoline()
{
    emu_hb_acquire(&sync_block_start);
    (*body_fn)();
    emu_hb_release(&sync_block_end);
    emu_cur->done = true;
    progress++;
    fiber_to_host();
    emu_ctx_switch(&emu_cur->sp, sched_sp);
    abort();
}

/* A stream: work runs at once, or is recorded while the stream is captured. */
struct CUstream_st {
    std::vector<std::function<void()>> *capture; /* NULL: not capturing */
};
struct CUgraph_st { std::vector<std::function<void()>> ops; };
struct CUgraphExec_st { std::vector<std::function<void()>> ops; };

static bool recorded(cudaStream_t s, std::function<void()> op)
{
    if (!s || !s->capture)
        return false;
    s->capture->push_back(std::move(op));
    return true;
}

void emu_on_stream(cudaStream_t s, const std::function<void()> &op)
{
    if (!recorded(s, op))
        op();
}

void emu_launch(std::function<void()> body, dim3 grid3, dim3 block3, size_t smem, cudaStream_t stream)
{
    if (recorded(stream, [=] { emu_launch(body, grid3, block3, smem, 0); }))
        return;
    unsigned block = block3.x;
    if (block3.y != 1 || block3.z != 1) {
        fprintf(stderr, "emu: only 1-D blocks are emulated (%u,%u,%u)\n", block3.x, block3.y, block3.z);
        abort();
    }
    if (block == 0 || block > 1024 || block % 32 || smem > dyn_max || grid3.x == 0 || grid3.y == 0 ||
        grid3.z == 0 || grid3.x > 0x7fffffffu || grid3.y > 65535 || grid3.z > 65535) {
        fprintf(stderr, "emu: bad launch config grid (%u,%u,%u) block %u smem %zu (max %zu)\n",
                grid3.x, grid3.y, grid3.z, block, smem, dyn_max);
        last_error = cudaErrorInvalidValue;
        return;
    }
    static int launches;
    if (getenv("EMU_TRACE"))
        fprintf(stderr, "emu: launch %d grid (%u,%u,%u) block %u smem %zu\n", launches, grid3.x, grid3.y, grid3.z, block, smem);
    launches++;
    body_fn = &body;
    nthreads = block;
    threads.resize(block);
    while (stacks.size() < block) {
        void *p = mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        stacks.push_back((char *)p);
    }
#if EMU_TSAN
    static std::vector<void *> fibers; /* one per thread slot, kept: TSan's are a finite supply */
    while (fibers.size() < block)
        fibers.push_back(__tsan_create_fiber(0));
    for (unsigned t = 0; t < block; t++)
        threads[t].fiber = fibers[t];
    __atomic_store_n(&host_fiber, __tsan_get_current_fiber(), __ATOMIC_RELAXED);
#endif
    warps.assign(block / 32, warp_state{});
    for (auto &w : warps) w.expect = 32;
    emu_gridDim = {grid3.x, grid3.y, grid3.z};
    emu_blockDim = {block, 1, 1};
    dyn.assign(smem + 8, 0xA5);
    std::vector<unsigned> order(block);
    /* Blocks in a scrambled order (i -> a i + c mod n, a coprime to n), as a GPU's scheduler
     * may run them: a kernel whose last block to finish does extra work (the split attention's
     * merge) must not depend on which block that is. */
    const uint64_t n_blocks = (uint64_t)grid3.x * grid3.y * grid3.z;
    uint64_t step = 1, start = rng() % n_blocks;
    while (n_blocks > 2) {
        step = rng() % n_blocks;
        uint64_t x = step, y = n_blocks;
        while (y) { uint64_t r = x % y; x = y; y = r; }
        if (x == 1) break;
    }
    for (uint64_t k = 0; k < n_blocks; k++) {
        const uint64_t i = (step * k + start) % n_blocks;
        const unsigned b = (unsigned)(i % grid3.x), by = (unsigned)(i / grid3.x % grid3.y),
                       bz = (unsigned)(i / ((uint64_t)grid3.x * grid3.y));
        emu_blockIdx = {b, by, bz};
        memset(dyn.data(), 0xA5, dyn.size());
        bar_count = 0;
        cp_groups.assign(block, std::vector<std::vector<cp_copy>>(1));
        for (unsigned t = 0; t < block; t++) {
            emu_thread &th = threads[t];
            th.pub.tid = {t, 0, 0};
            th.done = false;
            uint64_t *sp = (uint64_t *)(((uintptr_t)(stacks[t] + STACK)) & ~(uintptr_t)15);
            *--sp = 0;
            *--sp = (uint64_t)(uintptr_t)trampoline;
            for (int i = 0; i < 6; i++)
                *--sp = 0;
            *--sp = (uint64_t)0x037F << 32 | 0x1F80;
            th.sp = sp;
            order[t] = t;
        }
        unsigned alive = block;
        emu_hb_release(&sync_block_start);
        emu_quiet quiet; /* the scheduler's switches: emu_cur is the one "racy" variable */
        while (alive) {
            uint64_t before = progress;
            std::shuffle(order.begin(), order.end(), rng);
            for (unsigned t : order) {
                if (threads[t].done) continue;
                emu_cur = &threads[t];
                void *sp = threads[t].sp; /* read as the scheduler, before the switch */
                host_to_fiber(threads[t]);
                emu_ctx_switch(&sched_sp, sp);
                if (threads[t].done) alive--;
            }
            if (alive && progress == before) {
                fprintf(stderr, "emu: deadlock in block (%u,%u,%u) (%u threads alive, barrier count %u)\n", b, by, bz, alive, bar_count);
                abort();
            }
        }
        emu_hb_acquire(&sync_block_end); /* (sync is not ignored by emu_quiet) */
        /* a warp barrier some lanes entered but the rest left the kernel: divergent collective */
        for (size_t wi = 0; wi < warps.size(); wi++)
            if (warps[wi].count) {
                fprintf(stderr, "emu: block (%u,%u,%u) warp %zu ended with %u lanes in a collective\n", b, by, bz, wi, warps[wi].count);
                abort();
            }
        for (unsigned t = 0; t < block; t++)
            for (const auto &grp : cp_groups[t])
                if (!grp.empty()) {
                    fprintf(stderr, "emu: block (%u,%u,%u) thread %u ended with cp.async copies never waited for\n", b, by, bz, t);
                    abort();
                }
        if (bar_count) {
            fprintf(stderr, "emu: block (%u,%u,%u) ended with %u threads in __syncthreads\n", b, by, bz, bar_count);
            abort();
        }
    }
}

extern "C" {
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int)
{
    /* EMU_SMEM_OPTIN=N: the opt-in limit; EMU_NO_SMEM_OPTIN=1: a runtime that does not know
     * the attribute (what a vendor's port may do) */
    const char *e = getenv("EMU_SMEM_OPTIN"), *no = getenv("EMU_NO_SMEM_OPTIN");
    if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin && no && !strcmp(no, "1")) return cudaErrorInvalidValue;
    if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) { *v = e ? atoi(e) : 232448; return cudaSuccess; }
    if (a == cudaDevAttrMultiProcessorCount) { *v = 132; return cudaSuccess; }
    return cudaErrorInvalidValue;
}
cudaError_t emu_func_set_attribute(const void *, enum cudaFuncAttribute a, int v)
{
    int optin;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) != cudaSuccess) optin = SMEM_DEFAULT;
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize || v < 0 || v > optin) return cudaErrorInvalidValue;
    dyn_max = (size_t)v;
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n ? n : 1); if (*p) memset(*p, 0x5A, n); return *p ? cudaSuccess : cudaErrorMemoryAllocation; }
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind, cudaStream_t st)
{
    emu_on_stream(st, [=] { memcpy(d, s, n); });
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st)
{
    emu_on_stream(st, [=] { memset(d, v, n); });
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
/* As CUDA: a captured stream cannot be synchronised. */
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return s && s->capture ? cudaErrorStreamCaptureUnsupported : cudaSuccess; }
cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = new CUstream_st{NULL}; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { if (s) delete s->capture; delete s; return cudaSuccess; }
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode)
{
    if (!s || s->capture)
        return cudaErrorInvalidValue;
    s->capture = new std::vector<std::function<void()>>();
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g)
{
    if (!s || !s->capture)
        return cudaErrorInvalidValue;
    *g = new CUgraph_st{std::move(*s->capture)};
    delete s->capture;
    s->capture = NULL;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long) { *e = new CUgraphExec_st{g->ops}; return cudaSuccess; }
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s)
{
    if (s && s->capture)
        return cudaErrorStreamCaptureUnsupported;
    for (auto &op : e->ops)
        op();
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int)
{
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulator");
    p->totalGlobalMem = (size_t)8 << 30;
    p->major = 9;
    p->multiProcessorCount = 4;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) { *free_bytes = *total_bytes = (size_t)8 << 30; return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }
cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorString(cudaError_t e) { return e ? "emu error" : "no error"; }
struct CUevent_st { double t; };
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new CUevent_st{0}; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) { e->t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) { *ms = (float)(b->t - a->t); return cudaSuccess; }
}
