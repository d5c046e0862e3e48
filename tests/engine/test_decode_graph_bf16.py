"""bf16 models without MTP layers: their routed experts run inside the compiled decode graphs
(``DecodeGraphs.exact_verify`` False), so a decode step is one graph (embedding, layers, experts, LM head) instead
of a graph per layer with the experts eager between: ``gather_fused`` up to ``GRAPH_GATHER_MAX_PAIRS``
token-expert pairs, then ``dense`` (few experts).

* the step is one graph, and computes what the eager step computes (logits and every KV component written,
  to bf16 rounding), GLM-4.5 (GQA) and GLM-5 (MLA) alike, on both strategies;
* a bf16 model WITH MTP layers keeps its experts eager (speculative verify steps must round as decode does);
* greedy decoding through the graphs picks eager's greedy tokens, up to bf16 ties;
* after ``warm_up_decode`` serving compiles nothing.
"""
import re

import pytest
import torch
from test_decode_graph import _prefill, _step
from test_spec import TINY_DSA, TINY_GQA, make_engine, make_predictable, prompts_for
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from engine.batch import BatchRequest, ForwardBatch
from engine.checkpoint import init_random_model
from engine.kvcache import KVLayout, KVPool
from engine.layers import cpu_attention, mlp
from engine.layers.decode_graph import HeadWeights, graph_moe_strategy, lm_head
from engine.load import load_model
from engine.moe.router import route
from engine.sampling import SamplingParams
from engine.warmup import warm_up_decode

TIE_ULPS = 2
"""Logits within this many bf16 ulps (of the best logit) of each other are a tie: the two paths' logits differ by
up to a couple of ulps, so either token of such a pair is a greedy choice."""
ROUTING_TIE = 0.002
"""Router scores (sigmoid, ~0.5-0.7) closer than this are a tie: the two paths' hidden states differ by bf16 roundings, which move a score by up to ~1e-3."""
NO_MTP = {"gqa": dict(TINY_GQA, num_nextn_predict_layers=0), "dsa": dict(TINY_DSA, num_nextn_predict_layers=0),
          "gqa-mtp": TINY_GQA}


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    """Predictable weights (``make_predictable``: clear greedy margins, which random tiny weights lack in bf16)."""
    root = tmp_path_factory.mktemp("bf16")
    return {name: make_predictable(init_random_model(cfg, str(root / f"random-{name}"), std=0.08), str(root / name))
            for name, cfg in NO_MTP.items()}


@pytest.fixture(scope="module")
def compiled_bf16(bf16_dirs):
    out = {}
    for name, d in bf16_dirs.items():
        model, cfg = load_model(d, "bfloat16", "cpu")
        model.compile_decode()
        out[name] = (model, cfg)
    return out


# GLM-5 contexts stay under index_topk (16): past it a bf16 rounding difference in the DSA indexer's scores may
# select another key (a hard top-k), a different attention, not a rounding difference
MANY = tuple(5 + 3 * i for i in range(17))
"""17 requests of 2 experts each: 34 token-expert pairs, past GRAPH_GATHER_MAX_PAIRS (the ``dense`` strategy)."""


@pytest.mark.parametrize("name,lens", [("gqa", (40,)), ("gqa", (5, 23, 40)), ("gqa", (5, 23, 40, 7, 30, 19, 12, 33, 26)),
                                       ("gqa", MANY), ("dsa", (12,)), ("dsa", (5, 9, 14)), ("gqa-mtp", (40,))])
def test_bf16_step_is_one_graph_and_matches_eager(bf16_dirs, compiled_bf16, name, lens, monkeypatch):
    """One decode step, eager vs compiled, from the same prefilled KV: logits and the KV written agree to bf16
    rounding. Without MTP layers the whole step is one graph (before: the bf16 experts ran eagerly, a graph per
    layer, past 16 pairs), ``gather_fused`` for 1 / 3 / 9 requests, ``dense`` for 17; a model with MTP layers
    keeps them eager."""
    eager, cfg = load_model(bf16_dirs[name], "bfloat16", "cpu")
    comp, _ = compiled_bf16[name]
    prompts = prompts_for(cfg, lens, seed=len(lens))
    new = [[3 + i] for i in range(len(lens))]
    results, margins = [], []

    def spy_route(logits, bias, *args):  # the eager step's routing: how close each token's k-th and k+1-th expert are
        top = (logits.float().sigmoid() + bias.float()).topk(cfg.num_experts_per_tok + 1, dim=-1)[0]
        margins.append(top[:, -2] - top[:, -1])
        return route(logits, bias, *args)
    for model in (eager, comp):
        pool, pages = _prefill(eager, cfg, prompts, "bfloat16")
        if model is eager:
            monkeypatch.setattr(mlp, "route", spy_route)
        for _ in range(2):  # the first call of a shape class compiles; the second runs the cached graph
            snapshot = [{n: b.clone() for n, b in layer.items()} for layer in pool.buffers]
            logits, slots, whole = _step(model, pool, pages, prompts, new)
            written = [{n: pool.read(i, n, slots, torch.float32) for n in layer} for i, layer in enumerate(pool.buffers)]
            for i, layer in enumerate(pool.buffers):
                for n, b in layer.items():
                    b.copy_(snapshot[i][n])
        monkeypatch.setattr(mlp, "route", route)
        results.append((logits, written))
        K = cfg.num_experts_per_tok
        inside = (model is comp and "mtp" not in name
                  and graph_moe_strategy(len(lens) * K, cfg.n_routed_experts, K) is not None)
        assert whole == inside
    (le, we), (lc, wc) = results
    assert torch.isfinite(lc).all()
    # a request whose router scores its k-th and k+1-th expert within bf16 rounding of each other may pick either
    # on either path (the two compute q / k in different fused kernels): another expert, not a rounding difference
    tied = torch.stack([m for m in margins if m.shape[0] == len(lens)]).amin(0) < ROUTING_TIE if margins else None
    if tied is not None and tied.any():
        assert int(tied.sum()) <= max(1, len(lens) // 5), f"{int(tied.sum())} of {len(lens)} requests tie: other prompts"
        le, lc = le[~tied], lc[~tied]
    # 17 requests: one logit of 2,176 differs by 0.035 (~1 bf16 ulp of the largest logits) on the experts'
    # eager path of before as well as on ``dense``; hence 0.05
    torch.testing.assert_close(lc, le, rtol=0.03, atol=0.05 if lens == MANY else 0.03)
    for i, (a, b) in enumerate(zip(we, wc)):
        for n in a:
            # a few bf16 ulps of the largest values (|k| ~ 3: an ulp is 0.016): layer 1 reads layer 0's output
            torch.testing.assert_close(b[n], a[n], rtol=0.02, atol=0.05, msg=f"layer {i} {n}")


@pytest.mark.parametrize("name", ["gqa"])
def test_bf16_compiled_greedy_is_eager_greedy_up_to_bf16_ties(bf16_dirs, compiled_bf16, name, monkeypatch):
    """Every token greedy decoding picks through the bf16 graphs (one request: one-graph steps; nine: per-layer
    graphs) is eager's greedy choice on the same context, or within bf16 rounding of it: eager's logit of the
    picked token is at most ``TIE_ULPS`` bf16 ulps below eager's best (teacher-forced: the eager model reads the compiled
    path's prompt + tokens in one pass). Token-for-token equality over a long generation does not hold in
    bf16 (fused kernels round differently, and a near-tie then flips; the eager-expert graphs of before
    diverged as well), so a token within rounding of the best one is as greedy as eager's. GLM-4.5 only: past
    index_topk GLM-5's DSA top-k is a hard selection that a rounding difference may change (then other keys are
    attended, and the logits differ by more than rounding), so its check is the step test's, under index_topk."""
    model, cfg = compiled_bf16[name]
    eager, _ = load_model(bf16_dirs[name], "bfloat16", "cpu")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    # Prompts attend in torch's SDPA here, the reference's teacher-forced pass included: the test is about the
    # decode graphs. With our prefill kernel (engine.layers.cpu_attention; tested against SDPA and fp32 on its
    # own) the reference pass rounds differently, and on the AVX2 EPYC one token of a 32-token generation was
    # 10 ulps below that reference's best (the compiled tokens themselves unchanged).
    monkeypatch.setattr(cpu_attention, "usable", lambda q, k, v: False)
    for lens in ((37,), (5, 23, 40, 7, 30, 19, 12, 33, 26)):
        prompts = prompts_for(cfg, lens, seed=7)
        got = make_engine(model, cfg, "bfloat16").generate(prompts, params)
        for p, r in zip(prompts, got):
            ids = p + r.token_ids
            pool = KVPool(KVLayout.for_model(cfg, 8, "bfloat16"), len(ids) // 8 + 2)
            batch = ForwardBatch.build([BatchRequest(list(range(len(ids) // 8 + 2)), 0, ids[:-1])], 8)
            logits = eager(batch, pool, all_logits=True).logits[len(p) - 1:]  # [new tokens, V]: each one's context
            picked = logits.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
            best = logits.max(dim=-1).values
            ulp = torch.exp2(torch.floor(torch.log2(best.abs())) - 7)  # bf16: 8 significant bits
            gap = best - picked
            assert (gap <= TIE_ULPS * ulp).all(), \
                f"{name}: token {int((gap / ulp).argmax())} is {float((gap / ulp).max()):.1f} ulps below eager's best"
            assert (gap == 0).float().mean() >= 0.9  # nearly all exactly eager's choice


def test_bf16_no_compile_after_warm_up(bf16_dirs, fresh_dynamo):
    """``warm_up_decode`` compiles the bf16 graphs with the experts inside (and the per-layer ones of larger
    batches): decoding batches of other sizes and lengths afterwards compiles nothing."""
    model, cfg = load_model(bf16_dirs["gqa"], "bfloat16", "cpu")
    model.compile_decode()
    warm_up_decode(model, cfg, "bfloat16", 8)
    before = dict(counters["stats"])
    assert before.get("unique_graphs", 0) > 0
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for lens in ((11,), (3, 50), (5, 23, 40, 7, 30), (9,) * 12, (6,) * 20):
        make_engine(model, cfg, "bfloat16").generate(prompts_for(cfg, lens), params)
    assert dict(counters["stats"]) == before


def test_lm_head_row_gemv_is_one_reduction_rounded_as_linear():
    """``lm_head`` with ``row_gemv``: one row of bf16 logits is a fused multiply-sum (no ``mm`` in inductor's code:
    oneDNN's small-M bf16 path measured 1.45-1.65x slower for the whole glm4_moe step), rounded to bf16 as
    ``F.linear``'s output is: within an ulp of it. Several rows keep the GEMM."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16()
    embed, norm = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    fn = torch.compile(lm_head, fullgraph=True)
    for rows, gemv, want_mm in ((1, True, False), (1, False, True), (3, True, True)):
        h = torch.randn(rows, 64, generator=g).bfloat16()
        head = HeadWeights(embed, norm, 1e-5, w, row_gemv=gemv)
        out, code = run_and_get_code(fn, h, head)
        ref = torch.nn.functional.linear(h, w).float()
        assert out.dtype == torch.float32 and out.shape == (rows, 1000)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
        assert ((out - ref).abs() <= ulp).all()
        gemm = re.search(r"extern_kernels\.(mm|addmm)|aten\.mm|mm_out|mkldnn", " ".join(code)) is not None
        assert gemm == want_mm, (rows, gemv)


def test_row_gemv_only_where_verify_need_not_match(bf16_dirs, compiled_bf16):
    """The whole-step graph of a bf16 model without MTP layers reads its LM head row-wise; one with MTP layers
    (speculative verify steps must round as decode does) keeps the GEMM."""
    for name, want in (("gqa", True), ("dsa", True), ("gqa-mtp", None)):
        model, cfg = compiled_bf16[name]
        g = model.model.layers[0].graphs
        seen = []
        g.run_stack = lambda *a, _orig=g.run_stack, _seen=seen, **k: (_seen.append(a[6].row_gemv), _orig(*a, **k))[1]
        try:
            prompts = prompts_for(cfg, (12,))
            make_engine(model, cfg, "bfloat16").generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        finally:
            del g.run_stack
        # the 12-token prompt (24 token-expert pairs: ``gather_fused``) and two decode steps; with MTP: experts
        # eager, no whole step
        assert seen == ([] if want is None else [want] * 3), (name, seen)


def test_fp32_head_of_bf16_values_reads_its_bf16_copy(bf16_dirs):
    """An fp32 model (no MTP layers) whose LM head holds bf16 values (a bf16 checkpoint served in fp32) reads
    the head's exact bf16 copy in batch-1 steps: half the bytes, fp32 logits equal to the fp32 GEMM's up to
    summation order. A head with one value off the bf16 grid gets no copy (the row GEMV would change it)."""
    model, cfg = load_model(bf16_dirs["gqa"], "float32", "cpu")
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.bfloat16().float())
    model.compile_decode()
    assert model._lm_narrow is not None and model._lm_narrow.dtype == torch.bfloat16
    g = model.model.layers[0].graphs
    seen = []

    def spy(*a, _orig=g.run_stack, **k):
        logits, hidden = _orig(*a, **k)
        seen.append((a[6], logits, hidden))
        return logits, hidden
    g.run_stack = spy
    try:
        make_engine(model, cfg, "float32").generate(prompts_for(cfg, (12,)), SamplingParams(max_tokens=3,
                                                                                             ignore_eos=True))
    finally:
        del g.run_stack
    steps = [(head, logits, hidden) for head, logits, hidden in seen if logits.shape[0] == 1]
    assert len(steps) >= 2
    for head, logits, hidden in steps:
        assert head.row_gemv and head.lm_w_narrow is model._lm_narrow
        with torch.no_grad():
            ref = torch.nn.functional.linear(hidden[-1:], model.lm_head.weight)
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.lm_head.weight[3, 5] += 1e-6
    model.compile_decode()
    assert model._lm_narrow is None
    # a model with MTP layers verifies: its steps never read the copy, so none is made
    mtp, _ = load_model(bf16_dirs["gqa-mtp"], "float32", "cpu")
    with torch.no_grad():
        mtp.lm_head.weight.copy_(mtp.lm_head.weight.bfloat16().float())
    mtp.compile_decode()
    assert mtp._lm_narrow is None
