"""The in-register MXFP4 expert kernel (``fused_gemv``: engine/moe/csrc/mx_gemm.cpp ``mx_moe_fp4``) against the
reference MX path (the tile kernel ``mx_grouped_gemm`` with ``fused_gather``'s SwiGLU and combine), bit for bit:
both sum each output's fp32 dot in one order (mx_simd.h) and the ops between the GEMMs are the same ATen calls. At
every ISA level this CPU runs (its avx2, avx512 and avx512_bf16 builds, forced) and the scalar code (``scalar``,
what a generic CPU's build runs); fp32 and bf16 activations; experts without tokens, 1..9 tokens an expert (the
kernel's 1..4-token register blocks and their remainders). With ``auto`` decode runs it and holds no dense
expert byte."""
import pytest
import torch

from engine import cpu_ext
from engine.moe import mx_cpu_kernel, mx_fused
from engine.moe.mx_experts import DequantCache, MXRoutedExperts
from engine.moe.router import Routing
from engine.quant.mx import MXFP4, MXSpec
from engine.quant.prepare import expert_memory
from isa_levels import usable_level

pytestmark = pytest.mark.skipif(not mx_cpu_kernel.available(), reason="no C++ compiler: the torch path runs")

E, H, I, K = 8, 128, 96, 2  # I = 96: three MX blocks (not a multiple of 64 elements)


@pytest.fixture(scope="module")
def experts() -> MXRoutedExperts:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, I, generator=gen) * torch.logspace(-8, 8, I, base=2.0)  # scales across blocks differ
    return MXRoutedExperts.from_dense(w13, w2, K, MXSpec(MXFP4))


@pytest.fixture(params=cpu_ext.ISA_LEVELS, scope="module")
def level(request):
    return usable_level(request.param, mx_cpu_kernel.kernel, "no MX kernel at ISA level {}")


def routing(T: int, seed: int, num_used: int = 6) -> Routing:
    """Top-2 over experts 0..num_used-1 (the others get no token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, num_used, generator=gen).topk(K, dim=-1)[1]
    return Routing(ids, torch.rand(T, K, generator=gen).softmax(-1))


def reference(m: MXRoutedExperts, x: torch.Tensor, r: Routing, level: str, scalar: bool) -> torch.Tensor:
    """``fused_gather``'s math (mx_fused._gather) through the tile kernel of ``level`` (its scalar code if asked)."""
    g = mx_fused.pair_groups(r, E)
    h = mx_cpu_kernel.grouped_gemm(x.float(), g.tok, g.experts, g.starts, m.w13_codes, m.w13_scales, MXFP4, 32,
                                   level, scalar).to(x.dtype)
    a = mx_fused.swiglu(h, lambda t: t).float()
    y = mx_cpu_kernel.grouped_gemm(a, None, g.experts, g.starts, m.w2_codes, m.w2_scales, MXFP4, 32, level,
                                   scalar).to(x.dtype)
    return mx_fused.combine(y, g, r)


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_tile_kernel_bit_for_bit(experts, level, dtype, scalar):
    for T, used in ((1, 6), (3, 6), (9, 2), (18, 3)):  # 18 tokens on 3 experts: 9 to 18 tokens an expert
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
        r = routing(T, seed=T, num_used=used)
        got = mx_cpu_kernel.moe_fp4(x, r.ids, r.weights, experts.w13_codes, experts.w13_scales, experts.w2_codes,
                                    experts.w2_scales, 32, level, scalar)
        assert got.dtype == dtype and got.shape == (T, H)
        assert torch.equal(got, reference(experts, x, r, level, scalar)), (T, level, scalar)


def test_simd_of_each_level(level):
    assert mx_cpu_kernel.path(level) == ("avx2" if level == "avx2" else "avx512")


def test_strategy_is_fused_gather_bitwise_and_batch_invariant(experts):
    x = torch.randn(9, H)
    r = routing(9, seed=5)
    experts.impl = "fused_gemv"
    batch = experts(x, r)
    assert experts.last_impl == "fused_gemv"
    experts.impl = "fused_gather"
    assert torch.equal(batch, experts(x, r))
    experts.impl = "fused_gemv"
    for t in (0, 4, 8):
        assert torch.equal(experts(x[t:t + 1], Routing(r.ids[t:t + 1], r.weights[t:t + 1]))[0], batch[t])
    experts.impl = "auto"


def test_auto_runs_it_for_small_batches_and_holds_no_dense_expert(experts):
    experts.cache = DequantCache(1 << 30)  # room for the whole layer: auto still does not dequantize it
    try:
        for T in (1, 2, 8):
            experts(torch.randn(T, H).bfloat16(), routing(T, seed=T))
            assert experts.last_impl == "fused_gemv" and experts.cache.used_bytes == 0
        mem = expert_memory(torch.nn.ModuleList([experts]))
        assert mem.dense_bytes == 0 and mem.cache_bytes == 0 and mem.resident_bytes == mem.mx_bytes
    finally:
        experts.cache = None


def test_switched_off_auto_runs_the_tile_kernel(experts):
    try:
        mx_fused.enable_gemv(False)  # what $PDSERVE_MX_GEMV=0 does at start-up
        experts(torch.randn(1, H), routing(1, seed=1))
        assert experts.last_impl == "fused_gather"
    finally:
        mx_fused.enable_gemv(True)


def test_not_for_what_it_does_not_compute(experts):
    """Activation quantization (Quark W4A4) and other formats keep the tile kernel."""
    assert experts.can_run("fused_gemv", torch.float32)
    act = MXRoutedExperts(E, H, I, K, MXSpec(MXFP4), act_spec=MXSpec(MXFP4))
    assert not act.can_run("fused_gemv", torch.float32) and act.decode_impl(torch.float32) == "fused_gather"
    assert not mx_fused.gemv_ok("mxfp6_e2m3", 32, True) and not mx_fused.gemv_ok("mxfp4", 16, True)


def test_refuses_bad_arguments(experts):
    x = torch.randn(1, H)
    m = experts
    with pytest.raises(RuntimeError, match="out of range"):
        mx_cpu_kernel.moe_fp4(x, torch.tensor([[0, E]]), torch.ones(1, 2), m.w13_codes, m.w13_scales, m.w2_codes,
                              m.w2_scales, 32)
    with pytest.raises(RuntimeError, match="w13 must be"):
        mx_cpu_kernel.moe_fp4(torch.randn(1, 64), torch.tensor([[0, 1]]), torch.ones(1, 2), m.w13_codes,
                              m.w13_scales, m.w2_codes, m.w2_scales, 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        mx_cpu_kernel.moe_fp4(x.half(), torch.tensor([[0, 1]]), torch.ones(1, 2), m.w13_codes, m.w13_scales,
                              m.w2_codes, m.w2_scales, 32)
