"""pdserve's GLM runtimes against transformers' own model classes (fp32)."""
import pytest
import torch
from tiny import make_hf_model

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams

TOL = 1e-4


def _pool(cfg, num_pages=64, page_size=16, kv_dtype="float32"):
    return KVPool(KVLayout.for_model(cfg, page_size, kv_dtype), num_pages)


def _full_logits(model, cfg, ids, **pool_kw):
    pool = _pool(cfg, **pool_kw)
    pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
    b = ForwardBatch.build([BatchRequest(pages, 0, ids)], pool.page_size)
    return model(b, pool, all_logits=True).logits


@pytest.mark.parametrize("kind,dsa_attention", [("dsa", "masked"), ("dsa", "gather"), ("gqa", None)])
def test_full_sequence_logits_match(kind, dsa_attention, tiny_dirs, monkeypatch):
    """DSA prefill runs either as a dense GEMM with the top-k as a mask or gather-sparse over the
    selected keys (chosen by context / top-k ratio): both must match transformers."""
    import engine.layers.attention as attention
    monkeypatch.setattr(attention, "SPARSE_MIN_CONTEXT_RATIO", 1 if dsa_attention == "gather" else 10**9)
    hf = make_hf_model(kind)
    model, cfg = load_model(tiny_dirs[kind], "float32", "cpu")
    torch.manual_seed(1)
    ids = torch.randint(2, cfg.vocab_size, (77,))  # > index_topk (16): DSA sparsity is exercised
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = _full_logits(model, cfg, ids.tolist())
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_64_greedy_tokens_match_generate(kind, tiny_dirs):
    hf = make_hf_model(kind)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    model, cfg = load_model(tiny_dirs[kind], "float32", "cpu")
    torch.manual_seed(2)
    prompts = [torch.randint(2, cfg.vocab_size, (n,)).tolist() for n in (5, 23)]
    eng = Engine(model, cfg, kv_dtype="float32", page_size=8, num_pages=64, chunk_size=16)
    results = eng.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):]
        assert res.token_ids == ref.tolist()
    assert eng.pool.stats().num_used == 0


def test_dsa_sparsity_changes_the_output(tiny_dirs):
    """Guard against a silently dense indexer: a huge index_topk must change long-context logits."""
    model, cfg = load_model(tiny_dirs["dsa"], "float32", "cpu")
    ids = torch.randint(2, cfg.vocab_size, (60,)).tolist()
    sparse = _full_logits(model, cfg, ids)
    object.__setattr__(cfg, "index_topk", 10_000)
    for m in model.modules():
        if hasattr(m, "cfg"):
            object.__setattr__(m, "cfg", cfg)
    dense = _full_logits(model, cfg, ids)
    assert (sparse[:16] - dense[:16]).abs().max() < TOL  # short prefixes see everything either way
    assert (sparse[30:] - dense[30:]).abs().max() > 1e-3


@pytest.mark.parametrize("dsa_attention", ["masked", "gather"])
def test_chunked_single_request_indexer_fast_path(dsa_attention, tiny_dirs, monkeypatch):
    """One causal request prefilled in chunks over its cached prefix: the indexer masks only the
    [Tq, Tq] block where the future lies (no [Tq, S] mask is built) and must select exactly what the
    full causal mask selects: logits bit-identical to that path, and within TOL of transformers."""
    import engine.layers.attention as attention
    monkeypatch.setattr(attention, "SPARSE_MIN_CONTEXT_RATIO", 1 if dsa_attention == "gather" else 10**9)
    hf = make_hf_model("dsa")
    model, cfg = load_model(tiny_dirs["dsa"], "float32", "cpu")
    torch.manual_seed(3)
    ids = torch.randint(2, cfg.vocab_size, (77,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]

    def chunked():
        pool = _pool(cfg)
        pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
        out = []
        for s in range(0, len(ids), 20):
            chunk = ids[s:s + 20].tolist()
            b = ForwardBatch.build([BatchRequest(pages, s, chunk, num_logits=len(chunk))], pool.page_size)
            assert b.single_causal_start == s
            out.append(model(b, pool, all_logits=True).logits)
        return torch.cat(out)
    fast = chunked()
    assert (fast - ref).abs().max().item() < TOL
    monkeypatch.setattr(ForwardBatch, "single_causal_start", property(lambda self: None))  # the [Tq, S] mask path

    def chunked_general():
        pool = _pool(cfg)
        pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
        return torch.cat([model(ForwardBatch.build([BatchRequest(pages, s, ids[s:s + 20].tolist(),
                                                                 num_logits=len(ids[s:s + 20]))], pool.page_size),
                                pool, all_logits=True).logits for s in range(0, len(ids), 20)])
    assert torch.equal(fast, chunked_general())
