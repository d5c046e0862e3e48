// AVX-512 math shared by the CPU kernels of this directory (included; engine/cpu_ext.py hashes it with them).
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

#endif  // __AVX512F__
