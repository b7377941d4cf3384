/*
 * AVX-512 F attention and SiLU (attend_simd.h in 16-lane vectors; compiled with
 * dot_avx512f.c's flags, called only after a run-time CPU check).
 */
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

typedef __m512 VF;
#define VW 16

#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_fma _mm512_fmadd_ps
#define vf_max _mm512_max_ps
#define vf_min _mm512_min_ps
/* scalef multiplies by 2^floor(n): exact for integral n, subnormal results included */
#define vf_ldexp _mm512_scalef_ps
#define vf_hsum _mm512_reduce_add_ps
#define vf_hmax _mm512_reduce_max_ps

INLINE VF vf_round(VF x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

INLINE VF vf_zero_where_lt(VF v, VF x, float lim)
{
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_NLT_UQ), v);
}

/* As attend_avx2.c's: pairs interleaved and added twice within each 128-bit lane, then the
 * four lanes added. */
INLINE void vf_sum4(const VF a[4], float *out)
{
    const VF t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const VF t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
    const VF u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                               _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    const __m256 h =
        _mm256_add_ps(_mm512_castps512_ps256(u),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

#define ATTEND_FN cllm_attend_avx512f
#define SILU_FN cllm_silu_mul_avx512f
#include "backend/cpu/attend_simd.h"
