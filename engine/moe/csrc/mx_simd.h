// The MX kernels' element decode and fp32 dot products (mx_gemm.cpp), per SIMD level of the build.
//
// MXFP4 sum order. A row's dot product runs in LANES fp32 lanes (16 AVX-512, 8 AVX2, 8 scalar) over K in
// chunks of LANES, then a fixed reduction of the lanes. The codes hold element 2i in the low nibble of byte i
// and 2i+1 in the high one, so a SIMD build reads a chunk of CHUNK = 2 * LANES elements (CHUNK / 2 bytes, one
// byte a lane) as its LANES low nibbles (elements 2i) and then its LANES high nibbles (elements 2i+1): the
// order every MXFP4 dot of a SIMD build sums in. Both kernels take x permuted to that order once per call
// (``fp4_permute``): the tile kernel decodes a row into the same order (``decode_row_fp4_tile``), the
// in-register kernel (``fp4_rows``) never stores the decoded row, and the two are bit for bit the same dot.
// The scalar code (a generic CPU's build, and ``scalar`` in every build) sums in element order (CHUNK 1).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mx {

struct E8M0Table {
  float v[256];
  E8M0Table() {
    for (int s = 0; s < 256; ++s) {
      uint32_t bits = s == 0 ? (1u << 22) : (uint32_t(s) << 23);  // byte 0: 2^-127, a subnormal
      if (s == 255) bits = 0x7fc00000u;                            // NaN scale
      std::memcpy(&v[s], &bits, 4);
    }
  }
};
inline const E8M0Table kE8M0;

inline const char* simd_name() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

#if defined(__AVX512F__)
constexpr int64_t CHUNK = 32;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t CHUNK = 16;
#else
constexpr int64_t CHUNK = 1;
#endif

// The MXFP4 chunk of this build for block size bs (1: element order, the scalar decode's).
inline int64_t fp4_chunk(int64_t bs, bool scalar) { return scalar || CHUNK == 1 || bs % CHUNK ? 1 : CHUNK; }

// x [K] -> out [K] in the MXFP4 sum order of chunk C: per chunk its even elements, then its odd ones.
inline void fp4_permute(const float* x, int64_t K, int64_t C, float* out) {
  if (C == 1) {
    std::memcpy(out, x, K * sizeof(float));
    return;
  }
  int64_t k = 0;
  for (; k + C <= K; k += C)
    for (int64_t i = 0; i < C / 2; ++i) {
      out[k + i] = x[k + 2 * i];
      out[k + C / 2 + i] = x[k + 2 * i + 1];
    }
  for (; k < K; ++k) out[k] = x[k];
}

// ---- row decode: codes of one row -> K floats ------------------------------------------------------

inline float fp4_value(const uint8_t* codes, const uint8_t* scales, int64_t k, int64_t bs, const float* lut) {
  const uint8_t b = codes[k / 2];
  return lut[(k & 1) ? (b >> 4) : (b & 0xF)] * kE8M0.v[scales[k / bs]];
}

// Element order (dequantization; the scalar dots).
inline void decode_row_fp4(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                           float* out) {
  int64_t k = 0;
#if defined(__AVX512F__)
  if (bs % 32 == 0) {
    const __m512 table = _mm512_loadu_ps(lut);
    const __m512i idx_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i idx_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i nib = _mm512_set1_epi32(0xF);
    for (; k + 32 <= K; k += 32) {
      const __m512 s = _mm512_set1_ps(kE8M0.v[scales[k / bs]]);
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2)));
      __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(b, nib), table);
      __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
      _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_lo, hi), s));
      _mm512_storeu_ps(out + k + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx_hi, hi), s));
    }
  }
#endif
  for (; k < K; ++k) out[k] = fp4_value(codes, scales, k, bs, lut);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 8 codes (one byte a lane) -> their values times the block's scale: the 8-entry magnitude table scaled (pos_s),
// the sign from bit 3. (-v) * s == -(v * s) exactly, so this is the reference's value.
inline __m256 fp4_values8(__m256i codes, __m256 pos_s) {
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(int32_t(0x80000000u)));
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(pos_s, codes), _mm256_castsi256_ps(sign));
}
#endif

// The tile kernel's decode: in the MXFP4 sum order of fp4_chunk(bs, scalar).
inline void decode_row_fp4_tile(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                                bool scalar, float* out) {
  const int64_t C = fp4_chunk(bs, scalar);
  int64_t k = 0;
#if defined(__AVX512F__)
  if (C == 32) {
    const __m512 table = _mm512_loadu_ps(lut);
    for (; k + 32 <= K; k += 32) {
      const __m512 ts = _mm512_mul_ps(table, _mm512_set1_ps(kE8M0.v[scales[k / bs]]));
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2)));
      _mm512_storeu_ps(out + k, _mm512_permutexvar_ps(b, ts));  // vpermps reads the low 4 bits: the low nibble
      _mm512_storeu_ps(out + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), ts));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (C == 16) {
    const __m256 pos = _mm256_loadu_ps(lut);  // codes 0..7; the sign is bit 3
    for (; k + 16 <= K; k += 16) {
      const __m256 ps = _mm256_mul_ps(pos, _mm256_set1_ps(kE8M0.v[scales[k / bs]]));
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2)));
      _mm256_storeu_ps(out + k, fp4_values8(b, ps));
      _mm256_storeu_ps(out + k + 8, fp4_values8(_mm256_srli_epi32(b, 4), ps));
    }
  }
#endif
  (void)C;
  for (; k < K; ++k) out[k] = fp4_value(codes, scales, k, bs, lut);
}

inline void decode_row_fp6(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                           float* out) {
  for (int64_t k = 0; k < K; k += 4) {
    const uint8_t* b = codes + k / 4 * 3;
    uint32_t w = uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16);
    for (int j = 0; j < 4; ++j) out[k + j] = lut[(w >> (6 * j)) & 0x3F] * kE8M0.v[scales[(k + j) / bs]];
  }
}

inline void decode_row_fp8(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                           float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = lut[codes[k]] * kE8M0.v[scales[k / bs]];
}

// ---- dot: one fp32 dot product in a fixed order ----------------------------------------------------

inline float lanes8_sum(const float* l) { return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])); }

inline float dot_scalar(const float* a, const float* b, int64_t K) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[k + j] * b[k + j];
  float tail = 0.f;
  for (; k < K; ++k) tail += a[k] * b[k];
  return lanes8_sum(lanes) + tail;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline float hsum8(__m256 acc) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return lanes8_sum(lanes);
}
#endif

inline float dot(const float* a, const float* b, int64_t K) {
#if defined(__AVX512F__)
  int64_t k = 0;
  __m512 acc = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  const float head = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  int64_t k = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  const float head = hsum8(acc);
#else
  return dot_scalar(a, b, K);
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  float tail = 0.f;
  for (; k < K; ++k) tail += a[k] * b[k];
  return head + tail;
#endif
}

// Four dots of x with the consecutive rows w[0..3] (row stride K): the same per-row operations, in the same
// order, as dot() (so either gives bit-identical results), with four independent FMA chains in flight.
inline void dot4(const float* a, const float* w, int64_t K, float* out) {
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xa = _mm512_loadu_ps(a + k);
    acc0 = _mm512_fmadd_ps(xa, _mm512_loadu_ps(w + k), acc0);
    acc1 = _mm512_fmadd_ps(xa, _mm512_loadu_ps(w + K + k), acc1);
    acc2 = _mm512_fmadd_ps(xa, _mm512_loadu_ps(w + 2 * K + k), acc2);
    acc3 = _mm512_fmadd_ps(xa, _mm512_loadu_ps(w + 3 * K + k), acc3);
  }
  const __m512 accs[4] = {acc0, acc1, acc2, acc3};
  for (int r = 0; r < 4; ++r) {
    float tail = 0.f;
    for (int64_t j = k; j < K; ++j) tail += a[j] * w[r * K + j];
    out[r] = _mm512_reduce_add_ps(accs[r]) + tail;
  }
#else
  for (int r = 0; r < 4; ++r) out[r] = dot(a, w + r * K, K);
#endif
}

// ---- MXFP4 rows dotted in registers: the codes read once, never stored decoded ---------------------

// y[t][r] = row r (of R consecutive rows, stride Kp bytes / Ks scales) . x[t] for MT tokens, x in the sum order
// of fp4_chunk(bs, false) (bs % CHUNK == 0: the caller checks). Per row the same operations in the same order as
// decode_row_fp4_tile + dot: the same bits.
template <int R, int MT>
inline void fp4_rows(const uint8_t* codes, int64_t Kp, const uint8_t* scales, int64_t Ks, int64_t K, int64_t bs,
                     const float* lut, const float* const* x, float* const* y, int64_t r0) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(lut);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    for (int r = 0; r < R; ++r) {
      const __m512 ts = _mm512_mul_ps(table, _mm512_set1_ps(kE8M0.v[scales[r * Ks + k / bs]]));
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * Kp + k / 2)));
      const __m512 lo = _mm512_permutexvar_ps(b, ts), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), ts);
      for (int t = 0; t < MT; ++t) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(x[t] + k), lo, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(x[t] + k + 16), hi, acc[r][t]);
      }
    }
  }
  const float tail = 0.f;  // dot()'s: K % 32 == 0, an empty tail loop (-0.f + 0.f is +0.f there too)
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) y[t][r0 + r] = _mm512_reduce_add_ps(acc[r][t]) + tail;
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 pos = _mm256_loadu_ps(lut);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    for (int r = 0; r < R; ++r) {
      const __m256 ps = _mm256_mul_ps(pos, _mm256_set1_ps(kE8M0.v[scales[r * Ks + k / bs]]));
      const __m256i b =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + r * Kp + k / 2)));
      const __m256 lo = fp4_values8(b, ps), hi = fp4_values8(_mm256_srli_epi32(b, 4), ps);
      for (int t = 0; t < MT; ++t) {
        acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x[t] + k), lo, acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x[t] + k + 8), hi, acc[r][t]);
      }
    }
  }
  const float tail = 0.f;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) y[t][r0 + r] = hsum8(acc[r][t]) + tail;
#else
  (void)codes, (void)Kp, (void)scales, (void)Ks, (void)K, (void)bs, (void)lut, (void)x, (void)y, (void)r0;
#endif
}

// The scalar path: one row decoded into buf [K] (element order), then dot_scalar with each of MT tokens: the
// reference's very functions (a product and a sum in scalar code may be contracted to an FMA or not, by the
// compiler's choice per site: the same code is the same choice).
inline void fp4_row_scalar(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                           const float* const* x, int MT, float* const* y, int64_t r, float* buf) {
  decode_row_fp4_tile(codes, scales, K, bs, lut, true, buf);
  for (int t = 0; t < MT; ++t) y[t][r] = dot_scalar(x[t], buf, K);
}

}  // namespace mx
