"""Fused MX MoE kernels against the dequantized reference: every MX format, fp32 and bf16 activations, odd
token counts, experts without tokens; the C++ CPU kernel here, the Triton kernel under TRITON_INTERPRET=1 in
a subprocess (the interpreter is chosen when a kernel is decorated, i.e. at import).

Tolerances: the fused kernels sum each output in a different order than the library GEMM of the reference,
and nothing else differs (MX values and their products with fp32 activations are exact in fp32), so fp32
outputs agree to rtol 1e-5 / atol 1e-5 (outputs are O(1)); bf16 runs round h and y to bf16 at the same places as
the reference, so they agree to one bf16 rounding of an O(1) value plus what it propagates: atol 3e-2. Bit-exact:
the dequantized tile (fused_sorted's weights) equals dequantize_mx, and fused_gather's outputs for one token
are bitwise the same alone and in a batch (batch invariance)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from engine import cpu_ext
from engine.moe import mx_cpu_kernel
from engine.moe.mx_experts import MXRoutedExperts
from engine.moe.router import Routing
from engine.quant.mx import MX_FORMATS, MXSpec, dequantize_mx, quantize_mx

pytestmark = pytest.mark.skipif(not mx_cpu_kernel.available(), reason="no C++ compiler: the torch path runs")

E, H, I, K = 8, 64, 96, 2  # I = 96: three MX blocks, not a multiple of the 4-row tile's 64-element vectors


def make_experts(fmt: str, impl: str, seed: int = 0) -> MXRoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, I, generator=gen) * 0.2
    return MXRoutedExperts.from_dense(w13, w2, K, MXSpec(MX_FORMATS[fmt]), impl=impl)


def routing_with_empty_experts(T: int, seed: int = 0) -> Routing:
    """Top-2 routing over experts 0..5 only: experts 6 and 7 get no tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, 6, generator=gen).topk(K, dim=-1)[1]
    return Routing(ids, torch.rand(T, K, generator=gen).softmax(-1))


def run(m: MXRoutedExperts, impl: str, x: torch.Tensor, r: Routing) -> torch.Tensor:
    m.impl = impl
    out = m(x, r)
    assert m.last_impl == impl
    return out


@pytest.mark.parametrize("fmt", sorted(MX_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["fused_gather", "fused_sorted"])
def test_cpu_fused_matches_dequantized_reference(fmt, dtype, impl):
    m = make_experts(fmt, "auto")
    for T in (1, 3, 7, 33):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
        r = routing_with_empty_experts(T, seed=T)
        want = run(m, "mx_sorted", x, r)  # dequantize each expert, library GEMMs
        got = run(m, impl, x, r)
        assert got.dtype == dtype and got.shape == (T, H)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=3e-2)


def test_cpu_fused_gather_is_batch_invariant():
    m = make_experts("mxfp4", "fused_gather")
    x = torch.randn(9, H)
    r = routing_with_empty_experts(9, seed=5)
    batch = m(x, r)
    for t in (0, 4, 8):
        alone = m(x[t:t + 1], Routing(r.ids[t:t + 1], r.weights[t:t + 1]))
        assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("fmt", sorted(MX_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_dequant_tile_is_bit_exact(fmt, dtype):
    w = torch.randn(5, 40, 96) * torch.logspace(-30, 30, 96, base=2.0)  # scales across the E8M0 range
    q = quantize_mx(w, fmt)
    out = torch.empty(2, 40, 96, dtype=dtype)
    got = mx_cpu_kernel.dequant_into(q.codes, q.scales, torch.tensor([4, 1]), MX_FORMATS[fmt], 32, out)
    assert torch.equal(got, dequantize_mx(q, dtype)[[4, 1]])


SIMD_LEVELS = sorted({cpu_ext.isa(), "avx2"} & set(cpu_ext.levels_up_to(cpu_ext.host_isa())))
"""The levels whose builds differ in the kernel's SIMD (avx512, avx512_bf16 and amx all build its AVX-512 code):
this process's and avx2 (the AVX2 + FMA branches, forced on an AVX-512 host)."""


@pytest.mark.parametrize("level", SIMD_LEVELS)
@pytest.mark.parametrize("fmt", sorted(MX_FORMATS))
def test_kernel_at_each_simd_level_matches_reference(fmt, level):
    """grouped_gemm and dequant_into of the build for ``level`` against the dequantized weights (fp32 GEMM)."""
    if mx_cpu_kernel.kernel(level) is None:
        pytest.skip(f"the MX kernel did not build at {level}")
    assert mx_cpu_kernel.path(level) == ("avx2" if level == "avx2" else "avx512")
    g = torch.Generator().manual_seed(len(fmt))
    q = quantize_mx(torch.randn(3, 40, 96, generator=g), fmt)
    dense = dequantize_mx(q, torch.float32)
    x = torch.randn(7, 96, generator=g)
    rows = torch.tensor([6, 0, 2, 2, 5, 1])  # pairs 0..1 -> expert 2, 2..5 -> expert 0
    got = mx_cpu_kernel.grouped_gemm(x, rows, torch.tensor([2, 1, 0]), torch.tensor([0, 2, 2, 6]), q.codes, q.scales,
                                     MX_FORMATS[fmt], 32, level)
    want = torch.cat([x[rows[:2]] @ dense[2].t(), x[rows[2:]] @ dense[0].t()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out = torch.empty(2, 40, 96, dtype=torch.bfloat16)
    got = mx_cpu_kernel.dequant_into(q.codes, q.scales, torch.tensor([2, 0]), MX_FORMATS[fmt], 32, out, level)
    assert torch.equal(got, dequantize_mx(q, torch.bfloat16)[[2, 0]])


def test_kernel_rejects_bad_arguments():
    q = quantize_mx(torch.randn(2, 8, 64), "mxfp4")
    fmt = MX_FORMATS["mxfp4"]
    with pytest.raises(RuntimeError, match="row_index out of range"):
        mx_cpu_kernel.grouped_gemm(torch.randn(1, 64), torch.tensor([3]), torch.tensor([0]), torch.tensor([0, 1]),
                                   q.codes, q.scales, fmt, 32)
    with pytest.raises(RuntimeError, match="K does not match"):
        mx_cpu_kernel.grouped_gemm(torch.randn(1, 32), None, torch.tensor([0]), torch.tensor([0, 1]),
                                   q.codes, q.scales, fmt, 32)
    with pytest.raises(RuntimeError, match="bad group"):
        mx_cpu_kernel.grouped_gemm(torch.randn(1, 64), None, torch.tensor([2]), torch.tensor([0, 1]),
                                   q.codes, q.scales, fmt, 32)


def test_auto_decode_runs_fused_and_holds_no_dense_copy():
    from engine.moe.mx_experts import DequantCache
    m = make_experts("mxfp4", "auto")
    m.cache = DequantCache(1 << 30)  # room for the whole layer: auto still does not dequantize it
    x = torch.randn(33, H)
    for T in (1, 6, 33):
        m(x[:T], routing_with_empty_experts(T))
        assert m.last_impl in ("fused_gemv", "fused_gather", "fused_sorted") and m.cache.used_bytes == 0


TRITON_CHECK = r"""
import json, torch
from engine.moe.mx_experts import MXRoutedExperts
from engine.moe.router import Routing
from engine.quant.mx import MXSpec, MXFP4
E, H, I, K = 8, 64, 96, 2
gen = torch.Generator().manual_seed(0)
m = MXRoutedExperts.from_dense(torch.randn(E, 2 * I, H, generator=gen) * 0.2, torch.randn(E, H, I, generator=gen) * 0.2,
                               K, MXSpec(MXFP4))
err = {}
for dtype in (torch.float32, torch.bfloat16):
    for T in (1, 7, 33):
        x = torch.randn(T, H, generator=gen).to(dtype)
        ids = torch.rand(T, 6, generator=gen).topk(K, dim=-1)[1]  # experts 6, 7 empty
        r = Routing(ids, torch.rand(T, K, generator=gen).softmax(-1))
        m.impl = "mx_sorted"; want = m(x, r).float()
        m.impl = "triton"; got = m(x, r)
        assert m.last_impl == "triton" and got.dtype == dtype
        err[f"{dtype}-{T}"] = (got.float() - want).abs().max().item()
print(json.dumps(err))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_under_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    err = json.loads(out.stdout.strip().splitlines()[-1])
    for key, e in err.items():
        assert e <= (1e-5 if "float32" in key else 3e-2), (key, e)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_on_gpu_matches_reference():
    m = make_experts("mxfp4", "auto").cuda()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for T in (1, 7, 33, 512):
            x = torch.randn(T, H, device="cuda").to(dtype)
            r = routing_with_empty_experts(T)
            r = Routing(r.ids.cuda(), r.weights.cuda())
            want = run(m, "mx_sorted", x, r).float()
            torch.testing.assert_close(run(m, "triton", x, r).float(), want, rtol=0, atol=tol)
    assert m.decode_impl(torch.float32) == "triton"
