// Causal prefill attention for bf16 CPUs: flash attention (Dao et al. 2022, online softmax) whose two GEMMs run
// in oneDNN's AMX brgemm (at::native::cpublas::brgemm, the `brgemm` route: AMX CPUs at ISA level amx) or in a
// bf16 -> fp32 BLAS GEMM on the unpacked token-major q / k / v (the gemm route, every other level: what torch's
// FlashAttentionKernel.cpp does with cpublas::gemm where cpublas::could_pack is false; ../../csrc/bf16_gemm.h
// says why it is MKL's cblas_gemm_bf16bf16f32 here), and whose softmax runs in
// AVX-512 (16 lanes) or AVX2 + FMA (8 lanes), whichever the build's -march has (engine/cpu_ext.py).
//
// q [T, H, D], k [S, Hk, D], v [S, Hk, Dv] (bf16, token-major: the layout the projections produce, no
// transposes); query i sits at position q_start + i and sees keys 0 .. q_start + i (q_start = S - T: the
// prompt's cached prefix, then its new tokens). Hk divides H (GQA). Output [T, H, Dv] bf16.
//
// Layout of the work (brgemm route): K and V are first packed per (kv head, block of BLOCK_N keys) into the VNNI layout
// brgemm multiplies ([K/2][N][2] pairs; the tail block zero-padded). Then each work item (head, block of
// BLOCK_M queries) walks its key blocks up to the diagonal: S = Q K^T (brgemm, fp32), the row maxima and
// exp2((s - max) * scale * log2 e) in AVX-512 (a degree-6 polynomial and vscalefps: ~1 ulp), P rounded to
// bf16 as torch's own flash kernel does, O = O * alpha + P V (brgemm accumulating into fp32 O). Keys past a
// query's position are never exponentiated: its row stops at the diagonal and the rest of P is zero. Items
// are handed out longest first from a shared counter (the causal items differ in length up to T / BLOCK_M
// times), so two threads finish together. The gemm route is the same walk without the packing: its GEMMs read
// K and V in place (row stride: the token's) and its blocks are exactly as wide as the keys they need.
#include "ops.h"
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_gemm.h"
#include "simd_math.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t BLOCK_M = 64;   // queries per work item
constexpr int64_t BLOCK_N = 512;  // keys per block (a multiple of 32: the AMX tile's K for the P V GEMM)
// Row strides of the score and probability buffers: a power-of-two stride puts a tile's 16 rows in the same
// L1 sets (brgemm writing S at ld 512 ran at 384 GFLOP/s, at ld 528 at 1,222: measured, 1 thread)
constexpr int64_t LD_S = BLOCK_N + 16;
constexpr int64_t LD_P = BLOCK_N + 32;

bool could_pack() { return at::native::cpublas::could_pack(at::kBFloat16); }

// This build computes prefill_attention on the gemm route (the brgemm route needs could_pack() instead).
bool supported() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return pdserve::have_gemm_bf16();
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
inline float exp_row(const float* s, int64_t n, int64_t width, float c, float m, bf16* p, float& xmax) {
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
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

// max of s[0..n), n >= 1
inline float row_max(const float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  if (j < n) vmax = _mm512_mask_max_ps(vmax, tail_mask(n - j), vmax, _mm512_maskz_loadu_ps(tail_mask(n - j), s + j));
  return _mm512_reduce_max_ps(vmax);
}

// o[0..n) *= a (n a multiple of 16)
inline void scale_row(float* o, float a, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(va, _mm512_loadu_ps(o + d)));
}

// dst[0..n) = bf16(o * inv) (n a multiple of 16)
inline void store_row(bf16* dst, const float* o, float inv, int64_t n) {
  const __m512 vi = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < n; d += 16) store_bf16(dst + d, _mm512_mul_ps(vi, _mm512_loadu_ps(o + d)));
}

#elif defined(__AVX2__) && defined(__FMA__)  // the same functions, 8 lanes

// 8 floats -> bf16, round to nearest even (scores and outputs are finite: no NaN handling)
inline void store_bf16(bf16* dst, __m256 v) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  // packus works per 128-bit lane: [u0..u3 u0..u3 | u4..u7 u4..u7]; qwords 0 and 2 hold u0..u7
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

inline __m256 lanes_below(int64_t left) {  // all-ones in lanes i < left
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(left, 8))),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float exp_row(const float* s, int64_t n, int64_t width, float c, float m, bf16* p, float& xmax) {
  const __m256 vc = _mm256_set1_ps(c), vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps(), vmax = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(s + j), vc, vm);
    vmax = _mm256_max_ps(vmax, x);
    const __m256 e = exp2_ps(x);
    vsum = _mm256_add_ps(vsum, e);
    store_bf16(p + j, e);
  }
  if (j < n) {
    const __m256 ok = lanes_below(n - j);
    const __m256 x = _mm256_fmsub_ps(_mm256_maskload_ps(s + j, _mm256_castps_si256(ok)), vc, vm);
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, ok));
    const __m256 e = _mm256_and_ps(exp2_ps(x), ok);
    vsum = _mm256_add_ps(vsum, e);
    store_bf16(p + j, e);
    j += 8;
  }
  for (; j < width; j += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j), _mm_setzero_si128());
  xmax = hmax(vmax);
  return hsum(vsum);
}

inline float row_max(const float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  float m = hmax(vmax);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

inline void scale_row(float* o, float a, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(va, _mm256_loadu_ps(o + d)));
}

inline void store_row(bf16* dst, const float* o, float inv, int64_t n) {
  const __m256 vi = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < n; d += 8) store_bf16(dst + d, _mm256_mul_ps(vi, _mm256_loadu_ps(o + d)));
}

#endif  // __AVX512F__ / __AVX2__

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

// Lazy rescaling (as FlashAttention-4 does): a row's reference m is its exact max after its first key block;
// later blocks exponentiate against it unchanged while their scores stay below m + RESCALE_ABOVE (P <= 2^16:
// no overflow in fp32 sums or bf16 P, and P's relative rounding does not depend on its scale), so the
// output needs no rescaling and the scores no max pass. Only a block that overshoots moves m (and is redone).
constexpr float RESCALE_ABOVE = 16.f;

// One query row of a key block: n valid scores s[0..n) (fp32, unscaled), the row's reference m (scaled log2
// units; -inf before its first block) and sum l. Writes p[0..width) as bf16 (zeros past n) and returns the
// factor alpha the row's accumulated output must be multiplied by (1: unchanged).
inline float softmax_row(const float* s, int64_t n, int64_t width, float c, float& m, float& l, bf16* p) {
  float xmax;
  if (m == -INFINITY) {  // the row's first block: its exact max
    m = row_max(s, n) * c;
    l = exp_row(s, n, width, c, m, p, xmax);
    return 0.f;
  }
  const float sum = exp_row(s, n, width, c, m, p, xmax);
  if (xmax <= RESCALE_ABOVE) {
    l += sum;
    return 1.f;
  }
  const float m_new = m + xmax, alpha = std::exp2(m - m_new);
  l = l * alpha + exp_row(s, n, width, c, m_new, p, xmax);
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

// One call's operands and constants. kpack / vpack: the VNNI blocks of the brgemm route (null on the gemm route).
struct Attn {
  const bf16 *q, *k, *v;
  int64_t qs, ks, vs;  // token strides
  int64_t T, H, D, S, Hk, Dv, q_start, group, nb;
  float c;
  const bf16 *kpack, *vpack;
  bf16* out;
  bool brgemm() const { return kpack != nullptr; }
};

// s [rows, width] (ld LD_S) = the item's query rows qb [rows, D] times key block jb of kv head hk, transposed
inline void scores(const Attn& a, int64_t hk, int64_t jb, int64_t rows, int64_t width, const bf16* qb, float* s) {
  if (a.brgemm())
    at::native::cpublas::brgemm(rows, width, a.D, a.D, BLOCK_N, LD_S, false, qb,
                                a.kpack + (hk * a.nb + jb) * a.D * BLOCK_N, s);
  else  // S = Q [rows, D] x K_block^T (K_block [width, D], ld: the token stride)
    pdserve::gemm_bf16(true, rows, width, a.D, qb, a.D, a.k + jb * BLOCK_N * a.ks + hk * a.D, a.ks, 0.f, s, LD_S);
}

// o [rows, Dv] (+)= p [rows, width] (ld LD_P) times value block jb of kv head hk
inline void accumulate(const Attn& a, int64_t hk, int64_t jb, int64_t rows, int64_t width, const bf16* p, float* o,
                       bool add) {
  if (a.brgemm())
    at::native::cpublas::brgemm(rows, a.Dv, width, LD_P, a.Dv, a.Dv, add, p,
                                a.vpack + (hk * a.nb + jb) * BLOCK_N * a.Dv, o);
  else  // O (+)= P [rows, width] x V_block [width, Dv] (ld: the token stride)
    pdserve::gemm_bf16(false, rows, a.Dv, width, p, LD_P, a.v + jb * BLOCK_N * a.vs + hk * a.Dv, a.vs,
                       add ? 1.f : 0.f, o, a.Dv);
}

// Scratch of one thread, written before it is read (S by the QK GEMM, P by the softmax, O by the first P V GEMM).
struct Scratch {
  std::unique_ptr<float[]> s, o;
  std::vector<float> m, l, alpha;
  std::unique_ptr<bf16[]> p, q;
  explicit Scratch(int64_t rows, int64_t D, int64_t Dv)
      : s(new float[rows * LD_S]), o(new float[rows * Dv]), m(rows), l(rows), alpha(rows), p(new bf16[rows * LD_P]),
        q(new bf16[rows * D]) {}
};

// Work item (kv head hk, query block ib): the block's queries of every head sharing that kv head, stacked as
// rows (token-major: row r is token i0 + r / group, head hk * group + r % group), so one GEMM covers the group
// and each K / V block is read once for all of them.
void attend_item(const Attn& a, int64_t hk, int64_t ib, Scratch& w) {
  const int64_t i0 = ib * BLOCK_M, tokens = std::min(BLOCK_M, a.T - i0), rows = tokens * a.group, Dv = a.Dv;
  for (int64_t i = 0; i < tokens; ++i)  // the group's heads of token i0 + i are adjacent in q
    std::memcpy(w.q.get() + i * a.group * a.D, a.q + (i0 + i) * a.qs + hk * a.group * a.D,
                a.group * a.D * sizeof(bf16));
  const int64_t last_key = a.q_start + i0 + tokens - 1;  // the item's last query sees keys 0 .. last_key
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  for (int64_t jb = 0; jb * BLOCK_N <= last_key; ++jb) {
    const int64_t j0 = jb * BLOCK_N, need = std::min(BLOCK_N, last_key - j0 + 1);
    // brgemm: columns rounded up to 32 (brgemm shapes repeat; the packed tail is zero); gemm: just those needed
    const int64_t width = a.brgemm() ? std::min(BLOCK_N, (need + 31) / 32 * 32) : need;
    scores(a, hk, jb, rows, width, w.q.get(), w.s.get());
    bool moved = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t valid = std::min(width, a.q_start + i0 + r / a.group - j0 + 1);  // keys j0 .. the query's own
      w.alpha[r] = softmax_row(w.s.get() + r * LD_S, valid, width, a.c, w.m[r], w.l[r], w.p.get() + r * LD_P);
      moved |= w.alpha[r] != 1.f;
    }
    if (jb > 0 && moved)
      for (int64_t r = 0; r < rows; ++r)
        if (w.alpha[r] != 1.f) scale_row(w.o.get() + r * Dv, w.alpha[r], Dv);  // the row's max moved
    accumulate(a, hk, jb, rows, width, w.p.get(), w.o.get(), jb > 0);
  }
  for (int64_t r = 0; r < rows; ++r)
    store_row(a.out + (i0 + r / a.group) * a.H * Dv + (hk * a.group + r % a.group) * Dv, w.o.get() + r * Dv,
              1.f / w.l[r], Dv);
}

#endif  // __AVX512F__ || __AVX2__

// brgemm: the AMX route (packs K and V into VNNI blocks first; needs could_pack()), else the gemm route.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool brgemm) {
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(false, "prefill_attention: this build has neither AVX-512 nor AVX2 + FMA");
#endif
  TORCH_CHECK(brgemm ? could_pack() : supported(), "prefill_attention: the ", brgemm ? "brgemm" : "gemm",
              " route is not available here (brgemm: AMX bf16 brgemm; gemm: MKL's cblas_gemm_bf16bf16f32)");
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
  auto out = at::empty({T, H, Dv}, q.options());
  if (T == 0) return out;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t group = H / Hk, nb = (S + BLOCK_N - 1) / BLOCK_N;
  Attn a{q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), q.stride(0), k.stride(0), v.stride(0),
         T, H, D, S, Hk, Dv, S - T, group, nb, float(scale) * float(M_LOG2E), nullptr, nullptr,
         out.data_ptr<bf16>()};
  std::unique_ptr<bf16[]> kpack, vpack;
  if (brgemm) {  // every element is written by the packing (tails zero-padded): no initialisation
    const int64_t kb_size = D * BLOCK_N, vb_size = BLOCK_N * Dv;  // elements per packed block
    kpack.reset(new bf16[Hk * nb * kb_size]);
    vpack.reset(new bf16[Hk * nb * vb_size]);
    at::parallel_for(0, Hk * nb, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t i = b0; i < b1; ++i) {
        const int64_t hk = i / nb, j0 = (i % nb) * BLOCK_N, rows = std::min(BLOCK_N, S - j0);
        pack_kt_vnni(a.k + j0 * a.ks + hk * D, a.ks, rows, D, kpack.get() + i * kb_size);
        pack_vnni(a.v + j0 * a.vs + hk * Dv, a.vs, rows, BLOCK_N, Dv, vpack.get() + i * vb_size);
      }
    });
    a.kpack = kpack.get();
    a.vpack = vpack.get();
  }
  // items (kv head, query block), longest (latest query block) first
  const int64_t mb = (T + BLOCK_M - 1) / BLOCK_M, items = Hk * mb;
  std::atomic<int64_t> next{0};
  const int64_t nth = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    Scratch w(BLOCK_M * group, D, Dv);
    for (int64_t it; (it = next.fetch_add(1)) < items;) attend_item(a, it % Hk, mb - 1 - it / Hk, w);
    if (brgemm) at::native::cpublas::brgemm_release();
  });
#endif
  return out;
}

}  // namespace

PDSERVE_OPS(m) {
  // causal bf16 flash attention over token-major q/k/v
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, bool brgemm) -> Tensor", &prefill_attention);
  m.def("supported() -> bool", &supported);    // this build runs prefill_attention on the gemm route
  m.def("could_pack() -> bool", &could_pack);  // cpublas brgemm runs bf16 on VNNI-packed B here (the brgemm route)
}
