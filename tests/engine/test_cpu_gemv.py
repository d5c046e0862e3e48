"""The small-M bf16 GEMV kernel (engine/layers/csrc/gemv.cpp) against the fp32-accumulated reference, at every ISA
level this CPU runs, and a tiny bf16 model's greedy decode with it on equal to the one with ``F.linear``."""
import pytest
import torch
import torch.nn.functional as F

from engine import cpu_ext
from engine.checkpoint import init_random_model
from engine.layers import cpu_gemv
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from isa_levels import usable_level
from shared_helpers import TINY_MOE

ENABLED_AT_START = cpu_gemv.enabled()
pytestmark = pytest.mark.skipif(cpu_gemv.kernel() is None, reason="no C++ compiler: F.linear runs")

TINY_GQA = dict(TINY_MOE, vocab_size=300)


@pytest.fixture(params=cpu_ext.ISA_LEVELS, scope="module")
def level(request):
    return usable_level(request.param, cpu_gemv.kernel, "no GEMV kernel at ISA level {}")


def reference(x, w, b):
    return x.float() @ w.float().T + (0 if b is None else b.float())


def within_rounding(y, ref, K):
    """One bf16 rounding of the fp32 sum (half an ulp: 2^-9 relative) plus fp32 summation-order error, which
    is bounded by K * 2^-24 * sum |x w| (here ~ 4 sqrt(K) |ref| scale for random normals: taken as 2^-16 K)."""
    err = (y.float() - ref).abs()
    return bool((err <= ref.abs() * 2 ** -8 + K * 2 ** -16).all())


@pytest.mark.parametrize("M,N,K,bias", [(1, 37, 70, True), (3, 200, 256, False), (8, 129, 1000, True),
                                        (5, 64, 7, False)])
def test_equals_the_fp32_reference(M, N, K, bias, level):
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    y = cpu_gemv.kernel(level).linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert cpu_gemv.kernel(level).simd() in ("avx2", "avx512", "avx512_bf16", "scalar")
    assert within_rounding(y, reference(x, w, b), K)


def test_rows_are_batch_invariant_and_strides_are_read(level):
    """A row's output is the same alone and among 7 others (decode vs a batch); a weight with padded rows (a
    row-strided view) reads as its copy."""
    g = torch.Generator().manual_seed(1)
    x, wbig = torch.randn(8, 96, generator=g).bfloat16(), torch.randn(50, 128, generator=g).bfloat16()
    w = wbig[:, :96]
    k = cpu_gemv.kernel(level)
    whole = k.linear(x, w, None)
    assert torch.equal(whole, k.linear(x, w.contiguous(), None))
    assert all(torch.equal(whole[i:i + 1], k.linear(x[i:i + 1], w, None)) for i in (0, 3, 7))


def test_refuses_what_it_cannot_run():
    k = cpu_gemv.kernel()
    with pytest.raises(RuntimeError, match="M must be"):
        k.linear(torch.zeros(9, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        k.linear(torch.zeros(1, 8), torch.zeros(4, 8), None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        k.linear(torch.zeros(1, 8).bfloat16(), torch.zeros(4, 6).bfloat16(), None)


def test_linear_routes_only_eager_small_bf16():
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    try:
        cpu_gemv.enable(True)
        assert cpu_gemv.usable(x, w) and not cpu_gemv.usable(torch.randn(9, 16).bfloat16(), w)
        assert not cpu_gemv.usable(x.float(), w.float()) and not cpu_gemv.usable(x, w.T)
        assert torch.equal(cpu_gemv.linear(x, w), cpu_gemv.kernel().linear(x, w, None))
        cpu_gemv.enable(False)
        assert not cpu_gemv.usable(x, w) and cpu_gemv.path() == "off"
        assert torch.equal(cpu_gemv.linear(x, w), F.linear(x, w))
    finally:
        cpu_gemv.enable(ENABLED_AT_START)



def test_tiny_model_greedy_decode_is_unchanged(tmp_path):
    """bf16 glm4_moe (GQA with biases and QK norm, a dense layer, MoE with a shared expert): 12 greedy tokens
    of two prompts decoded together (batch 2) with the kernel equal those with F.linear."""
    init_random_model(TINY_GQA, str(tmp_path), dtype=torch.bfloat16)
    model, cfg = load_model(str(tmp_path), "bfloat16", "cpu")
    engine = Engine(model, cfg)
    prompts = [[5, 77, 30, 12, 9, 64, 33], [102, 7, 88, 250, 3]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    try:
        for on in (False, True):
            cpu_gemv.enable(on)
            outs[on] = [r.token_ids for r in engine.generate(prompts, params)]
    finally:
        cpu_gemv.enable(ENABLED_AT_START)
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
