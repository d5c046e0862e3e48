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
// order (MXFP4: in its chunks' order, mx_simd.h), then a fixed reduction) whatever the number of pairs, so a
// 1-token decode and a 6-token verify round alike.
//
// Two MXFP4 kernels, bit for bit the same dots: the tile kernel above (mx_grouped_gemm: rows decoded into the
// tile, then dotted with every pair; any number of pairs) and mx_moe_fp4, the whole routed-expert layer of a few
// tokens in one call (fused_gemv): rows dotted in registers straight from the codes (mx_simd.h fp4_rows:
// vpmovzxbd, vpermps over the block's scaled 16-entry table, FMA), 4 rows x up to 4 tokens at a time, no tile.
//
// SIMD: AVX-512F (fp4: vpermps over the 16-entry value table; dot: 16 lanes), AVX2+FMA (fp4: 8-entry table
// + sign bit; dot: 8 lanes), else scalar (and ``scalar=True`` runs the scalar code in any build: tests). Chosen
// at compile time by the build's ISA level (engine/cpu_ext.py); fp6/fp8 decode through the scalar LUT and
// share the SIMD dot.
#include "mx_simd.h"
#include "ops.h"

#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sum.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace mx;

constexpr int64_t ROWS_PER_TILE = 4;
constexpr int64_t ROWS_PER_ITEM = 32;

using DecodeFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const float*, float*);

DecodeFn decoder(int64_t bits) {
  if (bits == 4) return decode_row_fp4;
  if (bits == 6) return decode_row_fp6;
  return decode_row_fp8;
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

// x [M, K] fp32 rows in the sum order of the fp4 dots of this build (fp4_chunk): a copy when it differs.
at::Tensor fp4_ordered(const at::Tensor& x, int64_t C) {
  if (C == 1) return x;
  auto out = at::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) fp4_permute(xp + m * K, K, C, op + m * K);
  return out;
}

// Rows n0..n1 of one expert (codes / scales at its row 0) dotted in registers with the M rows xs[] into ys[]
// (pointers; ys[t][n] is the output of row n), MAX_MT tokens at a time.
constexpr int64_t MAX_MT = 4;

template <int MT>
void fp4_rows_mt(const uint8_t* codes, const uint8_t* scales, int64_t Kp, int64_t Ks, int64_t K, int64_t bs,
                 const float* lut, const float* const* x, float* const* y, int64_t n0, int64_t n1) {
  constexpr int R = MT <= 2 ? 4 : 2;  // rows at once: R * MT accumulators (independent FMA chains) in registers
  int64_t n = n0;
  for (; n + R <= n1; n += R) fp4_rows<R, MT>(codes + n * Kp, Kp, scales + n * Ks, Ks, K, bs, lut, x, y, n);
  for (; n < n1; ++n) fp4_rows<1, MT>(codes + n * Kp, Kp, scales + n * Ks, Ks, K, bs, lut, x, y, n);
}

void fp4_block(const uint8_t* codes, const uint8_t* scales, int64_t Kp, int64_t Ks, int64_t K, int64_t bs,
               const float* lut, const float* const* xs, float* const* ys, int64_t M, int64_t n0, int64_t n1,
               bool scalar, std::vector<float>& buf) {
  for (int64_t t0 = 0; t0 < M; t0 += MAX_MT) {
    const int mt = int(std::min(MAX_MT, M - t0));
    const float* const* x = xs + t0;
    float* const* y = ys + t0;
    if (fp4_chunk(bs, scalar) == 1) {
      buf.resize(K);
      for (int64_t n = n0; n < n1; ++n)
        fp4_row_scalar(codes + n * Kp, scales + n * Ks, K, bs, lut, x, mt, y, n, buf.data());
    } else if (mt == 1) {
      fp4_rows_mt<1>(codes, scales, Kp, Ks, K, bs, lut, x, y, n0, n1);
    } else if (mt == 2) {
      fp4_rows_mt<2>(codes, scales, Kp, Ks, K, bs, lut, x, y, n0, n1);
    } else if (mt == 3) {
      fp4_rows_mt<3>(codes, scales, Kp, Ks, K, bs, lut, x, y, n0, n1);
    } else {
      fp4_rows_mt<4>(codes, scales, Kp, Ks, K, bs, lut, x, y, n0, n1);
    }
  }
}

// The in-register grouped GEMV: for group g (expert ge[g], pairs gs[g] .. gs[g+1]-1) and pair p,
// y[yrow(p)] = W[ge[g]] @ x[xrow(p)] (rows: the index arrays, or p where null). x in the fp4 sum order.
struct Fp4Weights {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t N, K, Kp, Ks, bs;
};

void fp4_grouped_gemv(const float* x, const int64_t* xrow, const int64_t* ge, const int64_t* gs, int64_t G,
                      const Fp4Weights& w, const float* lut, float* y, const int64_t* yrow, bool scalar) {
  const int64_t items_per_group = (w.N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  at::parallel_for(0, G * items_per_group, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> xs;
    std::vector<float*> ys;
    std::vector<float> buf;  // the scalar path's decoded row
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / items_per_group, e = ge[g];
      if (gs[g] == gs[g + 1]) continue;
      const int64_t n0 = (item % items_per_group) * ROWS_PER_ITEM, n1 = std::min(w.N, n0 + ROWS_PER_ITEM);
      xs.clear();
      ys.clear();
      for (int64_t p = gs[g]; p < gs[g + 1]; ++p) {
        xs.push_back(x + (xrow ? xrow[p] : p) * w.K);
        ys.push_back(y + (yrow ? yrow[p] : p) * w.N);
      }
      fp4_block(w.codes + e * w.N * w.Kp, w.scales + e * w.N * w.Ks, w.Kp, w.Ks, w.K, w.bs, lut, xs.data(),
                ys.data(), int64_t(xs.size()), n0, n1, scalar, buf);
    }
  });
}

}  // namespace

// y[p, :] = W[e(p)] @ x[row(p), :] for pairs p grouped by expert: group g covers pairs
// group_start[g] .. group_start[g+1]-1, all routed to expert group_expert[g]; row(p) = row_index[p]
// (or p when row_index is empty). x [M, K] fp32; returns y [P, N] fp32. ``scalar``: the scalar code whatever
// the build (tests; what a generic CPU runs).
at::Tensor mx_grouped_gemm(at::Tensor x, at::Tensor row_index, at::Tensor group_expert,
                              at::Tensor group_start, at::Tensor codes, at::Tensor scales,
                              at::Tensor lut, int64_t bits, int64_t block_size, bool scalar) {
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

  const int64_t C = bits == 4 ? fp4_chunk(block_size, scalar) : 1;  // fp4: x in the tile's sum order
  const auto xo = fp4_ordered(x, C);
  auto y = at::empty({P, N}, x.options());
  const float* xp = xo.data_ptr<float>();
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
        for (int64_t r = 0; r < nr; ++r) {
          const uint8_t* c = cp + (e * N + r0 + r) * Kp;
          const uint8_t* s = sp + (e * N + r0 + r) * Ks;
          if (bits == 4) {
            decode_row_fp4_tile(c, s, K, block_size, lp, scalar, tile.data() + r * K);
          } else {
            decode(c, s, K, block_size, lp, tile.data() + r * K);
          }
        }
        for (int64_t p = gs[g]; p < gs[g + 1]; ++p) {
          const float* xr = xp + (indexed ? ri[p] : p) * K;
          if (scalar) {
            for (int64_t r = 0; r < nr; ++r) yp[p * N + r0 + r] = dot_scalar(xr, tile.data() + r * K, K);
          } else if (nr == ROWS_PER_TILE) {
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

// The routed experts of an MXFP4 MoE layer for a few tokens, in one call (the ``fused_gemv`` strategy):
// x [T, H] fp32/bf16, ids [T, k] int64, weights [T, k] -> [T, H] in x's dtype. The pairs grouped by expert
// (stable, as engine.moe.mx_fused.pair_groups), W13 and W2 dotted in registers from the codes (each selected
// expert's bytes read once a call for up to MAX_MT of its tokens), and between them, and after, the very ATen
// ops fused_gather runs on the same shapes (the rounding to x's dtype, SwiGLU, the weighted sum over k): the
// result is fused_gather's, bit for bit, at the same ISA level.
at::Tensor mx_moe_fp4(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13_codes, at::Tensor w13_scales,
                      at::Tensor w2_codes, at::Tensor w2_scales, at::Tensor lut, int64_t block_size, bool scalar) {
  check_weights(w13_codes, w13_scales, lut, 4);
  check_weights(w2_codes, w2_scales, lut, 4);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: fp32 or bf16 [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) &&
              weights.dim() == 2 && weights.sizes() == ids.sizes(), "ids int64 [T, k], weights [T, k]");
  TORCH_CHECK(block_size > 0 && block_size % 32 == 0, "block_size must be a multiple of 32");
  const int64_t T = x.size(0), H = x.size(1), K = ids.size(1), P = T * K, E = w13_codes.size(0);
  const int64_t N1 = w13_codes.size(1), I = N1 / 2;
  TORCH_CHECK(N1 % 2 == 0 && w13_codes.size(2) * 2 == H && w13_scales.size(2) * block_size == H,
              "w13 must be [E, 2I, H/2] codes with [E, 2I, H/bs] scales for x [T, H]");
  TORCH_CHECK(w2_codes.size(0) == E && w2_codes.size(1) == H && w2_codes.size(2) * 2 == I &&
              w2_scales.size(2) * block_size == I, "w2 must be [E, H, I/2] codes with [E, H, I/bs] scales");
  const auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0), order(P), tok(P), ge, gs{0};
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id ", id[p], " out of range");
    ++count[id[p]];
  }
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) {
      next[e] = gs.back();
      ge.push_back(e);
      gs.push_back(gs.back() + count[e]);
    }
  for (int64_t p = 0; p < P; ++p) {  // stable: within an expert, pairs in (token, k) order
    const int64_t q = next[id[p]]++;
    order[q] = p;
    tok[q] = p / K;
  }
  const int64_t G = int64_t(ge.size()), C = fp4_chunk(block_size, scalar);
  const float* lp = lut.data_ptr<float>();
  const Fp4Weights w13{w13_codes.data_ptr<uint8_t>(), w13_scales.data_ptr<uint8_t>(), N1, H, H / 2, H / block_size,
                       block_size};
  const Fp4Weights w2{w2_codes.data_ptr<uint8_t>(), w2_scales.data_ptr<uint8_t>(), H, I, I / 2, I / block_size,
                      block_size};

  const auto xo = fp4_ordered(x.to(at::kFloat).contiguous(), C);  // [T, H]
  auto h = at::empty({P, N1}, xo.options());                      // [P, 2I], pairs sorted by expert
  fp4_grouped_gemv(xo.data_ptr<float>(), tok.data(), ge.data(), gs.data(), G, w13, lp, h.data_ptr<float>(), nullptr,
                   scalar);
  const auto hx = h.to(x.scalar_type());
  const auto a = at::mul(at::silu(hx.slice(1, 0, I)), hx.slice(1, I)).to(at::kFloat).contiguous();  // [P, I]
  const auto ao = fp4_ordered(a, C);
  auto y = at::empty({P, H}, xo.options());  // [P, H] in (token, k) order
  fp4_grouped_gemv(ao.data_ptr<float>(), nullptr, ge.data(), gs.data(), G, w2, lp, y.data_ptr<float>(),
                   order.data(), scalar);
  const auto ys = y.to(x.scalar_type());
  return at::sum(at::mul(ys.view({T, K, H}), weights.unsqueeze(-1).to(ys.scalar_type())), {1});
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
        "Tensor scales, Tensor lut, int bits, int block_size, bool scalar=False) -> Tensor", &mx_grouped_gemm);
  // the routed experts of an MXFP4 layer for a few tokens, dotted in registers (fused_gemv)
  m.def("mx_moe_fp4(Tensor x, Tensor ids, Tensor weights, Tensor w13_codes, Tensor w13_scales, Tensor w2_codes, "
        "Tensor w2_scales, Tensor lut, int block_size, bool scalar=False) -> Tensor", &mx_moe_fp4);
  // dequantize selected experts into a buffer
  m.def("mx_dequant_into(Tensor codes, Tensor scales, Tensor experts, Tensor lut, int bits, int block_size, "
        "Tensor(a!) out) -> ()", &mx_dequant_into);
  m.def("simd() -> str", &mx_simd);  // the SIMD level this build uses
}
