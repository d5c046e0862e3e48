"""GEMM shapes repeat on CPU (``engine.shapes``): the routed experts' eager strategies and prefill steps.

oneDNN (bf16) and MKL's JIT (fp32) build a kernel per new GEMM shape; a prefill's per-expert row counts are new
at nearly every chunk, so each one paid a kernel build (~1.7 ms per bf16 shape on the Xeon of
docs/performance.md). The sorted and grouped strategies now run their GEMMs on row counts from a small set:
these tests check the set (bounded padding, few sizes per octave) and that the GEMMs only ever see it, with the
results still the definition's.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.moe.experts import moe_grouped, moe_sorted
from engine.shapes import bucket_floor, row_bucket
from engine.moe.router import Routing
from engine.sampling import greedy_ids

CPU = torch.device("cpu")


def test_row_bucket_bounds_padding_and_sizes():
    sizes = set()
    for n in range(1, 20_000):
        b = row_bucket(n, CPU)
        assert n <= b <= max(16, n * 1.125), n
        sizes.add(b)
        if n > 1:
            assert b >= row_bucket(n - 1, CPU)  # monotonic
    # 16 exact small sizes, then 8 per octave (17..20k spans ~10.2 octaves)
    assert len(sizes) <= 16 + 8 * 11
    assert row_bucket(1000, torch.device("meta")) == 1000  # other devices: exact shapes


def _gemm_rows(fn, *args) -> set[int]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        fn(*args)
    rows = set()
    for e in p.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm") and e.input_shapes:
            a = e.input_shapes[1] if e.name == "aten::addmm" else e.input_shapes[0]
            rows.add(a[-2])
    return rows


@pytest.mark.parametrize("fn", [moe_sorted, moe_grouped])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemms_run_on_bucketed_rows(fn, dtype):
    g = torch.Generator().manual_seed(3)
    E, H, I, T, K = 8, 32, 16, 301, 2
    x = torch.randn(T, H, generator=g).to(dtype)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g).to(dtype), torch.randn(E, H, I, generator=g).to(dtype)
    # uneven loads: expert e takes ~e+1 shares, expert 7 none; counts land between buckets
    ids = torch.multinomial(torch.arange(1, E + 1, dtype=torch.float).index_fill(0, torch.tensor([7]), 0),
                            K * T, replacement=True, generator=g).view(T, K)
    r = Routing(ids, torch.rand(T, K, generator=g))
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    rows = _gemm_rows(fn, x, w13, w2, r)
    assert rows and all(m == row_bucket(m, CPU) for m in rows), rows
    assert any(row_bucket(int(c), CPU) != int(c) for c in counts if c)  # the check bites: some count is padded
    ref = torch.zeros(T, H)
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    for k in range(K):  # the definition, pair by pair
        h = torch.einsum("th,tih->ti", xf, w13f[ids[:, k]])
        ref += r.weights[:, k:k + 1] * torch.einsum("ti,thi->th", torch.nn.functional.silu(h[:, :I]) * h[:, I:],
                                                    w2f[ids[:, k]])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (fn(x, w13, w2, r).float() - ref).abs().max() <= tol * ref.abs().max()


def test_greedy_ids_is_argmax_with_ties_and_nan():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=g).float()  # many ties of the maximum
    x[5, 17] = float("nan")
    x[9, [3, 250]] = float("nan")
    x[11] = float("-inf")
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
    assert torch.equal(greedy_ids(x.bfloat16()), x.bfloat16().argmax(dim=-1))


def test_bucket_floor_is_the_largest_bucket_below():
    cpu = CPU
    for n in range(1, 20_000):
        m = bucket_floor(n)
        assert m <= n and row_bucket(m, cpu) == m, n
        assert m >= min(n, 16) and (n <= 16 or m >= n * 7 / 8), n
        assert row_bucket(n, cpu) != n or m == n  # a bucket is its own floor
