/*
 * Vector helpers the AVX-512 paths of several kernels share (included by them; the build
 * keys each library on the bytes of the headers it includes, c_library.py).
 */
#ifndef TANDEM_AVX512_MATH_H
#define TANDEM_AVX512_MATH_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for a vector, to ~1e-7 relative: x = n ln2 + f, e^f by its degree-7 Taylor polynomial
 * on |f| <= ln2 / 2, times 2^n by scalef; lanes at -inf or far below give 0, far above inf. */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 fp32 values rounded to bf16, to nearest even as torch's casts (NaN aside): the bf16 is
 * the top half of each 32-bit lane of the result. */
static inline __m512i bf16_rounded_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
}

#endif
#endif
