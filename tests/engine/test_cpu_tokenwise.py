"""The one-pass bf16 RMSNorm and residual add + RMSNorm (engine/layers/csrc/tokenwise.cpp) against torch's
definition (transformers' Glm4MoeRMSNorm: normalise in fp32, round, multiply by the weight)."""
import pytest
import torch
import torch.nn.functional as F

from engine.layers import cpu_tokenwise
from engine.layers.norm import RMSNorm, add_rms_norm, rms_norm
from engine.layers.rotary import apply_half

pytestmark = pytest.mark.skipif(cpu_tokenwise.kernel() is None, reason="no C++ compiler: torch's ops run")


def definition(x, w, eps):
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def within_an_ulp(a, b):
    """Equal, or one bf16 ulp apart where the fp32 sums of squares ran in another order."""
    d = (a.float() - b.float()).abs()
    return bool((d <= b.float().abs() * 2 ** -7 + 1e-30).all()) and (d == 0).float().mean().item() > 0.999


@pytest.mark.parametrize("T,H", [(1, 256), (7, 64), (300, 256), (2048, 256), (33, 6144), (5, 100)])
def test_rms_norm_is_the_definition(T, H):
    torch.manual_seed(T + H)
    x, w = torch.randn(T, H).bfloat16() * 3, (torch.rand(H) + 0.5).bfloat16()
    assert within_an_ulp(cpu_tokenwise.kernel().rms_norm(x, w, 1e-5), definition(x, w, 1e-5))
    h = torch.randn(T, H).bfloat16()
    s, n = cpu_tokenwise.kernel().add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(s, x + h)
    assert within_an_ulp(n, definition(x + h, w, 1e-5))


def test_rows_are_batch_invariant_and_strides_are_read():
    """A row normalises the same alone and among 1,000 others (decode vs verify), and a row-strided view
    (a column slice) as its copy."""
    torch.manual_seed(0)
    x, w = torch.randn(1000, 384).bfloat16(), torch.randn(256).bfloat16()
    k = cpu_tokenwise.kernel()
    whole = k.rms_norm(x[:, :256], w, 1e-6)
    assert torch.equal(whole, k.rms_norm(x[:, :256].contiguous(), w, 1e-6))
    assert all(torch.equal(whole[i:i + 1], k.rms_norm(x[i:i + 1, :256], w, 1e-6)) for i in (0, 1, 517, 999))


def test_model_paths_take_the_kernel_only_for_eager_bf16(monkeypatch):
    calls = []
    real = cpu_tokenwise.kernel()
    monkeypatch.setattr(cpu_tokenwise, "kernel", lambda: calls.append(1) or real)
    norm = RMSNorm(64, 1e-5).bfloat16()
    x = torch.randn(10, 64).bfloat16()
    rms_norm(x, norm.weight, norm.eps)
    s, n = add_rms_norm(x, x, norm)
    assert torch.equal(s, x + x) and len(calls) >= 2
    calls.clear()
    rms_norm(x.float(), norm.weight.float(), norm.eps)  # fp32: torch's fused kernel
    rms_norm(x.view(2, 5, 64), norm.weight, norm.eps)  # per-head norms ([T, heads, dim]): torch's ops
    assert not calls


def test_kernel_rejects_bad_input():
    k = cpu_tokenwise.kernel()
    with pytest.raises(RuntimeError, match="bfloat16"):
        k.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        k.rms_norm(torch.randn(4, 8).bfloat16(), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="same rows"):
        k.add_rms_norm(torch.randn(4, 8).bfloat16(), torch.randn(3, 8).bfloat16(), torch.ones(8), 1e-5)


def rotate_half_definition(x, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` (rotate-half) on the first 2 * half dims, in x's dtype."""
    half = cos.shape[-1]
    c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    xr, xp = x[..., :2 * half], x[..., 2 * half:]
    return torch.cat([xr * c + torch.cat([-xr[..., half:], xr[..., :half]], -1) * s, xp], -1)


@pytest.mark.parametrize("T,heads,D,half", [(1, 4, 64, 16), (300, 2, 64, 32), (2048, 4, 64, 16), (9, 3, 40, 10)])
def test_rope_half_is_the_definition_bitwise(T, heads, D, half):
    torch.manual_seed(T)
    fused = torch.randn(T, (heads + 1) * D).bfloat16() * 4  # a row-strided view, as a fused projection gives
    x = fused[:, :heads * D].view(T, heads, D)
    cos, sin = torch.randn(T, half).bfloat16(), torch.randn(T, half).bfloat16()
    assert torch.equal(cpu_tokenwise.kernel().rope_half(x, cos, sin), rotate_half_definition(x, cos, sin))
    assert torch.equal(apply_half(x, cos, sin), rotate_half_definition(x, cos, sin))  # the model's entry point
    with pytest.raises(RuntimeError, match="over the head dim"):
        cpu_tokenwise.kernel().rope_half(x, torch.cat([cos] * 4, 1), torch.cat([sin] * 4, 1))


@pytest.mark.skipif(not cpu_tokenwise.kernel().simd(), reason="silu_mul is built for AVX-512 CPUs only")
@pytest.mark.parametrize("T,I", [(1, 128), (37, 100), (2048, 128), (300, 512)])
def test_silu_mul_is_torchs(T, I):
    """Bitwise torch's F.silu(g) * u (both bf16 roundings) on split views of one gate/up GEMM output, extreme
    inputs included; reached through the FFN's entry point."""
    torch.manual_seed(I + T)
    gu = torch.randn(T, 2 * I + 16).bfloat16() * 4
    g, u = gu[:, 16:16 + I], gu[:, 16 + I:]
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).bfloat16()
    assert torch.equal(cpu_tokenwise.kernel().silu_mul(g, u), F.silu(g) * u)
    assert torch.equal(cpu_tokenwise.silu_mul(g, u), F.silu(g) * u)
