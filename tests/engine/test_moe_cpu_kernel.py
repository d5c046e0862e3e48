"""The fused bf16 CPU MoE kernel (``engine/moe/csrc/moe_cpu.cpp``, strategy ``fused_cpu``): equal to the MoE
definition within bf16 rounding for uneven expert loads, odd sizes and top-k 1/4/8; clear errors for what it cannot
run; ``auto`` picks it for bf16 prefill (a real model's too) and never for decode-sized batches."""
import dataclasses

import os

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_ext
from isa_levels import usable_level
from shared_helpers import TINY_MOE
from engine.checkpoint import init_random_model
from engine.config import ModelConfig
from engine.load import load_model
from engine.moe import moe_cpu_kernel
from engine.moe.experts import GATHER_MAX_PAIRS, MOE_IMPLS, RoutedExperts, moe_fused_cpu, moe_gather, moe_sorted
from engine.moe.router import Routing
from engine.offline import Engine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(moe_cpu_kernel.kernel() is None,
                                reason="the fused MoE kernel did not build (no compiler?): the torch strategies run")
picked = pytest.mark.skipif(not moe_cpu_kernel.available(),
                            reason=f"auto keeps the torch strategies at ISA level {cpu_ext.isa()} (measured faster)")


@pytest.fixture(params=cpu_ext.ISA_LEVELS, scope="module")
def level(request):
    return usable_level(request.param, moe_cpu_kernel.kernel, "no fused MoE kernel at ISA level {}")



def reference(x, w13, w2, routing):
    """The definition in float64: sum_k w[t,k] * W2[e] (silu(Wg[e] x) * (Wu[e] x)), e = ids[t,k]."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    I = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        t, k = (routing.ids == e).nonzero(as_tuple=True)
        if t.numel():
            h = x[t] @ w13[e].t()
            y = (F.silu(h[:, :I]) * h[:, I:]) @ w2[e].t()
            out.index_add_(0, t, y * routing.weights[t, k, None].double())
    return out


def uneven_routing(T, E, K, g):
    """Duplicate-free top-K per token, expert e drawn ~ e + 1 times as often, expert 0 never and expert 1 once
    (when T * K leaves room)."""
    p = torch.arange(1, E + 1, dtype=torch.float)
    p[:2] = 0
    ids = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    if E > 2:
        ids[0, 0] = 1
    return Routing(ids, torch.rand(T, K, generator=g))


def weights(E, H, I, g, dtype=torch.bfloat16):
    return ((torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype),
            (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype))


@pytest.mark.parametrize("T,E,H,I,K", [(1, 4, 64, 32, 1), (3, 16, 256, 128, 4), (37, 16, 256, 128, 8),
                                       (301, 16, 200, 72, 4), (1023, 8, 320, 130, 1), (3000, 16, 256, 128, 4),
                                       (577, 64, 96, 66, 8)])
def test_fused_equals_definition(T, E, H, I, K, level):
    g = torch.Generator().manual_seed(T + E + H)
    w13, w2 = weights(E, H, I, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    r = uneven_routing(T, E, K, g)
    counts = torch.bincount(r.ids.reshape(-1), minlength=E)
    assert counts[0] == 0 and (E <= 2 or counts[1] == 1)
    want = reference(x, w13, w2, r)
    got = moe_fused_cpu(x, w13, w2, r, moe_cpu_kernel.pack(w13, w2, level))
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    err = (got.double() - want).abs()
    scale = want.abs().max()
    # bf16 rounds the activation, each pair's output and the sum: a few ulps (2^-8) of the output's scale
    assert err.max() <= 0.02 * scale and err.mean() <= 2e-3 * scale, (err.max(), scale)
    # as close as the torch strategy that rounds the same intermediates
    sorted_err = (moe_sorted(x, w13, w2, r).double() - want).abs()
    assert err.mean() <= 1.5 * sorted_err.mean()


def test_token_chunks_change_nothing(monkeypatch, level):
    """The kernel runs chunks of tokens (its pair buffer stays in cache); each token's result is the same: bit for
    bit on the brgemm route; on the gemm route but for the library GEMM's summation order, which may depend on a
    block's row count (MKL's AVX2 kernels: ~1 element in 10k an ulp apart)."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = weights(16, 96, 48, g)
    x = torch.randn(303, 96, generator=g).to(torch.bfloat16)
    r = uneven_routing(303, 16, 4, g)
    packed = moe_cpu_kernel.pack(w13, w2, level)
    whole = moe_fused_cpu(x, w13, w2, r, packed)
    monkeypatch.setattr(moe_cpu_kernel, "CHUNK_BYTES", 1)
    monkeypatch.setattr(moe_cpu_kernel, "CHUNK_MIN_TOKENS", 7)  # 44 chunks, the last of 303 % 7 = 2 tokens
    chunked = moe_fused_cpu(x, w13, w2, r, packed)
    if packed.brgemm:
        assert torch.equal(chunked, whole)
    else:
        assert (chunked == whole).float().mean() >= 0.999, (chunked != whole).float().mean()
        assert (chunked.float() - whole.float()).abs().max() <= 2 ** -8 * whole.float().abs().max()


@pytest.mark.parametrize("T,E,H,I,K", [(40, 8, 64, 32, 2), (64, 16, 256, 128, 4), (300, 16, 200, 72, 8)])
def test_rounds_as_gather(T, E, H, I, K, level):
    """A verify step large enough for fused_cpu must decode as the gather-run steps (lossless greedy speculation):
    the kernel rounds where gather's bf16 tensors do, so the two agree bit for bit but for the GEMMs' summation
    order (~1 element in 30k here; ``sorted``, which scales before the down projection, differs on half)."""
    g = torch.Generator().manual_seed(T)
    w13, w2 = weights(E, H, I, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    r = uneven_routing(T, E, K, g)
    want = moe_gather(x, w13, w2, r)
    got = moe_fused_cpu(x, w13, w2, r, moe_cpu_kernel.pack(w13, w2, level))
    assert (got == want).float().mean() >= 0.999
    assert (got.float() - want.float()).abs().max() <= 2 ** -8 * want.float().abs().max()  # an ulp at the scale


def test_unsupported_shapes_and_inputs_are_refused():
    g = torch.Generator().manual_seed(0)
    r = uneven_routing(5, 4, 2, g)
    with pytest.raises(ValueError, match="even"):
        moe_cpu_kernel.pack(*weights(4, 63, 32, g))
    with pytest.raises(ValueError, match="even"):
        moe_cpu_kernel.pack(*weights(4, 64, 33, g))
    with pytest.raises(ValueError, match="bf16"):
        moe_cpu_kernel.pack(*weights(4, 64, 32, g, torch.float32))
    packed = moe_cpu_kernel.pack(*weights(4, 64, 32, g))
    with pytest.raises(RuntimeError, match="out of range"):
        moe_cpu_kernel.fused_moe(torch.zeros(5, 64, dtype=torch.bfloat16), packed, r.ids + 3, r.weights)
    with pytest.raises(RuntimeError, match="do not match"):
        moe_cpu_kernel.fused_moe(torch.zeros(5, 66, dtype=torch.bfloat16), packed, r.ids, r.weights)
    assert moe_cpu_kernel.fused_moe(torch.zeros(0, 64, dtype=torch.bfloat16), packed, r.ids[:0], r.weights[:0]).shape == (0, 64)


def experts_module(dtype=torch.bfloat16, impl="auto", E=16, H=256, I=128, K=4):
    cfg = dataclasses.replace(ModelConfig.from_dict(TINY_MOE), hidden_size=H, moe_intermediate_size=I,
                              n_routed_experts=E, num_experts_per_tok=K)
    m = RoutedExperts(cfg, impl)
    g = torch.Generator().manual_seed(1)
    w13, w2 = weights(E, H, I, g, dtype)
    with torch.no_grad():
        m.w13.data, m.w2.data = w13, w2
    return m


@picked
def test_auto_picks_fused_for_bf16_prefill_only(monkeypatch):
    m = experts_module()
    g = torch.Generator().manual_seed(2)
    for T, want in ((1, "gather"), (GATHER_MAX_PAIRS // 4, "gather"), (GATHER_MAX_PAIRS // 4 + 1, "fused_cpu"),
                    (2048, "fused_cpu")):
        r = uneven_routing(T, 16, 4, g)
        x = torch.randn(T, 256, generator=g).to(torch.bfloat16)
        y = m(x, r)
        assert m.last_impl == want, T
        assert torch.allclose(y.double(), reference(x, m.w13, m.w2, r), atol=0.02 * y.abs().max().item())
    fp32 = experts_module(torch.float32)
    fp32(torch.randn(64, 256), uneven_routing(64, 16, 4, g))
    assert fp32.last_impl in ("sorted", "grouped")
    # a layer too large to keep a packed copy: auto keeps the torch strategies; forced, it packs per call
    monkeypatch.setattr(moe_cpu_kernel, "PACK_CACHE_MAX_BYTES", 1 << 20)
    r = uneven_routing(64, 16, 4, g)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    big = experts_module()
    big(x, r)
    assert big.last_impl in ("sorted", "grouped") and big.packed() is None
    forced = experts_module(impl="fused_cpu")
    y = forced(x, r)
    assert forced.last_impl == "fused_cpu" and forced._packed is None
    assert torch.equal(y, MOE_IMPLS["fused_cpu"](x, forced.w13, forced.w2, r))


def test_path_names_the_route():
    """``path``: amx (brgemm on packed tiles, a copy) only at level amx where torch can pack bf16; below it the
    level's gemm route on the weights as stored (no copy)."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = weights(4, 64, 32, g)
    for lv in cpu_ext.levels_up_to(cpu_ext.host_isa()):
        if moe_cpu_kernel.kernel(lv) is None:
            continue
        packed = moe_cpu_kernel.pack(w13, w2, lv)
        route = moe_cpu_kernel.route(lv)
        assert moe_cpu_kernel.path(lv) == ("torch" if route in moe_cpu_kernel.TORCH_LEVELS else route)
        if lv == "amx" and moe_cpu_kernel.kernel(lv).could_pack():
            assert route == "amx" and packed.brgemm and packed.w13.data_ptr() != w13.data_ptr()
        else:
            assert route in (lv, "avx512_bf16") and not packed.brgemm
            assert packed.w13.data_ptr() == w13.data_ptr() and packed.w2.data_ptr() == w2.data_ptr()


@pytest.mark.skipif(moe_cpu_kernel.available(), reason=f"auto picks fused_cpu at ISA level {cpu_ext.isa()}")
def test_auto_keeps_torch_where_the_kernel_measured_slower():
    """At a level in ``TORCH_LEVELS`` (avx512_bf16: torch's oneDNN bf16 GEMMs beat the kernel's) ``auto`` runs the
    torch strategies for prefill; ``fused_cpu`` by name still runs the kernel and agrees."""
    m, forced = experts_module(), experts_module(impl="fused_cpu")
    g = torch.Generator().manual_seed(4)
    r = uneven_routing(64, 16, 4, g)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    y, z = m(x, r), forced(x, r)
    assert m.last_impl in ("sorted", "grouped") and forced.last_impl == "fused_cpu"
    assert torch.allclose(y.double(), z.double(), atol=0.02 * y.abs().max().item())


@picked
def test_packed_copy_follows_weight_updates():
    m = experts_module()
    g = torch.Generator().manual_seed(3)
    r = uneven_routing(64, 16, 4, g)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    m(x, r)
    first = m._packed
    assert m.last_impl == "fused_cpu" and first is not None
    m(x, r)
    assert m._packed is first  # packed once
    with torch.no_grad():
        m.w2.mul_(2)  # an in-place update (a weight load): the packed copy is stale
    y = m(x, r)
    assert m._packed is not first
    assert torch.allclose(y.double(), reference(x, m.w13, m.w2, r), atol=0.02 * y.abs().max().item())


def test_kernel_runs_on_all_threads():
    """Built with OpenMP (cpu_ext.CFLAGS): without -fopenmp ATen's parallel_for silently runs every kernel on one thread.
    Sets two threads itself: a test module imported earlier in the session (test_malloc) leaves the process at one."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert moe_cpu_kernel.kernel().parallel_threads() == 2
    finally:
        torch.set_num_threads(before)


@picked
def test_bf16_model_prefill_runs_fused(tmp_path):
    init_random_model(TINY_MOE, str(tmp_path))
    prompt = [5, 77, 30, 12, 9, 64, 33, 102, 7, 88]  # 10 tokens x top-4: 40 pairs
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for impl in ("auto", "sorted"):
        model, cfg = load_model(str(tmp_path), "bfloat16", "cpu", impl)
        engine = Engine(model, cfg)
        outs[impl] = engine.generate([prompt], params)[0].token_ids
        moe = [layer.mlp.experts for i, layer in enumerate(model.model.layers) if cfg.is_moe_layer(i)]
        if impl == "auto":
            # the prefill ran fused_cpu; decode (4 pairs a step) went back to the batch-invariant gather
            assert all(m._packed is not None for m in moe)
            assert {m.last_impl for m in moe} == {"gather"}
            assert {m.pick(Routing(torch.zeros(10, 4, dtype=torch.long), torch.ones(10, 4))) for m in moe} == {"fused_cpu"}
    assert outs["auto"] == outs["sorted"] and len(outs["auto"]) == 8
