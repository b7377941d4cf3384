/*
 * IEEE half (F16) and bfloat16 (BF16) conversions, bit-exact with numpy/torch: widening is
 * exact; narrowing rounds to nearest even and keeps NaN a NaN.
 */
#ifndef CLLM_CORE_F16_H
#define CLLM_CORE_F16_H

#include <stdint.h>
#include <string.h>

static inline float cllm_bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t cllm_f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float cllm_bf16_to_f32(uint16_t h)
{
    return cllm_bits_to_f32((uint32_t)h << 16);
}

static inline uint16_t cllm_f32_to_bf16(float f)
{
    uint32_t u = cllm_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float cllm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / NaN */
        return cllm_bits_to_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return cllm_bits_to_f32(sign);
        /* subnormal: man * 2^-24, exact in f32 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    return cllm_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t cllm_f32_to_f16(float f)
{
    uint32_t u = cllm_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return sign | 0x7e00u;
    if (a >= 0x477ff000u) /* rounds to >= 65520: inf */
        return sign | 0x7c00u;
    if (a < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        /* Adding 0.5 shifts the value so the FPU's round-to-nearest-even lands on the half's ulp. */
        float v = cllm_bits_to_f32(a) + 0.5f;
        return sign | (uint16_t)(cllm_f32_to_bits(v) - 0x3f000000u);
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return sign | (uint16_t)(a >> 13);
}

#endif
