/*
 * Device sampling (sample.h): one CTA of THREADS threads per row of logits, no global scratch,
 * no state between launches. The rules are the host sampler's (sampling/sampling.c): greedy
 * is its argmax (NaN below -inf, the lowest index on ties, 0 for an all-NaN row); otherwise
 * x = logit / T in float (NaN -> -inf), a row without a finite maximum gives the raw argmax,
 * top-k keeps every x >= the k-th largest, top-p keeps the shortest prefix of the order
 * (x descending, id ascending) whose mass exp(x - max) reaches top_p * Z (Z over the top-k
 * survivors, or over the vocab), min-p drops exp(x - max) < min_p, always keeping the top.
 * A draw inverts the CDF at u = hash(seed, counter) (splitmix64; 53 bits), so it depends on
 * nothing but the row, its parameters and (seed, counter).
 *
 * A "pass" reads the row once, coalesced: 600 KB at n_vocab 151,936, ~40 us for 256 rows at
 * H200 bandwidth (rows do not stay in L2 between passes when 132 SMs stream 600 KB each).
 *   greedy                 1 pass (an integer max per logit)
 *   temperature only       1 pass: the argmax and each thread's online softmax sum of its
 *                          strided logits; a block scan picks the thread, one warp re-reads
 *                          its ~150 logits to pick the token
 *   top-k (+ top-p, min-p) 2 passes: the first also counts keys in 4096 bins (the top 12 bits
 *                          of the order-preserving key), which bounds the k largest; the second
 *                          gathers that bin and above into shared memory; a bitonic sort there
 *                          and the exact rules in double on the sorted candidates
 *   top-p without top-k    3 passes: max; a histogram of max - x in 1/16-logit bins whose mass
 *                          bounds the nucleus; the gather (summing the rest into Z)
 *   min-p alone            2 passes: max; the draw over x >= its threshold
 * More candidates than fit in shared memory (cap, 16384 on Hopper; a huge k, or a flat row
 * with top-p near 1) take the exact fallback: MSB radix selects over the full row (3 passes
 * each, for the k-th largest, for the top-p cut, and for a cut inside a run of equal logits
 * by id), weights in 2^-40 fixed point so that every sum is exact and order-free, then a draw
 * pass. Everything is deterministic: integer atomics only, fixed reduction trees.
 *
 * This file: the passes, the exact fallback, the candidates and the kernel; the keys, weights
 * and block-wide primitives are in sample_block.h, the penalties (a kernel of their own, run
 * before this one) in penalize.cu.
 */
#include "backend/cuda/vendor.h"

#include <math.h>
#include <stdint.h>

#include "backend/cuda/sample.h"
#include "backend/cuda/sample_block.h"
#include "backend/cuda/warp.h"

/* ---- passes over the row: thread t takes logits t, t + THREADS, ... in that order ---- */

/* Run-length cache in front of a shared-memory histogram: equal bins in a row (flat rows,
 * masked logits) cost one atomic. */
struct hist_run {
    uint32_t bin, count;
    uint64_t mass;
};

static __device__ __forceinline__ void hist_add(struct hist_run *r, uint32_t bin, uint64_t mass,
                                                uint32_t *cnt, uint64_t *mass_hist)
{
    if (bin != r->bin) {
        if (r->count) {
            atomicAdd(&cnt[r->bin], r->count);
            if (mass_hist)
                atomicAdd((unsigned long long *)&mass_hist[r->bin], (unsigned long long)r->mass);
        }
        r->bin = bin;
        r->count = 0;
        r->mass = 0;
    }
    r->count++;
    r->mass += mass;
}

static __device__ __forceinline__ void hist_flush(struct hist_run *r, uint32_t *cnt,
                                                  uint64_t *mass_hist)
{
    if (r->count) {
        atomicAdd(&cnt[r->bin], r->count);
        if (mass_hist)
            atomicAdd((unsigned long long *)&mass_hist[r->bin], (unsigned long long)r->mass);
    }
}

/* The packed argmax of the raw logits (the greedy token and the fallback one). With sums,
 * each thread's online softmax of its finite x with pack(key(x), i) >= end: *s = sum of
 * exp(x - *m), *m its largest x. With hist, counts of the finite x by top 12 key bits. */
static __device__ uint64_t pass_row(const float *__restrict__ l, int32_t n, float t, bool sums,
                                    uint64_t end, uint32_t *hist, float *m_out, double *s_out)
{
    uint64_t best = 0;
    float m = -INFINITY;
    double s = 0.0;
    struct hist_run run = {0, 0, 0};
    for (int32_t i0 = threadIdx.x; i0 < n; i0 += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int32_t i = i0 + u * THREADS;
            v[u] = i < n ? l[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int32_t i = i0 + u * THREADS;
            if (i >= n)
                break;
            uint64_t key = pack(fkey(v[u]), i);
            best = key > best ? key : best;
            if (!sums && !hist)
                continue;
            float x = scaled(v[u], t);
            if (!(x > -INFINITY))
                continue;
            uint32_t k = fkey(x);
            if (hist)
                hist_add(&run, k >> KEY_SHIFT, 0, hist, NULL);
            if (sums && pack(k, i) >= end) {
                if (x > m) {
                    s = s * (double)expf(m - x) + 1.0;
                    m = x;
                } else {
                    s += (double)expf(x - m);
                }
            }
        }
    }
    if (hist)
        hist_flush(&run, hist, NULL);
    *m_out = m;
    *s_out = s;
    return best;
}

/* Draws from the sums of pass_row (same t, end): a block scan of the threads' sums picks the
 * thread whose share holds u * total, and warp 0 walks that thread's logits in double. */
static __device__ int32_t draw_from_sums(const float *__restrict__ l, int32_t n, float t, float mx,
                                         uint64_t end, float m, double s, double u,
                                         int32_t fallback, struct block_state *st)
{
    const int lane = threadIdx.x & 31;
    const double mine = s > 0.0 ? s * exp((double)m - (double)mx) : 0.0;
    double total;
    const double before = block_scan_f64(mine, &total, st);
    const double r = u * total;
    uint32_t who = block_min_u32(mine > 0.0 && r < before + mine ? threadIdx.x : NONE, st);
    if (who == NONE) /* r fell past the rounded total: the last thread with mass */
        who = THREADS - 1 - block_min_u32(mine > 0.0 ? THREADS - 1 - threadIdx.x : NONE, st);
    if (who >= THREADS) { /* no mass at all (cannot happen with a finite maximum) */
        return fallback;
    }
    if (threadIdx.x == who)
        st->dword = r - before;
    __syncthreads();
    if (threadIdx.x < 32) {
        const double target = st->dword;
        double cum = 0.0;
        int32_t found = -1, last = -1;
        for (int32_t j0 = 0; (int64_t)j0 * THREADS + who < n; j0 += 32) {
            const int64_t i = (int64_t)(j0 + lane) * THREADS + who;
            double w = 0.0;
            if (i < n) {
                float x = scaled(l[i], t);
                if (x > -INFINITY && pack(fkey(x), (int32_t)i) >= end)
                    w = exp((double)x - (double)mx);
            }
            double c = w;
            for (int o = 1; o < 32; o <<= 1) {
                double y = cllm_shfl_up(c, o);
                if (lane >= o)
                    c += y;
            }
            c += cum;
            const unsigned hit = cllm_ballot(w > 0.0 && target < c);
            const unsigned pos = cllm_ballot(w > 0.0);
            if (pos)
                last = (j0 + 31 - __clz(pos)) * THREADS + (int32_t)who;
            if (hit) {
                found = (j0 + __ffs(hit) - 1) * THREADS + (int32_t)who;
                break;
            }
            cum = cllm_shfl(c, 31);
        }
        if (lane == 0)
            st->token = found >= 0 ? found : last >= 0 ? last : fallback;
    }
    __syncthreads();
    const int32_t token = st->token;
    __syncthreads();
    return token;
}

/* Top-p bound: per bin of max - x, the count of finite x (the last bin is left to the
 * caller: it would take most of a peaked row). Returns this thread's count of finite x. */
static __device__ uint32_t pass_gap_hist(const float *__restrict__ l, int32_t n, float t, float mx,
                                         uint32_t *hist)
{
    uint32_t fin = 0;
    struct hist_run run = {0, 0, 0};
    for (int32_t i0 = threadIdx.x; i0 < n; i0 += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int32_t i = i0 + u * THREADS;
            v[u] = i < n ? l[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (i0 + u * THREADS >= n)
                break;
            float x = scaled(v[u], t);
            if (!(x > -INFINITY))
                continue;
            fin++;
            uint32_t b = gap_bin(x, mx);
            if (b < GAP_BINS - 1)
                hist_add(&run, b, 0, hist, NULL);
        }
    }
    hist_flush(&run, hist, NULL);
    return fin;
}

/* Gathers pack(key(x), i) of every finite x with key >= kmin into cand (the first cap of
 * them; st->n_cand counts all). With rest, returns this thread's sum of exp(x - max) over the
 * finite x left out. */
static __device__ double pass_gather(const float *__restrict__ l, int32_t n, float t, float mx,
                                     uint32_t kmin, bool rest, uint64_t *cand, uint32_t cap,
                                     struct block_state *st)
{
    const int lane = threadIdx.x & 31;
    double z = 0.0;
    /* i0 is the same for the whole warp, so every lane takes part in each ballot. */
    for (int32_t i0 = threadIdx.x - lane; i0 < n; i0 += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int32_t i = i0 + u * THREADS + lane;
            v[u] = i < n ? l[i] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (i0 + u * THREADS >= n)
                break;
            const int32_t i = i0 + u * THREADS + lane;
            const float x = scaled(v[u], t);
            uint32_t k = 0;
            bool take = false;
            if (x > -INFINITY) {
                k = fkey(x);
                take = k >= kmin;
                if (!take && rest)
                    z += (double)expf(x - mx);
            }
            const unsigned want = cllm_ballot(take);
            if (want) {
                const int leader = __ffs(want) - 1;
                uint32_t slot = 0;
                if (lane == leader)
                    slot = atomicAdd(&st->n_cand, (uint32_t)__popc(want));
                slot = cllm_shfl(slot, leader) + __popc(want & ((1u << lane) - 1));
                if (take && slot < cap)
                    cand[slot] = pack(k, i);
            }
        }
    }
    return z;
}

/* One level of an MSB radix select over the finite x: sub-key key(x) (by_id false; only
 * key >= ref) or n - 1 - i (by_id; only key == ref). Counts (and fixed-point masses, if mass)
 * each digit (sub >> shift) & mask among the sub-keys whose bits above prev_shift are prefix. */
static __device__ void pass_radix(const float *__restrict__ l, int32_t n, float t, float mx,
                                  bool by_id, uint32_t ref, int prev_shift, int shift,
                                  uint32_t prefix, uint32_t *cnt, uint64_t *mass, double fix_one)
{
    const uint32_t mask = (1u << (prev_shift - shift)) - 1;
    struct hist_run run = {0, 0, 0};
    for (int32_t i0 = threadIdx.x; i0 < n; i0 += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int32_t i = i0 + u * THREADS;
            v[u] = i < n ? l[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int32_t i = i0 + u * THREADS;
            if (i >= n)
                break;
            const float x = scaled(v[u], t);
            if (!(x > -INFINITY))
                continue;
            const uint32_t k = fkey(x);
            if (by_id ? k != ref : k < ref)
                continue;
            const uint32_t sub = by_id ? (uint32_t)(n - 1 - i) : k;
            if (prev_shift < 32 && (sub >> prev_shift) != prefix)
                continue;
            hist_add(&run, (sub >> shift) & mask, mass ? fixed_weight(x, mx, fix_one) : 0, cnt,
                     mass);
        }
    }
    hist_flush(&run, cnt, mass);
}

/* ---- the exact fallback ---- */

struct selection {
    bool found;
    uint32_t key;      /* the sub-key where the running count / mass reaches the target */
    uint64_t before;   /* count / mass of the sub-keys above it */
    uint64_t eq_count; /* elements with that sub-key */
    uint64_t eq_mass;  /* their mass (with mass) */
    uint64_t target;   /* the target reached */
};

/* MSB radix select, 11 + 11 + 10 bits, largest sub-key first: the sub-key at which the
 * running count (or with mass, fixed-point mass) reaches target. With top_p >= 0 the target is
 * instead ceil(top_p * the total mass), at least 1. */
static __device__ CLLM_NOINLINE struct selection
radix_select(const float *__restrict__ l, int32_t n, float t, float mx, bool by_id, uint32_t ref,
             bool mass, uint64_t target, double top_p, double fix_one, uint64_t *region,
             struct block_state *st)
{
    uint32_t *cnt = (uint32_t *)region;                /* [2048] */
    uint64_t *mass_hist = mass ? region + 1024 : NULL; /* [2048], after cnt */
    struct selection sel = {false, 0, 0, 0, 0, target};
    uint32_t prefix = 0;
    int prev_shift = 32;
    for (int level = 0; level < 3; level++) {
        const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;
        const uint32_t bins = 1u << (prev_shift - shift);
        if (by_id && level < 2 && ((uint32_t)(n - 1) >> shift) == 0) {
            prev_shift = shift; /* every id sub-key is below 2^shift: this digit is 0 */
            continue;
        }
        for (uint32_t b = threadIdx.x; b < bins; b += THREADS) {
            cnt[b] = 0;
            if (mass_hist)
                mass_hist[b] = 0;
        }
        __syncthreads();
        pass_radix(l, n, t, mx, by_id, ref, prev_shift, shift, prefix, cnt, mass_hist, fix_one);
        __syncthreads();
        if (top_p >= 0.0) { /* the first level sees every element: its total is Z */
            uint64_t unused, z;
            find_bin(NULL, mass_hist, bins, true, UINT64_MAX, &unused, &z, st);
            double lim = ceil(top_p * (double)z);
            target = lim >= 1.0 ? (uint64_t)lim : 1;
            sel.target = target;
            top_p = -1.0;
        }
        uint64_t before, total;
        uint32_t b = find_bin(mass ? NULL : cnt, mass_hist, bins, true, target - sel.before,
                              &before, &total, st);
        if (b == NONE) /* only at the first level: the total falls short of the target */
            return sel;
        sel.before += before;
        sel.eq_count = cnt[b];
        sel.eq_mass = mass_hist ? mass_hist[b] : 0;
        prefix = prefix << (prev_shift - shift) | b;
        prev_shift = shift;
        __syncthreads(); /* cnt is cleared next */
    }
    sel.found = true;
    sel.key = prefix;
    return sel;
}

/* Smallest key whose x keeps exp(x - max) >= min_p (min_p <= 1, so the max's key qualifies). */
static __device__ uint32_t minp_key(float mx, double min_p, struct block_state *st)
{
    uint32_t k = 0;
    if (threadIdx.x == 0) {
        uint32_t lo = KEY_FINITE_MIN, hi = fkey(mx);
        /* Start near mx + log(min_p): the exact test flips within an ulp or two of it. */
        uint32_t guess = fkey((float)((double)mx + log(min_p)));
        if (guess > lo + 64 && guess + 64 < hi) {
            if (exp((double)kval(guess + 64) - (double)mx) >= min_p)
                hi = guess + 64;
            if (!(exp((double)kval(guess - 64) - (double)mx) >= min_p))
                lo = guess - 63;
        }
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (exp((double)kval(mid) - (double)mx) >= min_p)
                hi = mid;
            else
                lo = mid + 1;
        }
        k = lo;
    }
    return from_thread0(k, st);
}

struct row_rules {
    bool use_k, use_p, use_m;
    int32_t top_k;
    double top_p;
    uint32_t km; /* min-p: the smallest key it keeps */
};

/* Every rule by exact selects over the full row, then a draw pass. */
static __device__ CLLM_NOINLINE int32_t sample_exact(const float *__restrict__ l, int32_t n,
                                                     float t, float mx, const struct row_rules *r,
                                                     double u, int32_t fallback, uint64_t *region,
                                                     struct block_state *st)
{
    const int bits = 32 - __clz((unsigned)n);
    const double fix_one = ldexp(1.0, 62 - bits < 40 ? 62 - bits : 40); /* sums < 2^62 */
    uint64_t end = 0; /* the draw keeps pack(key(x), i) >= end */
    uint32_t floor_key = KEY_FINITE_MIN;
    if (r->use_k) {
        struct selection k = radix_select(l, n, t, mx, false, KEY_FINITE_MIN, false,
                                          (uint64_t)r->top_k, -1.0, fix_one, region, st);
        if (k.found) { /* else fewer finite x than k: top-k keeps them all */
            floor_key = k.key;
            end = (uint64_t)k.key << 32;
        }
    }
    if (r->use_p) {
        struct selection p =
            radix_select(l, n, t, mx, false, floor_key, true, 0, r->top_p, fix_one, region, st);
        if (p.found) {
            /* The mass reaches the target inside the run of x == kval(p.key), each of weight w:
             * the prefix keeps the m lowest ids of the run, the fewest that reach it. */
            uint64_t cut = (uint64_t)p.key << 32;
            const uint64_t w = p.eq_mass / p.eq_count;
            if (p.eq_count > 1 && w > 0) {
                uint64_t m = (p.target - p.before + w - 1) / w;
                m = m < 1 ? 1 : m;
                if (m < p.eq_count) {
                    struct selection id =
                        radix_select(l, n, t, mx, true, p.key, false, m, -1.0, fix_one, region, st);
                    cut = pack(p.key, n - 1 - (int32_t)id.key);
                }
            }
            end = cut > end ? cut : end;
        }
    }
    if (r->use_m) {
        const uint64_t cut = (uint64_t)r->km << 32;
        end = cut > end ? cut : end;
    }
    float m;
    double s;
    pass_row(l, n, t, true, end, NULL, &m, &s);
    return draw_from_sums(l, n, t, mx, end, m, s, u, fallback, st);
}

/* Smallest key whose x lies in gap bin <= bin. */
static __device__ uint32_t gap_key(float mx, uint32_t bin, struct block_state *st)
{
    uint32_t k = 0;
    if (threadIdx.x == 0) {
        uint32_t lo = KEY_FINITE_MIN, hi = fkey(mx);
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (gap_bin(kval(mid), mx) <= bin)
                hi = mid;
            else
                lo = mid + 1;
        }
        k = lo;
    }
    return from_thread0(k, st);
}

/* ---- the candidates: sorted in shared memory ---- */

/* Descending bitonic sort of c[0..n), padded with zeros (below every real entry) to a power
 * of two that fits in the region. */
static __device__ void sort_desc(uint64_t *c, uint32_t n)
{
    if (n < 2)
        return;
    uint32_t p = 2;
    while (p < n)
        p <<= 1;
    for (uint32_t i = n + threadIdx.x; i < p; i += THREADS)
        c[i] = 0;
    __syncthreads();
    for (uint32_t k = 2; k <= p; k <<= 1) {
        for (uint32_t j = k >> 1; j > 0; j >>= 1) {
            for (uint32_t i = threadIdx.x; i < p / 2; i += THREADS) {
                const uint32_t lo = (i & ~(j - 1)) << 1 | (i & (j - 1)), hi = lo | j;
                const uint64_t a = c[lo], b = c[hi];
                const bool ascending = (lo & k) != 0; /* the halves that end up reversed */
                if (ascending ? a > b : a < b) {
                    c[lo] = b;
                    c[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}

/* How many of the sorted c[0..len) have a key >= key. */
static __device__ uint32_t count_key_ge(const uint64_t *c, uint32_t len, uint32_t key,
                                        struct block_state *st)
{
    uint32_t lo = 0;
    if (threadIdx.x == 0) {
        uint32_t hi = len;
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if ((uint32_t)(c[mid] >> 32) >= key)
                lo = mid + 1;
            else
                hi = mid;
        }
    }
    return from_thread0(lo, st);
}

/* Each thread takes a contiguous chunk of c[0..len), so that sums run in the sorted order. */
static __device__ void chunk_of(uint32_t len, uint32_t *lo, uint32_t *hi)
{
    const uint32_t per = (len + THREADS - 1) / THREADS;
    *lo = threadIdx.x * per < len ? threadIdx.x * per : len;
    *hi = *lo + per < len ? *lo + per : len;
}

static __device__ double cand_sum(const uint64_t *c, uint32_t len, float mx, struct block_state *st)
{
    uint32_t lo, hi;
    chunk_of(len, &lo, &hi);
    double s = 0.0;
    for (uint32_t i = lo; i < hi; i++)
        s += cand_weight(c[i], mx);
    return block_sum_f64(s, st);
}

/* The first position of c[0..len) at which the running sum of the weights reaches thr (with
 * strict: exceeds it), or -1. */
static __device__ int32_t cand_find(const uint64_t *c, uint32_t len, float mx, double thr,
                                    bool strict, struct block_state *st)
{
    uint32_t lo, hi;
    chunk_of(len, &lo, &hi);
    double s = 0.0;
    for (uint32_t i = lo; i < hi; i++)
        s += cand_weight(c[i], mx);
    double total;
    double run = block_scan_f64(s, &total, st);
    uint32_t found = NONE;
    for (uint32_t i = lo; i < hi; i++) {
        run += cand_weight(c[i], mx);
        if (strict ? run > thr : run >= thr) {
            found = i;
            break;
        }
    }
    found = block_min_u32(found, st);
    return found == NONE ? -1 : (int32_t)found;
}

/* Top-k, top-p and min-p: bound the survivors, gather them into shared memory, sort them and
 * apply the rules exactly; sample_exact when they do not fit. */
static __device__ CLLM_NOINLINE int32_t sample_filtered(const float *__restrict__ l, int32_t n,
                                                        float t, float mx,
                                                        const struct row_rules *r, double u,
                                                        int32_t fallback, uint64_t *region,
                                                        uint32_t cap, struct block_state *st)
{
    if (!r->use_k && !r->use_p) { /* min-p alone: a threshold, no candidates needed */
        const uint64_t end = (uint64_t)r->km << 32;
        float m;
        double s;
        pass_row(l, n, t, true, end, NULL, &m, &s);
        return draw_from_sums(l, n, t, mx, end, m, s, u, fallback, st);
    }
    uint32_t bound;     /* the candidates are the finite x with key >= bound ... */
    uint64_t count;     /* ... this many */
    bool p_cut = false; /* the bound is top-p's estimate, to be confirmed */
    if (r->use_k) {
        /* pass_row counted the keys by their top bits: the bin holding the k-th largest. */
        const uint32_t *hist = (const uint32_t *)region;
        uint64_t before, total;
        uint32_t b = find_bin(hist, NULL, KEY_BINS, true, (uint64_t)r->top_k, &before, &total, st);
        bound = b == NONE ? KEY_FINITE_MIN : b << KEY_SHIFT;
        count = b == NONE ? total : before + hist[b];
    } else {
        /* Top-p: bin max - x; the weights of bin b lie in (e^-(b+1)/16, e^-b/16], so the
         * first bin whose lower-bound running mass reaches top_p times the upper bound of Z
         * holds the crossing or lies past it. */
        uint32_t *hist = (uint32_t *)region; /* [GAP_BINS] */
        uint64_t *lower = region + GAP_BINS; /* [GAP_BINS], 8 KiB in: past hist */
        for (uint32_t b = threadIdx.x; b < GAP_BINS; b += THREADS)
            hist[b] = 0;
        __syncthreads();
        uint64_t fin;
        block_scan_u64(pass_gap_hist(l, n, t, mx, hist), &fin, st);
        uint64_t binned;
        uint64_t mine = 0;
        for (uint32_t b = threadIdx.x; b < GAP_BINS - 1; b += THREADS)
            mine += hist[b];
        block_scan_u64(mine, &binned, st);
        if (threadIdx.x == 0)
            hist[GAP_BINS - 1] = (uint32_t)(fin - binned);
        __syncthreads();
        const int bits = 32 - __clz((unsigned)n);
        const double fix_one = ldexp(1.0, 62 - bits < 40 ? 62 - bits : 40);
        uint64_t upper = 0;
        for (uint32_t b = threadIdx.x; b < GAP_BINS; b += THREADS) {
            const double c = (double)hist[b];
            const double lo_w =
                b == GAP_BINS - 1 ? 0.0 : exp(-(double)(b + 1) / GAP_PER_LOGIT) * (1.0 - 1e-5);
            const double hi_w = exp(-(double)b / GAP_PER_LOGIT) * (1.0 + 1e-5);
            lower[b] = (uint64_t)(c * lo_w * fix_one);
            upper += (uint64_t)ceil(c * hi_w * fix_one);
        }
        uint64_t z_upper;
        block_scan_u64(upper, &z_upper, st);
        const uint64_t target = (uint64_t)ceil(r->top_p * (double)z_upper);
        uint64_t before, total;
        uint32_t b = find_bin(NULL, lower, GAP_BINS, false, target, &before, &total, st);
        if (b == NONE || b == GAP_BINS - 1) {
            bound = KEY_FINITE_MIN;
            count = fin;
        } else {
            bound = gap_key(mx, b, st);
            mine = 0;
            for (uint32_t q = threadIdx.x; q <= b; q += THREADS)
                mine += hist[q];
            block_scan_u64(mine, &count, st);
            p_cut = true;
        }
    }
    __syncthreads(); /* every thread has read the histogram: the region is free again */
    uint32_t kmin = bound;
    if (r->use_m && !(r->use_k && r->use_p) && r->km > kmin) {
        kmin = r->km; /* min-p cuts deeper: gather only its survivors */
        p_cut = false;
    }
    if (kmin == bound && count > cap)
        return sample_exact(l, n, t, mx, r, u, fallback, region, st);

    if (threadIdx.x == 0)
        st->n_cand = 0;
    __syncthreads();
    const bool rest = !r->use_k; /* top-p's Z runs over the vocab */
    double z_rest = pass_gather(l, n, t, mx, kmin, rest, region, cap, st);
    __syncthreads();
    const uint32_t nc = st->n_cand;
    if (nc > cap)
        return sample_exact(l, n, t, mx, r, u, fallback, region, st);
    z_rest = rest ? block_sum_f64(z_rest, st) : 0.0;
    sort_desc(region, nc);

    uint32_t len = nc;
    if (r->use_k && (uint32_t)r->top_k <= nc)
        len = count_key_ge(region, nc, (uint32_t)(region[r->top_k - 1] >> 32), st);
    if (r->use_p) {
        const double z = cand_sum(region, len, mx, st) + z_rest;
        const int32_t pos = cand_find(region, len, mx, r->top_p * z, false, st);
        if (pos >= 0)
            len = (uint32_t)pos + 1;
        else if (p_cut) /* rounding hid the crossing from the bound: do it exactly */
            return sample_exact(l, n, t, mx, r, u, fallback, region, st);
    }
    if (r->use_m) {
        const uint32_t kept = count_key_ge(region, len, r->km, st);
        len = kept ? kept : 1;
    }
    const double total = cand_sum(region, len, mx, st);
    int32_t pos = cand_find(region, len, mx, u * total, true, st);
    if (pos < 0) { /* u * total fell past the rounded sum: the last candidate with weight */
        pos = (int32_t)len - 1;
        while (pos > 0 && !(cand_weight(region[pos], mx) > 0.0))
            pos--;
    }
    return unpack_id(region[pos]);
}

/* ---- the kernel ---- */

static __device__ int32_t row_token(const float *__restrict__ l, int32_t n,
                                    const struct cllm_sample_row *p, uint64_t *region, uint32_t cap,
                                    struct block_state *st)
{
    const bool greedy = !(p->temperature > 0.0f);
    const float t = greedy ? 1.0f : p->temperature;
    struct row_rules r;
    r.use_k = !greedy && p->top_k > 0 && p->top_k < n;
    r.use_p = !greedy && p->top_p < 1.0f;
    r.use_m = !greedy && p->min_p > 0.0f;
    r.top_k = p->top_k;
    r.top_p = (double)p->top_p;
    r.km = 0;
    const bool dense = !greedy && !r.use_k && !r.use_p && !r.use_m;

    uint32_t *key_hist = r.use_k ? (uint32_t *)region : NULL;
    if (key_hist) {
        for (uint32_t b = threadIdx.x; b < KEY_BINS; b += THREADS)
            key_hist[b] = 0;
        __syncthreads();
    }
    float m;
    double s;
    const uint64_t best = block_max_u64(pass_row(l, n, t, dense, 0, key_hist, &m, &s), st);
    const int32_t best_id = unpack_id(best);
    if (greedy)
        return best_id;
    /* As the host: no finite maximum of x (no finite raw maximum, +inf, or an overflowing
     * division) leaves the raw argmax, or token 0 when every logit is -inf or NaN. */
    const uint32_t best_key = (uint32_t)(best >> 32);
    if (best_key <= KEY_NEG_INF)
        return 0;
    const float mx = __fdiv_rn(kval(best_key), t);
    if (!isfinite(mx))
        return best_id;
    const double u = uniform(p->seed, p->counter);
    if (dense)
        return draw_from_sums(l, n, t, mx, 0, m, s, u, best_id, st);
    if (r.use_m)
        r.km = minp_key(mx, p->min_p < 1.0f ? (double)p->min_p : 1.0, st);
    return sample_filtered(l, n, t, mx, &r, u, best_id, region, cap, st);
}

static __global__ void __launch_bounds__(THREADS, 1)
    sample_kernel(const float *__restrict__ logits, int32_t n,
                  const struct cllm_sample_row *__restrict__ rows, int32_t *__restrict__ tokens,
                  uint32_t cap)
{
    extern __shared__ uint64_t region[]; /* [cap] candidates, or a histogram */
    __shared__ struct block_state st;
    const struct cllm_sample_row p = rows[blockIdx.x];
    const int32_t token =
        row_token(logits + (size_t)blockIdx.x * (size_t)n, n, &p, region, cap, &st);
    if (threadIdx.x == 0)
        tokens[blockIdx.x] = token;
}
extern "C" size_t cllm_cuda_sample_scratch_bytes(int32_t n, int32_t n_vocab)
{
    (void)n;
    (void)n_vocab;
    return 0;
}

extern "C" cudaError_t cllm_cuda_sample(const float *logits, int32_t n, int32_t n_vocab,
                                        const struct cllm_sample_row *rows_dev, int32_t *tokens_dev,
                                        void *scratch, size_t scratch_bytes, cudaStream_t stream)
{
    (void)scratch;
    (void)scratch_bytes;
    if (n < 0 || n_vocab <= 0 || n_vocab > CLLM_CUDA_SAMPLE_MAX_VOCAB)
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    /* As many candidates as the device's shared memory per block holds (16384 on Hopper and
     * A100, 8192 on consumer Ampere and Ada); the block state needs well under 2 KiB. A
     * runtime that cannot say (a vendor's port may not know the attribute) gets the 48 KiB
     * every device gives a block without asking: CAND_MIN candidates. */
    int device = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess || optin < DEFAULT_SMEM) {
        (void)cudaGetLastError(); /* not an error of the draw */
        optin = DEFAULT_SMEM;
    }
    uint32_t cap = CAND_MAX;
    while (cap > CAND_MIN && (size_t)cap * 8 + 2048 > (size_t)optin)
        cap >>= 1;
    const size_t smem = (size_t)cap * 8;
    if (smem + 2048 > DEFAULT_SMEM) {
        e = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem);
        if (e != cudaSuccess)
            return e;
    }
    sample_kernel<<<(unsigned)n, THREADS, smem, stream>>>(logits, n_vocab, rows_dev, tokens_dev,
                                                          cap);
    return cudaGetLastError();
}
