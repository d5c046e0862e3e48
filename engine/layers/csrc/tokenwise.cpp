// Token-wise bf16 ops of a prompt's layers, one pass each (torch runs a bf16 RMSNorm as seven: cast up,
// square, mean, rsqrt, scale, cast down, weight; ~0.3 ms each at 2k x 256 on one core).
//
// rms_norm: GLM's / transformers' definition and rounding: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
// with x, the mean and the scaling in fp32 (a bf16 x bf16 product is exact in fp32, so the last rounding is
// the only one after the normalised value's). Each row is summed in one fixed order whatever the number of
// rows (batch invariant). add_rms_norm: s = bf16(x + h) (torch's bf16 add), then rms_norm(s); returns both.
//
// silu_mul: bf16(bf16(silu(g)) * u), torch's two roundings of F.silu(g) * u (SwiGLU's activation), with
// silu(x) = x / (1 + exp(-x)) in fp32 and exp through a degree-6 exp2 polynomial (relative error ~2e-7, so the
// bf16 result is torch's but where fp32 ulps decide a rounding). AVX-512 only (``simd()``); elsewhere torch's.
//
// rope_half: rotate-half RoPE on the first 2 * half dims of each head, the rest copied: out1 = x1 c - x2 s,
// out2 = x2 c + x1 s with torch's roundings of ``x * cos + rotate_half(x) * sin`` in bf16 (each product, then
// the sum).
//
// Plain loops over uint16 bit patterns that the compiler vectorises for the host (-march=native): the
// same source serves AVX-512 and AVX2 machines.
#include "bf16_scalar.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_math.h"

namespace {

constexpr int64_t MAX_DIM = 16384;  // per-row fp32 scratch on the stack
constexpr int64_t LANES = 16;       // partial sums per row (the fixed summation order)

// one row: xs fp32 [n] -> out bf16, weight w (bf16 or fp32, as fp32 values)
inline void norm_row(const float* xs, int64_t n, const float* w, float eps, uint16_t* out) {
  float part[LANES] = {0.f};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += xs[j + l] * xs[j + l];
  for (int64_t l = 0; j + l < n; ++l) part[l] += xs[j + l] * xs[j + l];
  float ss = 0.f;
  for (int64_t l = 0; l < LANES; ++l) ss += part[l];
  const float r = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(xs[i] * r)));
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be bfloat16 [rows, dim] with contiguous rows");
  TORCH_CHECK(x.size(1) <= MAX_DIM, "dim ", x.size(1), " over ", MAX_DIM);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1), "weight must be [dim]");
}

at::Tensor weight_f32(const at::Tensor& w) { return w.to(at::kFloat).contiguous(); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  const int64_t T = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({T, n}, x.options());
  const auto wf = weight_f32(w);
  const float* wp = wf.data_ptr<float>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / n), [&](int64_t t0, int64_t t1) {
    float xs[MAX_DIM];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < n; ++i) xs[i] = bf16_to_f32(xp[t * ld + i]);
      norm_row(xs, n, wp, float(eps), op + t * n);
    }
  });
  return out;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                        double eps) {
  check(x, w);
  check(h, w);
  TORCH_CHECK(h.size(0) == x.size(0), "x and h must have the same rows");
  const int64_t T = x.size(0), n = x.size(1), ldx = x.stride(0), ldh = h.stride(0);
  auto sum = at::empty({T, n}, x.options()), out = at::empty({T, n}, x.options());
  const auto wf = weight_f32(w);
  const float* wp = wf.data_ptr<float>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(h.data_ptr<at::BFloat16>());
  uint16_t* sp = reinterpret_cast<uint16_t*>(sum.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / n), [&](int64_t t0, int64_t t1) {
    float xs[MAX_DIM];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t s = f32_to_bf16(bf16_to_f32(xp[t * ldx + i]) + bf16_to_f32(hp[t * ldh + i]));
        sp[t * n + i] = s;
        xs[i] = bf16_to_f32(s);
      }
      norm_row(xs, n, wp, float(eps), op + t * n);
    }
  });
  return {sum, out};
}

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {  // e^x = 2^(x log2 e)
  return exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

inline __m512 round_bf16(__m512 v) {  // to the nearest even bf16, kept as fp32 (finite inputs)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}
#endif

bool simd() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(simd(), "silu_mul needs AVX-512");
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 && u.scalar_type() == at::kBFloat16 && g.dim() == 2 &&
                  u.sizes() == g.sizes() && g.stride(1) == 1 && u.stride(1) == 1,
              "g and u must be bfloat16 [rows, dim] of the same shape with contiguous rows");
  const int64_t T = g.size(0), n = g.size(1), ldg = g.stride(0), ldu = u.stride(0);
  auto out = at::empty({T, n}, g.options());
#if defined(__AVX512F__)
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
  const uint16_t* up = reinterpret_cast<const uint16_t*>(u.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t t0, int64_t t1) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        const __m512 x = load_bf16(gp + t * ldg + i, k);
        const __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        const __m512 y = round_bf16(_mm512_mul_ps(s, load_bf16(up + t * ldu + i, k)));
        _mm256_mask_storeu_epi16(op + t * n + i, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16)));
      }
  });
#endif
  return out;
}

at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be bfloat16 [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be bfloat16 [tokens, half] with contiguous rows");
  const int64_t T = x.size(0), nh = x.size(1), D = x.size(2), half = cos.size(1), ldx = x.stride(0);
  TORCH_CHECK(2 * half <= D, "2 * half (", 2 * half, ") over the head dim (", D, ")");
  auto out = at::empty({T, nh, D}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
  auto r = [](float a) { return bf16_to_f32(f32_to_bf16(a)); };
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(nh * D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < nh; ++h) {
        const uint16_t* xr = xp + t * ldx + h * D;
        uint16_t* o = op + (t * nh + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float c = bf16_to_f32(cp[t * ldc + i]), s = bf16_to_f32(sp[t * lds + i]);
          const float x1 = bf16_to_f32(xr[i]), x2 = bf16_to_f32(xr[half + i]);
          o[i] = f32_to_bf16(r(x1 * c) + r(-x2 * s));
          o[half + i] = f32_to_bf16(r(x2 * c) + r(x1 * s));
        }
        for (int64_t i = 2 * half; i < D; ++i) o[i] = xr[i];
      }
  });
  return out;
}

}  // namespace

PDSERVE_OPS(m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);  // GLM RMSNorm of bf16 rows in one pass
  // bf16 residual add, then RMSNorm of the sum: [sum, normed]
  m.def("add_rms_norm(Tensor x, Tensor h, Tensor w, float eps) -> Tensor[]", &add_rms_norm);
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor", &silu_mul);  // bf16 silu(g) * u with torch's roundings (AVX-512)
  m.def("simd() -> bool", &simd);                             // silu_mul is built (AVX-512)
  // bf16 rotate-half RoPE on the first 2 * half dims of each head
  m.def("rope_half(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope_half);
}
