"""The paged decode / verify attention kernel (engine/layers/csrc/decode_attention.cpp): float64 attention over the
gathered context is its reference; a query's result does not depend on its batch, its request's other queries or
the mask of keys it cannot see (what keeps greedy speculation lossless); the compiled decode graphs call it."""
import pytest
import torch
import torch.nn.functional as F

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.layers import cpu_attention
from engine.layers.attention import GQAAttention
from engine.load import load_model

pytestmark = pytest.mark.skipif(not cpu_attention.decode_kernel(),
                                reason="no C++ compiler: decode steps gather the context and run torch's ops")


def reference(q, kb, vb, slots, mask, scale):
    """float64 GQA attention of q [B, Tq, H, D] over the rows ``slots`` [B, S] of kb / vb, ``mask`` [B, Tq, S]."""
    B, Tq, H, _ = q.shape
    Hk = kb.shape[1]
    k, v = kb[slots].double().transpose(1, 2), vb[slots].double().transpose(1, 2)  # [B, Hk, S, D]
    out = F.scaled_dot_product_attention(q.double().transpose(1, 2), k, v, scale=scale, enable_gqa=Hk != H,
                                         attn_mask=None if mask is None else mask[:, None])
    return out.transpose(1, 2)


def inputs(B, Tq, H, Hk, D, Dv, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = B * S + 40
    kb, vb = torch.randn(n, Hk, D, generator=g).to(dtype), torch.randn(n, Hk, Dv, generator=g).to(dtype)
    pages = torch.randperm(n // 8, generator=g)[:, None] * 8 + torch.arange(8)  # pages of 8 slots in random order
    slots = pages.reshape(-1)[:B * S].view(B, S)
    q = torch.randn(B, Tq, H, D, generator=g).to(dtype)
    return q, kb, vb, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Tq,H,Hk,D,Dv,S", [
    (1, 1, 4, 2, 64, 64, 1), (1, 1, 4, 2, 64, 64, 2048), (3, 1, 8, 2, 64, 64, 300), (2, 6, 4, 4, 128, 128, 129),
    (4, 3, 16, 1, 32, 32, 77), (1, 2, 2, 2, 24, 40, 19)])  # D / Dv off the 16-lane path too
def test_kernel_equals_attention(dtype, B, Tq, H, Hk, D, Dv, S):
    q, kb, vb, slots = inputs(B, Tq, H, Hk, D, Dv, S, dtype)
    mask = None
    if B > 1 or Tq > 1:  # causal over each request's own length, the rest padding
        lens = torch.randint(Tq, S + 1, (B,), generator=torch.Generator().manual_seed(1))
        pos = lens[:, None] - Tq + torch.arange(Tq)
        mask = torch.arange(S) <= pos[:, :, None]
    out = cpu_attention.paged_attention(q, kb, vb, slots, mask, D ** -0.5)
    assert out.dtype == dtype and out.shape == (B, Tq, H, Dv)
    ref = reference(q, kb, vb, slots, mask, D ** -0.5)
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # fp32 math, one output rounding
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_a_query_rounds_the_same_in_any_batch_and_under_any_mask():
    """A decode query (one request, one query, no mask) and the same query as row 2 of a verify step (4 queries of
    a request among others, a causal mask hiding the later keys and padding) give bitwise the same output."""
    H, Hk, D, S = 8, 2, 64, 700
    q, kb, vb, slots = inputs(3, 4, H, Hk, D, D, S, torch.bfloat16)
    scale = D ** -0.5
    pos = torch.tensor([[300, 301, 302, 303], [600, 601, 602, 603], [696, 697, 698, 699]])
    mask = torch.arange(S) <= pos[:, :, None]
    verify = cpu_attention.paged_attention(q, kb, vb, slots, mask, scale)
    for b in range(3):
        n = int(pos[b, 2]) + 1  # the keys row 2 sees
        alone = cpu_attention.paged_attention(q[b:b + 1, 2:3], kb, vb, slots[b:b + 1, :n].contiguous(), None, scale)
        assert torch.equal(alone[0, 0], verify[b, 2]), f"request {b}"
    tree = mask.clone()  # a tree mask: row 3 does not see the key of row 2's draft; row 2 still sees what it saw
    tree[:, 3, pos[:, 2]] = False
    assert torch.equal(cpu_attention.paged_attention(q, kb, vb, slots, tree, scale)[:, 2], verify[:, 2])


def test_kernel_refuses_what_it_cannot_read():
    q, kb, vb, slots = inputs(1, 1, 4, 2, 64, 64, 10, torch.float32)
    op = torch.ops.pdserve_cpu.decode_attention
    with pytest.raises(RuntimeError, match="out of the pool's range"):
        op(q, kb, vb, slots + kb.shape[0], None)
    with pytest.raises(RuntimeError, match="must divide"):
        op(torch.zeros(1, 1, 3, 64), kb, vb, slots, None)
    with pytest.raises(RuntimeError, match="fp32, bf16, fp16"):
        op(q, kb.double(), vb.double(), slots, None)
    with pytest.raises(RuntimeError, match="mask must be"):
        op(q, kb, vb, slots, torch.ones(1, 2, 10, dtype=torch.bool))


def test_compiled_graph_calls_the_kernel():
    """Inside ``torch.compile`` (the C++ wrapper, as the decode graphs run) the op traces through its fake
    implementation and computes what the eager call does."""
    q, kb, vb, slots = inputs(2, 3, 4, 2, 64, 64, 50, torch.bfloat16)
    mask = torch.ones(2, 3, 50, dtype=torch.bool).tril(47)

    def f(q, kb, vb, slots, mask):
        return cpu_attention.paged_attention(q, kb, vb, slots, mask, 0.125) * 2

    compiled = torch.compile(f, fullgraph=True, options={"cpp_wrapper": True})
    assert torch.equal(compiled(q, kb, vb, slots, mask), f(q, kb, vb, slots, mask))


def test_gqa_decode_and_verify_steps_read_the_pool_in_place(tiny_dirs, monkeypatch):
    """A GQA model's decode step and a verify-shaped step attend through the kernel, over the pool's own buffers
    (no gathered copy: ``KVPool.read`` is not called), and their logits equal those of the gather + SDPA path to
    float rounding."""
    model, cfg = load_model(tiny_dirs["gqa"], "float32", "cpu")
    pool = KVPool(KVLayout.for_model(cfg, 16, "float32"), 64)
    prompt = torch.randint(2, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = list(range(5))
    model(ForwardBatch.build([BatchRequest(pages, 0, prompt)], 16), pool)
    steps = [[BatchRequest(pages, 40, [7])], [BatchRequest(pages, 40, [7, 8, 9])]]
    calls = []
    paged = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a: calls.append(1) or paged(*a))
    reads = []
    read = KVPool.read
    monkeypatch.setattr(KVPool, "read", lambda self, *a: reads.append(1) or read(self, *a))
    new = [model(ForwardBatch.build(reqs, 16), pool, all_logits=True).logits for reqs in steps]
    assert len(calls) == 2 * cfg.num_hidden_layers and not reads
    monkeypatch.setattr(GQAAttention, "paged_kernel", staticmethod(lambda pool: False))
    old = [model(ForwardBatch.build(reqs, 16), pool, all_logits=True).logits for reqs in steps]
    for a, b in zip(new, old):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
