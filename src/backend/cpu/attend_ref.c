/*
 * Portable attention kernel (the scalar family's, and the SIMD families' for head sizes their
 * vectors do not divide): per block of positions, each query head's scores one dot product at
 * a time, one online-softmax rescale, then the weighted V rows added one at a time.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/attend.h"

#define POS_BLOCK 32 /* positions scored before each softmax rescale */

/* 8-float vectors (GCC vector extensions: SSE pairs at the baseline ISA). Loads go through
 * memcpy: cache rows are only 4-byte aligned. */
typedef float v8f __attribute__((vector_size(32)));

#define LOAD8(dst, p) memcpy(&(dst), (p), sizeof(v8f))

static void attend_one_kv_head(const struct cllm_attend_item *it)
{
    const int32_t hd = it->head_dim, group = it->group, n_pos = it->n_pos;
    const int vec = hd % 8 == 0;
    float m[CLLM_ATTEND_MAX_GROUP], l[CLLM_ATTEND_MAX_GROUP], s[CLLM_ATTEND_MAX_GROUP][POS_BLOCK];
    memset(it->out, 0, (size_t)group * (size_t)hd * sizeof(float));
    for (int32_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const float *krow[POS_BLOCK], *vrow[POS_BLOCK];
    for (int32_t p0 = 0; p0 < n_pos; p0 += POS_BLOCK) {
        int32_t np = n_pos - p0 < POS_BLOCK ? n_pos - p0 : POS_BLOCK;
        for (int32_t i = 0; i < np; i++) {
            int64_t slot = cllm_attend_slot(it, p0 + i);
            krow[i] = it->k + slot * it->slot_stride;
            vrow[i] = it->v + slot * it->slot_stride;
        }
        for (int32_t g = 0; g < group; g++) {
            const float *q = it->q + (int64_t)g * hd;
            float *og = it->out + (int64_t)g * hd;
            float bm = -INFINITY;
            for (int32_t i = 0; i < np; i++) {
                float d = 0.0f;
                if (vec) {
                    v8f acc = {0}, a, c;
                    for (int32_t e = 0; e < hd; e += 8) {
                        LOAD8(a, q + e);
                        LOAD8(c, krow[i] + e);
                        acc += a * c;
                    }
                    d = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                        ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                } else {
                    for (int32_t e = 0; e < hd; e++)
                        d += q[e] * krow[i][e];
                }
                s[g][i] = d * it->scale;
                bm = s[g][i] > bm ? s[g][i] : bm;
            }
            float m_new = bm > m[g] ? bm : m[g];
            float corr = expf(m[g] - m_new);
            l[g] *= corr;
            for (int32_t d = 0; d < hd; d++)
                og[d] *= corr;
            for (int32_t i = 0; i < np; i++) {
                float w = expf(s[g][i] - m_new);
                l[g] += w;
                const float *v = vrow[i];
                if (vec) {
                    v8f wv = {w, w, w, w, w, w, w, w};
                    for (int32_t d = 0; d < hd; d += 8) {
                        v8f acc, vv;
                        LOAD8(acc, og + d);
                        LOAD8(vv, v + d);
                        acc += wv * vv;
                        memcpy(og + d, &acc, sizeof acc);
                    }
                } else {
                    for (int32_t d = 0; d < hd; d++)
                        og[d] += w * v[d];
                }
            }
            m[g] = m_new;
        }
    }
    for (int32_t g = 0; g < group; g++) {
        float inv = 1.0f / l[g];
        float *og = it->out + (int64_t)g * hd;
        for (int32_t d = 0; d < hd; d++)
            og[d] *= inv;
    }
}

void cllm_attend_ref(const struct cllm_attend_item *it)
{
    for (int32_t j = 0; j < it->n_kv; j++) {
        struct cllm_attend_item one = *it;
        const int64_t heads = (int64_t)j * it->group * it->head_dim;
        one.q += heads;
        one.out += heads;
        one.k += (int64_t)j * it->head_dim;
        one.v += (int64_t)j * it->head_dim;
        one.n_kv = 1;
        attend_one_kv_head(&one);
    }
}
