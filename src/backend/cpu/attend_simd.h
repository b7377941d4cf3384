/*
 * Attention and SiLU kernels written once for attend_avx2.c (8 lanes) and attend_avx512f.c
 * (16), which include this after defining INLINE, UNROLL, the vector type VF of VW floats and
 *   vf_load vf_store vf_set1 vf_zero vf_add vf_sub vf_mul vf_div vf_fma(a, b, c) = a * b + c
 *   vf_max(a, b), vf_min(a, b)        (b where either is NaN, as maxps/minps)
 *   vf_round(x)                       to the nearest integer, ties to even
 *   vf_ldexp(p, n)                    p * 2^n for integral n in [-126, 128]
 *   vf_zero_where_lt(v, x, lim)       v, with 0 in the lanes where x < lim
 *   vf_hsum(v), vf_hmax(v)            a vector's sum and maximum, in a fixed order
 *   vf_sum4(a[4], out)                out[i] = the sum of a[i]'s lanes, in a fixed order
 * and then define ATTEND_FN and SILU_FN as the names of the two functions to emit.
 *
 * Why not the portable kernel (attend_ref.c): it scores one query head against one key at a
 * time, a chain of dependent FMAs as long as the head, and adds each weighted V row into the
 * output in memory; at a few hundred positions that was 11% of a batched step's time
 * (perf, the BF16 1.5B on 2 Zen 4 cores). Here two query heads meet four keys at once (eight
 * independent sums, each key row loaded once for both heads), the softmax's exponentials run
 * in vectors, and the weighted V rows of a block accumulate in registers, up to eight heads a
 * pass, written once per block; an item of several KV heads scores and weighs each block for
 * all of them while its rows are in cache. Every output's arithmetic is fixed by its own
 * token's data and head.
 */
#ifndef CLLM_BACKEND_CPU_ATTEND_SIMD_H
#define CLLM_BACKEND_CPU_ATTEND_SIMD_H

#include <math.h>

#include "backend/cpu/attend.h"

/* Positions scored before each softmax rescale: whole vectors, whole groups of four keys. */
#define POS_BLOCK 32
_Static_assert(POS_BLOCK % VW == 0 && POS_BLOCK % 4 == 0, "a block is whole vectors");

/*
 * e^x in float: Cody-Waite reduction x = n ln2 + r (|r| <= ln2 / 2), e^r by Cephes' expf
 * polynomial (about 1 ulp), scaled by 2^n. Results below e^-87.5 (~1e-38, where floats turn
 * subnormal) are 0, so a lane of -inf gives 0; above e^88.72 +inf; NaN stays NaN.
 */
INLINE VF vf_exp(VF x)
{
    const VF xc = vf_min(vf_set1(88.8f), vf_max(vf_set1(-87.5f), x));
    const VF n = vf_round(vf_mul(xc, vf_set1(1.44269504088896341f)));
    VF r = vf_fma(n, vf_set1(-0.693359375f), xc);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    VF p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_zero_where_lt(vf_ldexp(p, n), x, -87.5f);
}

INLINE VF silu_mul_vec(VF g, VF u)
{
    const VF e = vf_exp(vf_sub(vf_zero(), g));
    return vf_mul(vf_div(g, vf_add(vf_set1(1.0f), e)), u);
}

void SILU_FN(const float *gate, const float *up, int64_t n, float *out)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW)
        vf_store(out + i, silu_mul_vec(vf_load(gate + i), vf_load(up + i)));
    if (i < n) { /* the tail through the same arithmetic, in a padded vector */
        float g[VW] = {0}, u[VW] = {0}, o[VW];
        for (int64_t j = i; j < n; j++)
            g[j - i] = gate[j], u[j - i] = up[j];
        vf_store(o, silu_mul_vec(vf_load(g), vf_load(u)));
        for (int64_t j = i; j < n; j++)
            out[j] = o[j - i];
    }
}

/* s0[i] = q0 . k[i], s1[i] = q1 . k[i] for the four key rows k[0..3] + off. */
INLINE void scores_2x4(const float *q0, const float *q1, const float *const *k, int64_t off,
                       int32_t hd, float *s0, float *s1)
{
    VF a0[4], a1[4];
    UNROLL for (int i = 0; i < 4; i++)
    {
        a0[i] = vf_zero();
        a1[i] = vf_zero();
    }
    for (int32_t e = 0; e < hd; e += VW) {
        const VF x0 = vf_load(q0 + e), x1 = vf_load(q1 + e);
        UNROLL for (int i = 0; i < 4; i++)
        {
            const VF kv = vf_load(k[i] + off + e);
            a0[i] = vf_fma(x0, kv, a0[i]);
            a1[i] = vf_fma(x1, kv, a1[i]);
        }
    }
    vf_sum4(a0, s0);
    vf_sum4(a1, s1);
}

/* G heads' outputs o (head_dim apart) = o * corr + sum over i < np of p[g][i] * (v[i] + off)
 * (p rows POS_BLOCK apart), or without the o * corr term in the first block. */
INLINE void weigh_values(float *o, int32_t hd, const float *p, const float *corr,
                         const float *const *v, int64_t off, int32_t np, bool first, const int G)
{
    for (int32_t d = 0; d < hd; d += VW) {
        VF acc[8];
        UNROLL for (int g = 0; g < G; g++) acc[g] =
            first ? vf_zero() : vf_mul(vf_load(o + g * hd + d), vf_set1(corr[g]));
        for (int32_t i = 0; i < np; i++) {
            const VF vv = vf_load(v[i] + off + d);
            UNROLL for (int g = 0; g < G; g++) acc[g] =
                vf_fma(vf_set1(p[g * POS_BLOCK + i]), vv, acc[g]);
        }
        UNROLL for (int g = 0; g < G; g++) vf_store(o + g * hd + d, acc[g]);
    }
}

/* Asks for the cache lines of a row of hd floats, into L2. */
INLINE void fetch_row(const float *row, int32_t hd)
{
    for (int32_t e = 0; e < hd; e += 16)
        _mm_prefetch((const char *)(row + e), _MM_HINT_T1);
}

/* While a KV head's first scores of a block are computed, four positions at a time: asks for
 * that head's part (at off) of the block's V rows i..i+3 (weighed once all its scores are in)
 * and of the K rows of the next block's positions i..i+3 (scored next). In a batch a
 * long-lived cache's rows come from memory, four slots to a 4 KiB page and pages out of
 * order, which the hardware's prefetchers hardly follow: attention waited on them at ~9 GB/s
 * (perf, 32 sequences of ~170 positions, 2 Zen 4 cores). Into L2, not L1: asking for L1
 * (tried) filled the L1's miss queue, and the waits moved from the weighing to the prefetches
 * and the scores (attention 8.5% of a step's time without asking, 8.6% asking for L1); into
 * L2, 6.7%. A head's part at a time, each during its own head's first scores: asking for a
 * whole slot's heads at once (the same lines, in fewer, larger bursts) left an item of two KV
 * heads ~15% slower (a scratch harness: 32 sequences of 300 positions, 28 layers' caches). */
INLINE void fetch_ahead(const struct cllm_attend_item *it, const float *const *vrow, int64_t off,
                        int32_t np, int32_t next0, int32_t i)
{
    for (int32_t j = i; j < i + 4; j++) {
        if (j < np)
            fetch_row(vrow[j] + off, it->head_dim);
        if (next0 + j < it->n_pos)
            fetch_row(it->k + cllm_attend_slot(it, next0 + j) * it->slot_stride + off,
                      it->head_dim);
    }
}

/* weigh_values for each head count of a pass, by that count. */
typedef void (*weigh_fn)(float *o, int32_t hd, const float *p, const float *corr,
                         const float *const *v, int64_t off, int32_t np, bool first);
#define WEIGH_HEADS(G)                                                                             \
    static void weigh_##G(float *o, int32_t hd, const float *p, const float *corr,                 \
                          const float *const *v, int64_t off, int32_t np, bool first)              \
    {                                                                                              \
        weigh_values(o, hd, p, corr, v, off, np, first, G);                                        \
    }
WEIGH_HEADS(1)
WEIGH_HEADS(2)
WEIGH_HEADS(3)
WEIGH_HEADS(4)
WEIGH_HEADS(5)
WEIGH_HEADS(6)
WEIGH_HEADS(7)
WEIGH_HEADS(8)
static const weigh_fn weigh_heads[9] = {NULL,    weigh_1, weigh_2, weigh_3, weigh_4,
                                        weigh_5, weigh_6, weigh_7, weigh_8};

void ATTEND_FN(const struct cllm_attend_item *it)
{
    const int32_t hd = it->head_dim, group = it->group, n_pos = it->n_pos;
    const int32_t heads = group * it->n_kv;
    if (hd % VW != 0) {
        cllm_attend_ref(it);
        return;
    }
    float m[CLLM_ATTEND_MAX_GROUP], l[CLLM_ATTEND_MAX_GROUP], corr[CLLM_ATTEND_MAX_GROUP];
    float s[CLLM_ATTEND_MAX_GROUP][POS_BLOCK], spare[4];
    const float *krow[POS_BLOCK], *vrow[POS_BLOCK];
    for (int32_t h = 0; h < heads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int32_t p0 = 0; p0 < n_pos; p0 += POS_BLOCK) {
        const int32_t np = n_pos - p0 < POS_BLOCK ? n_pos - p0 : POS_BLOCK;
        const int32_t np4 = (np + 3) / 4 * 4, npv = (np + VW - 1) / VW * VW;
        for (int32_t i = 0; i < np; i++) { /* the first KV head's rows */
            const int64_t slot = cllm_attend_slot(it, p0 + i);
            krow[i] = it->k + slot * it->slot_stride;
            vrow[i] = it->v + slot * it->slot_stride;
        }
        for (int32_t i = np; i < np4; i++) /* scored and then ignored */
            krow[i] = krow[np - 1];
        /* scores, KV head by KV head, two of its query heads at a time (a lone last head pairs
         * with itself into spare): the block's K rows are read whole while in cache */
        for (int32_t kv = 0; kv < it->n_kv; kv++) {
            const int64_t off = (int64_t)kv * hd;
            for (int32_t g = kv * group; g < (kv + 1) * group; g += 2) {
                const bool pair = g + 1 < (kv + 1) * group;
                const float *q0 = it->q + (int64_t)g * hd, *q1 = pair ? q0 + hd : q0;
                for (int32_t i = 0; i < np4; i += 4) {
                    if (g == kv * group)
                        fetch_ahead(it, vrow, off, np, p0 + POS_BLOCK, i);
                    scores_2x4(q0, q1, krow + i, off, hd, s[g] + i, pair ? s[g + 1] + i : spare);
                }
            }
        }
        /* one online-softmax step per head: s becomes the weights e^(s - max) */
        const VF scale = vf_set1(it->scale);
        for (int32_t g = 0; g < heads; g++) {
            float *sg = s[g];
            for (int32_t i = np; i < npv; i++)
                sg[i] = -INFINITY;
            VF mx = vf_set1(-INFINITY);
            for (int32_t i = 0; i < npv; i += VW) {
                const VF x = vf_mul(vf_load(sg + i), scale);
                vf_store(sg + i, x);
                mx = vf_max(mx, x);
            }
            const float bm = vf_hmax(mx), m_new = bm > m[g] ? bm : m[g];
            const VF mv = vf_set1(m_new);
            VF sum = vf_zero();
            for (int32_t i = 0; i < npv; i += VW) {
                const VF w = vf_exp(vf_sub(vf_load(sg + i), mv));
                vf_store(sg + i, w);
                sum = vf_add(sum, w);
            }
            corr[g] = expf(m[g] - m_new);
            l[g] = l[g] * corr[g] + vf_hsum(sum);
            m[g] = m_new;
        }
        /* the weighted values, KV head by KV head, up to eight of its query heads a pass */
        const bool first = p0 == 0;
        for (int32_t kv = 0; kv < it->n_kv; kv++) {
            const int64_t off = (int64_t)kv * hd;
            const int32_t end = (kv + 1) * group;
            for (int32_t g = kv * group; g < end; g += 8) {
                float *o = it->out + (int64_t)g * hd;
                weigh_heads[end - g < 8 ? end - g : 8](o, hd, s[g], corr + g, vrow, off, np, first);
            }
        }
    }
    for (int32_t g = 0; g < heads; g++) {
        const VF inv = vf_set1(1.0f / l[g]);
        float *o = it->out + (int64_t)g * hd;
        for (int32_t d = 0; d < hd; d += VW)
            vf_store(o + d, vf_mul(vf_load(o + d), inv));
    }
}

#endif
