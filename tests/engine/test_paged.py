"""Paged KV: incremental decoding, chunked prefill over a cached prefix, mixed batches, fp8 KV."""
import pytest
import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.layers import attention
from engine.load import load_model

TOL = 1e-4


def make_pool(cfg, kv_dtype="float32", num_pages=96, page_size=8):
    return KVPool(KVLayout.for_model(cfg, page_size, kv_dtype), num_pages)


def run(model, pool, reqs, all_logits=True):
    return model(ForwardBatch.build(reqs, pool.page_size), pool, all_logits=all_logits).logits


@pytest.fixture(params=["dsa", "gqa"])
def loaded(request, tiny_dirs):
    return load_model(tiny_dirs[request.param], "float32", "cpu")


def test_incremental_decode_equals_full_forward(loaded):
    model, cfg = loaded
    ids = torch.randint(2, cfg.vocab_size, (50,)).tolist()
    pool = make_pool(cfg)
    full = run(model, pool, [BatchRequest(pool.allocator.alloc(7, "a"), 0, ids)])
    pool2 = make_pool(cfg)
    pages = pool2.allocator.alloc(7, "b")
    steps = [run(model, pool2, [BatchRequest(pages, 0, ids[:20])])]
    for i in range(20, 50):  # one token at a time over the paged prefix
        steps.append(run(model, pool2, [BatchRequest(pages, i, [ids[i]])]))
    assert (torch.cat(steps) - full).abs().max().item() < TOL


def test_chunked_prefill_over_cached_prefix_equals_one_pass(loaded):
    model, cfg = loaded
    ids = torch.randint(2, cfg.vocab_size, (70,)).tolist()
    pool = make_pool(cfg)
    full = run(model, pool, [BatchRequest(pool.allocator.alloc(9, "a"), 0, ids)])
    pages = pool.allocator.alloc(9, "b")
    parts, start = [], 0
    for end in (13, 40, 41, 70):  # uneven chunks, not page aligned
        parts.append(run(model, pool, [BatchRequest(pages, start, ids[start:end])]))
        start = end
    assert (torch.cat(parts) - full).abs().max().item() < TOL


def test_mixed_batch_equals_separate_requests(loaded):
    """Prefill chunk + decode step + multi-token verify in one forward == each alone."""
    model, cfg = loaded
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (30, 45, 12))
    pool = make_pool(cfg)
    pa, pb, pc = (pool.allocator.alloc(8, x) for x in "abc")
    run(model, pool, [BatchRequest(pa, 0, a[:25]), BatchRequest(pb, 0, b[:44])])  # cached prefixes
    mixed = run(model, pool, [BatchRequest(pa, 25, a[25:]), BatchRequest(pb, 44, b[44:]),
                              BatchRequest(pc, 0, c)])
    ref = make_pool(cfg)
    alone = []
    for ids, cached in ((a, 25), (b, 44), (c, 0)):
        pages = ref.allocator.alloc(8, "r")
        if cached:
            run(model, ref, [BatchRequest(pages, 0, ids[:cached])])
        alone.append(run(model, ref, [BatchRequest(pages, cached, ids[cached:])]))
    assert (mixed - torch.cat(alone)).abs().max().item() < TOL


@pytest.mark.parametrize("contexts", [(20, 37, 50), (9, 37, 50)])
def test_batched_decode_step_equals_separate_requests(loaded, contexts):
    """One decode token per request, batched: with every context past DSA's index_topk (16) the selection
    carries no validity mask; with one shorter context it does. Both equal each request run alone."""
    model, cfg = loaded
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, cfg.vocab_size, (n + 1,), generator=g).tolist() for n in contexts]
    pool, ref = make_pool(cfg), make_pool(cfg)
    pages = [pool.allocator.alloc(8, "b") for _ in seqs]
    alone = []
    for ids, n, pg in zip(seqs, contexts, pages):
        run(model, pool, [BatchRequest(pg, 0, ids[:n])])
        own = ref.allocator.alloc(8, "r")
        run(model, ref, [BatchRequest(own, 0, ids[:n])])
        alone.append(run(model, ref, [BatchRequest(own, n, ids[n:])]))
    batched = run(model, pool, [BatchRequest(pg, n, ids[n:]) for ids, n, pg in zip(seqs, contexts, pages)])
    assert (batched - torch.cat(alone)).abs().max().item() < TOL


def test_mla_absorbed_equals_expanded(tiny_dirs, monkeypatch):
    model, cfg = load_model(tiny_dirs["dsa"], "float32", "cpu")
    ids = torch.randint(2, cfg.vocab_size, (40,)).tolist()
    outs = []
    for limit in (0, 10_000):  # 0: always expanded; huge: always absorbed
        monkeypatch.setattr(attention, "MLA_ABSORB_MAX_Q", limit)
        pool = make_pool(cfg)
        pages = pool.allocator.alloc(6, "x")
        run(model, pool, [BatchRequest(pages, 0, ids[:30])])
        outs.append(run(model, pool, [BatchRequest(pages, 30, ids[30:])]))
    assert (outs[0] - outs[1]).abs().max().item() < TOL


def test_fp8_kv_within_tolerance(loaded):
    """fp8 e4m3 KV with per-token scales, prefill then decode over the fp8 pages.

    Stated tolerance on these random tiny models (the worst case: no margin between logits):
    mean |error| <= 10% of mean |logit| and >= 90% argmax agreement for GQA; for DSA the fp8
    indexer keys also flip some top-k selections, so 20% / 80%.
    """
    model, cfg = loaded
    ids = torch.randint(2, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = run(model, make_pool(cfg), [BatchRequest(list(range(5)), 0, ids)])
    p8 = make_pool(cfg, "fp8_e4m3")
    assert p8.buffers[0][p8.layout.components[0].name].dtype == torch.float8_e4m3fn
    pages = p8.allocator.alloc(5, "f")
    got = torch.cat([run(model, p8, [BatchRequest(pages, 0, ids[:30])])]
                    + [run(model, p8, [BatchRequest(pages, i, [ids[i]])]) for i in range(30, 40)])
    rel = ((got - ref).abs().mean() / ref.abs().mean()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    max_rel, min_agree = (0.2, 0.8) if cfg.is_mla else (0.1, 0.9)
    assert 0 < rel <= max_rel and agree >= min_agree, (rel, agree)


def test_pool_accounting_and_generations():
    from engine.kvcache import PageError, PoolExhausted
    from engine.kvcache.pool import PageAllocator
    a = PageAllocator(4)
    p = a.alloc(3, "r1")
    gens = a.generations(p)
    with pytest.raises(PoolExhausted):
        a.alloc(2, "r2")
    a.incref(p[:1])
    assert a.decref(p) == 2 and a.num_free == 3
    a.check(p[:1], gens[:1])
    assert a.decref(p[:1]) == 1 and a.num_used == 0
    with pytest.raises(PageError):
        a.decref(p[:1])  # double free
    q = a.alloc(4, "r3")
    with pytest.raises(PageError, match="stale"):
        a.check([p[0]], [gens[0]])  # reused page: the old generation is rejected
    assert a.owners() == {"r3": 4} and sorted(q) == [0, 1, 2, 3]
    with pytest.raises(PageError, match="page 9 is not allocated"):
        a.check([q[0], 9])
    with pytest.raises(PageError, match="3 generations for 4 pages"):
        a.check(q, a.generations(q)[:3])
    a.check(q, a.generations(q))


def test_freed_runs_come_back_as_runs():
    """A request's pages freed together are handed out again in the same ascending order, not reversed:
    contiguous pages are one copy per KV transfer frame instead of one per page."""
    from engine.kvcache.pool import PageAllocator
    a = PageAllocator(64)
    first = a.alloc(20, "r1")
    assert first == list(range(20))
    a.decref(first)
    for _ in range(3):
        again = a.alloc(20, "r2")
        assert again == list(range(20))
        a.decref(again)
    b, c = a.alloc(8, "b"), a.alloc(8, "c")
    a.decref(c)
    a.decref(b)
    assert a.alloc(16, "d") == b + c[:8] == list(range(16))


def _allocator_trace(seed: int, as_numpy: bool) -> list:
    """A random run of allocator calls (with duplicates, double frees, stale generations and bad ids);
    every result, error message and the final state, in order."""
    import random

    import numpy as np
    from engine.kvcache.pool import PageAllocator, PageError, PoolExhausted
    rng, dtypes, a, held, out = random.Random(seed), random.Random(seed), PageAllocator(300), [], []

    def arg(pages):  # the dtype from its own stream: both runs make the same calls
        if not as_numpy:
            return list(pages)
        return np.asarray(pages, dtype=dtypes.choice([np.int64, np.int32] + [np.uint32] * (min(pages) >= 0)))

    for _ in range(400):
        op = rng.choice(["alloc", "alloc", "incref", "decref", "decref", "check", "bad"])
        try:
            if op == "alloc":
                pages = a.alloc(rng.randint(1, 120), f"r{len(held)}")
                held.append(pages)
                out.append(("alloc", pages))
            elif op in ("incref", "decref") and held:
                pages = rng.choice(held)
                pick = [p for p in pages if rng.random() < 0.8] + rng.sample(pages, min(2, len(pages)))  # duplicates
                out.append((op, getattr(a, op)(arg(pick))))
            elif op == "check" and held:
                pages = rng.choice(held)
                gens = a.generations(pages)
                if rng.random() < 0.3:
                    gens[rng.randrange(len(gens))] -= 1
                a.check(arg(pages), arg(gens) if as_numpy else gens)
                out.append(("check ok",))
            elif op == "bad":
                a.check(arg(list(range(0, 100)) + [rng.choice([-1, 300, 10**6])]))
        except (PageError, PoolExhausted, ValueError) as e:
            out.append((op, type(e).__name__, str(e)))
    out.append((a._free, list(a._ref), list(a._gen), a.owners()))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocator_vector_paths_match_scalar(seed, monkeypatch):
    """Long page lists and numpy arrays take numpy passes (``VECTOR_MIN``): the same run of calls gives
    the same results, errors, free-list order, refcounts, generations and owners as the per-page loops."""
    import engine.kvcache.pool as pool
    monkeypatch.setattr(pool, "VECTOR_MIN", 10**9)
    scalar = _allocator_trace(seed, as_numpy=False)
    monkeypatch.setattr(pool, "VECTOR_MIN", 1)
    assert _allocator_trace(seed, as_numpy=False) == scalar
    vector_np = _allocator_trace(seed, as_numpy=True)
    assert [t for t in vector_np if t[0] != "bad"] == [t for t in scalar if t[0] != "bad"]
    # the run covered what it claims: frees, and each kind of refusal
    assert sum(t[0] == "decref" and isinstance(t[1], int) and t[1] > 0 for t in scalar) > 10
    said = " ".join(t[2] for t in scalar if len(t) == 3 and isinstance(t[2], str))
    for msg in ("freed more times than it is referenced", "is stale", "is not allocated", "KV pool exhausted"):
        assert msg in said


@pytest.mark.parametrize("impl", ["sorted", "grouped", "gather", "dense", "graph:gather_fused", "graph:dense"])
def test_moe_strategies_agree(impl):
    """Every strategy, the compiled graphs' ones (``GRAPH_MOE_IMPLS``) included, computes the definition; ~19
    pairs per expert, so the CPU's GEMMs run on bucketed row counts (``row_bucket``)."""
    from engine.moe.experts import GRAPH_MOE_IMPLS, MOE_IMPLS
    from engine.moe.router import Routing
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 8, 32, 16, 50, 3
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    r = Routing(ids, torch.rand(T, K, generator=g))
    ref = torch.zeros(T, H)
    for t in range(T):  # the definition, token by token
        for k in range(K):
            h = w13[ids[t, k]] @ x[t]
            ref[t] += r.weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    fn = GRAPH_MOE_IMPLS[impl[6:]] if impl.startswith("graph:") else MOE_IMPLS[impl]
    assert (fn(x, w13, w2, r) - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("copy_max", [None, 0])
def test_moe_gather_is_batch_invariant(copy_max, monkeypatch):
    """The decode/verify MoE path gives each token the same bits whether it runs alone or among 8 (what
    lossless greedy speculation relies on), with per-pair weight copies (small experts) and without
    (``PAIR_COPY_MAX_BYTES`` exceeded, as GLM-5's are); both match the definition."""
    from engine.moe import experts
    from engine.moe.router import Routing
    if copy_max is not None:
        monkeypatch.setattr(experts, "PAIR_COPY_MAX_BYTES", copy_max)
    g = torch.Generator().manual_seed(1)
    E, H, I, T, K = 8, 48, 24, 8, 2
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    r = Routing(ids, torch.rand(T, K, generator=g))
    together = experts.moe_gather(x, w13, w2, r)
    for t in range(T):
        alone = experts.moe_gather(x[t:t + 1], w13, w2, Routing(ids[t:t + 1], r.weights[t:t + 1]))
        assert torch.equal(alone[0], together[t])
    ref = experts.moe_sorted(x, w13, w2, r)
    assert (together - ref).abs().max() < 1e-5 * ref.abs().max()
