"""Our causal bf16 prefill attention kernel (engine/layers/csrc/prefill_attention.cpp) against float64
attention at every ISA level up to this CPU's (each its own build and GEMM route: ``level``), and inside a bf16 GQA
model: prompts and chunks over a cached prefix run it, decode steps do not."""
import pytest
import torch
import torch.nn.functional as F

from engine import cpu_ext
from isa_levels import usable_level
from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.layers import cpu_attention
from engine.load import load_model

host_kernel = pytest.mark.skipif(cpu_attention.kernel() is None,
                                 reason=f"no kernel at ISA level {cpu_ext.isa()} (or no C++ compiler): torch's SDPA "
                                        f"runs prompts")
"""For the tests of the kernel this process serves with; the ``level`` tests build and check every level up to
this CPU's that has one (a level in ``TORCH_LEVELS`` serves with SDPA, the levels below it still run the kernel)."""


@pytest.fixture(params=cpu_ext.ISA_LEVELS, scope="module")
def level(request):
    return usable_level(request.param, cpu_attention.kernel, "prompts run torch's SDPA at ISA level {}")


def reference(q, k, v, scale):
    """float64 attention with query i at position S - T + i (the kernel's contract)."""
    T, H, _ = q.shape
    S, Hk, _ = k.shape
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                         v.double().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=Hk != H)
    return out[0].transpose(0, 1)


def torch_bf16(q, k, v, scale):
    """torch's own bf16 SDPA on the same inputs: the error budget our kernel must match."""
    T, H, _ = q.shape
    S, Hk, _ = k.shape
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=Hk != H)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("T,S,H,Hk,D,Dv", [
    (1, 1, 4, 2, 64, 64), (7, 7, 4, 2, 64, 64), (64, 64, 4, 4, 64, 64), (65, 65, 2, 1, 32, 32),
    (513, 513, 4, 2, 64, 64), (300, 1100, 4, 2, 64, 64), (1, 700, 8, 8, 64, 64), (37, 600, 8, 1, 96, 64),
    (1030, 1030, 6, 3, 128, 128), (200, 200, 4, 2, 16, 16),
])
def test_kernel_equals_attention(T, S, H, Hk, D, Dv, level):
    torch.manual_seed(T * 7 + S)
    q, k, v = torch.randn(T, H, D).bfloat16(), torch.randn(S, Hk, D).bfloat16(), torch.randn(S, Hk, Dv).bfloat16()
    scale = D ** -0.5
    ref = reference(q, k, v, scale)
    ours = (cpu_attention.causal_attention(q, k, v, scale, level).double() - ref).abs().max().item()
    theirs = (torch_bf16(q, k, v, scale).double() - ref).abs().max().item()
    # both round P and the output to bf16: within torch's own error (plus an output ulp of slack)
    assert ours <= theirs * 1.5 + 8e-3, (ours, theirs)


def test_kernel_rescales_when_later_keys_score_higher(level):
    """Scores that grow along the keys by far more than the kernel's lazy-rescale margin (2^16): rows move their
    reference max many times and must still match."""
    torch.manual_seed(0)
    T, H, Hk, D = 1500, 4, 2, 64
    q = torch.randn(T, H, D).abs().bfloat16()
    k = (torch.randn(T, Hk, D).abs() * torch.linspace(0.1, 8, T)[:, None, None]).bfloat16()
    v = torch.randn(T, Hk, D).bfloat16()
    ref = reference(q, k, v, 0.125)
    ours = (cpu_attention.causal_attention(q, k, v, 0.125, level).double() - ref).abs().max().item()
    theirs = (torch_bf16(q, k, v, 0.125).double() - ref).abs().max().item()
    assert ours <= theirs * 1.5 + 8e-3, (ours, theirs)


def test_kernel_takes_strided_views(level):
    """q / k / v as column slices of one fused projection output (row stride > heads * dim)."""
    torch.manual_seed(0)
    T, H, Hk, D = 300, 4, 2, 32
    qkv = torch.randn(T, (H + 2 * Hk) * D).bfloat16()
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)
    v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
    got = cpu_attention.causal_attention(q, k, v, 0.2, level)
    want = cpu_attention.causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.2, level)
    assert torch.equal(got, want)


@host_kernel
def test_kernel_rejects_what_it_cannot_compute():
    q = torch.randn(8, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_attention.causal_attention(q.float(), q.float(), q.float(), 1.0)
    with pytest.raises(RuntimeError, match="must divide"):
        cpu_attention.causal_attention(q, q[:, :3], q[:, :3], 1.0)
    with pytest.raises(RuntimeError, match="fewer keys"):
        cpu_attention.causal_attention(q, q[:4], q[:4], 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_attention.causal_attention(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, 1.0)
    assert not cpu_attention.usable(q.float(), q.float(), q.float())
    assert not cpu_attention.usable(q, q, q)  # too few queries to pay
    long = torch.randn(cpu_attention.min_tokens(), 4, 64).bfloat16()
    assert cpu_attention.usable(long, long, long)


@host_kernel
def test_path_names_the_route():
    """``path``: amx (brgemm) only at level amx where torch can pack bf16; the level's gemm route below it."""
    lv = cpu_ext.isa()
    if lv == "amx":
        assert cpu_attention.path() == ("amx" if cpu_attention.kernel().could_pack() else "avx512_bf16")
    else:
        assert cpu_attention.path() == lv


def _prompt_then_chunk_then_decode(model_dir, dtype, ids):
    """Logits of a 70-token prompt, a 66-token chunk over it, then a decode step (paged KV in ``dtype``)."""
    model, cfg = load_model(model_dir, dtype, "cpu")
    pool = KVPool(KVLayout.for_model(cfg, 8, dtype), 32)
    pages = pool.allocator.alloc(18, "a")
    logits = [model(ForwardBatch.build([BatchRequest(pages, c, ids[c:e])], pool.page_size), pool,
                    all_logits=True).logits for c, e in ((0, 70), (70, 136), (136, 137))]
    return torch.cat(logits).float()


@host_kernel
def test_bf16_model_prompts_run_the_kernel(tiny_dirs, monkeypatch):
    """A bf16 GQA prompt, and a chunk over its cached prefix, run the kernel (a decode step keeps SDPA), and
    the logits are as close to the fp32 model's as with SDPA."""
    torch.manual_seed(1)
    ids = torch.randint(2, 128, (137,)).tolist()
    ref = _prompt_then_chunk_then_decode(tiny_dirs["gqa"], "float32", ids)
    calls = []
    real = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    ours = _prompt_then_chunk_then_decode(tiny_dirs["gqa"], "bfloat16", ids)
    layers = len(calls) // 2
    assert layers >= 1 and calls == [(70, 4, 16)] * layers + [(66, 4, 16)] * layers
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    sdpa = _prompt_then_chunk_then_decode(tiny_dirs["gqa"], "bfloat16", ids)
    err_ours, err_sdpa = (ours - ref).abs().amax(-1), (sdpa - ref).abs().amax(-1)  # per token
    assert err_ours.mean() <= 1.2 * err_sdpa.mean() + 5e-3, (err_ours.mean(), err_sdpa.mean())
    assert err_ours.max() <= 1.5 * err_sdpa.max() + 1e-2, (err_ours.max(), err_sdpa.max())


@host_kernel
def test_bf16_batch_of_prompts_runs_the_kernel_per_request(tiny_dirs, monkeypatch):
    """A prefill step of two requests (a fresh 80-token prompt and a 66-token chunk over a 70-token cached
    prefix), as the prefill worker batches them: one kernel call per request and layer, each over its own keys,
    the logits those of the requests run one at a time."""
    model, cfg = load_model(tiny_dirs["gqa"], "bfloat16", "cpu")
    torch.manual_seed(3)
    a, b = torch.randint(2, 128, (80,)).tolist(), torch.randint(2, 128, (136,)).tolist()

    def fresh():
        pool = KVPool(KVLayout.for_model(cfg, 8, "bfloat16"), 48)
        pa, pb = pool.allocator.alloc(10, "a"), pool.allocator.alloc(17, "b")
        model(ForwardBatch.build([BatchRequest(pb, 0, b[:70])], 8), pool)  # b's cached prefix
        return pool, pa, pb

    pool, pa, pb = fresh()
    alone = [model(ForwardBatch.build([BatchRequest(pa, 0, a)], 8), pool, all_logits=True).logits,
             model(ForwardBatch.build([BatchRequest(pb, 70, b[70:])], 8), pool, all_logits=True).logits]
    pool, pa, pb = fresh()
    calls = []
    real = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *x: calls.append((x[0].shape[0], x[1].shape[0]))
                        or real(*x))
    both = model(ForwardBatch.build([BatchRequest(pa, 0, a), BatchRequest(pb, 70, b[70:])], 8), pool,
                 all_logits=True).logits
    layers = len(calls) // 2
    assert layers >= 1 and calls == [(80, 80), (66, 136)] * layers  # (queries, keys) per request and layer
    torch.testing.assert_close(both.float(), torch.cat(alone).float(), rtol=0.02, atol=0.02)
