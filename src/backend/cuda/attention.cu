/*
 * Paged causal attention over a BF16 KV cache, for prefill and decode alike.
 *
 * The formula (both kernels below compute it for each query row = one token's one head):
 *   - the row's keys 0..pos are cut into splits whose length depends only on pos
 *     (split_len_for), and each split into tiles of TILE keys at fixed absolute positions;
 *   - within a split, an online softmax folds tile after tile into (max, sum, accumulator);
 *   - a combine kernel merges the splits in order.
 * Nothing in it depends on the other rows of the step, so a sequence gets the same bits
 * whether it runs alone or with 255 others, and a prompt token the same bits whether its
 * chunk holds 1 token or 512 (batch invariance).
 *
 * attention_mma (tensor cores, the default where mma.sync exists): one block per query tile
 * x KV head x split. A query tile is up to 64 / group consecutive tokens of one sequence, and
 * its rows are (token, query head of the group): a prefill chunk shares each K/V tile across
 * all its tokens and heads; a decode token still shares it across its group. Q K^T and P V
 * are m16n8k16 MMAs (BF16 in, F32 accumulate); K/V tiles come in through cp.async, double
 * buffered. Q and the softmax weights P enter the MMAs as BF16, as in FlashAttention 2.
 *
 * attention_simt (CUDA cores; vendors without MMA, and CLLM_ATTN_SIMT=1 for comparison): one
 * block per (token, KV head, split), a warp per query head, lane j scoring key j of a tile,
 * Q and P in F32. Same splits and tiles, different rounding: a process uses one or the other.
 */
#include "backend/cuda/vendor.h"

#include "backend/cuda/kernels.h"
#include "backend/cuda/warp.h"

#define TILE 32       /* keys per tile */
#define MAX_GROUP 16  /* attention_simt: query heads per KV head (warps per block) */
#define MAX_SPLITS 16 /* blocks one (token, head) is split over at most */
/* Keys per split at least. 64 rather than the 256 of before session 22: a decode token at 320
 * keys took 28.6 us on an H200 with two 256-key splits, each walked 32 keys at a time by one
 * block (most of a batch-1 layer's 77 us); with 64 it is five splits of two tiles. Longer
 * rows still split 16 ways. */
#define SPLIT_MIN 64

#define MMA_WARPS 4               /* attention_mma: 16 query rows per warp */
#define MMA_ROWS (16 * MMA_WARPS) /* query rows per block */
#define MMA_MAX_GROUP MMA_ROWS    /* a tile holds at least one token's heads */
#define KV_PAD                                                                                     \
    8 /* BF16 after each shared K/V row: a row stride of 4 (mod 32) words puts the                 \
       * fragment reads of a warp on 32 different banks, rows stay 16-byte aligned */

/* Keys per split for a token that attends to len keys: a function of len alone. */
static __host__ __device__ int32_t split_len_for(int32_t len)
{
    int32_t per = (len + MAX_SPLITS - 1) / MAX_SPLITS;
    per = (per + TILE - 1) / TILE * TILE;
    return per < SPLIT_MIN ? SPLIT_MIN : per;
}

static __host__ __device__ int32_t n_splits_for(int32_t len)
{
    const int32_t sl = split_len_for(len);
    return (len + sl - 1) / sl;
}

/* The scratch of split rows: one record per token t, at a place that does not depend on how
 * many tokens the step has -- so attention_mma's counts, zero-filled once, are never written
 * over by another step's partial results. A record holds, per query head and split, the F32
 * accumulator [hd] and (max, sum); then one count per KV head (n_head slots, n_kv used). */
struct split_scratch {
    float *base;
    int32_t n_head, hd;
};

static __host__ __device__ int64_t record_floats(int32_t n_head, int32_t hd)
{
    return (int64_t)n_head * (MAX_SPLITS * ((int64_t)hd + 2) + 1);
}

static __device__ __forceinline__ float *part_acc(const split_scratch &sc, int32_t t, int32_t h,
                                                  int32_t s)
{
    return sc.base + t * record_floats(sc.n_head, sc.hd) + ((int64_t)h * MAX_SPLITS + s) * sc.hd;
}

static __device__ __forceinline__ float *part_ml(const split_scratch &sc, int32_t t, int32_t h,
                                                 int32_t s)
{
    return sc.base + t * record_floats(sc.n_head, sc.hd) + (int64_t)sc.n_head * MAX_SPLITS * sc.hd +
           ((int64_t)h * MAX_SPLITS + s) * 2;
}

static __device__ __forceinline__ int32_t *split_count(const split_scratch &sc, int32_t t,
                                                       int32_t kvh)
{
    return (int32_t *)(sc.base + t * record_floats(sc.n_head, sc.hd) +
                       (int64_t)sc.n_head * MAX_SPLITS * (sc.hd + 2)) +
           kvh;
}

/* Max and sum over each group of WIDTH lanes (an xor butterfly): all lanes of a group get the
 * same bits. WIDTH 32: a warp (attention_simt's keys); 4: a quad (the lanes of one MMA row). */
template <int WIDTH> static __device__ __forceinline__ float group_max(float v)
{
    for (int o = WIDTH / 2; o > 0; o >>= 1)
        v = fmaxf(v, cllm_shfl_xor(v, o));
    return v;
}

template <int WIDTH> static __device__ __forceinline__ float group_sum(float v)
{
    for (int o = WIDTH / 2; o > 0; o >>= 1)
        v += cllm_shfl_xor(v, o);
    return v;
}

/* The CUDA-core kernel; D = head_dim / 32 dimensions per lane. */
template <int D>
static __global__ void __launch_bounds__(32 * MAX_GROUP)
    attention_simt(struct cllm_cuda_batch b, const float *q, int32_t ldq,
                   const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache, int32_t n_head,
                   int32_t n_kv, float scale, __nv_bfloat16 *out, split_scratch sc)
{
    cllm_pdl_wait();
    constexpr int HD = 32 * D;
    /* K rows padded by one 4-byte word: lane j reads row j, and an odd row stride in words
     * puts the 32 lanes on 32 different banks. */
    __shared__ __align__(16) __nv_bfloat16 ks[TILE][HD + 2];
    __shared__ __align__(16) __nv_bfloat16 vs[TILE][HD];
    __shared__ __align__(16) float qs[MAX_GROUP][HD];

    const int32_t t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t group = n_head / n_kv, h = kvh * group + warp;
    const int32_t len = b.pos[t] + 1, split_len = split_len_for(len);
    const int32_t n_splits = n_splits_for(len);
    if (split >= n_splits)
        return; /* the whole block: no barrier has been reached yet */
    const int32_t start = split * split_len;
    const int32_t end = min(len, start + split_len);

    const float *qrow = q + (int64_t)t * ldq + (int64_t)h * HD;
    for (int d = lane; d < HD; d += 32)
        qs[warp][d] = qrow[d];

    const int32_t *table = b.block_table + (int64_t)b.seq[t] * b.max_blocks;
    const int64_t kv_stride = (int64_t)n_kv * HD; /* elements between consecutive slots */
    float m = -INFINITY, l = 0.0f, acc[D];
#pragma unroll
    for (int i = 0; i < D; i++)
        acc[i] = 0.0f;

    for (int32_t p0 = start; p0 < end; p0 += TILE) {
        __syncthreads();               /* the previous tile is consumed (and qs is visible) */
        constexpr int CHUNKS = HD / 8; /* 16-byte chunks per row */
        for (int c = threadIdx.x; c < TILE * CHUNKS; c += blockDim.x) {
            int j = c / CHUNKS, e = (c % CHUNKS) * 8;
            int32_t p = p0 + j;
            uint4 kk = make_uint4(0, 0, 0, 0), vv = kk;
            if (p < end) {
                int64_t slot = (int64_t)table[p / b.block_size] * b.block_size + p % b.block_size;
                int64_t at = slot * kv_stride + (int64_t)kvh * HD + e;
                kk = *(const uint4 *)(k_cache + at);
                vv = *(const uint4 *)(v_cache + at);
            }
            *(uint4 *)&vs[j][e] = vv;
            uint32_t *kd = (uint32_t *)&ks[j][e]; /* padded rows are only 4-byte aligned */
            kd[0] = kk.x, kd[1] = kk.y, kd[2] = kk.z, kd[3] = kk.w;
        }
        __syncthreads();

        float score = -INFINITY;
        if (p0 + lane < end) {
            const __nv_bfloat162 *kr = (const __nv_bfloat162 *)&ks[lane][0];
            const float2 *qv = (const float2 *)&qs[warp][0];
            float dot = 0.0f;
#pragma unroll 8
            for (int d2 = 0; d2 < HD / 2; d2++) {
                float2 kf = __bfloat1622float2(kr[d2]);
                float2 qf = qv[d2];
                dot = fmaf(qf.x, kf.x, dot);
                dot = fmaf(qf.y, kf.y, dot);
            }
            score = dot * scale;
        }
        float m_new = fmaxf(m, group_max<32>(score)); /* finite: key p0 is always valid */
        float corr = expf(m - m_new);
        float w = p0 + lane < end ? expf(score - m_new) : 0.0f;
        l = l * corr + group_sum<32>(w);
#pragma unroll
        for (int i = 0; i < D; i++)
            acc[i] *= corr;
        int32_t n_keys = min(TILE, end - p0);
        for (int j = 0; j < n_keys; j++) {
            float wj = cllm_shfl(w, j);
            const __nv_bfloat16 *vr = &vs[j][lane * D];
#pragma unroll
            for (int i = 0; i < D; i++)
                acc[i] = fmaf(wj, __bfloat162float(vr[i]), acc[i]);
        }
        m = m_new;
    }

    int64_t th = (int64_t)t * n_head + h;
    if (n_splits == 1) {
        float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < D; i++)
            out[th * HD + lane * D + i] = __float2bfloat16_rn(acc[i] * inv);
        return;
    }
    float *pa = part_acc(sc, t, h, split);
#pragma unroll
    for (int i = 0; i < D; i++)
        pa[lane * D + i] = acc[i];
    if (lane == 0) {
        part_ml(sc, t, h, split)[0] = m;
        part_ml(sc, t, h, split)[1] = l;
    }
}

/* Merging a row's n_splits partial results, in split order, in two stages -- the one formula
 * both the combine kernel and attention_mma's last block use. Stage one, once per row: the
 * splits' weights w_s = 2^(m_s - max) (BASE2: the maxima are in log2 units, attention_mma) or
 * e^(m_s - max) into w, and the denominator sum_s w_s l_s, returned. The loops run over
 * MAX_SPLITS so that their loads are all in flight together (a loop over n_splits waited for
 * each load in turn: at 16 splits, 32 round trips to L2 per row). */
template <bool BASE2>
static __device__ __forceinline__ float split_weights(const split_scratch &sc, int32_t t, int32_t h,
                                                      int32_t n_splits, float *w)
{
    float m[MAX_SPLITS], l[MAX_SPLITS], mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        if (s < n_splits) {
            const float *ml = part_ml(sc, t, h, s);
            m[s] = cllm_load_fresh(&ml[0]);
            l[s] = cllm_load_fresh(&ml[1]);
        }
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        if (s < n_splits)
            mx = fmaxf(mx, m[s]);
    float den = 0.0f;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        if (s < n_splits) {
            w[s] = BASE2 ? exp2f(m[s] - mx) : expf(m[s] - mx);
            den = fmaf(w[s], l[s], den);
        }
    return den;
}

/* Stage two, once per dimension d of the row: sum_s w_s acc_s[d] in split order, over den. */
static __device__ __forceinline__ __nv_bfloat16 merged_dim(const split_scratch &sc, int32_t t,
                                                           int32_t h, int32_t n_splits,
                                                           const float *w, float den, int32_t d)
{
    float num = 0.0f;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        if (s < n_splits)
            num = fmaf(w[s], cllm_load_fresh(part_acc(sc, t, h, s) + d), num);
    return __float2bfloat16_rn(num / den);
}

/* One block per (token, head), one thread per dimension: merges the token's splits in order
 * (after attention_simt; attention_mma merges in its last block instead). */
static __global__ void combine_kernel(struct cllm_cuda_batch b, int32_t n_head, int32_t hd,
                                      split_scratch sc, __nv_bfloat16 *out)
{
    cllm_pdl_wait();
    const int32_t t = blockIdx.x, h = blockIdx.y;
    const int32_t n_splits = n_splits_for(b.pos[t] + 1);
    if (n_splits == 1)
        return; /* written by the attention kernel */
    __shared__ float w[MAX_SPLITS], den;
    if (threadIdx.x == 0)
        den = split_weights<false>(sc, t, h, n_splits, w);
    __syncthreads();
    const int64_t th = (int64_t)t * n_head + h;
    for (int32_t d = threadIdx.x; d < hd; d += blockDim.x)
        out[th * hd + d] = merged_dim(sc, t, h, n_splits, w, den, d);
}

#ifdef CLLM_HAVE_MMA

/* Does token t start a query tile? Tiles are runs of consecutive tokens of one sequence at
 * consecutive positions, cut where pos is a multiple of tile_tokens. */
static __device__ bool leads_tile(const struct cllm_cuda_batch &b, int32_t t, int32_t tile_tokens)
{
    return t == 0 || b.seq[t - 1] != b.seq[t] || b.pos[t - 1] + 1 != b.pos[t] ||
           b.pos[t] % tile_tokens == 0;
}

/* Keys [*lo, *hi) that query row with position pos reads in split `split` (empty: lo >= hi). */
static __device__ void split_range(int32_t pos, int32_t split, int32_t *lo, int32_t *hi)
{
    const int32_t len = pos + 1, sl = split_len_for(len);
    *lo = split * sl;
    *hi = min(len, *lo + sl);
}

static __device__ __forceinline__ unsigned pack_bf16(float lo, float hi)
{
    return cllm_cuda_pack_bf16x2(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}

/* One query row of a lane: which token and head, its keys in this split, its softmax state. */
struct mma_row {
    int32_t t, h;   /* token index in the step, query head; t < 0 for a padding row */
    int32_t lo, hi; /* keys this split reads for the row */
    float m, l;     /* running max (base 2) and sum of the weights */
};

/* The tensor-core kernel; HD = head_dim. Lane (g = lane / 4, q = lane % 4) of warp w holds the
 * MMA rows g and g + 8 of the warp's 16 rows (block rows 16 w + g, 16 w + g + 8). */
template <int HD>
static __global__ void __launch_bounds__(MMA_WARPS * 32)
    attention_mma(struct cllm_cuda_batch b, const float *q, int32_t ldq,
                  const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache, int32_t n_head,
                  int32_t n_kv, float scale_log2, __nv_bfloat16 *out, split_scratch sc)
{
    cllm_pdl_wait();
    constexpr int KC = HD / 16;  /* MMA k-steps of Q K^T */
    constexpr int ND = HD / 8;   /* MMA n-tiles of the output */
    constexpr int NK = TILE / 8; /* MMA n-tiles of the scores */
    constexpr int ROW = HD + KV_PAD;
    constexpr int CHUNKS = HD / 8; /* 16-byte chunks per K/V row */
    __shared__ __align__(16) __nv_bfloat16 ks[2][TILE][ROW];
    __shared__ __align__(16) __nv_bfloat16 vs[2][TILE][ROW];

    const int32_t t0 = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int32_t group = n_head / n_kv, tile_tokens = MMA_ROWS / group;
    if (!leads_tile(b, t0, tile_tokens))
        return; /* the whole block: its token belongs to an earlier token's tile */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
    /* The tile's length: lane x looks at the tokens 1 + x and 33 + x after t0 (tile_tokens
     * <= 64), and the first that does not continue the tile ends it. Every warp alike. */
    const int32_t c0 = 1 + lane, c1 = 33 + lane;
    const unsigned end0 = cllm_ballot(c0 >= tile_tokens || t0 + c0 >= b.n_tokens ||
                                      leads_tile(b, t0 + c0, tile_tokens));
    const unsigned end1 = cllm_ballot(c1 >= tile_tokens || t0 + c1 >= b.n_tokens ||
                                      leads_tile(b, t0 + c1, tile_tokens));
    const int32_t count = end0 ? __ffs(end0) : 32 + __ffs(end1);
    /* Keys the block loads: the union of its rows' ranges (each row masks the rest); and
     * the most splits a row of the tile has (blocks split < that one have keys to read). */
    int32_t lo = 0x7fffffff, hi = 0, tile_splits = 1;
    for (int32_t i = lane; i < count; i += 32) {
        int32_t rlo, rhi;
        split_range(b.pos[t0 + i], split, &rlo, &rhi);
        if (rlo < rhi)
            lo = min(lo, rlo), hi = max(hi, rhi);
        tile_splits = max(tile_splits, n_splits_for(b.pos[t0 + i] + 1));
    }
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, cllm_shfl_xor(lo, o));
        hi = max(hi, cllm_shfl_xor(hi, o));
        tile_splits = max(tile_splits, cllm_shfl_xor(tile_splits, o));
    }
    if (lo >= hi)
        return; /* no row has keys in this split; no barrier has been reached yet */

    const int32_t *table = b.block_table + (int64_t)b.seq[t0] * b.max_blocks;
    const int64_t kv_stride = (int64_t)n_kv * HD; /* elements between consecutive slots */
    const int32_t n_tiles = (hi - lo + TILE - 1) / TILE;
    /* Queues tile i's keys into buffer buf; keys past hi become zeros (always masked). */
    auto load_tile = [&](int32_t i, int buf) {
        for (int c = threadIdx.x; c < TILE * CHUNKS; c += MMA_WARPS * 32) {
            const int j = c / CHUNKS, e = (c % CHUNKS) * 8;
            const int32_t p = lo + i * TILE + j;
            if (p < hi) {
                int64_t slot = (int64_t)table[p / b.block_size] * b.block_size + p % b.block_size;
                int64_t at = slot * kv_stride + (int64_t)kvh * HD + e;
                cllm_cp_async16(&ks[buf][j][e], k_cache + at);
                cllm_cp_async16(&vs[buf][j][e], v_cache + at);
            } else {
                *(uint4 *)&ks[buf][j][e] = make_uint4(0, 0, 0, 0);
                *(uint4 *)&vs[buf][j][e] = make_uint4(0, 0, 0, 0);
            }
        }
        cllm_cp_async_commit();
    };
    /* The first two tiles are requested before Q is read: a decode block walks one or two
     * tiles, so the memory round trips overlap rather than follow each other. Then tile i + 2
     * goes into tile i's buffer once that is consumed; one commit group per tile (empty past
     * the last), so "tile i has landed" is always "at most one group pending". */
    load_tile(0, 0);
    if (n_tiles > 1)
        load_tile(1, 1);
    else
        cllm_cp_async_commit();

    const bool warp_has_rows = 16 * warp / group < count; /* warp-uniform */
    struct mma_row row[2];
    unsigned qa[KC][4]; /* Q as MMA A fragments, BF16 */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int32_t r = 16 * warp + g + 8 * i, tt = r / group;
        row[i].t = tt < count ? t0 + tt : -1;
        row[i].h = kvh * group + r % group;
        row[i].lo = row[i].hi = 0;
        if (row[i].t >= 0)
            split_range(b.pos[row[i].t], split, &row[i].lo, &row[i].hi);
        row[i].m = -INFINITY;
        row[i].l = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; kc++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const struct mma_row &rw = row[j & 1];
            const int32_t d = 16 * kc + 2 * qd + 8 * (j >> 1);
            qa[kc][j] = 0u;
            if (rw.t >= 0) {
                const float *src = q + (int64_t)rw.t * ldq + (int64_t)rw.h * HD + d;
                qa[kc][j] = pack_bf16(src[0], src[1]);
            }
        }
    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    for (int32_t i = 0; i < n_tiles; i++) {
        const int buf = i & 1;
        cllm_cp_async_wait<1>(); /* this thread's copies of tile i have landed... */
        __syncthreads();         /* ... everyone's have */
        if (warp_has_rows) {
            const int32_t p0 = lo + i * TILE;
            /* scores s = Q K^T for the warp's 16 rows x TILE keys */
            float s[NK][4];
#pragma unroll
            for (int j = 0; j < NK; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
                const __nv_bfloat16 *kr = &ks[buf][8 * j + g][2 * qd];
#pragma unroll
                for (int kc = 0; kc < KC; kc++) {
                    const unsigned kb[2] = {*(const unsigned *)(kr + 16 * kc),
                                            *(const unsigned *)(kr + 16 * kc + 8)};
                    cllm_mma_bf16_16816(s[j], qa[kc], kb);
                }
            }
            /* online softmax, base 2: element e of s[j] is row (e >> 1), key 8 j + 2 q + (e & 1) */
            float corr[2];
#pragma unroll
            for (int i2 = 0; i2 < 2; i2++) {
                struct mma_row &rw = row[i2];
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < NK; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int32_t p = p0 + 8 * j + 2 * qd + e;
                        float x = s[j][2 * i2 + e] * scale_log2;
                        x = p >= rw.lo && p < rw.hi ? x : -INFINITY;
                        s[j][2 * i2 + e] = x;
                        mx = fmaxf(mx, x);
                    }
                const float m_new = fmaxf(rw.m, group_max<4>(mx));
                /* a row with no key yet keeps its state exactly (-inf - -inf would be NaN) */
                corr[i2] = m_new == -INFINITY ? 1.0f : exp2f(rw.m - m_new);
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < NK; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float x = s[j][2 * i2 + e];
                        /* the weight as the P V MMA will see it: rounded to BF16 */
                        const float w =
                            x == -INFINITY
                                ? 0.0f
                                : __bfloat162float(__float2bfloat16_rn(exp2f(x - m_new)));
                        s[j][2 * i2 + e] = w;
                        sum += w;
                    }
                rw.l = rw.l * corr[i2] + group_sum<4>(sum);
                rw.m = m_new;
            }
#pragma unroll
            for (int n = 0; n < ND; n++) {
                acc[n][0] *= corr[0], acc[n][1] *= corr[0];
                acc[n][2] *= corr[1], acc[n][3] *= corr[1];
            }
            /* acc += P V: the score tiles 2 kk and 2 kk + 1 are the A fragment of keys 16 kk.. */
#pragma unroll
            for (int kk = 0; kk < TILE / 16; kk++) {
                const unsigned pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                                        pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                        pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                const int key = 16 * kk + 2 * qd;
#pragma unroll
                for (int n = 0; n < ND; n++) {
                    const int d = 8 * n + g;
                    const unsigned vb[2] = {
                        cllm_cuda_pack_bf16x2(vs[buf][key][d], vs[buf][key + 1][d]),
                        cllm_cuda_pack_bf16x2(vs[buf][key + 8][d], vs[buf][key + 9][d])};
                    cllm_mma_bf16_16816(acc[n], pa, vb);
                }
            }
        }
        __syncthreads(); /* buffer buf is free for tile i + 2 */
        if (i + 2 < n_tiles)
            load_tile(i + 2, buf);
        else
            cllm_cp_async_commit();
    }
    cllm_cp_async_wait<0>();

    /* acc[n][2 i + c] is row i's dimension 8 n + 2 q + c */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const struct mma_row &rw = row[i];
        if (rw.t < 0 || rw.lo >= rw.hi)
            continue;
        const int64_t th = (int64_t)rw.t * n_head + rw.h;
        if (n_splits_for(b.pos[rw.t] + 1) == 1) { /* the row's only split: the answer itself */
            const float inv = 1.0f / rw.l;
#pragma unroll
            for (int n = 0; n < ND; n++) {
                __nv_bfloat162 o;
                o.x = __float2bfloat16_rn(acc[n][2 * i] * inv);
                o.y = __float2bfloat16_rn(acc[n][2 * i + 1] * inv);
                *(__nv_bfloat162 *)&out[th * HD + 8 * n + 2 * qd] = o;
            }
            continue;
        }
        float *pa = part_acc(sc, rw.t, rw.h, split);
#pragma unroll
        for (int n = 0; n < ND; n++)
            pa[8 * n + 2 * qd] = acc[n][2 * i], pa[8 * n + 2 * qd + 1] = acc[n][2 * i + 1];
        if (qd == 0) {
            part_ml(sc, rw.t, rw.h, split)[0] = rw.m;
            part_ml(sc, rw.t, rw.h, split)[1] = rw.l;
        }
    }
    if (tile_splits == 1)
        return;

    /* The last of the tile's tile_splits blocks to finish merges the split rows, in split
     * order (split_weights, merged_dim: the same bits whichever block it is), which saves the
     * combine kernel's launch. */
    __shared__ bool last;
    if (!cllm_cuda_last_block(split_count(sc, t0, kvh), tile_splits, &last))
        return;
    /* Each row's weights once (a thread a row), then every (row, dimension) of the tile spread
     * over the block: the merge was a thread per dimension walking the rows, all 64 of a
     * prefill tile one after the other. */
    __shared__ float wts[MMA_ROWS][MAX_SPLITS], dens[MMA_ROWS];
    const int32_t rows = count * group;
    for (int32_t r = threadIdx.x; r < rows; r += MMA_WARPS * 32) {
        const int32_t t = t0 + r / group, n_splits = n_splits_for(b.pos[t] + 1);
        if (n_splits > 1)
            dens[r] = split_weights<true>(sc, t, kvh * group + r % group, n_splits, wts[r]);
    }
    __syncthreads();
#pragma unroll 4
    for (int32_t i = threadIdx.x; i < rows * HD; i += MMA_WARPS * 32) {
        const int32_t r = i / HD, d = i % HD;
        const int32_t t = t0 + r / group, n_splits = n_splits_for(b.pos[t] + 1);
        if (n_splits == 1)
            continue;
        const int32_t h = kvh * group + r % group;
        out[((int64_t)t * n_head + h) * HD + d] =
            merged_dim(sc, t, h, n_splits, wts[r], dens[r], d);
    }
}

#endif /* CLLM_HAVE_MMA */

/* split_scratch's records; the counts in them must be zero before the first launch and are
 * left zero. */
size_t cllm_cuda_attention_scratch(int32_t n_tokens, int32_t n_head, int32_t head_dim)
{
    return (size_t)n_tokens * (size_t)record_floats(n_head, head_dim) * sizeof(float);
}

int cllm_cuda_attention_supported(int32_t n_head, int32_t n_kv, int32_t head_dim, bool simt)
{
#ifndef CLLM_HAVE_MMA
    simt = true;
#endif
    return n_kv > 0 && n_head % n_kv == 0 && n_head / n_kv <= (simt ? MAX_GROUP : MMA_MAX_GROUP) &&
           (head_dim == 64 || head_dim == 128);
}

cudaError_t cllm_cuda_attention(const struct cllm_cuda_batch *b, const float *q, int32_t ldq,
                                const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                                int32_t n_head, int32_t n_kv, int32_t head_dim, float scale,
                                bool simt, void *scratch, __nv_bfloat16 *out, cudaStream_t stream)
{
#ifndef CLLM_HAVE_MMA
    simt = true;
#endif
    if (b->n_tokens <= 0)
        return cudaSuccess;
    if (!cllm_cuda_attention_supported(n_head, n_kv, head_dim, simt) || b->max_len < 1)
        return cudaErrorInvalidValue;
    int32_t splits = (b->max_len + SPLIT_MIN - 1) / SPLIT_MIN;
    splits = splits < MAX_SPLITS ? splits : MAX_SPLITS;
    const split_scratch sc = {(float *)scratch, n_head, head_dim};
    dim3 grid((unsigned)b->n_tokens, (unsigned)n_kv, (unsigned)splits);
    cudaError_t e = cudaSuccess;
    if (simt) {
        unsigned threads = 32u * (unsigned)(n_head / n_kv);
        if (head_dim == 64)
            e = cllm_launch(attention_simt<2>, grid, threads, 0, stream, *b, q, ldq, k_cache,
                            v_cache, n_head, n_kv, scale, out, sc);
        else
            e = cllm_launch(attention_simt<4>, grid, threads, 0, stream, *b, q, ldq, k_cache,
                            v_cache, n_head, n_kv, scale, out, sc);
    } else {
#ifdef CLLM_HAVE_MMA
        const float scale_log2 = scale * 1.44269504088896341f; /* exp(x) = exp2(x log2 e) */
        if (head_dim == 64)
            e = cllm_launch(attention_mma<64>, grid, MMA_WARPS * 32, 0, stream, *b, q, ldq, k_cache,
                            v_cache, n_head, n_kv, scale_log2, out, sc);
        else
            e = cllm_launch(attention_mma<128>, grid, MMA_WARPS * 32, 0, stream, *b, q, ldq,
                            k_cache, v_cache, n_head, n_kv, scale_log2, out, sc);
#endif
    }
    if (e == cudaSuccess)
        e = cudaGetLastError();
    if (e != cudaSuccess || splits == 1 || !simt)
        return e; /* attention_mma merges its splits itself */
    return cllm_launch(combine_kernel, dim3((unsigned)b->n_tokens, (unsigned)n_head),
                       (unsigned)head_dim, 0, stream, *b, n_head, head_dim, sc, out);
}
