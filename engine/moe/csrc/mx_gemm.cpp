// Grouped MoE GEMMs straight from OCP MX codes + E8M0 scales (OCP MX v1.0), CPU.
//
// Weights W [E, N, Kp] uint8 codes (mxfp4: two a byte, element 2i in the low nibble; mxfp6: four in three
// bytes, the LE 24-bit word v0 | v1<<6 | v2<<12 | v3<<18; mxfp8: one e4m3 byte) with S [E, N, K/bs] E8M0
// scales. A weight row is decoded (LUT value * 2^(s-127), exact in fp32) into a small per-thread tile of
// ROWS_PER_TILE rows (ROWS_PER_TILE * K * 4 bytes: 32 KB at K = 2048, L1/L2 resident) and dotted with every
// token routed to its expert, so each weight byte is read from memory once per call and no dense copy of
// an expert ever exists.
//
// Batch invariance: y[p, n] is one fp32 dot product over K in a fixed order (16 / 8 lane partial sums in K
// order, then a fixed reduction) whatever the number of pairs, so a 1-token decode and a 6-token verify
// round alike.
//
// SIMD: AVX-512F (fp4: vpermps over the 16-entry value table; dot: 16 lanes), AVX2+FMA (fp4: 8-entry table
// + sign bit; dot: 8 lanes), else scalar. Chosen at compile time for the host (-march=native, one build per
// CPU flag set); fp6/fp8 decode through the scalar LUT and share the SIMD dot.
#include "ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS_PER_TILE = 4;
constexpr int64_t ROWS_PER_ITEM = 32;

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
const E8M0Table kE8M0;

const char* simd_name() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// ---- row decode: codes of one row -> K floats ------------------------------------------------------

void decode_row_fp4(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
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
#elif defined(__AVX2__) && defined(__FMA__)
  if (bs % 16 == 0) {
    const __m256 pos = _mm256_loadu_ps(lut);  // codes 0..7; the sign is bit 3
    const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
    for (; k + 16 <= K; k += 16) {
      const __m256 s = _mm256_set1_ps(kE8M0.v[scales[k / bs]]);
      // 8 bytes -> codes in element order: low nibble then high nibble of each byte
      uint64_t raw;
      std::memcpy(&raw, codes + k / 2, 8);
      alignas(32) int32_t c[16];
      for (int j = 0; j < 8; ++j) {
        c[2 * j] = int32_t((raw >> (8 * j)) & 0xF);
        c[2 * j + 1] = int32_t((raw >> (8 * j + 4)) & 0xF);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i ci = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + 8 * h));
        __m256 v = _mm256_permutevar8x32_ps(pos, _mm256_and_si256(ci, seven));
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(ci, eight), 28);
        v = _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
        _mm256_storeu_ps(out + k + 8 * h, _mm256_mul_ps(v, s));
      }
    }
  }
#endif
  for (; k < K; ++k) {
    uint8_t b = codes[k / 2];
    out[k] = lut[(k & 1) ? (b >> 4) : (b & 0xF)] * kE8M0.v[scales[k / bs]];
  }
}

void decode_row_fp6(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                    float* out) {
  for (int64_t k = 0; k < K; k += 4) {
    const uint8_t* b = codes + k / 4 * 3;
    uint32_t w = uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16);
    for (int j = 0; j < 4; ++j) out[k + j] = lut[(w >> (6 * j)) & 0x3F] * kE8M0.v[scales[(k + j) / bs]];
  }
}

void decode_row_fp8(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t bs, const float* lut,
                    float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = lut[codes[k]] * kE8M0.v[scales[k / bs]];
}

using DecodeFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const float*, float*);

DecodeFn decoder(int64_t bits) {
  if (bits == 4) return decode_row_fp4;
  if (bits == 6) return decode_row_fp6;
  return decode_row_fp8;
}

// ---- dot: one fp32 dot product in a fixed order ----------------------------------------------------

inline float dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float tail = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  float head = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float head = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#else
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[k + j] * b[k + j];
  float head = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
  for (; k < K; ++k) tail += a[k] * b[k];
  return head + tail;
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

void check_weights(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& lut, int64_t bits) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 3 &&
              codes.is_contiguous(), "codes: contiguous uint8 [E, N, Kp] on CPU");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 3 && scales.is_contiguous() &&
              scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1), "scales: uint8 [E, N, K/bs]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.is_contiguous() && lut.numel() == (1 << bits),
              "lut: float32 [2^bits]");
}

}  // namespace

// y[p, :] = W[e(p)] @ x[row(p), :] for pairs p grouped by expert: group g covers pairs
// group_start[g] .. group_start[g+1]-1, all routed to expert group_expert[g]; row(p) = row_index[p]
// (or p when row_index is empty). x [M, K] fp32; returns y [P, N] fp32.
at::Tensor mx_grouped_gemm(at::Tensor x, at::Tensor row_index, at::Tensor group_expert,
                              at::Tensor group_start, at::Tensor codes, at::Tensor scales,
                              at::Tensor lut, int64_t bits, int64_t block_size) {
  check_weights(codes, scales, lut, bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t N = codes.size(1), K = x.size(1);
  TORCH_CHECK(codes.size(2) * 8 == K * bits && scales.size(2) * block_size == K, "x's K does not match the weights");
  TORCH_CHECK(group_expert.scalar_type() == at::kLong && group_start.scalar_type() == at::kLong &&
              group_start.numel() == group_expert.numel() + 1, "group_expert int64 [G], group_start int64 [G+1]");
  const int64_t G = group_expert.numel();
  const int64_t* ge = group_expert.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t P = G ? gs[G] : 0;
  const bool indexed = row_index.numel() > 0;
  TORCH_CHECK(!indexed || (row_index.scalar_type() == at::kLong && row_index.numel() == P), "row_index int64 [P]");
  TORCH_CHECK(indexed || x.size(0) >= P, "x has fewer rows than pairs");
  const int64_t* ri = indexed ? row_index.data_ptr<int64_t>() : nullptr;
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(ge[g] >= 0 && ge[g] < codes.size(0) && gs[g] <= gs[g + 1], "bad group ", g);
  for (int64_t p = 0; indexed && p < P; ++p) TORCH_CHECK(ri[p] >= 0 && ri[p] < x.size(0), "row_index out of range");

  auto y = at::empty({P, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* lp = lut.data_ptr<float>();
  const int64_t Kp = codes.size(2), Ks = scales.size(2);
  const int64_t items_per_group = (N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  const DecodeFn decode = decoder(bits);

  at::parallel_for(0, G * items_per_group, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(ROWS_PER_TILE * K);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / items_per_group, e = ge[g];
      if (gs[g] == gs[g + 1]) continue;  // an expert without pairs: its weights are not even read
      const int64_t n0 = (item % items_per_group) * ROWS_PER_ITEM, n1 = std::min(N, n0 + ROWS_PER_ITEM);
      for (int64_t r0 = n0; r0 < n1; r0 += ROWS_PER_TILE) {
        const int64_t nr = std::min(ROWS_PER_TILE, n1 - r0);
        for (int64_t r = 0; r < nr; ++r)
          decode(cp + (e * N + r0 + r) * Kp, sp + (e * N + r0 + r) * Ks, K, block_size, lp, tile.data() + r * K);
        for (int64_t p = gs[g]; p < gs[g + 1]; ++p) {
          const float* xr = xp + (indexed ? ri[p] : p) * K;
          if (nr == ROWS_PER_TILE) {
            dot4(xr, tile.data(), K, yp + p * N + r0);
          } else {
            for (int64_t r = 0; r < nr; ++r) yp[p * N + r0 + r] = dot(xr, tile.data() + r * K, K);
          }
        }
      }
    }
  });
  return y;
}

// Dense rows of the experts `experts` [n] -> out [n, N, K] (fp32 or bf16; every MX value is exact in both).
// The prefill path's tile: one expert (or a few) at a time into a reused buffer, then a library GEMM.
void mx_dequant_into(at::Tensor codes, at::Tensor scales, at::Tensor experts, at::Tensor lut,
                     int64_t bits, int64_t block_size, at::Tensor out) {
  check_weights(codes, scales, lut, bits);
  const int64_t N = codes.size(1), K = scales.size(2) * block_size, n = experts.numel();
  TORCH_CHECK(experts.scalar_type() == at::kLong, "experts: int64");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) >= n && out.size(1) == N && out.size(2) == K &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16), "out: [n, N, K] fp32/bf16");
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ex[i] >= 0 && ex[i] < codes.size(0), "expert index out of range");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* lp = lut.data_ptr<float>();
  const int64_t Kp = codes.size(2), Ks = scales.size(2);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const DecodeFn decode = decoder(bits);
  at::parallel_for(0, n * N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(bf16 ? K : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = ex[i / N], r = i % N;
      float* dst = bf16 ? row.data() : of + i * K;
      decode(cp + (e * N + r) * Kp, sp + (e * N + r) * Ks, K, block_size, lp, dst);
      if (bf16) {  // exact: an MX value has <= 4 significant bits, so its low 16 fp32 bits are zero
        uint16_t* d = ob + i * K;
        int64_t k = 0;
#if defined(__AVX512F__)
        for (; k + 16 <= K; k += 16) {
          __m512i v = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(dst + k)), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k), _mm512_cvtepi32_epi16(v));
        }
#endif
        for (; k < K; ++k) {
          uint32_t b;
          std::memcpy(&b, dst + k, 4);
          d[k] = uint16_t(b >> 16);
        }
      }
    }
  });
}

std::string mx_simd() { return simd_name(); }

PDSERVE_OPS(m) {
  // grouped MoE GEMM from MX codes (fp32 activations)
  m.def("mx_grouped_gemm(Tensor x, Tensor row_index, Tensor group_expert, Tensor group_start, Tensor codes, "
        "Tensor scales, Tensor lut, int bits, int block_size) -> Tensor", &mx_grouped_gemm);
  // dequantize selected experts into a buffer
  m.def("mx_dequant_into(Tensor codes, Tensor scales, Tensor experts, Tensor lut, int bits, int block_size, "
        "Tensor(a!) out) -> ()", &mx_dequant_into);
  m.def("simd() -> str", &mx_simd);  // the SIMD level this build uses
}
