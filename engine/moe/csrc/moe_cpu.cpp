// Fused bf16 MoE experts for CPU prefill: y[t] = sum_k w[t,k] * W2[e] (silu(Wg[e] x[t]) * (Wu[e] x[t])),
// e = ids[t,k], bf16 inputs and weights, fp32 accumulation (the design of SGLang's sgl-kernel fused_experts_cpu).
//
// Weights are packed once into the VNNI layout brgemm wants for B ([K/2][N][2] bf16): per expert, tiles of
// columns, each [K/2][width][2]. w13 [E, 2I, H] -> tiles of `bn1` gate columns followed by the same `bn1` up
// columns (so silu(gate) * up pairs sit in one tile); w2 [E, H, I] -> tiles of `bn2` output columns. A last,
// narrower tile takes the remainder, so any even H and I work.
//
// That is the brgemm route (AMX CPUs at ISA level amx, engine/cpu_ext.py). Below amx the gemm route runs the same
// blocks on the weights as stored (no packing) with a bf16 -> fp32 BLAS GEMM (../../csrc/bf16_gemm.h: MKL's),
// one GEMM per block for all of w13's columns and one for w2's; the epilogues are
// AVX-512 where the build has it, scalar (auto-vectorized) otherwise, and round identically.
//
// One chunk of tokens: a counting sort of its (token, slot) pairs by expert (stable: pairs of an expert keep token order),
// then the pairs of each expert in blocks of block_m rows, handed to threads from an atomic counter. Per block:
// gather its x rows into a thread-local bf16 buffer; per w13 tile one brgemm (AMX) into fp32, silu(gate) * up
// rounded to bf16 into a thread-local [rows, I] buffer; per w2 tile one brgemm, times the routing
// weight, rounded to bf16 into that pair's row of a [T*K, H] buffer (each pair's row is written by one
// block only: no races). Last, per token, the K rows summed in fp32 in slot order, rounded once to bf16.
//
// The result does not depend on the thread count (each output element is one fixed sequence of operations), and
// the epilogues round where the torch strategies' bf16 tensors do (below), so it equals the ``gather`` strategy
// but for the GEMMs' fp32 summation order.
#include "ops.h"
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;
constexpr int64_t KEEP_BYTES = int64_t(64) << 20;

#if defined(__AVX512F__)
// exp(x) to ~1 ulp of fp32 over the range silu needs (Cephes expf polynomial; 2^n applied by scalef)
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// fp32 -> bf16, round to nearest even (NaN stays NaN), as c10::BFloat16's constructor
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                  _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

inline __m512 from_bf16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// fp32 -> the nearest bf16, as fp32
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
#endif

// The epilogues round where the torch strategies' bf16 tensors do (each GEMM output, silu's, the product's,
// y * w's), so the kernel agrees with the batch-invariant ``gather`` path up to the GEMMs' fp32 summation
// order: a verify step run by this kernel decodes as the gather-run decode steps do (lossless greedy
// speculation).
inline float rb(float v) { return float(bf16(v)); }
inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// out[c] = bf16(bf16(silu(bf16(g[c]))) * bf16(u[c])), c < n
void silu_mul(const float* g, const float* u, bf16* out, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    const __m512 gv = round_bf16(_mm512_maskz_loadu_ps(m, g + c)), uv = round_bf16(_mm512_maskz_loadu_ps(m, u + c));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    _mm256_mask_storeu_epi16(out + c, m, to_bf16(_mm512_mul_ps(round_bf16(_mm512_div_ps(gv, d)), uv)));
  }
#endif
  for (; c < n; ++c) out[c] = bf16(rb(silu(rb(g[c]))) * rb(u[c]));
}

// out[c] = bf16(bf16(y[c]) * bf16(w)), c < n
void scale_round(const float* y, float w, bf16* out, int64_t n) {
  int64_t c = 0;
  w = rb(w);
#if defined(__AVX512F__)
  for (; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    _mm256_mask_storeu_epi16(out + c, m, to_bf16(_mm512_mul_ps(_mm512_set1_ps(w), round_bf16(_mm512_maskz_loadu_ps(m, y + c)))));
  }
#endif
  for (; c < n; ++c) out[c] = bf16(w * rb(y[c]));
}

// out[c] = bf16(sum_k rows[k * H + c]) in fp32, k in order, c < H
void sum_rows(const bf16* rows, int64_t K, int64_t H, bf16* out) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c < H; c += 16) {
    const __mmask16 m = tail_mask(H - c);
    __m512 acc = from_bf16(rows + c, m);
    for (int64_t k = 1; k < K; ++k) acc = _mm512_add_ps(acc, from_bf16(rows + k * H + c, m));
    _mm256_mask_storeu_epi16(out + c, m, to_bf16(acc));
  }
#endif
  for (; c < H; ++c) {
    float acc = float(rows[c]);
    for (int64_t k = 1; k < K; ++k) acc += float(rows[k * H + c]);
    out[c] = bf16(acc);
  }
}

// Source row of column r of tile j (width nb): gate_up tiles hold nb gate rows, then the same nb up rows.
inline int64_t tile_row(bool gate_up, int64_t half, int64_t bn, int64_t j, int64_t nb, int64_t r) {
  if (!gate_up) return j * bn + r;
  return r < nb ? j * bn + r : half + j * bn + (r - nb);
}

// w [E, N, K] bf16 -> the VNNI tiles described at the top, same size. gate_up: N = 2I and tiles of bn gate + bn
// up columns; else tiles of bn columns.
at::Tensor pack_vnni(const at::Tensor& w, int64_t bn, bool gate_up) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.is_contiguous(),
              "pack_vnni: w must be a contiguous CPU bf16 [E, N, K] tensor");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(K % 2 == 0 && bn > 0 && (!gate_up || N % 2 == 0), "pack_vnni: K and (gate_up) N must be even, bn > 0");
  const int64_t half = gate_up ? N / 2 : N, ntiles = (half + bn - 1) / bn, per = gate_up ? 2 : 1;
  at::Tensor out = at::empty_like(w);
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // [E, N, K/2] bf16 pairs
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, E * ntiles, 1, [&](int64_t b, int64_t e_) {
    for (int64_t i = b; i < e_; ++i) {
      const int64_t e = i / ntiles, j = i % ntiles, nb = std::min(bn, half - j * bn), width = per * nb;
      const uint32_t* we = src + e * N * (K / 2);
      uint32_t* tile = dst + e * N * (K / 2) + j * per * bn * (K / 2);
      for (int64_t r = 0; r < width; ++r) {
        const uint32_t* row = we + tile_row(gate_up, half, bn, j, nb, r) * (K / 2);
        for (int64_t kk = 0; kk < K / 2; ++kk) tile[kk * width + r] = row[kk];
      }
    }
  });
  return out;
}

struct Block {
  int64_t expert, start, rows;  // rows [start, start + rows) of the expert-sorted pairs
};

struct Shapes {
  int64_t H, I, E, K, bn1, bn2, block_m;
};

// One block of one expert's pairs on the brgemm route (AMX): w13e / w2e the expert's VNNI tiles.
void block_brgemm(const Shapes& sh, const Block& blk, const int64_t* order, const float* wt, const bf16* w13e,
                  const bf16* w2e, const bf16* a, bf16* inter, float* c, bf16* po) {
  const int64_t H = sh.H, I = sh.I, bn1 = sh.bn1, bn2 = sh.bn2, M = blk.rows, ldc = std::max(2 * bn1, bn2);
  for (int64_t j = 0; j * bn1 < I; ++j) {
    const int64_t nb = std::min(bn1, I - j * bn1);
    at::native::cpublas::brgemm(M, 2 * nb, H, H, 2 * nb, ldc, false, a, w13e + j * 2 * bn1 * H, c);
    for (int64_t r = 0; r < M; ++r) silu_mul(&c[r * ldc], &c[r * ldc + nb], &inter[r * I + j * bn1], nb);
  }
  for (int64_t j = 0; j * bn2 < H; ++j) {
    const int64_t nb = std::min(bn2, H - j * bn2);
    at::native::cpublas::brgemm(M, nb, I, I, nb, ldc, false, inter, w2e + j * bn2 * I, c);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t p = order[blk.start + r];
      scale_round(&c[r * ldc], wt[p], po + p * H + j * bn2, nb);
    }
  }
}

// The same block on the gemm route (bf16 in, fp32 out, ../../csrc/bf16_gemm.h): w13e [2I, H] / w2e [H, I] the
// expert's rows as stored, one GEMM each over all columns: C = A x W^T.
void block_gemm(const Shapes& sh, const Block& blk, const int64_t* order, const float* wt, const bf16* w13e,
                const bf16* w2e, const bf16* a, bf16* inter, float* c, bf16* po) {
  const int64_t H = sh.H, I = sh.I, M = blk.rows;
  pdserve::gemm_bf16(true, M, 2 * I, H, a, H, w13e, H, 0.f, c, 2 * I);  // c [M, 2I]: gate columns, then up
  for (int64_t r = 0; r < M; ++r) silu_mul(&c[r * 2 * I], &c[r * 2 * I + I], &inter[r * I], I);
  pdserve::gemm_bf16(true, M, H, I, inter, I, w2e, I, 0.f, c, H);  // c [M, H]
  for (int64_t r = 0; r < M; ++r) {
    const int64_t p = order[blk.start + r];
    scale_round(&c[r * H], wt[p], po + p * H, H);
  }
}

// Tokens [0, T) of a chunk: x [T, H], id / wt [T, K], out [T, H]; po a [T*K, H] scratch buffer. brgemm: w13d / w2d
// are pack_vnni's tiles and the AMX route runs; else they are the weights as stored and the gemm route runs.
void moe_chunk(const Shapes& sh, const bf16* xd, const int64_t* id, const float* wt, const bf16* w13d,
               const bf16* w2d, bf16* po, bf16* od, int64_t T, bool brgemm) {
  const int64_t H = sh.H, I = sh.I, E = sh.E, K = sh.K, block_m = sh.block_m, P = T * K;
  // counting sort of the pairs by expert (stable)
  std::vector<int64_t> offset(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) ++offset[id[p] + 1];
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[fill[id[p]]++] = p;
  }
  std::vector<Block> blocks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t s = offset[e]; s < offset[e + 1]; s += block_m) blocks.push_back({e, s, std::min(block_m, offset[e + 1] - s)});
  const int64_t ldc = brgemm ? std::max(2 * sh.bn1, sh.bn2) : std::max(2 * I, H);
  const auto run = brgemm ? block_brgemm : block_gemm;
  std::atomic<int64_t> next{0};
  const int64_t nthr = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(blocks.size()));
  at::parallel_for(0, nthr, 1, [&](int64_t tb, int64_t te) {
    std::vector<bf16> a(block_m * H), inter(block_m * I);
    std::vector<float> c(block_m * ldc);
    for (int64_t tid = tb; tid < te; ++tid) {
      for (int64_t bi = next++; bi < static_cast<int64_t>(blocks.size()); bi = next++) {
        const Block& blk = blocks[bi];
        for (int64_t r = 0; r < blk.rows; ++r)
          std::memcpy(&a[r * H], xd + (order[blk.start + r] / K) * H, H * sizeof(bf16));
        run(sh, blk, order.data(), wt, w13d + blk.expert * 2 * I * H, w2d + blk.expert * H * I, a.data(),
            inter.data(), c.data(), po);
      }
    }
    if (brgemm) at::native::cpublas::brgemm_release();
  });
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sum_rows(po + t * K * H, K, H, od + t * H);
  });
}

// x [T, H] bf16, w13p / w2p from pack_vnni (bn1 gate_up, bn2 plain; brgemm) or the weights as stored (w13 [E, 2I,
// H], w2 [E, H, I]; the gemm route), ids [T, K] int64, weights [T, K] fp32.
// Runs chunk_tokens tokens at a time: the chunk's [tokens*K, H] pair buffer then stays in cache between the
// expert pass that writes it and the sum that reads it (at 8k tokens of glm4_moe it would be 16 MiB).
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p, const at::Tensor& ids,
                     const at::Tensor& weights, int64_t bn1, int64_t bn2, int64_t block_m, int64_t chunk_tokens,
                     bool brgemm) {
  TORCH_CHECK(brgemm ? at::native::cpublas::could_pack(at::kBFloat16) : pdserve::have_gemm_bf16(),
              "fused_moe: the ", brgemm ? "brgemm" : "gemm", " route is not available here (brgemm: AMX bf16 brgemm; "
              "gemm: MKL's cblas_gemm_bf16bf16f32)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "fused_moe: x must be a contiguous CPU bf16 [T, H] tensor");
  TORCH_CHECK(w13p.scalar_type() == at::kBFloat16 && w13p.dim() == 3 && w13p.is_contiguous() &&
              w2p.scalar_type() == at::kBFloat16 && w2p.dim() == 3 && w2p.is_contiguous(),
              "fused_moe: packed weights must be contiguous bf16 [E, N, K]");
  const int64_t T = x.size(0), H = x.size(1), E = w13p.size(0), I = w13p.size(1) / 2;
  TORCH_CHECK(w13p.size(2) == H && w2p.size(0) == E && w2p.size(1) == H && w2p.size(2) == I && H % 2 == 0 &&
              I % 2 == 0, "fused_moe: weight shapes do not match x (need w13 [E, 2I, H], w2 [E, H, I], H, I even)");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == T && ids.is_contiguous() &&
              weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "fused_moe: ids int64 [T, K] and weights fp32 [T, K], contiguous");
  TORCH_CHECK(bn1 > 0 && bn2 > 0 && block_m > 0 && chunk_tokens > 0,
              "fused_moe: tile widths, block rows and chunk tokens must be positive");
  const int64_t K = ids.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < T * K; ++p)
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "fused_moe: expert id ", id[p], " out of range [0, ", E, ")");
  const int64_t chunk = std::min(T, chunk_tokens), pairs = chunk * K;
  // the chunk's pair buffer. Up to KEEP_BYTES it is kept per calling thread (grown, never shrunk): a fresh
  // allocation of this size comes from mmap, and its first-touch page faults cost about as much as the sum
  // that reads it.
  thread_local std::vector<bf16> kept;
  at::Tensor fresh;
  bf16* po;
  if (pairs * H * int64_t(sizeof(bf16)) <= KEEP_BYTES) {
    if (static_cast<int64_t>(kept.size()) < pairs * H) kept.resize(pairs * H);
    po = kept.data();
  } else {
    fresh = at::empty({pairs, H}, x.options());
    po = fresh.data_ptr<bf16>();
  }
  const Shapes sh{H, I, E, K, bn1, bn2, block_m};
  const bf16* xd = x.data_ptr<bf16>();
  const float* wt = weights.data_ptr<float>();
  bf16* od = out.data_ptr<bf16>();
  for (int64_t t0 = 0; t0 < T; t0 += chunk)
    moe_chunk(sh, xd + t0 * H, id + t0 * K, wt + t0 * K, w13p.data_ptr<bf16>(), w2p.data_ptr<bf16>(), po,
              od + t0 * H, std::min(chunk, T - t0), brgemm);
  return out;
}

// How many threads at::parallel_for spreads 64 items over (1 when built without OpenMP: cpu_ext.CFLAGS).
int64_t parallel_threads() {
  std::vector<int> seen(at::get_num_threads(), 0);
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace

bool could_pack_bf16() { return at::native::cpublas::could_pack(at::kBFloat16); }

PDSERVE_OPS(m) {
  m.def("pack_vnni(Tensor w, int bn, bool gate_up) -> Tensor", &pack_vnni);  // w [E, N, K] bf16 -> VNNI tiles
  m.def("fused_moe(Tensor x, Tensor w13p, Tensor w2p, Tensor ids, Tensor weights, int bn1, int bn2, int block_m, "
        "int chunk_tokens, bool brgemm) -> Tensor", &fused_moe);  // fused bf16 MoE experts (see above)
  m.def("parallel_threads() -> int", &parallel_threads);  // threads at::parallel_for uses here
  m.def("could_pack() -> bool", &could_pack_bf16);         // brgemm runs bf16 on VNNI-packed B (the brgemm route)
  m.def("have_gemm() -> bool", &pdserve::have_gemm_bf16);  // the bf16 GEMM of the gemm route is there
}
