// bf16 x bf16 -> fp32 GEMM for the kernels' non-AMX route (included by engine/**/csrc/*.cpp; engine/cpu_ext.py puts
// this directory on their include path and hashes it into their build names).
//
// torch's at::native::cpublas::gemm has this overload (bf16 in, fp32 out; torch's FlashAttentionKernel.cpp uses it
// where cpublas::could_pack is false), but it is not exported from libtorch_cpu (no TORCH_API): an extension that
// calls it fails to load (undefined symbol). What torch's x86 wheels do export is MKL's cblas_gemm_bf16bf16f32
// (MKL is linked in statically; it has AVX-512 and AVX2 kernels), so the kernels call that, looked up at run time:
// a torch without it still loads the extension (its AMX brgemm route keeps working) and have_gemm_bf16() is false.
#pragma once

#include <dlfcn.h>

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pdserve {

// MKL LP64 cblas: (layout, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), MKL_BF16 = uint16_t
using GemmBf16Fn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                            float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_LAYOUT / CBLAS_TRANSPOSE

inline GemmBf16Fn gemm_bf16_fn() {
  static const GemmBf16Fn fn = [] {
    void* f = dlsym(RTLD_DEFAULT, "cblas_gemm_bf16bf16f32");
    if (f == nullptr) {  // libtorch_cpu loaded RTLD_LOCAL: look in it by name
      if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) f = dlsym(lib, "cblas_gemm_bf16bf16f32");
    }
    return reinterpret_cast<GemmBf16Fn>(f);
  }();
  return fn;
}

inline bool have_gemm_bf16() { return gemm_bf16_fn() != nullptr; }

// Row-major C [M, N] (fp32, ldc) = A [M, K] (lda) x B [K, N] (ldb) + beta * C; with b_trans, B is stored [N, K]
// (ldb) and its transpose is used. beta 0: C is only written.
inline void gemm_bf16(bool b_trans, int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                      const c10::BFloat16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm_bf16_fn()(kRowMajor, kNoTrans, b_trans ? kTrans : kNoTrans, int(M), int(N), int(K), 1.f,
                 reinterpret_cast<const uint16_t*>(A), int(lda), reinterpret_cast<const uint16_t*>(B), int(ldb), beta,
                 C, int(ldc));
}

}  // namespace pdserve
