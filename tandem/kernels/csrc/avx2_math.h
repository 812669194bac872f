/*
 * Vector helpers the AVX2 paths of several kernels share (included by them; the build keys
 * each library on the bytes of the headers it includes, c_library.py).
 */
#ifndef TANDEM_AVX2_MATH_H
#define TANDEM_AVX2_MATH_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x to ~1e-7 relative, as exp16 (avx512_math.h): x = n ln2 + f, the degree-7 Taylor
 * polynomial of e^f, times 2^n built in the exponent bits. AVX2 has no scalef, so x is held
 * to [-87, 88] first, where 2^n stays a normal number: below, e^-87 (~1.6e-38) instead of
 * less (the attention's softmax only takes e^(score - max) <= 1); above e^x's largest fp32
 * value, inf, so that silu's x / (1 + e^-x) is -0 far below zero, as torch's. */
static inline __m256 exp8(__m256 x) {
    const __m256 held = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(held, _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718f));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 value = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
    const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.72284f), _CMP_GT_OQ);
    return _mm256_blendv_ps(value, _mm256_set1_ps(__builtin_inff()), overflow);
}

#endif
#endif
