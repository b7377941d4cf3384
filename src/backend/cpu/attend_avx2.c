/*
 * AVX2+FMA attention and SiLU (attend_simd.h in 8-lane vectors; compiled with dot_avx2.c's
 * flags, called only after a run-time CPU check).
 */
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

typedef __m256 VF;
#define VW 8

#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_fma _mm256_fmadd_ps
#define vf_max _mm256_max_ps
#define vf_min _mm256_min_ps

INLINE VF vf_round(VF x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* 2^n in two factors, each a normal float for n in [-126, 128]. */
INLINE VF vf_ldexp(VF p, VF n)
{
    const __m256i ni = _mm256_cvtps_epi32(n), bias = _mm256_set1_epi32(127);
    const __m256i e1 = _mm256_srai_epi32(ni, 1), e2 = _mm256_sub_epi32(ni, e1);
    const VF f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    const VF f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

INLINE VF vf_zero_where_lt(VF v, VF x, float lim)
{
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lim), _CMP_LT_OQ), v);
}

INLINE __m128 half_sum(VF v)
{
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

INLINE float vf_hsum(VF v)
{
    __m128 x = half_sum(v);
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

INLINE float vf_hmax(VF v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* Pairs of vectors interleaved and added twice: each 128-bit lane then holds one partial sum
 * of each of the four, and the lanes are added last. */
INLINE void vf_sum4(const VF a[4], float *out)
{
    const VF t0 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
    const VF t1 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
    const __m256d d0 = _mm256_castps_pd(t0), d1 = _mm256_castps_pd(t1);
    const VF u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(d0, d1)),
                               _mm256_castpd_ps(_mm256_unpackhi_pd(d0, d1)));
    _mm_storeu_ps(out, half_sum(u));
}

#define ATTEND_FN cllm_attend_avx2
#define SILU_FN cllm_silu_mul_avx2
#include "backend/cpu/attend_simd.h"
