"""Compiled decode graphs (``GlmForCausalLM.compile_decode``, ``engine.layers.decode_graph``).

* a compiled decode / verify step computes what the eager step computes (logits and the KV it writes into
  the paged pool, to float rounding), for one request, several requests of different context lengths
  (short ones attend to every key, long ones through the DSA top-k), several tokens per request
  (verification), and a batch large enough that the routed experts leave the graph;
* lossless speculation holds within the compiled path: greedy speculative == greedy plain, both compiled;
* GLM-4.5's GQA layers and fp8 KV pools run the same graphs (``engine.layers.gqa_graph``): the same
  step checks, and greedy output equals eager's;
* after ``warm_up_decode`` (a decode worker's start) serving compiles nothing.

Tiny models: one compile per shape class (seconds each), shared by the tests of this module.
"""
import pytest
import torch
from test_spec import dirs, make_engine, one_thread, prompts_for  # noqa: F401  (fixtures)
from torch._dynamo.utils import counters

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.quant.prepare import expert_memory
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine
from engine.layers.decode_graph import GRAPH_EXACT_GATHER_MAX_PAIRS
from engine.warmup import warm_up_decode

PAGE = 8


@pytest.fixture(scope="module")
def mx_dir(dirs, tmp_path_factory):  # noqa: F811
    """The random DSA model with MXFP4 routed experts (what decode workers serve)."""
    from engine.quant.quantize import quantize_checkpoint
    out = str(tmp_path_factory.mktemp("graph") / "mxfp4")
    quantize_checkpoint(dirs["random-dsa"], out, "mxfp4", progress=False)
    return out


@pytest.fixture(scope="module")
def compiled(dirs, mx_dir):  # noqa: F811
    """{name: (compiled model, cfg)}: separate instances from the eager ones."""
    dirs = dict(dirs, mxfp4=mx_dir)
    out = {}
    for name in ("random-dsa", "pred-gqa", "mxfp4"):
        model, cfg = load_model(dirs[name], "float32", "cpu")
        model.compile_decode()
        out[name] = (model, cfg)
    return out


def _prefill(model, cfg, prompts, kv_dtype="float32"):
    pool = KVPool(KVLayout.for_model(cfg, PAGE, kv_dtype), 256)
    pages, start = [], 0
    for p in prompts:
        n = len(p) // PAGE + 4
        pages.append(list(range(start, start + n)))
        start += n
        model(ForwardBatch.build([BatchRequest(pages[-1], 0, p)], PAGE), pool)
    return pool, pages


def _step(model, pool, pages, prompts, new_tokens):
    reqs = [BatchRequest(pg, len(p), toks) for pg, p, toks in zip(pages, prompts, new_tokens)]
    batch = ForwardBatch.build(reqs, PAGE)
    whole = model._stack_layers(model.model.layers, batch, pool) is not None
    return model(batch, pool, all_logits=True).logits, batch.out_slots, whole


@pytest.mark.parametrize("name,lens,q", [("random-dsa", (40,), 1), ("random-dsa", (5, 23, 40), 1),
                                         ("random-dsa", (40,), 6), ("random-dsa", (23, 40), 3),
                                         ("random-dsa", (5, 23, 40, 7, 30, 19, 12, 33, 26), 1),
                                         ("mxfp4", (5, 23, 40), 1), ("mxfp4", (5, 23, 40, 7, 30, 19, 12, 33, 26), 1),
                                         ("pred-gqa", (40,), 1), ("pred-gqa", (5, 23, 40), 1),
                                         ("pred-gqa", (23, 40), 3), ("pred-gqa", (5, 23, 40, 7, 30, 19, 12, 33, 26), 1),
                                         ("pred-gqa+fp8", (5, 23, 40), 1), ("pred-gqa+fp8", (23, 40), 3),
                                         ("random-dsa+fp8", (5, 23, 40), 1), ("random-dsa+fp8", (23, 40), 3),
                                         ("random-dsa", (5, 23, 40, 7, 30, 19, 12, 33, 26, 9, 14), 3)])
def test_compiled_step_matches_eager(dirs, mx_dir, compiled, name, lens, q):  # noqa: F811
    """One decode (q = 1) or verify-shaped (q > 1) step, eager vs compiled, from the same prefilled KV: the
    logits and every KV component written agree to float rounding. Up to 64 token-expert pairs
    (``GRAPH_EXACT_GATHER_MAX_PAIRS``) the whole step is one graph; 11 requests of 3 tokens (66 pairs) run a
    graph per layer with the routed experts eager between the graph and the residual. MXFP4 experts run the fused kernel (from the codes,
    no dense copy) as one op inside the graph. GLM-4.5's GQA layers (``engine.layers.gqa_graph``) likewise, and fp8 KV pools (the
    graphs quantise the writes and dequantise the reads as ``KVPool.write`` / ``read`` do)."""
    name, _, fp8 = name.partition("+")
    kv_dtype = "fp8_e4m3" if fp8 else "float32"
    eager, cfg = load_model(mx_dir if name == "mxfp4" else dirs[name], "float32", "cpu")
    comp, _ = compiled[name]
    prompts = prompts_for(cfg, lens, seed=len(lens) + q)
    g = torch.Generator().manual_seed(q)
    new = [torch.randint(2, cfg.vocab_size, (q,), generator=g).tolist() for _ in lens]
    results = []
    for model in (eager, comp):
        pool, pages = _prefill(eager, cfg, prompts, kv_dtype)  # the same (eager) prompt KV for both
        for _ in range(2):  # the first call of a shape class compiles; the second runs the cached graph
            snapshot = [{n: b.clone() for n, b in layer.items()} for layer in pool.buffers + pool.scales]
            logits, slots, whole = _step(model, pool, pages, prompts, new)
            # dequantised for fp8 pools (the bytes and the scales both written)
            written = [{n: pool.read(i, n, slots, torch.float32) for n in layer} for i, layer in enumerate(pool.buffers)]
            for i, layer in enumerate(pool.buffers + pool.scales):  # undo the step: the second call starts alike
                for n, b in layer.items():
                    b.copy_(snapshot[i][n])
        results.append((logits, written))
        # one graph for the whole step when every routed expert runs inside (<= 64 token-expert pairs)
        assert whole == (model is comp and len(lens) * q * cfg.num_experts_per_tok <= GRAPH_EXACT_GATHER_MAX_PAIRS)
    (le, we), (lc, wc) = results
    assert torch.isfinite(lc).all()
    torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(we, wc)):
        for n in a:
            if fp8:  # a value within float rounding of an fp8 rounding boundary may land one e4m3 step away
                close = torch.isclose(b[n], a[n], rtol=1e-4, atol=1e-5)
                assert close.float().mean() > 0.99, f"layer {i} {n}"
                torch.testing.assert_close(b[n], a[n], rtol=0.13, atol=1e-5, msg=f"layer {i} {n}")
            else:
                torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-5, msg=f"layer {i} {n}")
    assert any(layer.graphs.compiled for layer in comp.model.layers)
    if name == "mxfp4":  # the graphs ran the MX kernel from the codes: no dense copy of any expert, ever
        mem = expert_memory(comp)
        assert mem.cache_bytes == 0 and mem.dense_bytes == 0 and mem.resident_bytes == mem.mx_bytes


def _greedy_both(model, cfg, spec, num_tokens, kv_dtype=None):
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    prompts = prompts_for(cfg)
    plain = make_engine(model, cfg, "float32", kv_dtype=kv_dtype).generate(prompts, params)
    eng = SpecEngine(make_engine(model, cfg, "float32", kv_dtype=kv_dtype), SpecConfig.parse(spec))
    out = eng.generate(prompts, params)
    for i, (r, o) in enumerate(zip(plain, out)):
        first = next((j for j, (a, b) in enumerate(zip(r.token_ids, o.token_ids)) if a != b), None)
        assert first is None and len(o.token_ids) == num_tokens, f"request {i} diverges at token {first}"
    assert eng.pool.allocator.num_used == 0 and eng.pool.allocator.owners() == {}
    return eng.metrics


def test_compiled_speculative_lossless_gqa(compiled):
    """Lossless within the compiled path: drafts, chained MTP steps, verification and KV rollback through
    GLM-4.5's GQA graphs give plain compiled greedy decoding's tokens. (A tree over an fp8 KV pool and a bf16
    chain, both to 8x index_topk through the MLA + DSA graphs: test_spec_dsa's compiled test; one speculation
    shape per graph family: each shape's graphs cost a minute or more of compile on 2 cores.)"""
    model, cfg = compiled["pred-gqa"]
    _greedy_both(model, cfg, "3/1/4", 48)


def test_compiled_gqa_greedy_equals_eager(dirs, compiled):  # noqa: F811
    """GLM-4.5 greedy decoding through the compiled GQA graphs gives eager decoding's tokens (batched
    requests of different lengths: whole-step graphs, then per-layer graphs with the experts eager)."""
    model, cfg = compiled["pred-gqa"]
    eager, _ = load_model(dirs["pred-gqa"], "float32", "cpu")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for lens in ((37,), (5, 23, 40, 7, 30, 19, 12, 33, 26)):
        prompts = prompts_for(cfg, lens, seed=7)
        want = make_engine(eager, cfg, "float32").generate(prompts, params)
        got = make_engine(model, cfg, "float32").generate(prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("name", ["pred-gqa"])
def test_no_compile_after_warm_up(dirs, name, fresh_dynamo):  # noqa: F811
    """``warm_up_decode`` (what a decode worker runs before it reports ready) compiles every graph the
    served shapes need: decoding and speculating batches of other sizes and lengths afterwards compile
    nothing (torch._dynamo's compile counters stay put)."""
    model, cfg = load_model(dirs[name], "float32", "cpu")
    model.compile_decode()
    warm_up_decode(model, cfg, "float32", PAGE, "3/1/4")
    before = dict(counters["stats"])
    assert before.get("unique_graphs", 0) > 0
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # 34 requests: 68 token-expert pairs, past GRAPH_EXACT_GATHER_MAX_PAIRS (the experts leave the graph)
    for lens in ((11,), (3, 50), (5, 23, 40, 7, 30), (9,) * 12, (6,) * 34):
        make_engine(model, cfg, "float32").generate(prompts_for(cfg, lens), params)
        SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("3/1/4")).generate(prompts_for(cfg, lens),
                                                                                          params)
    assert dict(counters["stats"]) == before


def test_compile_decode_off_returns_to_eager(dirs):  # noqa: F811
    model, cfg = load_model(dirs["random-dsa"], "float32", "cpu")
    model.compile_decode()
    assert all(layer.graphs.compiled for layer in list(model.model.layers) + [m.block for m in model.mtp])
    model.compile_decode(False)
    assert not any(layer.graphs.compiled for layer in list(model.model.layers) + [m.block for m in model.mtp])


def test_recompile_limit_holds_in_every_thread():
    """torch._dynamo's config is per thread and a decode worker steps in its scheduler thread: with torch's
    default limit (8 graphs per function) the ninth shape class there was a hard error (seen serving)."""
    import threading

    from engine.layers import decode_graph
    seen = []

    def worker():
        decode_graph._dynamic(True, torch.zeros(2, 4))
        seen.append(torch._dynamo.config.recompile_limit)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [decode_graph.RECOMPILE_LIMIT]
