/* The emulator's runtime: green threads, barriers, a fake device. */
#include "emu.h"
#include "emu_hooks.h"
#include <ucontext.h>
#include <sys/mman.h>
#include <atomic>
#include <vector>
#include <map>
#include <algorithm>
#include <random>
#include <chrono>

/* Under ThreadSanitizer (CLLM_TSAN) the emulator is also a race checker for the kernels and
 * for the host code that drives them, as compute-sanitizer's racecheck is on a GPU and more:
 * each CUDA thread is a TSan fiber, switched to without implied ordering, and only what orders
 * memory on a GPU orders it here. Within a block: __syncthreads, __syncwarp (a shuffle, ballot
 * or MMA exchanges values, not memory), the block's start and end. Between blocks of a launch:
 * nothing but __threadfence (sequentially consistent: each fence is ordered after every fence
 * before it, as CUDA's fence.sc are) - so two blocks touching the same bytes, one writing,
 * with no fence pair between, are reported. Blocks run one after another in EMU_SETS slots
 * (emu.h), each with its own fibers, stacks and shared memory: a slot's blocks are ordered
 * (they reuse its fibers and memory), blocks in different slots are not, and consecutive blocks of
 * the scrambled order are always in different slots. Between launches, the device's timeline:
 * work on a stream is ordered after the stream's previous work, except that a kernel launched
 * for programmatic dependent launch (cllm_launch) is ordered after the kernel just before it
 * only from its cllm_pdl_wait on (before it, after the one before that); the legacy stream and
 * blocking streams order each other; copies, sets and BLAS calls run on the stream's own fiber.
 * The host is ordered after device work only where CUDA orders it (emu_host_waits(false), the
 * default): cudaStreamSynchronize, cudaDeviceSynchronize, cudaFree, an event waited for, a
 * copy to pageable memory; a copy from pageable memory reads its source before it returns
 * (CUDA stages it) but lands later. So a host that rewrites a pinned buffer a queued copy
 * still reads, reads results before waiting, or a kernel that reads what its predecessor
 * writes before cllm_pdl_wait, is reported, whichever order the emulator ran things in. The
 * emulator's own bookkeeping is hidden from TSan: ignored accesses (emu_quiet), uninstrumented
 * switches (EMU_UNCHECKED). tests/emu/test_emu_race.cpp checks that the races this should
 * find are found. Not explored: other orders than the one run. A block that fenced before it
 * counted itself in follows every earlier block's fence, so a missing fence after its count
 * goes unseen; two launches two kernels apart reuse slots, so their fibers order them (as
 * stream order does on one stream, not across streams). */
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
static void emu_hb_write(const void *p, size_t n) { __tsan_write_range((void *)p, n); }
#else
#define EMU_UNCHECKED
struct emu_quiet {};
static void emu_hb_release(void *) {}
static void emu_hb_acquire(void *) {}
static void emu_hb_read(const void *, size_t) {}
static void emu_hb_write(const void *, size_t) {}
#endif
/* Sync objects: their addresses name them to TSan. Each slot has its own: its blocks' order
 * (block g of the slot releases block[g & 1] as it ends, block g + 1 acquires it as it
 * starts: two, so that a thread is not ordered after threads of its own block that ended
 * before it started), its barriers (two by generation, so a thread released from barrier k
 * is not ordered after what others did past it), its warps' barriers. */
struct slot_syncs { char block[2]; char bar[2]; char warp[32][2]; };
static slot_syncs slot_sync[EMU_SLOTS];
static unsigned slot_blocks[EMU_SLOTS]; /* blocks run in a slot */
static char sync_fence; /* __threadfence */
unsigned emu_slot;

struct emu_thread {
    emu_thread_pub pub;
    void *sp;
    bool done;
    void *fiber; /* its TSan fiber (EMU_TSAN) */
};
/* What a piece of device work is ordered after and what orders later work after it. */
struct op_order {
    char *start[16]; /* acquired as it starts */
    int n_start;
    char *wait;      /* acquired at emu_pdl_wait (NULL: nothing more) */
    char *end;       /* released as it ends */
};
/* A context switch without the signal-mask syscall of swapcontext: callee-saved registers,
 * MXCSR and the x87 control word go on the stack. In a section pushed and popped: the compiler
 * does not know a top-level asm changed sections, and at -O0 put the globals after it in .text
 * (a Debug TSan build crashed writing emu_gridDim). */
extern "C" void emu_ctx_switch(void **from_sp, void *to_sp);
asm(R"(
.pushsection .text
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
.popsection
)");
static void *sched_sp;
emu_thread *emu_cur;
emu_uint3 emu_blockIdx, emu_blockDim, emu_gridDim;

static std::vector<emu_thread> threads;
static std::vector<char *> stacks[EMU_SLOTS]; /* a slot's: blocks in other slots must not share them */
static const size_t STACK = 256 * 1024;
static std::function<void()> *body_fn;
static unsigned nthreads;
static uint64_t progress;
static std::vector<unsigned char> dyn[EMU_SLOTS]; /* dynamic shared memory, a slot's */
static const int SMEM_DEFAULT = 48 * 1024; /* dynamic shared memory a launch gets unasked */
static size_t dyn_max = SMEM_DEFAULT;      /* the limit set last */
static std::map<const void *, size_t> dyn_max_of; /* each kernel's, as CUDA keeps them */
static cudaError_t last_error = cudaSuccess;
static std::mt19937_64 rng(12345);

/* block barrier */
static unsigned bar_count, bar_gen;
static void *bar_site;
/* warp barriers */
struct warp_state { unsigned count, gen, expect; void *site; uint64_t stage[32], out[32]; };
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
    char *sync = &slot_sync[emu_slot].bar[g & 1];
    emu_hb_release(sync);
    if (++bar_count == nthreads) {
        bar_count = 0;
        bar_gen++;
    } else {
        while (bar_gen == g)
            yield_now();
    }
    emu_hb_acquire(sync);
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
    const unsigned wi = emu_cur->pub.tid.x / 32;
    warp_state &w = warps[wi];
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
    char *sync = &slot_sync[emu_slot].warp[wi][(g >> 1) & 1]; /* gen moves by two per exchange */
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

void *emu_dyn_smem(void) { return dyn[emu_slot].data(); }

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

/* The launch running now: what its blocks are ordered after. */
static const op_order *cur_op;

/* What a piece of work does first (uninstrumented: the host wrote o unordered). */
EMU_UNCHECKED static void acquire_start(const op_order &o)
{
    for (int k = 0; k < o.n_start; k++)
        emu_hb_acquire(o.start[k]);
}

/* A green thread's first frame. It never returns, so it is not instrumented: TSan's shadow
 * stack of a fiber would grow by its frame with every block the fiber runs. */
EMU_UNCHECKED static void trampoline()
{
    acquire_start(*cur_op);
    const unsigned g = slot_blocks[emu_slot];
    emu_hb_acquire(&slot_sync[emu_slot].block[(g - 1) & 1]);
    (*body_fn)();
    emu_hb_release(&slot_sync[emu_slot].block[g & 1]);
    emu_hb_release(cur_op->end);
    emu_cur->done = true;
    progress++;
    fiber_to_host();
    emu_ctx_switch(&emu_cur->sp, sched_sp);
    abort();
}

/* Programmatic dependent launch: from here on the kernel is ordered after the one before it. */
EMU_UNCHECKED void emu_pdl_wait(void)
{
    if (cur_op && cur_op->wait)
        emu_hb_acquire(cur_op->wait);
}

void emu_threadfence(void)
{
    emu_hb_acquire(&sync_fence);
    emu_hb_release(&sync_fence);
}

/* A stream: work runs at once, or is recorded while the stream is captured; under TSan it
 * keeps the order of its work (op i releases end[i % 3] as it ends). */
struct CUstream_st {
    std::vector<std::function<void(cudaStream_t)>> *capture = NULL; /* NULL: not capturing */
    bool blocking = true;      /* ordered with the legacy stream (not cudaStreamNonBlocking) */
    uint64_t n_ops = 0;        /* work issued */
    bool last_kernel = false;  /* the last work was a kernel: a PDL launch may overlap it */
    char end[3] = {0, 0, 0};
    char enqueue = 0;          /* the host's clock as it issued work */
    void *agent = NULL;        /* TSan fiber for its copies, sets, BLAS calls and event records */
};
struct CUgraph_st { std::vector<std::function<void(cudaStream_t)>> ops; };
struct CUgraphExec_st { std::vector<std::function<void(cudaStream_t)>> ops; };
static CUstream_st legacy_stream;
static std::vector<CUstream_st *> streams; /* those created */
static CUstream_st *stream_of(cudaStream_t s) { return s ? s : &legacy_stream; }
static char *last_end(CUstream_st *S) { return S->n_ops ? &S->end[(S->n_ops - 1) % 3] : NULL; }

static bool host_waits_every_op = false;
void emu_host_waits(bool every_op) { host_waits_every_op = every_op; }

/* Issues work on S: what it is ordered after. The host's release comes last, so everything
 * the host did before issuing it is in it. */
static op_order begin_op(CUstream_st *S, bool kernel, bool pdl)
{
    op_order o = {};
    auto add = [&](char *c) {
        if (c && o.n_start < 16)
            o.start[o.n_start++] = c;
    };
    const uint64_t i = S->n_ops++;
    add(&S->enqueue);
    if (kernel && pdl && S->last_kernel) {
        add(i >= 2 ? &S->end[(i - 2) % 3] : NULL);
        o.wait = &S->end[(i - 1) % 3];
    } else
        add(i >= 1 ? &S->end[(i - 1) % 3] : NULL);
    if (S == &legacy_stream) {
        for (CUstream_st *b : streams)
            if (b->blocking)
                add(last_end(b));
    } else if (S->blocking)
        add(last_end(&legacy_stream));
    S->last_kernel = kernel;
    o.end = &S->end[i % 3];
    emu_hb_release(&S->enqueue);
    return o;
}
static void end_op(const op_order &o)
{
    if (host_waits_every_op)
        emu_hb_acquire(o.end);
}
static void host_waits_for(CUstream_st *S)
{
    if (char *e = last_end(S))
        emu_hb_acquire(e);
}
static void host_waits_for_device()
{
    host_waits_for(&legacy_stream);
    for (CUstream_st *S : streams)
        host_waits_for(S);
}

/* Runs f as work of S on S's fiber, ordered by o. f is copied and dropped unseen by TSan:
 * the caller's copy may be freed or its stack reused while TSan still remembers the reads. */
EMU_UNCHECKED static void on_agent(CUstream_st *S, const op_order &o, const std::function<void()> &f)
{
    std::function<void()> *mine;
    {
        emu_quiet q;
        mine = new std::function<void()>(f);
    }
#if EMU_TSAN
    if (!S->agent)
        S->agent = __tsan_create_fiber(0);
    void *host = __tsan_get_current_fiber();
    __tsan_switch_to_fiber(S->agent, __tsan_switch_to_fiber_no_sync);
#endif
    acquire_start(o);
    (*mine)();
    emu_hb_release(o.end);
#if EMU_TSAN
    __tsan_switch_to_fiber(host, __tsan_switch_to_fiber_no_sync);
#else
    (void)S;
#endif
    emu_quiet q;
    delete mine;
}
static void device_op(cudaStream_t s, const std::function<void()> &f)
{
    CUstream_st *S = stream_of(s);
    const op_order o = begin_op(S, false, false);
    on_agent(S, o, f);
    end_op(o);
}

static bool recorded(cudaStream_t s, std::function<void(cudaStream_t)> op)
{
    if (!s || !s->capture)
        return false;
    s->capture->push_back(std::move(op));
    return true;
}

void emu_on_stream(cudaStream_t s, const std::function<void()> &op)
{
    if (!recorded(s, [op](cudaStream_t r) { device_op(r, op); }))
        device_op(s, op);
}

void emu_launch(std::function<void()> body, dim3 grid3, dim3 block3, size_t smem,
                cudaStream_t stream, bool pdl, const void *func)
{
    if (recorded(stream,
                 [=](cudaStream_t s) { emu_launch(body, grid3, block3, smem, s, pdl, func); }))
        return;
    const auto own = func ? dyn_max_of.find(func) : dyn_max_of.end();
    const size_t smem_max = !func                     ? dyn_max
                            : own != dyn_max_of.end() ? own->second
                                                      : (size_t)SMEM_DEFAULT;
    unsigned block = block3.x;
    if (block3.y != 1 || block3.z != 1) {
        fprintf(stderr, "emu: only 1-D blocks are emulated (%u,%u,%u)\n", block3.x, block3.y, block3.z);
        abort();
    }
    if (block == 0 || block > 1024 || block % 32 || smem > smem_max || grid3.x == 0 ||
        grid3.y == 0 || grid3.z == 0 || grid3.x > 0x7fffffffu || grid3.y > 65535 ||
        grid3.z > 65535) {
        fprintf(stderr, "emu: bad launch config grid (%u,%u,%u) block %u smem %zu (max %zu)\n",
                grid3.x, grid3.y, grid3.z, block, smem, smem_max);
        last_error = cudaErrorInvalidValue;
        return;
    }
    /* The emulator's state is written by the host and read by the blocks, which under TSan
     * are not ordered after the host's earlier work: hidden from TSan (emu_quiet). The body
     * is the emulator's own copy, for the same reason as on_agent's. */
    emu_quiet quiet;
    std::function<void()> *mine = new std::function<void()>(std::move(body));
    static int launches;
    if (getenv("EMU_TRACE"))
        fprintf(stderr, "emu: launch %d grid (%u,%u,%u) block %u smem %zu\n", launches, grid3.x, grid3.y, grid3.z, block, smem);
    /* This launch's slots: the other half's than the launch before it. */
    const unsigned first_slot = (unsigned)(launches % (EMU_SLOTS / EMU_SETS)) * EMU_SETS;
    launches++;
    body_fn = mine;
    nthreads = block;
    threads.resize(block);
#if EMU_TSAN
    static std::vector<void *> fibers[EMU_SLOTS]; /* one per thread of a slot, kept: they cost ~1 ms and ~1 MB each */
    __atomic_store_n(&host_fiber, __tsan_get_current_fiber(), __ATOMIC_RELAXED);
#endif
    for (unsigned slot = first_slot; slot < first_slot + EMU_SETS; slot++) {
        while (stacks[slot].size() < block) {
            void *p = mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            stacks[slot].push_back((char *)p);
        }
#if EMU_TSAN
        while (fibers[slot].size() < block)
            fibers[slot].push_back(__tsan_create_fiber(0));
#endif
        dyn[slot].assign(smem + 8, 0xA5);
    }
    warps.assign(block / 32, warp_state{});
    for (auto &w : warps) w.expect = 32;
    emu_gridDim = {grid3.x, grid3.y, grid3.z};
    emu_blockDim = {block, 1, 1};
    std::vector<unsigned> order(block);
    const op_order o = begin_op(stream_of(stream), true, pdl);
    cur_op = &o;
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
        emu_slot = first_slot + (unsigned)(k % EMU_SETS);
        slot_blocks[emu_slot]++;
        memset(dyn[emu_slot].data(), 0xA5, dyn[emu_slot].size());
        bar_count = 0;
        cp_groups.assign(block, std::vector<std::vector<cp_copy>>(1));
        for (unsigned t = 0; t < block; t++) {
            emu_thread &th = threads[t];
            th.pub.tid = {t, 0, 0};
            th.done = false;
#if EMU_TSAN
            th.fiber = fibers[emu_slot][t];
#endif
            uint64_t *sp = (uint64_t *)(((uintptr_t)(stacks[emu_slot][t] + STACK)) & ~(uintptr_t)15);
            *--sp = 0;
            *--sp = (uint64_t)(uintptr_t)trampoline;
            for (int i = 0; i < 6; i++)
                *--sp = 0;
            *--sp = (uint64_t)0x037F << 32 | 0x1F80;
            th.sp = sp;
            order[t] = t;
        }
        unsigned alive = block;
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
    cur_op = NULL;
    body_fn = NULL;
    delete mine;
    end_op(o);
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
cudaError_t emu_func_set_attribute(const void *f, enum cudaFuncAttribute a, int v)
{
    int optin;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) != cudaSuccess) optin = SMEM_DEFAULT;
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize || v < 0 || v > optin) return cudaErrorInvalidValue;
    dyn_max = (size_t)v;
    dyn_max_of[f] = (size_t)v;
    return cudaSuccess;
}
/* Memory the emulator hands out: poisoned (0x5A), so that a kernel reading what nothing wrote
 * reads garbage, as it may on a GPU. */
static cudaError_t emu_alloc(void **p, size_t n)
{
    *p = malloc(n ? n : 1);
    if (*p)
        memset(*p, 0x5A, n);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
/* The emulated device's memory (cudaMemGetInfo, cudaGetDeviceProperties): an allocation
 * larger than all of it fails, as on a GPU, rather than reaching malloc. */
static const size_t DEVICE_BYTES = (size_t)8 << 30;
/* emu_refuse_device_bytes(N): from then on every device allocation of N bytes or more fails
 * as a full device would fail it (0: none; the out-of-memory paths under test), and
 * emu_refused_allocations counts the refusals. A function, not the environment, so that a
 * test can change it while an engine's thread allocates. As CUDA, a failed cudaMalloc is also
 * the error cudaGetLastError returns next. */
static std::atomic<size_t> refuse_from{0};
static std::atomic<long> refused_allocations{0}, refused_graphs{0};
void emu_refuse_device_bytes(size_t n)
{
    refuse_from.store(n);
}
long emu_refused_allocations(void)
{
    return refused_allocations.load();
}
long emu_refused_graphs(void)
{
    return refused_graphs.load();
}
/* True (and counted) if n bytes of device memory find no room. */
static bool refused(size_t n)
{
    const size_t refuse = refuse_from.load();
    if (n <= DEVICE_BYTES && !(refuse && n >= refuse))
        return false;
    refused_allocations++;
    return true;
}
cudaError_t cudaMalloc(void **p, size_t n)
{
    cudaError_t e = refused(n) ? (*p = NULL, cudaErrorMemoryAllocation) : emu_alloc(p, n);
    if (e != cudaSuccess)
        last_error = e;
    return e;
}
/* As CUDA: freeing device memory waits for the device. */
cudaError_t cudaFree(void *p) { host_waits_for_device(); free(p); return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { host_waits_for_device(); return cudaSuccess; }
/* As CUDA: a captured stream cannot be synchronised. */
cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    if (s && s->capture)
        return cudaErrorStreamCaptureUnsupported;
    host_waits_for(stream_of(s));
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    *s = new CUstream_st();
    (*s)->blocking = !(flags & cudaStreamNonBlocking);
    streams.push_back(*s);
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s)
        return cudaErrorInvalidValue;
    streams.erase(std::remove(streams.begin(), streams.end(), s), streams.end());
#if EMU_TSAN
    if (s->agent)
        __tsan_destroy_fiber(s->agent);
#endif
    delete s->capture;
    delete s;
    return cudaSuccess;
}

/* Pinned host memory (cudaMallocHost): copies from and to it are asynchronous to the host. */
static std::map<uintptr_t, size_t> pinned;
static bool is_pinned(const void *p)
{
    auto it = pinned.upper_bound((uintptr_t)p);
    return it != pinned.begin() && (uintptr_t)p < (--it)->first + it->second;
}
cudaError_t cudaMallocHost(void **p, size_t n)
{
    cudaError_t e = emu_alloc(p, n);
    if (e != cudaSuccess)
        last_error = e;
    else
        pinned[(uintptr_t)*p] = n ? n : 1;
    return e;
}
cudaError_t cudaFreeHost(void *p)
{
    pinned.erase((uintptr_t)p);
    return cudaFree(p);
}

/* A copy on stream s, ordered for the host as CUDA's API synchronization rules say: from
 * pageable memory to the device the source is read before the call returns (CUDA stages it)
 * and the bytes land later; to pageable memory the call returns once the copy is done; copies
 * from and to pinned memory are asynchronous. `sync`: cudaMemcpy, which also returns once the
 * copy is done, but for a device-to-device copy, and a staged one, whose bytes may not have
 * landed yet (so work on a non-blocking stream is not ordered after it). */
static void copy_op(cudaStream_t s, void *d, const void *src, size_t n, enum cudaMemcpyKind kind, bool sync)
{
    CUstream_st *S = stream_of(s);
    const bool staged = kind == cudaMemcpyHostToDevice && !is_pinned(src);
    const bool host_waits = kind == cudaMemcpyDeviceToHost ? sync || !is_pinned(d)
                                                           : sync && kind != cudaMemcpyDeviceToDevice && !staged;
    if (staged) {
        if (sync)
            host_waits_for(S); /* "a stream sync is performed before the copy is initiated" */
        emu_hb_read(src, n);
    }
    const op_order o = begin_op(S, false, false);
    on_agent(S, o, [=] {
        if (staged) {
            emu_hb_write(d, n);
            emu_quiet q;
            memcpy(d, src, n);
        } else
            memcpy(d, src, n);
    });
    end_op(o);
    if (host_waits)
        emu_hb_acquire(o.end);
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k)
{
    copy_op(NULL, d, s, n, k, true);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st)
{
    if (!recorded(st, [=](cudaStream_t r) { copy_op(r, d, s, n, k, false); }))
        copy_op(st, d, s, n, k, false);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n)
{
    device_op(NULL, [=] { memset(d, v, n); });
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st)
{
    emu_on_stream(st, [=] { memset(d, v, n); });
    return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode)
{
    if (!s || s->capture)
        return cudaErrorInvalidValue;
    s->capture = new std::vector<std::function<void(cudaStream_t)>>();
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
/* An executable graph keeps its kernels' parameters in device memory: here 1 KiB a node,
 * refused as an allocation of that size would be (emu_refuse_device_bytes). */
#ifdef CLLM_EMU_MUSA
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, cudaGraphNode_t *, char *,
                                 size_t)
#else
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long)
#endif
{
    if (refused(g->ops.size() << 10)) {
        refused_graphs++;
        *e = NULL;
        return last_error = cudaErrorMemoryAllocation;
    }
    *e = new CUgraphExec_st{g->ops};
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s)
{
    if (s && s->capture)
        return cudaErrorStreamCaptureUnsupported;
    stream_of(s)->last_kernel = false; /* the graph's first kernel waits for the work before */
    for (auto &op : e->ops)
        op(s);
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int)
{
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulator");
    p->totalGlobalMem = DEVICE_BYTES;
    p->major = 9;
    p->multiProcessorCount = 4;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = DEVICE_BYTES;
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorString(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? "out of memory" : e ? "emu error" : "no error";
}
/* An event: `done` holds the stream's work up to its record (released by the stream's fiber). */
struct CUevent_st { double t; char done; };
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new CUevent_st{0, 0}; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
static void record_event(cudaEvent_t e, cudaStream_t s)
{
    e->t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    CUstream_st *S = stream_of(s);
    op_order o = {};
    if (char *last = last_end(S))
        o.start[o.n_start++] = last;
    o.end = &e->done;
    on_agent(S, o, [] {});
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (!recorded(s, [=](cudaStream_t r) { record_event(e, r); }))
        record_event(e, s);
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { emu_hb_acquire(&e->done); return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) { *ms = (float)(b->t - a->t); return cudaSuccess; }
}
