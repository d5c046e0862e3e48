"""Speculative decoding stays lossless once DSA sparse attention is active (issue 24).

The models here keep ``index_topk`` small (8) and the contexts run from 1x to 8x of it before 256 generated
tokens make them far longer, so every verify step selects keys. Three equalities are checked, each on
the same checkpoint:

* plain pdserve greedy == transformers' ``GlmMoeDsaForCausalLM.generate`` (fp32), IndexShare
  ("shared" indexer layers) included;
* speculative greedy == plain greedy for chains 1/1/2, 3/1/4, 5/1/6 and trees 3/2/6, 4/2/8, fp32 and
  bf16, the checkpoint's weights and its MXFP4-quantized experts, eager and compiled;
* sampling: the token a speculative step emits follows the target distribution at a context past
  ``index_topk``.

Ties: the indexer's ReLU makes exact score ties common (a key whose every head dot product is negative
scores 0). The DSA paper and transformers leave the order of equal scores to ``torch.topk``, whose
choice depends on the row's length; pdserve breaks ties by position (``dsa_topk``). The transformers
reference runs with the same rule, written here independently as a stable sort.
"""
import os

import pytest
import torch
from test_spec import check_emitted_distribution, make_predictable, one_thread  # noqa: F401 (autouse fixture)
from tiny import stable_topk, transformers_ties_by_position

from engine.batch import BatchRequest, ForwardBatch
from engine.checkpoint import TINY_GLM5, init_random_model
from engine.kvcache import KVLayout, KVPool
from engine.layers.attention import dsa_topk
from engine.quant.quantize import quantize_checkpoint
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplerState, SamplingParams, probs_from_logits
from engine.speculative import SpecConfig, SpecDecoder, SpecEngine, SpecSeq, mtp_prefill

TOPK = 8
DSA = dict(TINY_GLM5, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
           qk_nope_head_dim=16, index_topk=TOPK, index_head_dim=16, index_n_heads=4, n_group=2, topk_group=1)
"""GLM-5 architecture with 4 indexer heads: 1 key in 16 scores exactly 0, so ties at the k-th score happen."""
LENS = (TOPK, 2 * TOPK, 4 * TOPK, 8 * TOPK)
NUM_TOKENS = 256
COMPILED_TOKENS = 96
CHAINS = ["1/1/2", "3/1/4", "5/1/6"]
TREES = ["3/2/6", "4/2/8"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: checkpoint}: ``full`` (every layer scores its keys), ``shared`` (IndexShare: layer 2 reuses
    layer 1's selection), each "predictable" (multi-token acceptance, see test_spec), and ``full-mxfp4``."""
    root = tmp_path_factory.mktemp("spec_dsa")
    out = {}
    for name, extra in (("full", {}), ("shared", dict(indexer_types=["full", "full", "shared"]))):
        rnd = init_random_model(dict(DSA, **extra), str(root / f"random-{name}"), std=0.08)
        out[name] = make_predictable(rnd, str(root / name))
    out["full-mxfp4"] = str(root / "full-mxfp4")
    quantize_checkpoint(out["full"], out["full-mxfp4"], "mxfp4")
    return out


_models: dict = {}
_plain: dict = {}


def get_model(dirs, name, dtype):
    if (name, dtype) not in _models:
        _models[(name, dtype)] = load_model(dirs[name], dtype, "cpu")
    return _models[(name, dtype)]


def prompts_for(cfg, lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def plain_greedy(dirs, name, dtype):
    if (name, dtype) not in _plain:
        model, cfg = get_model(dirs, name, dtype)
        eng = Engine(model, cfg, kv_dtype=dtype, page_size=8, num_pages=512)
        _plain[(name, dtype)] = [r.token_ids for r in eng.generate(
            prompts_for(cfg), SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))]
    return _plain[(name, dtype)]


def first_difference(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def bf16_gemm_rows_alike() -> bool:
    """Does this CPU's bf16 GEMM round a row the same whatever the row count (1 for decode, N for verify)?
    True on CPUs with AMX / AVX512-BF16 kernels (oneDNN); where it is not, a bf16 verify step's keys differ
    from a decode step's by an ulp and DSA's hard top-k may select differently: a property of the kernels
    (nothing speculation can fix), so those runs are skipped with this reason."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    full = torch.nn.functional.linear(x, w)
    return all(torch.equal(torch.nn.functional.linear(x[i:i + 1], w)[0], full[i]) for i in range(8))


def check_spec_equals_plain(dirs, name, dtype, spec):
    if dtype == "bfloat16" and not bf16_gemm_rows_alike():
        pytest.skip("this CPU's bf16 GEMMs round a row differently at different row counts")
    model, cfg = get_model(dirs, name, dtype)
    ref = plain_greedy(dirs, name, dtype)
    eng = SpecEngine(Engine(model, cfg, kv_dtype=dtype, page_size=8, num_pages=512), SpecConfig.parse(spec))
    out = eng.generate(prompts_for(cfg), SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    for n, r, o in zip(LENS, ref, out):
        first = first_difference(r, o.token_ids)
        assert first is None, f"{spec} {dtype} {name}: prompt of {n} tokens diverges at token {first}: " \
                              f"plain {r[first:first + 4]} spec {o.token_ids[first:first + 4]}"
    assert eng.pool.allocator.num_used == 0
    return eng.metrics


# -- the selection itself -------------------------------------------------------------------------------

def test_dsa_topk_is_a_total_order_independent_of_the_row_shape():
    g = torch.Generator().manual_seed(0)
    S, k = 300, 16
    scores = torch.randn(4, 7, S, generator=g).relu_()  # half the scores exactly 0: ties at the k-th
    scores[0, 0, 50:] = 0.0
    scores[1] = torch.where(torch.rand(7, S, generator=g) < 0.5, -0.0, scores[1])  # -0.0 ties +0.0
    scores[2, :, :100] = 0.25  # ties above the k-th score
    got = dsa_topk(scores, k)
    # the same keys as a stable sort picks (+ 0.0: -0.0 sorts as +0.0), in position order
    assert torch.equal(got, stable_topk(scores + 0.0, k).sort(dim=-1).values)
    # a query's keys do not depend on the row's length, a masked tail or the batch it is padded into
    padded = torch.cat([scores, torch.full((4, 7, 37), float("-inf"))], dim=-1)
    assert torch.equal(dsa_topk(padded, k), got)
    for b in range(4):
        for t in range(7):
            assert torch.equal(dsa_topk(scores[b, t], k), got[b, t])
    # fewer finite scores than k: every finite one, then masked ones by position (marked invalid by callers)
    short = torch.full((1, S), float("-inf"))
    short[0, [5, 9, 200]] = torch.tensor([0.0, 1.0, 0.0])
    assert dsa_topk(short, 5).tolist() == [[0, 1, 5, 9, 200]]


def test_ties_at_the_kth_score_happen_in_these_models(dirs):
    """Guard: the models below do exercise the tie rule (else the equalities would not test it)."""
    model, cfg = get_model(dirs, "full", "float32")
    seen, orig = [], dsa_topk

    import engine.layers.attention as attention

    def spy(scores, k):
        kth = scores.topk(k, dim=-1).values[..., -1:]
        ties = ((scores == kth).sum(-1) > 1) & torch.isfinite(kth[..., 0])
        seen.append(int(ties.sum()))
        return orig(scores, k)

    attention.dsa_topk = spy
    try:
        Engine(model, cfg, kv_dtype="float32", page_size=8, num_pages=512).generate(
            prompts_for(cfg), SamplingParams(max_tokens=64, ignore_eos=True))
    finally:
        attention.dsa_topk = orig
    assert sum(seen) > 0


# -- plain greedy == transformers ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "shared"])
def test_plain_greedy_equals_transformers_past_index_topk(dirs, name):
    from transformers import GlmMoeDsaForCausalLM
    hf = GlmMoeDsaForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
    assert hf.config.index_topk == TOPK
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    _, cfg = get_model(dirs, name, "float32")
    for n, prompt, ours in zip(LENS, prompts_for(cfg), plain_greedy(dirs, name, "float32")):
        with torch.no_grad(), transformers_ties_by_position():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False)[0, n:].tolist()
        first = first_difference(ref, ours)
        assert first is None, f"prompt of {n}: transformers {ref[first:first + 4]} pdserve {ours[first:first + 4]} " \
                              f"at token {first}"


# -- speculative == plain -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", CHAINS + TREES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights", ["full", "full-mxfp4"])
def test_spec_greedy_equals_plain_past_index_topk(dirs, spec, dtype, weights):
    m = check_spec_equals_plain(dirs, weights, dtype, spec)
    # drafts accepted (multi-token steps) and rejected (rollbacks), both often
    assert 1.3 < m.accept_len < 1 + SpecConfig.parse(spec).num_steps - 0.3, m.as_dict(5)
    if spec in TREES and dtype == "float32":
        assert m.num_moved_kv > 0  # a non-first sibling accepted: its KV (indexer key included) moved


@pytest.mark.parametrize("spec", ["3/1/4", "3/2/6"])
def test_spec_greedy_equals_plain_with_index_share(dirs, spec):
    check_spec_equals_plain(dirs, "shared", "float32", spec)


@pytest.mark.own_xdist_group
@pytest.mark.timeout(1200)  # ~9.5 min of inductor compiles alone on the 2-core AVX2 EPYC (13 graphs)
@pytest.mark.parametrize("dtype,spec,kv_dtype", [("float32", "4/2/8", "fp8_e4m3"), ("bfloat16", "5/1/6", None)])
def test_compiled_spec_greedy_equals_compiled_plain_past_index_topk(dirs, dtype, spec, kv_dtype):
    """``--compile``: verify and draft steps through the compiled graphs (their own copy of the top-k); in bf16
    the routed experts run eagerly at every batch size (``decode_graph.REDUCED_PRECISION``). One shape of
    speculation per dtype (each costs its own graphs' compile, minutes on 2 cores): a wide tree in fp32 over an
    fp8 KV pool (the graphs quantise the writes, the rollback of rejected drafts included), a 5-step chain in
    bf16 over a bf16 pool; test_decode_graph adds a 3/1/4 chain through GLM-4.5's GQA graphs. (An fp32 pool's
    compiled steps: test_decode_graph's step tests; its speculation eager: the tests above.)"""
    if dtype == "bfloat16" and not bf16_gemm_rows_alike():
        pytest.skip("this CPU's bf16 GEMMs round a row differently at different row counts")
    model, cfg = load_model(dirs["full"], dtype, "cpu")  # its own copy: the graphs stay with it
    model.compile_decode()
    kv = kv_dtype or dtype
    eng = Engine(model, cfg, kv_dtype=kv, page_size=8, num_pages=512)
    # 96 tokens (not 256): every context still ends past 8x index_topk, and the graphs' shape classes (dense
    # and sparse selection, chain and tree verify, drafts) are all reached; the graphs' compile is the cost
    params = SamplingParams(max_tokens=COMPILED_TOKENS, ignore_eos=True)
    ref = [r.token_ids for r in eng.generate(prompts_for(cfg), params)]
    spec_eng = SpecEngine(Engine(model, cfg, kv_dtype=kv, page_size=8, num_pages=512), SpecConfig.parse(spec))
    out = spec_eng.generate(prompts_for(cfg), params)
    for n, r, o in zip(LENS, ref, out):
        first = first_difference(r, o.token_ids)
        assert first is None, f"compiled {spec} {dtype} (pool {kv}): prompt of {n} diverges at token {first}"
    assert spec_eng.metrics.accept_len > 1.5, spec_eng.metrics.as_dict(5)  # drafts accepted, not just verified
    assert spec_eng.pool.allocator.num_used == 0


# -- sampling past index_topk ------------------------------------------------------------------------

def test_sampling_matches_target_distribution_past_index_topk(dirs):
    """The token a speculative step emits (accepted draft, residual or bonus) over 1200 seeded requests,
    at a context of 3x index_topk, against the exact target distribution (chi-square, p > 1e-3)."""
    model, cfg = get_model(dirs, "full", "float32")
    P = 8
    prompt = prompts_for(cfg, (3 * TOPK + 1,), seed=3)[0]
    C = len(prompt) - 1  # the prompt's last token is the first "generated" one, run by the verify step
    base = dict(max_tokens=2, temperature=0.8, top_p=0.95, ignore_eos=True)
    n = 1200
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), C // P + 2 * n + 2)
    shared = pool.allocator.alloc(C // P, "prefix")  # the first C tokens, prefilled once (C % P == 0)
    assert C % P == 0
    out = model(ForwardBatch.build([BatchRequest(shared, 0, prompt[:C])], P), pool)
    res = mtp_prefill(model, pool, shared, 0, prompt[:C], out.hidden, next_token=prompt[C])
    seqs = []
    for i in range(n):
        pool.allocator.incref(shared)
        sp = SamplingParams(seed=5000 + i, **base)
        st = SamplerState(sp, prompt[:C], [prompt[C]])
        seqs.append(SpecSeq(f"r{i}", st, shared + pool.allocator.alloc(2, f"r{i}"), C, res.draft_hidden,
                            res.draft_logits))
    pool.allocator.free(shared)
    dec = SpecDecoder(model, pool, SpecConfig.parse("3/1/4"), cfg.eos_token_ids)
    dec.step(seqs)
    # exact: the target's processed distribution after prompt (C + 1 tokens), one plain forward
    ref_pool = KVPool(KVLayout.for_model(cfg, P, "float32"), C // P + 2)
    logits = model(ForwardBatch.build([BatchRequest(list(range(C // P + 2)), 0, prompt)], P), ref_pool).logits
    exact = probs_from_logits(logits, [SamplerState(SamplingParams(**base), prompt[:C], [prompt[C]])])[0].double()
    check_emitted_distribution(dec, pool, seqs, exact)


def test_models_here_are_not_quietly_dense(dirs):
    """Guard: every prompt's context outgrows index_topk while it decodes (DSA selection active)."""
    _, cfg = get_model(dirs, "full", "float32")
    assert cfg.index_topk == TOPK and min(LENS) + min(NUM_TOKENS, COMPILED_TOKENS) > 8 * TOPK
    assert os.path.exists(os.path.join(dirs["full-mxfp4"], "config.json"))
