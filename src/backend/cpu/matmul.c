/*
 * The matmul driver: picks the kernel family at first use (detect, below), validates shapes,
 * quantizes the activations once per call into scratch (8 bits for quantized weights; BF16
 * for BF16 weights under the AVX-512 BF16 kernels, F32 even/odd pairs under the AVX-512 F
 * ones), then hands out (token chunk, row range) work items to the pool's threads. For each
 * weight row of an item the kernel runs on tiles of CLLM_MM_TILE tokens, so a weight block is
 * decoded once per tile (GEMM, not repeated GEMV), while the row range stays in cache across
 * the tiles (float weights: one kernel call takes the item's rows and all its tokens, and
 * orders them itself). Every output element is computed by
 * exactly one kernel call whose arithmetic for a token does not depend on the other tokens of
 * the tile, nor on which thread runs it, so results do not depend on the thread count or the
 * batch.
 */
#include "backend/cpu/matmul.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "backend/cpu/pack_x16.h"
#include "backend/cpu/quant_dot.h"
#include "core/alloc.h"
#include "core/log.h"

/* Weight bytes of one row chunk: stays in L1/L2 while every token tile passes over it. */
#define ROW_CHUNK_BYTES (16u << 10)
/* Activation bytes of one token chunk: stays in L2 while the row chunks pass over it. */
#define TOKEN_CHUNK_BYTES (192u << 10)
/* Weight bytes of one work item: small enough to balance threads, large enough that taking
 * items costs nothing. Decode-sized calls (one tile) stream weights, so they take more. */
#define ITEM_BYTES (16u << 10)
#define DECODE_ITEM_BYTES (64u << 10)
/* Float weights: a kernel call takes a row chunk against a tile; the chunk (~144 KiB) stays in
 * the L2 cache while the tiles pass, each tile's four-token passes in L1 or L2. Chunks and
 * items are whole multiples of the kernels' row blocks (dot_avx2.c: 3 or 4 rows for several
 * tokens, 8 for one), so only a matrix's last rows take the single-row path. */
#define FLOAT_ROW_CHUNK_BYTES (144u << 10)
#define FLOAT_ROW_MULTIPLE 12
#define FLOAT_DECODE_ROW_MULTIPLE 8
/* Float items take this many tokens (a multiple of CLLM_MM_TILE, and one still when halved),
 * halved while that leaves fewer than FLOAT_ITEMS_PER_THREAD items a thread. */
#define FLOAT_TOKEN_CHUNK 64
#define FLOAT_ITEMS_PER_THREAD 4
/* Activation blocks per quantization work item. */
#define QUANT_ITEM_BLOCKS 16
/* Below this many activations, quantizing on the caller beats waking the pool. */
#define QUANT_SERIAL_ELEMS 32768

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
/* The kernel families this CPU runs, slowest first; the default is the last but where
 * detect says otherwise. */
static const struct cllm_matmul_kernels *families[6];
static int n_families;
static const struct cllm_matmul_kernels *default_family;
static _Atomic(const struct cllm_matmul_kernels *) active;
#if defined(__x86_64__) || defined(__i386__)
static struct cllm_matmul_kernels avx512_kernels, avx512vnni_kernels, avx512bf16_kernels;

/* F16C from CPUID itself: clang's __builtin_cpu_supports does not know "f16c". */
static bool cpu_has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

/* Whether AVX-512 BF16's dot products outrun F32 FMAs on this CPU, so that BF16 weights gain
 * from activations rounded to BF16: on AMD's cores (Zen 4 runs a 512-bit FMA in two halves,
 * 16 products a cycle, and vdpbf16ps at 32: the BF16 kernels ran 2x AVX-512 F's, docs/
 * measured.md), not on Intel's, whose two 512-bit FMA units make 32 a cycle as its one
 * vdpbf16ps port does (an Emerald Rapids ran the 1.5B's BF16 folder 1.2x faster with F32
 * activations, and they are the more exact). The vendor, not a timing at start: a server must
 * pick the same kernels, so the same answers, every time it starts. */
static bool cpu_bf16_dots_pay(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u /* "Auth" */ &&
           d == 0x69746e65u /* "enti" */ && c == 0x444d4163u /* "cAMD" */;
}

/* AVX-VNNI (CPUID leaf 7, sub-leaf 1, EAX bit 4), which older compilers' checks do not know; its
 * registers are AVX2's, whose saving by the OS the AVX2 check has seen to. */
static bool cpu_has_avxvnni(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
}
#endif

static const struct cllm_matmul_kernels *family_named(const char *isa)
{
    for (int i = 0; i < n_families; i++)
        if (strcmp(families[i]->isa, isa) == 0)
            return families[i];
    return NULL;
}

/* The families this CPU runs (compilers' checks include the OS's saving of the registers), the
 * default among them, and CLLM_CPU_ISA's choice: a slower family for a comparison,
 * "avx512bf16" for BF16 activations where they are not the default, or "avx2" to keep a BF16
 * model's activations in F32 on a CPU where they are. */
static void detect(void)
{
    families[n_families++] = cllm_matmul_kernels_scalar();
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c()) {
        families[n_families++] = cllm_matmul_kernels_avx2();
        if (cpu_has_avxvnni())
            families[n_families++] = cllm_matmul_kernels_avxvnni();
        /* each AVX-512 family adds its kernels to the one before (AVX-VNNI's quantized ones
         * where the CPU has it): CPUs with BF16 have VNNI */
        const bool avx512 = __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl");
        if (avx512) {
            avx512_kernels = *families[n_families - 1];
            cllm_matmul_kernels_add_avx512(&avx512_kernels);
            families[n_families++] = &avx512_kernels;
        }
        if (avx512 && __builtin_cpu_supports("avx512vnni")) {
            avx512vnni_kernels = *families[n_families - 1];
            cllm_matmul_kernels_add_avx512vnni(&avx512vnni_kernels);
            families[n_families++] = &avx512vnni_kernels;
        }
        if (avx512 && __builtin_cpu_supports("avx512bf16")) {
            avx512bf16_kernels = *families[n_families - 1];
            cllm_matmul_kernels_add_avx512bf16(&avx512bf16_kernels);
            families[n_families++] = &avx512bf16_kernels;
        }
    }
#endif
    const struct cllm_matmul_kernels *best = families[n_families - 1];
#if defined(__x86_64__) || defined(__i386__)
    /* the AVX-512 BF16 family differs from the one before only in its BF16 weights' kernels */
    if (best == &avx512bf16_kernels && !cpu_bf16_dots_pay()) {
        best = families[n_families - 2];
        cllm_log(CLLM_LOG_INFO, "cpu: AVX-512 BF16's dot products run no faster than FMAs on "
                                "this CPU (not AMD's): BF16 weights take F32 activations "
                                "(CLLM_CPU_ISA=avx512bf16 rounds them to BF16)");
    }
#endif
    default_family = best;
    const char *want = getenv("CLLM_CPU_ISA");
    if (want && *want) {
        const struct cllm_matmul_kernels *k = family_named(want);
        if (k)
            best = k;
        else
            cllm_log(CLLM_LOG_WARN,
                     "CLLM_CPU_ISA=%s: not a kernel family this CPU runs "
                     "(scalar, avx2, avxvnni, avx512, avx512vnni, avx512bf16); using %s",
                     want, best->isa);
    }
    atomic_store(&active, best);
}

static const struct cllm_matmul_kernels *kernels(void)
{
    pthread_once(&detect_once, detect);
    return atomic_load(&active);
}

const char *cllm_cpu_matmul_isa(void)
{
    return kernels()->isa;
}

bool cllm_cpu_matmul_bf16_activations(void)
{
    return kernels()->to_bf16 != NULL;
}

bool cllm_cpu_matmul_use_isa(const char *isa)
{
    pthread_once(&detect_once, detect);
    const struct cllm_matmul_kernels *k = isa ? family_named(isa) : default_family;
    if (!k)
        return false;
    atomic_store(&active, k);
    return true;
}

void cllm_cpu_attend(const struct cllm_attend_item *it)
{
    kernels()->attend(it);
}

void cllm_cpu_silu_mul(const float *gate, const float *up, int64_t n, float *out)
{
    kernels()->silu_mul(gate, up, n, out);
}

static atomic_bool fetch_ahead = true;

void cllm_cpu_matmul_fetch_ahead(bool on)
{
    atomic_store(&fetch_ahead, on);
}

size_t cllm_cpu_matmul_scratch_size(enum cllm_dtype wtype, int64_t K, int64_t n_tokens)
{
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(wtype);
    if (!tr)
        return 0;
    const enum cllm_act_kind kind = cllm_kernels_act_kind(kernels(), wtype);
    size_t tile_bytes, off_d, off_sums;
    uint64_t bytes;
    if (kind == CLLM_ACT_F32 || n_tokens <= 0 || n_tokens > INT64_MAX - CLLM_MM_TILE ||
        !cllm_act_tile_layout(kind, K, &tile_bytes, &off_d, &off_sums))
        return 0;
    const uint64_t n_tiles = (uint64_t)(n_tokens + CLLM_MM_TILE - 1) / CLLM_MM_TILE;
    /* + 64: room to align the caller's buffer */
    if (!cllm_mul_u64(tile_bytes, n_tiles, &bytes) || !cllm_add_u64(bytes, 64, &bytes) ||
        bytes > SIZE_MAX)
        return 0;
    return (size_t)bytes;
}

struct mm_job {
    cllm_dot_fn dot;            /* quantized weights: one row a call */
    cllm_dot_rows_fn dot_rows;  /* float weights: a row chunk a call */
    cllm_dot_rows_fn dot_rows1; /* quantized weights, a lone token: a row chunk a call */
    cllm_quant_fn quant;
    cllm_to_bf16_fn to_bf16;    /* BF16 activations: a token's row a call */
    cllm_to_pairs_fn to_pairs;  /* F32 pair rows: a token's row a call */
    const uint8_t *w;           /* [N][row_bytes] */
    size_t row_bytes;
    int64_t K, N, n_tokens;
    const float *x;             /* [n_tokens][K] */
    float *y;                   /* [n_tokens][ldy] */
    int64_t ldy;
    uint8_t *act;               /* quantized or BF16 tiles (quant_dot.h), or NULL for F32 */
    size_t tile_bytes;          /* bytes per tile of those activations */
    struct cllm_act_view view;  /* tile 0 of the activations (F32: token 0's row) */
    int64_t B, G;               /* activation block and group sizes */
    /* Work is handed out in items through atomic counters, not split up front: when a thread
     * is slowed (another process on its core), the others take over its share. Which thread
     * computes an output never changes its value. */
    atomic_llong next_quant; /* next quantization item: QUANT_ITEM_BLOCKS blocks of a token
                              * (BF16 or F32 pairs: a whole token) */
    int64_t quant_per_token, quant_items;
    atomic_llong next_dot;      /* next (token chunk, row item) pair, token chunk major */
    int64_t row_item, row_items, dot_items;
    int64_t row_chunk, token_chunk;
    bool fetch_ahead; /* cllm_cpu_matmul_fetch_ahead's setting at the call */
};

static void quant_task(void *ctx, int ith, int nth)
{
    struct mm_job *j = ctx;
    (void)ith;
    (void)nth;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next_quant, 1, memory_order_relaxed);
        if (i >= j->quant_items)
            return;
        if (j->to_bf16) {
            j->to_bf16(j->x + i * j->K, j->K,
                       (uint16_t *)(void *)(j->act + (size_t)i * j->view.stride));
            continue;
        }
        if (j->to_pairs) {
            j->to_pairs(j->x + i * j->K, j->K,
                        (float *)(void *)(j->act + (size_t)i * j->view.stride));
            continue;
        }
        const int64_t nbk = j->K / j->B;
        const int64_t t = i / j->quant_per_token, slot = t % CLLM_MM_TILE;
        const int64_t b = i % j->quant_per_token * QUANT_ITEM_BLOCKS;
        const int64_t n = nbk - b < QUANT_ITEM_BLOCKS ? nbk - b : QUANT_ITEM_BLOCKS;
        uint8_t *tile = j->act + (size_t)(t / CLLM_MM_TILE) * j->tile_bytes;
        j->quant(j->x + t * j->K + b * j->B, n, (int8_t *)tile + slot * j->K + b * j->B,
                 (float *)(void *)(tile + j->view.off_d) + b * j->view.step + slot,
                 (int16_t *)(void *)(tile + j->view.off_sums) +
                     (b * j->view.step + slot) * (j->B / j->G),
                 j->view.step);
    }
}

/* Rows [r0, r1) for tokens [t0, t1): row chunks that stay in cache while the tiles pass. */
static void dot_block(const struct mm_job *j, int64_t r0, int64_t r1, int64_t t0, int64_t t1)
{
    for (int64_t rb = r0; rb < r1; rb += j->row_chunk) {
        const int64_t re = rb + j->row_chunk < r1 ? rb + j->row_chunk : r1;
        /* float kernels take every token of the item at once and order the work themselves */
        const int64_t tile = j->dot_rows ? t1 - t0 : CLLM_MM_TILE;
        for (int64_t tt = t0; tt < t1; tt += tile) {
            const int nt = (int)(t1 - tt < tile ? t1 - tt : tile);
            struct cllm_act_view v = j->view;
            v.base += j->act ? (size_t)(tt / CLLM_MM_TILE) * j->tile_bytes : (size_t)tt * v.stride;
            /* not a lone token's call: it streams its rows once, in order, which the hardware
             * prefetchers follow; asking ahead there cost 10% on 1 thread of a Zen 4 */
            v.weights_cold = tt == t0 && j->fetch_ahead && j->n_tokens > 1;
            float *y = j->y + tt * j->ldy;
            const cllm_dot_rows_fn rows = j->dot_rows ? j->dot_rows : j->dot_rows1;
            if (rows) {
                rows(j->w + (size_t)rb * j->row_bytes, j->row_bytes, re - rb, j->K, &v, nt, y + rb,
                     j->ldy);
                continue;
            }
            for (int64_t r = rb; r < re; r++)
                j->dot(j->w + (size_t)r * j->row_bytes, j->K, &v, nt, y + r, j->ldy);
        }
    }
}

static void dot_task(void *ctx, int ith, int nth)
{
    struct mm_job *j = ctx;
    (void)ith;
    (void)nth;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next_dot, 1, memory_order_relaxed);
        if (i >= j->dot_items)
            return;
        const int64_t t0 = i / j->row_items * j->token_chunk;
        const int64_t r0 = i % j->row_items * j->row_item;
        const int64_t t1 = t0 + j->token_chunk < j->n_tokens ? t0 + j->token_chunk : j->n_tokens;
        const int64_t r1 = r0 + j->row_item < j->N ? r0 + j->row_item : j->N;
        dot_block(j, r0, r1, t0, t1);
    }
}

bool cllm_cpu_matmul_packs(enum cllm_dtype t, int64_t K, int64_t N)
{
    return cllm_x16_packs(t) && kernels()->dot_x16[t] && K > 0 && K % CLLM_QK_K == 0 && N > 0 &&
           N % CLLM_PACK_ROWS == 0;
}

/* The kernel family's kernel for packed rows of dtype t, else the reference. */
static cllm_dot_rows_fn packed_kernel(const struct cllm_matmul_kernels *k, enum cllm_dtype t)
{
    if (k->dot_x16[t])
        return k->dot_x16[t];
    return t == CLLM_DTYPE_Q4_K ? cllm_dot_q4_k_x16_ref : cllm_dot_q6_k_x16_ref;
}

/* cllm_cpu_matmul, or (packed) cllm_cpu_matmul_packed. */
static enum cllm_status matmul(struct cllm_threadpool *tp, const struct cllm_tensor *w, bool packed,
                               const float *x, int64_t n_tokens, float *y, int64_t ldy,
                               void *scratch, size_t scratch_size)
{
    if (!w || !x || !y || n_tokens < 0)
        return CLLM_ERR_INVALID_ARG;
    if (packed && (!cllm_x16_packs(w->dtype) || w->ne[1] % CLLM_PACK_ROWS != 0))
        return CLLM_ERR_INVALID_ARG;
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(w->dtype);
    const int64_t K = w->ne[0], N = w->ne[1];
    uint64_t row_bytes, total, last;
    if (!tr || !w->data || K <= 0 || N <= 0 || w->ne[2] != 1 || w->ne[3] != 1 ||
        K % tr->block_size != 0 || !cllm_dtype_row_bytes(w->dtype, K, &row_bytes) ||
        !cllm_mul_u64(row_bytes, (uint64_t)N, &total) || total > w->nbytes || ldy < N)
        return CLLM_ERR_INVALID_ARG;
    if (n_tokens == 0)
        return CLLM_OK;
    /* The last element of y and x must be addressable. */
    if (!cllm_mul_u64((uint64_t)(n_tokens - 1), (uint64_t)ldy, &last) ||
        !cllm_add_u64(last, (uint64_t)N, &last) || last > (uint64_t)INT64_MAX ||
        !cllm_mul_u64((uint64_t)n_tokens, (uint64_t)K, &last) || last > SIZE_MAX / sizeof(float))
        return CLLM_ERR_INVALID_ARG;

    const struct cllm_matmul_kernels *k = kernels();
    const enum cllm_act_kind kind = cllm_kernels_act_kind(k, w->dtype);
    const bool quantized = kind == CLLM_ACT_Q8_0 || kind == CLLM_ACT_Q8_K;
    struct mm_job j = {
        .dot = k->dot[w->dtype],
        .dot_rows = k->dot_rows[w->dtype],
        .dot_rows1 = packed          ? packed_kernel(k, w->dtype)
                     : n_tokens == 1 ? k->dot_rows1[w->dtype]
                                     : NULL,
        .quant = k->quant[kind],
        .w = w->data,
        .row_bytes = (size_t)row_bytes,
        .K = K,
        .N = N,
        .n_tokens = n_tokens,
        .x = x,
        .y = y,
        .ldy = ldy,
        .fetch_ahead = atomic_load_explicit(&fetch_ahead, memory_order_relaxed),
    };
    if (quantized ? !j.dot : !j.dot_rows)
        return CLLM_ERR_INVALID_ARG;
    if (kind == CLLM_ACT_F32) {
        j.view = (struct cllm_act_view){
            .base = (const uint8_t *)x, .stride = (size_t)K * sizeof(float), .step = 1};
    } else {
        const size_t need = cllm_cpu_matmul_scratch_size(w->dtype, K, n_tokens);
        if (!need || !scratch || scratch_size < need || (quantized && !j.quant))
            return CLLM_ERR_INVALID_ARG;
        cllm_act_tile_layout(kind, K, &j.tile_bytes, &j.view.off_d, &j.view.off_sums);
        j.act = (uint8_t *)(((uintptr_t)scratch + 63u) & ~(uintptr_t)63u);
        j.view.base = j.act;
        if (quantized) {
            j.view.stride = (size_t)K;
            j.view.step = n_tokens == 1 ? 1 : CLLM_MM_TILE;
            j.B = cllm_act_block(kind);
            j.G = cllm_act_group(kind);
        } else { /* BF16 or F32 pair rows, padded */
            j.view.stride = j.tile_bytes / CLLM_MM_TILE;
            j.view.step = 1;
            if (kind == CLLM_ACT_BF16)
                j.to_bf16 = k->to_bf16;
            else
                j.to_pairs = k->to_pairs;
        }
    }
    const size_t tile_bytes = j.act ? j.tile_bytes : CLLM_MM_TILE * j.view.stride;
    j.token_chunk = (int64_t)(TOKEN_CHUNK_BYTES / tile_bytes) * CLLM_MM_TILE;
    if (j.token_chunk < CLLM_MM_TILE)
        j.token_chunk = CLLM_MM_TILE;
    if (quantized) {
        j.row_chunk = (int64_t)(ROW_CHUNK_BYTES / j.row_bytes);
        j.row_item = (int64_t)((n_tokens <= CLLM_MM_TILE ? DECODE_ITEM_BYTES : ITEM_BYTES) /
                               j.row_bytes);
        if (packed) { /* whole groups of packed rows */
            j.row_item = (j.row_item + CLLM_PACK_ROWS - 1) / CLLM_PACK_ROWS * CLLM_PACK_ROWS;
            j.row_chunk = (j.row_chunk + CLLM_PACK_ROWS - 1) / CLLM_PACK_ROWS * CLLM_PACK_ROWS;
            if (j.row_item < CLLM_PACK_ROWS)
                j.row_item = CLLM_PACK_ROWS;
            if (j.row_chunk < CLLM_PACK_ROWS || j.row_chunk > j.row_item)
                j.row_chunk = j.row_item;
        } else if (j.dot_rows1) { /* whole 8-row blocks a call (the kernels' unit) */
            j.row_item = (j.row_item + 7) / 8 * 8;
            j.row_chunk = j.row_item;
        }
    } else if (n_tokens <= CLLM_MM_TILE) { /* one tile: items of streamed rows, no chunking */
        const int64_t m = n_tokens == 1 ? FLOAT_DECODE_ROW_MULTIPLE : FLOAT_ROW_MULTIPLE;
        j.row_item = ((int64_t)(DECODE_ITEM_BYTES / j.row_bytes) + m - 1) / m * m;
        j.row_chunk = j.row_item;
    } else { /* an item is one chunk */
        j.row_chunk = (int64_t)(FLOAT_ROW_CHUNK_BYTES / j.row_bytes) / FLOAT_ROW_MULTIPLE *
                      FLOAT_ROW_MULTIPLE;
        if (j.row_chunk < FLOAT_ROW_MULTIPLE)
            j.row_chunk = FLOAT_ROW_MULTIPLE;
        j.row_item = j.row_chunk;
    }
    if (j.row_chunk < 1)
        j.row_chunk = 1;
    if (j.row_item < 1)
        j.row_item = 1;
    j.row_items = (N + j.row_item - 1) / j.row_item;
    if (!quantized && j.token_chunk < FLOAT_TOKEN_CHUNK) {
        /* A float item's rows are read from L2 once per four tokens, from memory once per item:
         * long rows (K = 8960: a 12-row chunk, 8 tokens a chunk) re-read the weights from
         * memory for every 8 tokens at 48 GFLOP/s; 64 tokens a chunk run at 70. Halved again
         * while that leaves too few items to share among the threads. */
        const int64_t nth = tp ? cllm_threadpool_n_threads(tp) : 1;
        const int64_t want = FLOAT_ITEMS_PER_THREAD * nth;
        j.token_chunk = FLOAT_TOKEN_CHUNK;
        while (j.token_chunk > CLLM_MM_TILE &&
               (n_tokens + j.token_chunk - 1) / j.token_chunk * j.row_items < want)
            j.token_chunk /= 2;
    }
    j.dot_items = (n_tokens + j.token_chunk - 1) / j.token_chunk * j.row_items;
    atomic_init(&j.next_dot, 0);

    if (j.act) {
        j.quant_per_token = quantized ? (K / j.B + QUANT_ITEM_BLOCKS - 1) / QUANT_ITEM_BLOCKS : 1;
        j.quant_items = n_tokens * j.quant_per_token;
        atomic_init(&j.next_quant, 0);
        if (quantized && n_tokens % CLLM_MM_TILE) {
            /* the last tile's empty slots: zero scales and sums, which the kernels read */
            uint8_t *pad = j.act + (size_t)(n_tokens / CLLM_MM_TILE) * j.tile_bytes;
            memset(pad + j.view.off_d, 0, j.tile_bytes - j.view.off_d);
        }
        if (n_tokens * K <= QUANT_SERIAL_ELEMS)
            quant_task(&j, 0, 1);
        else
            cllm_threadpool_run(tp, quant_task, &j);
    }
    cllm_threadpool_run(tp, dot_task, &j);
    return CLLM_OK;
}

enum cllm_status cllm_cpu_matmul(struct cllm_threadpool *tp, const struct cllm_tensor *w,
                                 const float *x, int64_t n_tokens, float *y, int64_t ldy,
                                 void *scratch, size_t scratch_size)
{
    return matmul(tp, w, false, x, n_tokens, y, ldy, scratch, scratch_size);
}

enum cllm_status cllm_cpu_matmul_packed(struct cllm_threadpool *tp, const struct cllm_tensor *w,
                                        const float *x, int64_t n_tokens, float *y, int64_t ldy,
                                        void *scratch, size_t scratch_size)
{
    return matmul(tp, w, true, x, n_tokens, y, ldy, scratch, scratch_size);
}
