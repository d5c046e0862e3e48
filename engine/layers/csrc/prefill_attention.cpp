// Causal prefill attention for bf16 on CPUs with AMX: flash attention (Dao et al. 2022, online softmax) whose
// two GEMMs run in oneDNN's AMX brgemm (at::native::cpublas::brgemm) and whose softmax runs in AVX-512.
//
// q [T, H, D], k [S, Hk, D], v [S, Hk, Dv] (bf16, token-major: the layout the projections produce, no
// transposes); query i sits at position q_start + i and sees keys 0 .. q_start + i (q_start = S - T: the
// prompt's cached prefix, then its new tokens). Hk divides H (GQA). Output [T, H, Dv] bf16.
//
// Layout of the work: K and V are first packed per (kv head, block of BLOCK_N keys) into the VNNI layout
// brgemm multiplies ([K/2][N][2] pairs; the tail block zero-padded). Then each work item (head, block of
// BLOCK_M queries) walks its key blocks up to the diagonal: S = Q K^T (brgemm, fp32), the row maxima and
// exp2((s - max) * scale * log2 e) in AVX-512 (a degree-6 polynomial and vscalefps: ~1 ulp), P rounded to
// bf16 as torch's own flash kernel does, O = O * alpha + P V (brgemm accumulating into fp32 O). Keys past a
// query's position are never exponentiated: its row stops at the diagonal and the rest of P is zero. Items
// are handed out longest first from a shared counter (the causal items differ in length up to T / BLOCK_M
// times), so two threads finish together.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd_math.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t BLOCK_M = 64;   // queries per work item
constexpr int64_t BLOCK_N = 512;  // keys per block (a multiple of 32: the AMX tile's K for the P V GEMM)
// Row strides of the score and probability buffers: a power-of-two stride puts a tile's 16 rows in the same
// L1 sets (brgemm writing S at ld 512 ran at 384 GFLOP/s, at ld 528 at 1,222: measured, 1 thread)
constexpr int64_t LD_S = BLOCK_N + 16;
constexpr int64_t LD_P = BLOCK_N + 32;

bool supported() {
#if defined(__AVX512F__)
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

#if defined(__AVX512F__)


inline void store_bf16(bf16* dst, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
#else  // round to nearest even by hand (no NaN can reach here: scores are finite)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// exp2(x - m) of one row's n valid scaled scores x = s * c into p[0..n) (bf16, zeros up to width); returns
// their sum and sets xmax to max(x - m) (-inf for n <= 0).
inline float exp_row(const float* s, int64_t n, int64_t width, __m512 vc, __m512 vm, bf16* p, float& xmax) {
  __m512 vsum = _mm512_setzero_ps(), vmax = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vc, vm);
    vmax = _mm512_max_ps(vmax, x);
    const __m512 e = exp2_ps(x);
    vsum = _mm512_add_ps(vsum, e);
    store_bf16(p + j, e);
  }
  if (j < n) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vc, vm);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, x);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2_ps(x));
    vsum = _mm512_add_ps(vsum, e);
    store_bf16(p + j, e);  // masked lanes hold 0: the row's tail of this vector is zeroed too
    j += 16;
  }
  for (; j < width; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm256_setzero_si256());
  xmax = _mm512_reduce_max_ps(vmax);
  return _mm512_reduce_add_ps(vsum);
}

// Lazy rescaling (as FlashAttention-4 does): a row's reference m is its exact max after its first key block;
// later blocks exponentiate against it unchanged while their scores stay below m + RESCALE_ABOVE (P <= 2^16:
// no overflow in fp32 sums or bf16 P, and P's relative rounding does not depend on its scale), so the
// output needs no rescaling and the scores no max pass. Only a block that overshoots moves m (and is redone).
constexpr float RESCALE_ABOVE = 16.f;

// One query row of a key block: n valid scores s[0..n) (fp32, unscaled), the row's reference m (scaled log2
// units; -inf before its first block) and sum l. Writes p[0..width) as bf16 (zeros past n) and returns the
// factor alpha the row's accumulated output must be multiplied by (1: unchanged).
inline float softmax_row(const float* s, int64_t n, int64_t width, float c, float& m, float& l, bf16* p) {
  const __m512 vc = _mm512_set1_ps(c);
  float xmax;
  if (m == -INFINITY) {  // the row's first block: its exact max
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    if (j < n) vmax = _mm512_mask_max_ps(vmax, tail_mask(n - j), vmax, _mm512_maskz_loadu_ps(tail_mask(n - j), s + j));
    m = _mm512_reduce_max_ps(vmax) * c;
    l = exp_row(s, n, width, vc, _mm512_set1_ps(m), p, xmax);
    return 0.f;
  }
  const float sum = exp_row(s, n, width, vc, _mm512_set1_ps(m), p, xmax);
  if (xmax <= RESCALE_ABOVE) {
    l += sum;
    return 1.f;
  }
  const float m_new = m + xmax, alpha = std::exp2(m - m_new);
  l = l * alpha + exp_row(s, n, width, vc, _mm512_set1_ps(m_new), p, xmax);
  m = m_new;
  return alpha;
}

// src rows r of [rows, cols] (row stride ld) -> VNNI [ceil(rows/2)][cols][2], zero rows past `rows` up to
// `rows_pad` (even).
void pack_vnni(const bf16* src, int64_t ld, int64_t rows, int64_t rows_pad, int64_t cols, bf16* dst) {
  for (int64_t r = 0; r < rows_pad; r += 2)
    for (int64_t c = 0; c < cols; ++c) {
      dst[(r / 2) * cols * 2 + c * 2] = r < rows ? src[r * ld + c] : bf16(0.f);
      dst[(r / 2) * cols * 2 + c * 2 + 1] = r + 1 < rows ? src[(r + 1) * ld + c] : bf16(0.f);
    }
}

// The key block's transpose: K rows j (stride ld) -> B [D][N] in VNNI, B[d][j] = K[j][d], zero past `rows`.
void pack_kt_vnni(const bf16* src, int64_t ld, int64_t rows, int64_t D, bf16* dst) {
  for (int64_t d = 0; d < D; d += 2)
    for (int64_t j = 0; j < BLOCK_N; ++j) {
      const bool in = j < rows;
      dst[(d / 2) * BLOCK_N * 2 + j * 2] = in ? src[j * ld + d] : bf16(0.f);
      dst[(d / 2) * BLOCK_N * 2 + j * 2 + 1] = in && d + 1 < D ? src[j * ld + d + 1] : bf16(0.f);
    }
}

#endif  // __AVX512F__

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                double scale) {
  TORCH_CHECK(supported(), "prefill_attention: this CPU or build has no AVX-512 AMX brgemm");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "q, k, v must be bfloat16");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(2) == D && v.size(0) == S && v.size(1) == Hk, "k / v shapes do not match q");
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "kv heads (", Hk, ") must divide query heads (", H, ")");
  TORCH_CHECK(S >= T, "fewer keys (", S, ") than queries (", T, ")");
  TORCH_CHECK(D % 2 == 0 && Dv % 16 == 0, "head dims must be even (", D, ") and a multiple of 16 (", Dv, ")");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D &&
                  k.stride(1) == D && v.stride(1) == Dv, "q, k, v must be contiguous in their last two dims");
  auto out = torch::empty({T, H, Dv}, q.options());
  if (T == 0) return out;
#if defined(__AVX512F__)
  const int64_t q_start = S - T, group = H / Hk, nb = (S + BLOCK_N - 1) / BLOCK_N;
  const int64_t kb_size = D * BLOCK_N, vb_size = BLOCK_N * Dv;  // elements per packed block
  // every element is written by the packing below (tails zero-padded): no initialisation
  std::unique_ptr<bf16[]> kpack(new bf16[Hk * nb * kb_size]), vpack(new bf16[Hk * nb * vb_size]);
  const bf16 *qp = q.data_ptr<bf16>(), *kp = k.data_ptr<bf16>(), *vp = v.data_ptr<bf16>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, Hk * nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t hk = i / nb, jb = i % nb, j0 = jb * BLOCK_N, rows = std::min(BLOCK_N, S - j0);
      pack_kt_vnni(kp + j0 * ks + hk * D, ks, rows, D, kpack.get() + i * kb_size);
      pack_vnni(vp + j0 * vs + hk * Dv, vs, rows, BLOCK_N, Dv, vpack.get() + i * vb_size);
    }
  });
  // work items (kv head, query block): the block's queries of every head sharing that kv head, stacked as
  // rows (token-major: row r is token i0 + r / group, head hk * group + r % group), so one GEMM covers the
  // group and each K / V tile is read once for all of them. Longest (latest query block) first.
  const int64_t mb = (T + BLOCK_M - 1) / BLOCK_M, items = Hk * mb, max_rows = BLOCK_M * group;
  std::atomic<int64_t> next{0};
  const float c = float(scale) * float(M_LOG2E);
  bf16* op = out.data_ptr<bf16>();
  const int64_t nth = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    // scratch, written before it is read (S by the QK GEMM, P by the softmax, O by the first P V GEMM)
    std::unique_ptr<float[]> s_buf(new float[max_rows * LD_S]), o_buf(new float[max_rows * Dv]);
    std::vector<float> m_buf(max_rows), l_buf(max_rows), a_buf(max_rows);
    std::unique_ptr<bf16[]> p_buf(new bf16[max_rows * LD_P]), q_buf(new bf16[max_rows * D]);
    for (int64_t it; (it = next.fetch_add(1)) < items;) {
      const int64_t ib = mb - 1 - it / Hk, hk = it % Hk;
      const int64_t i0 = ib * BLOCK_M, tokens = std::min(BLOCK_M, T - i0), rows = tokens * group;
      for (int64_t i = 0; i < tokens; ++i)  // the group's heads of token i0 + i are adjacent in q
        std::memcpy(q_buf.get() + i * group * D, qp + (i0 + i) * qs + hk * group * D, group * D * sizeof(bf16));
      const int64_t last_key = q_start + i0 + tokens - 1;  // the item's last query sees keys 0 .. last_key
      std::fill(m_buf.begin(), m_buf.end(), -INFINITY);
      std::fill(l_buf.begin(), l_buf.end(), 0.f);
      for (int64_t jb = 0; jb * BLOCK_N <= last_key; ++jb) {
        const int64_t j0 = jb * BLOCK_N;
        // columns this block needs: up to the last query's key, rounded up to 32 (brgemm shapes repeat)
        const int64_t width = std::min(BLOCK_N, (std::min(BLOCK_N, last_key - j0 + 1) + 31) / 32 * 32);
        at::native::cpublas::brgemm(rows, width, D, D, BLOCK_N, LD_S, false, q_buf.get(),
                                    kpack.get() + (hk * nb + jb) * kb_size, s_buf.get());
        bool moved = false;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t valid = std::min(width, q_start + i0 + r / group - j0 + 1);  // keys j0 .. the query's own
          a_buf[r] = softmax_row(s_buf.get() + r * LD_S, valid, width, c, m_buf[r], l_buf[r], p_buf.get() + r * LD_P);
          moved |= a_buf[r] != 1.f;
        }
        if (jb > 0 && moved)
          for (int64_t r = 0; r < rows; ++r) {
            if (a_buf[r] == 1.f) continue;  // the row's max did not move
            const __m512 a = _mm512_set1_ps(a_buf[r]);
            for (int64_t d = 0; d < Dv; d += 16)
              _mm512_storeu_ps(o_buf.get() + r * Dv + d, _mm512_mul_ps(a, _mm512_loadu_ps(o_buf.get() + r * Dv + d)));
          }
        at::native::cpublas::brgemm(rows, Dv, width, LD_P, Dv, Dv, jb > 0, p_buf.get(),
                                    vpack.get() + (hk * nb + jb) * vb_size, o_buf.get());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / l_buf[r]);
        bf16* dst = op + (i0 + r / group) * H * Dv + (hk * group + r % group) * Dv;
        for (int64_t d = 0; d < Dv; d += 16)
          store_bf16(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o_buf.get() + r * Dv + d)));
      }
    }
    at::native::cpublas::brgemm_release();
  });
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "causal bf16 flash attention over token-major q/k/v (AMX)");
  m.def("supported", &supported, "this build and CPU run prefill_attention");
}
