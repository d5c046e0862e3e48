// Small-M bf16 linear: y [M, N] = x [M, K] @ w [N, K]^T (+ b), M <= 8, for decode steps (issue 44). A decode
// step at batch 1..8 is bound by reading the weights, and oneDNN's / MKL's small-M bf16 GEMM reads them at
// a fraction of the machine's bandwidth (bench/bench_roofline.py). Here each weight row is read exactly once,
// in order, for all M rows of x at once: x is cast to fp32 once per call (M x K x 4 bytes, L2-resident), each
// 8 (AVX2) or 16 (AVX-512) bf16 weights are widened to fp32 in registers (a 16-bit shift) and FMA'd into M
// accumulators, so the only memory stream is the weight. The N rows are split across the threads in blocks
// (at::parallel_for), so both cores stream disjoint halves of the weight.
//
// Rounding: fp32 products (exact for bf16 x bf16) summed in fp32 in a fixed order per output (lane-wise
// partial sums over k, then a tree over the lanes), the bias added in fp32, one rounding to bf16 (nearest
// even). Not bit-equal to oneDNN's order: equal to an fp32-accumulated reference within fp32 summation error
// before the final bf16 rounding (tests/engine/test_cpu_gemv.py states the tolerance). The same result for a row
// whatever M and the thread count (each output is one fixed loop), so a batch is batch-invariant.
//
// Paths by the build's ISA (engine/cpu_ext.py): __AVX512BF16__ vdpbf16ps (bf16 pairs, fp32 sums, as the instruction
// rounds: denormal inputs and outputs flushed), __AVX512F__ 16 fp32 lanes, __AVX2__+__FMA__ 8 lanes, else scalar;
// the AVX-512 paths two weight rows per pass.
#include "bf16_scalar.h"
#include "ops.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAX_M = 8;

#if defined(__AVX512F__)
// Two weight rows per pass (two independent chains per x row, and each x load feeds both rows: at M 8 the x
// loads from L2, not the weight, were the bound). AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs per
// instruction into 16 fp32 lanes (x read as bf16, half the loads and FMAs of widening to fp32).
constexpr int64_t LANES = 16;
constexpr int64_t ROWS = 2;
inline __m512 load_w(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <int M>
inline void rows2_dot(const uint16_t* w0, const uint16_t* w1, const float* xf, const uint16_t* xb, int64_t K,
                      float* out0, float* out1) {
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
#if defined(__AVX512BF16__)
  for (; k + 2 * LANES <= K; k += 2 * LANES) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k), v1 = (__m512bh)_mm512_loadu_si512(w1 + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
      a0[m] = _mm512_dpbf16_ps(a0[m], v0, xv);
      a1[m] = _mm512_dpbf16_ps(a1[m], v1, xv);
    }
  }
#else
  (void)xb;
#endif
  for (; k + LANES <= K; k += LANES) {
    const __m512 v0 = load_w(w0 + k), v1 = load_w(w1 + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(xf + m * K + k);
      a0[m] = _mm512_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm512_fmadd_ps(v1, xv, a1[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float s0 = _mm512_reduce_add_ps(a0[m]), s1 = _mm512_reduce_add_ps(a1[m]);
    for (int64_t j = k; j < K; ++j) {
      s0 += bf16_to_f32(w0[j]) * xf[m * K + j];
      s1 += bf16_to_f32(w1[j]) * xf[m * K + j];
    }
    out0[m] = s0;
    out1[m] = s1;
  }
}
template <int M>
inline void row_dot(const uint16_t* w, const float* xf, const uint16_t* xb, int64_t K, float* out) {
  float unused[MAX_M];
  rows2_dot<M>(w, w, xf, xb, K, out, unused);
}
#if defined(__AVX512BF16__)
const char* kSimd = "avx512_bf16";
#else
const char* kSimd = "avx512";
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
inline __m256 load_w(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int64_t ROWS = 1;
template <int M>
inline void row_dot(const uint16_t* w, const float* xf, const uint16_t*, int64_t K, float* out) {
  __m256 acc[M], acc2[M];  // two chains per row: the FMA latency hidden at M 1
  for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * LANES <= K; k += 2 * LANES) {
    const __m256 w0 = load_w(w + k), w1 = load_w(w + k + LANES);
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + m * K + k), acc[m]);
      acc2[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + m * K + k + LANES), acc2[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float s = hsum(_mm256_add_ps(acc[m], acc2[m]));
    for (int64_t j = k; j < K; ++j) s += bf16_to_f32(w[j]) * xf[m * K + j];
    out[m] = s;
  }
}
const char* kSimd = "avx2";
#else
constexpr int64_t ROWS = 1;
template <int M>
inline void row_dot(const uint16_t* w, const float* xf, const uint16_t*, int64_t K, float* out) {
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t j = 0; j < K; ++j) s += bf16_to_f32(w[j]) * xf[m * K + j];
    out[m] = s;
  }
}
const char* kSimd = "scalar";
#endif

template <int M>
void rows(const uint16_t* w, int64_t ldw, const float* xf, const uint16_t* xb, int64_t K, const float* bias,
          int64_t n0, int64_t n1, int64_t N, uint16_t* y) {
  float out[MAX_M], out1[MAX_M];
  int64_t n = n0;
#if defined(__AVX512F__)
  for (; n + ROWS <= n1; n += ROWS) {
    rows2_dot<M>(w + n * ldw, w + (n + 1) * ldw, xf, xb, K, out, out1);
    const float b0 = bias ? bias[n] : 0.f, b1 = bias ? bias[n + 1] : 0.f;
    for (int m = 0; m < M; ++m) {
      y[m * N + n] = f32_to_bf16(out[m] + b0);
      y[m * N + n + 1] = f32_to_bf16(out1[m] + b1);
    }
  }
#endif
  for (; n < n1; ++n) {
    row_dot<M>(w + n * ldw, xf, xb, K, out);
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = f32_to_bf16(out[m] + b);
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, const float*, const uint16_t*, int64_t, const float*, int64_t,
                        int64_t, int64_t, uint16_t*);
constexpr RowsFn kRows[MAX_M] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "x and w must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  TORCH_CHECK(w.stride(1) == 1, "w must have contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= MAX_M, "M must be 1..", MAX_M, ", got ", M);
  const auto xf = x.to(at::kFloat).contiguous();  // [M, K] fp32, read from cache by every row
  const auto xc = x.contiguous();                   // [M, K] bf16 (the AVX512-BF16 path's operand)
  at::Tensor bf;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N, "bias must be [N]");
    bf = b->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const RowsFn fn = kRows[M - 1];
  const int64_t ldw = w.stride(0);
  // ~64 KiB of weight per task at least: splitting finer costs more in scheduling than it balances
  const int64_t grain = std::max<int64_t>(16, (1 << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { fn(wp, ldw, xp, xbp, K, bp, n0, n1, N, yp); });
  return y;
}

std::string simd() { return kSimd; }

}  // namespace

PDSERVE_OPS(m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor", &linear);
  m.def("simd() -> str", &simd);
}
