// AVX-512 / AVX2 math shared by the CPU kernels of this directory (included; engine/cpu_ext.py hashes it with them).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// 2^x for finite x: x = n + f, |f| <= 1/2, 2^f by its Taylor series to degree 6 (relative error < 2e-7),
// scaled by 2^n in vscalefps (exact, denormals included; 0 below 2^-149, inf above 2^128).
inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// 2^x, 8 lanes: the same polynomial as the AVX-512 one; 2^n built in the exponent bits, so x is clamped to
// [-126, 127] first (2^-126 ~ 1e-38 stands for 0: it adds nothing a bf16 probability can hold).
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif  // __AVX512F__ / __AVX2__
