// Paged attention for decode and verify steps on CPU: each query reads its request's keys and values straight
// from the KV pool by slot (no gathered copy of the context), grouped-query heads share every key they load,
// and the softmax is online (Milakov & Gimelshein 2018) in fp32 over fixed blocks of keys.
//
// q [B, Tq, H, D] fp32 (pre-scaled by the caller: softmax scale * log2 e, so that p = 2^(s - max)); the pool's
// k [N, Hk, D] and v [N, Hk, Dv] (fp32, bf16 or fp16: read as they are stored, widened to fp32); kv_slots
// [B, S] int64 (request b's keys are the rows kv_slots[b, :]); mask [B, Tq, S] bool (True: attend) or None
// (every query sees all S keys). Output [B, Tq, H, Dv] fp32.
//
// Batch invariance is by construction: a query row's result is the same sequence of operations whatever the
// batch, the number of queries of its request, or the other heads: its keys are visited in blocks of BLOCK_N
// at fixed offsets (0, BLOCK_N, ...), a block whose keys are all masked for this row changes nothing, and each
// dot product and exponential is computed per (row, key) alone. So a decode step (one query, no mask) and the
// verify step of speculative decoding (several queries, a causal or tree mask) round alike: greedy speculation
// stays lossless. Work items are (request, kv head) pairs.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd_math.h"

namespace {

constexpr int64_t BLOCK_N = 128;  // keys per online-softmax block

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
inline float widen(at::Half x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
// 16 stored values widened to fp32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#endif

// sum_d q[d] * k[d] (the same operations for every row and key: D fixed per call)
template <typename kv_t>
inline float dot(const float* q, const kv_t* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), a);
    return _mm512_reduce_add_ps(a);
  }
#endif
  float a = 0.f;
  for (int64_t d = 0; d < D; ++d) a += q[d] * widen(k[d]);
  return a;
}

#if defined(__AVX512F__)
// acc[0:16 NV] += sum_j p[j] v_j for the n value rows v_j = v + slots[j] * v_row, acc held in registers over the
// block (a store / load per key would chain every key's FMA behind the last one's store)
template <int NV, typename kv_t>
inline void pv_block(float* acc, const float* p, const kv_t* v, const int64_t* slots, int64_t n, int64_t v_row) {
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const kv_t* vp = v + slots[j] * v_row;
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(pj, load16(vp + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

template <typename kv_t>
inline void pv(float* acc, const float* p, const kv_t* v, const int64_t* slots, int64_t n, int64_t v_row,
               int64_t Dv) {
#if defined(__AVX512F__)
  switch (Dv) {
    case 16: return pv_block<1>(acc, p, v, slots, n, v_row);
    case 32: return pv_block<2>(acc, p, v, slots, n, v_row);
    case 64: return pv_block<4>(acc, p, v, slots, n, v_row);
    case 128: return pv_block<8>(acc, p, v, slots, n, v_row);
    case 256: return pv_block<16>(acc, p, v, slots, n, v_row);
    default: break;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const kv_t* vp = v + slots[j] * v_row;
    for (int64_t d = 0; d < Dv; ++d) acc[d] += p[j] * widen(vp[d]);
  }
}

// dst[i] = 2^(src[i]) for n values (src finite or -inf: 2^-inf = 0)
inline void exp2_block(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_set1_ps(-200.f);  // 2^-200 underflows to 0 in scalef, and -inf never reaches it
  for (; j + 16 <= n; j += 16) {
    _mm512_storeu_ps(dst + j, exp2_ps(_mm512_max_ps(_mm512_loadu_ps(src + j), lo)));
  }
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(dst + j, m, exp2_ps(_mm512_max_ps(_mm512_maskz_loadu_ps(m, src + j), lo)));
  }
#else
  for (; j < n; ++j) dst[j] = std::exp2(std::max(src[j], -200.f));
#endif
}

template <typename kv_t>
void attend(const float* q, const kv_t* k, const kv_t* v, const int64_t* slots, const bool* mask, float* out,
            int64_t B, int64_t Tq, int64_t H, int64_t Hk, int64_t D, int64_t Dv, int64_t S, int64_t k_row,
            int64_t v_row) {
  const int64_t G = H / Hk, R = Tq * G;  // the rows of one work item: its request's queries x the kv head's heads
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(R * BLOCK_N), p(R * BLOCK_N), acc(R * Dv), m(R), l(R);
    std::vector<char> live(R);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hk, kh = item % Hk;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t* sl = slots + b * S;
      for (int64_t s0 = 0; s0 < S; s0 += BLOCK_N) {
        const int64_t n = std::min(BLOCK_N, S - s0);
        // scores of every row against the block's keys (masked: -inf)
        for (int64_t j = 0; j < n; ++j) {
          const kv_t* kp = k + sl[s0 + j] * k_row + kh * D;
          for (int64_t i = 0; i < Tq; ++i) {
            const bool seen = mask == nullptr || mask[(b * Tq + i) * S + s0 + j];
            for (int64_t g = 0; g < G; ++g) {
              const int64_t r = i * G + g;
              const float* qr = q + ((b * Tq + i) * H + kh * G + g) * D;
              s[r * BLOCK_N + j] = seen ? dot(qr, kp, D) : -std::numeric_limits<float>::infinity();
            }
          }
        }
        // online softmax: a row's running max, its sum and its output rescaled when the max grows
        for (int64_t r = 0; r < R; ++r) {
          float* sr = s.data() + r * BLOCK_N;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sr[j]);
          live[r] = mx != -std::numeric_limits<float>::infinity();
          if (!live[r]) continue;  // every key of this block is masked for this row: nothing changes
          const float m_new = std::max(m[r], mx);
          if (m_new != m[r]) {
            float alpha = m[r] - m_new;  // 2^-inf = 0 for the row's first live block
            exp2_block(&alpha, &alpha, 1);
            float* ar = acc.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
            l[r] *= alpha;
            m[r] = m_new;
          }
          for (int64_t j = 0; j < n; ++j) sr[j] -= m_new;
          float* pr = p.data() + r * BLOCK_N;
          exp2_block(pr, sr, n);
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) sum += pr[j];
          l[r] += sum;
        }
        // acc += p V, row by row (the block's value rows stay in L1 across the rows)
        for (int64_t r = 0; r < R; ++r) {
          if (live[r]) pv(acc.data() + r * Dv, p.data() + r * BLOCK_N, v + kh * Dv, sl + s0, n, v_row, Dv);
        }
      }
      for (int64_t i = 0; i < Tq; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // a row with no visible key (padding) reads zeros
          float* o = out + ((b * Tq + i) * H + kh * G + g) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] = acc[r * Dv + d] * inv;
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be contiguous fp32 [B, Tq, H, D]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.scalar_type() == v.scalar_type(),
              "k / v must be [slots, kv heads, dim] of one dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each k / v row must be contiguous");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "kv_slots must be contiguous int64 [B, S]");
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3), Hk = k.size(1), Dv = v.size(2);
  const int64_t S = slots.size(1);
  TORCH_CHECK(slots.size(0) == B && S > 0, "kv_slots must be [B, S] with S >= 1");
  TORCH_CHECK(k.size(2) == D && v.size(1) == Hk && v.size(0) == k.size(0), "k / v shapes do not match q");
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "kv heads (", Hk, ") must divide query heads (", H, ")");
  const bool has_mask = mask.has_value();
  if (has_mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->dim() == 3 && mask->size(0) == B &&
                mask->size(1) == Tq && mask->size(2) == S, "mask must be contiguous bool [B, Tq, S]");
  }
  auto out = at::empty({B, Tq, H, Dv}, q.options());
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t n = k.size(0), k_row = k.stride(0), v_row = v.stride(0);
  for (int64_t i = 0; i < B * S; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n, "kv_slots out of the pool's range");
  const auto run = [&](auto tag) {
    using kv_t = decltype(tag);
    attend<kv_t>(q.data_ptr<float>(), k.data_ptr<kv_t>(), v.data_ptr<kv_t>(), sp, mp, out.data_ptr<float>(), B, Tq,
                 H, Hk, D, Dv, S, k_row, v_row);
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention: KV dtype ", k.scalar_type(), " (fp32, bf16, fp16 only)");
  }
  return out;
}

}  // namespace

// A dispatcher op (not only a Python function) so that the compiled decode graphs call it from their C++ wrapper.
TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

