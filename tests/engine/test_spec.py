"""MTP speculative decoding end to end on tiny GLM models: lossless greedy against the plain engine,
the MTP / target KV left behind by rollback, chunked and cached-prefix MTP prefill, the sampled
distribution, stop conditions, seeds and page accounting.

Two kinds of model:

* random weights (``init_random_model``): the MTP layer almost never guesses right, so nearly every
  step rejects at depth 1 (the rejection and sibling paths);
* a "predictable" model built here: the embedding, LM head and MTP ``eh_proj`` are set so the next
  token is mostly ``perm[current token]`` while attention / MLP outputs (scaled by ``ALPHA``) bend
  some predictions depending on the context. Drafts ``perm[perm[...]]`` are then often right,
  so steps accept several tokens and roll back the rest: multi-token acceptance, KV rollback,
  tree moves. Its target still depends on the KV (a wrong rollback changes its output).

bf16 runs use ``index_topk`` above the context and the predictable model: DSA's hard top-k turns
the 1-ulp rounding difference between a 1-token decode GEMM and an N-token verify GEMM into a
different key set (seen at token 136 of a random model), and a random model's bf16 logits tie
exactly (two top logits both 1.5391 at token 255), where argmax follows that 1-ulp difference.
Exact ties of the indexer's scores are ordered by position now (``dsa_topk``); ``test_spec_dsa.py`` runs bf16
with DSA active where the CPU's bf16 GEMMs round each row alike at any row count. fp32 runs keep DSA active.

The last test runs ``engine.speculative.worker`` inside the decode worker's real scheduler.
"""
import json
import os
import shutil

import pytest
import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.checkpoint import TINY_GLM5, init_random_model, save_checkpoint
from engine.kvcache import KVLayout, KVPool, PoolExhausted
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplerState, SamplingParams, probs_from_logits, sample
from engine.speculative import MTPChunk, SpecConfig, SpecDecoder, SpecEngine, SpecSeq, mtp_prefill, mtp_prefill_batch, run_speculative
from engine.speculative.cost import DraftChoice, DraftCostConfig, DraftCostModel
from engine.speculative.oracle import OracleDrafts, chain_accept_len, rate_for_accept_len
from engine.speculative.worker import make_speculator
from test_spec_verify import P_VALUE_MIN, chi_square_p_value

TINY_DSA = dict(TINY_GLM5, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16)
"""GLM-5 architecture, DSA active past 16 tokens (16 indexer heads: exact-zero score ties are rare)."""
TINY_GQA = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=128, hidden_size=64,
                intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                max_position_embeddings=4096, rope_theta=10000.0, partial_rotary_factor=0.5, use_qk_norm=True,
                attention_bias=True, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False,
                num_nextn_predict_layers=1)
ALPHA = 7.0
"""Scale of the predictable model's attention / MLP outputs: ~80% of next tokens follow ``perm``."""
CONFIGS = ["5/1/6", "3/1/4", "3/2/6"]
LENS = (5, 23, 40)
NUM_TOKENS = 256


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models with hidden size 64: intra-op threads only add overhead (and contend on a busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_predictable(model_dir, out_dir, alpha=ALPHA, seed=0):
    """Rewrite a random checkpoint so that next token ~ perm[token] and the MTP drafts perm[token]."""
    model, cfg = load_model(model_dir, "float32", "cpu")
    g = torch.Generator().manual_seed(seed)
    V, H = cfg.vocab_size, cfg.hidden_size
    perm = torch.randperm(V, generator=g)
    emb = torch.randn(V, H, generator=g)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.empty(V, H)
        head[perm] = emb / emb.norm(dim=-1, keepdim=True)  # logit of perm[t] peaks on norm(embed(t))
        model.lm_head.weight.copy_(head)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(alpha)
        eh = torch.zeros(H, 2 * H)
        eh[:, :H] = torch.eye(H)  # MTP input ~ the next token's embedding: drafts ~ perm[next token]
        eh[:, H:] = torch.randn(H, H, generator=g) * (0.5 / H ** 0.5)  # plus some of the target hidden
        for m in model.mtp:
            m.eh_proj.weight.copy_(eh)
    save_checkpoint(model, cfg, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: checkpoint dir}: ``random-dsa``, ``pred-dsa``, ``pred-dense`` (the same weights with DSA
    top-k above the context), ``pred-gqa`` (GLM-4.5 architecture), ``no-mtp``."""
    root = tmp_path_factory.mktemp("spec")
    out = {"random-dsa": init_random_model(TINY_DSA, str(root / "random-dsa"), std=0.08)}
    out["pred-dsa"] = make_predictable(out["random-dsa"], str(root / "pred-dsa"))
    out["pred-dense"] = str(root / "pred-dense")
    shutil.copytree(out["pred-dsa"], out["pred-dense"])
    with open(os.path.join(out["pred-dense"], "config.json")) as f:
        conf = json.load(f)
    with open(os.path.join(out["pred-dense"], "config.json"), "w") as f:
        json.dump(dict(conf, index_topk=1024), f)
    gqa = init_random_model(TINY_GQA, str(root / "random-gqa"), std=0.08)
    out["pred-gqa"] = make_predictable(gqa, str(root / "pred-gqa"))
    out["no-mtp"] = init_random_model(dict(TINY_DSA, num_nextn_predict_layers=0), str(root / "no-mtp"))
    return out


_models: dict = {}
_refs: dict = {}


def get_model(dirs, name, dtype):
    key = (name, dtype)
    if key not in _models:
        _models[key] = load_model(dirs[name], dtype, "cpu")
    return _models[key]


def prompts_for(cfg, lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def make_engine(model, cfg, dtype, num_pages=512, kv_dtype=None):
    return Engine(model, cfg, kv_dtype=kv_dtype or dtype, page_size=8, num_pages=num_pages)


def plain_greedy(dirs, name, dtype, max_tokens, kv_dtype=None):
    key = (name, dtype, max_tokens, kv_dtype)
    if key not in _refs:
        model, cfg = get_model(dirs, name, dtype)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        eng = make_engine(model, cfg, dtype, kv_dtype=kv_dtype)
        _refs[key] = [r.token_ids for r in eng.generate(prompts_for(cfg), params)]
    return _refs[key]


def check_greedy(dirs, name, dtype, spec, num_tokens=NUM_TOKENS, kv_dtype=None):
    model, cfg = get_model(dirs, name, dtype)
    ref = plain_greedy(dirs, name, dtype, num_tokens, kv_dtype)
    eng = SpecEngine(make_engine(model, cfg, dtype, kv_dtype=kv_dtype), SpecConfig.parse(spec))
    out = eng.generate(prompts_for(cfg), SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    for i, (r, o) in enumerate(zip(ref, out)):
        first = next((j for j, (a, b) in enumerate(zip(r, o.token_ids)) if a != b), None)
        assert first is None and len(o.token_ids) == num_tokens, \
            f"request {i} (prompt {LENS[i]}) diverges at token {first}: plain {r[first:first + 4]} " \
            f"spec {o.token_ids[first:first + 4]}"
        assert o.finish_reason == "length"
    assert eng.pool.allocator.num_used == 0 and eng.pool.allocator.owners() == {}
    return eng.metrics


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", CONFIGS)
def test_greedy_equals_plain_with_multi_token_acceptance(dirs, spec, dtype):
    name = "pred-dsa" if dtype == "float32" else "pred-dense"
    m = check_greedy(dirs, name, dtype, spec)
    assert m.accept_len > 1.5, m.as_dict(5)
    assert m.num_accepted_drafts > 0 and m.num_verify_steps > m.num_accepted_drafts / 5  # also rejections
    if spec == "3/2/6":
        assert m.num_moved_kv > 0  # accepted a non-first sibling: its KV moved into place


@pytest.mark.parametrize("name,spec,kv_dtype", [("random-dsa", "3/2/6", None), ("pred-gqa", "3/2/6", None),
                                                ("pred-dense", "3/2/6", "fp8_e4m3")])
def test_greedy_equals_plain_other_models(dirs, name, spec, kv_dtype):
    """Random weights (which reject at depth 1 almost every step: 128 tokens cost as much as 256 above),
    GLM-4.5's GQA attention, and an fp8 KV cache (tree nodes' KV, scales included, moved into place)."""
    num_tokens = 128 if name.startswith("random") or kv_dtype else NUM_TOKENS
    m = check_greedy(dirs, name, "float32", spec, num_tokens, kv_dtype)
    if kv_dtype:
        assert m.num_moved_kv > 0
    if name.startswith("random"):
        assert m.accept_len < 1.3  # the rejection path, nearly every step
    else:
        assert m.accept_len > 1.5


def fresh_kv(model, cfg, seq_ids, dtype):
    """Target KV of ``seq_ids[:-1]`` and MTP KV of its pairs, computed in one non-speculative pass."""
    C = len(seq_ids) - 1
    pool = KVPool(KVLayout.for_model(cfg, 8, dtype), C // 8 + 2)
    pages = list(range(C // 8 + 2))
    out = model(ForwardBatch.build([BatchRequest(pages, 0, seq_ids[:C])], 8), pool)
    mtp = model.forward_mtp(ForwardBatch.build([BatchRequest(pages, 0, seq_ids[1:])], 8), pool, out.hidden)
    return pool, pages, mtp.hidden[-1]


def kv_rows(pool, pages, layer, name, n):
    j = torch.arange(n)
    slots = torch.as_tensor(pages)[j // pool.page_size] * pool.page_size + j % pool.page_size
    return pool.flat(layer, name)[slots].float()


@pytest.mark.parametrize("spec", ["5/1/6", "3/2/6"])
def test_kv_after_rollback_equals_non_speculative_pass(dirs, spec):
    """After steps with partial acceptance: target KV at every committed position (tree nodes moved
    into place) and the MTP KV (overwritten by the draft extend with target hiddens) equal one plain
    pass over the sequence, and so does the draft state for the next step."""
    model, cfg = get_model(dirs, "pred-dense", "float32")
    eng = SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse(spec))
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    prompts = prompts_for(cfg, (9, 30))
    seqs = [SpecSeq(f"r{i}", SamplerState(params, p), [], 0, None) for i, p in enumerate(prompts)]
    for s, p in zip(seqs, prompts):
        eng.prefill(s, p)
    for _ in range(25):
        eng.decoder.step(seqs)
    assert eng.metrics.num_accepted_drafts > 25 and eng.metrics.accept_len < 1 + eng.spec.num_drafts
    if not eng.spec.is_chain:
        assert eng.metrics.num_moved_kv > 0
    N = cfg.num_hidden_layers
    for s, p in zip(seqs, prompts):
        ids = p + s.output_ids
        assert s.cached_len == len(ids) - 1
        ref_pool, ref_pages, ref_draft = fresh_kv(model, cfg, ids, "float32")
        for layer in range(N + 1):
            for comp in ref_pool.buffers[layer]:
                got = kv_rows(eng.pool, s.pages, layer, comp, s.cached_len)
                want = kv_rows(ref_pool, ref_pages, layer, comp, s.cached_len)
                assert (got - want).abs().max() < 1e-4, (layer, comp)
        assert (s.draft_hidden.float() - ref_draft.float()).abs().max() < 1e-4


def test_tree_drafts_equal_chained_mtp_along_each_path(dirs):
    """Siblings share positions and the draft slots hold every branch: each frontier node's MTP output
    must still equal running the MTP layer down its own path alone (its ancestors' KV only)."""
    model, cfg = get_model(dirs, "pred-dense", "float32")
    eng = SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("4/3/10"))
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    prompts = prompts_for(cfg, (9, 30))
    seqs = [SpecSeq(f"r{i}", SamplerState(params, p), [], 0, None) for i, p in enumerate(prompts)]
    for s, p in zip(seqs, prompts):
        eng.prefill(s, p)
    for _ in range(3):
        eng.decoder.step(seqs)
    proposer, calls = eng.decoder.proposer, []
    orig = proposer._forward_frontier

    def record(seqs_, d, f_tok, f_hid, vis):
        out = orig(seqs_, d, f_tok, f_hid, vis)
        calls.append((f_tok.clone(), vis.clone(), out[0].clone()))
        return out

    proposer._forward_frontier = record
    for s in seqs:
        eng.decoder.reserve(s)
    proposer.propose(seqs)
    assert len(calls) == 3
    k = 3
    for d, (f_tok, vis, logits) in enumerate(calls, start=1):
        for b, s in enumerate(seqs):
            for r in range(k):
                path = [int(calls[j][0][b, int(vis[b, r, j * k:(j + 1) * k].nonzero())]) for j in range(d - 1)]
                path.append(int(f_tok[b, r]))
                pool = KVPool(eng.pool.layout, eng.pool.num_pages)  # a scratch copy of the MTP layer's KV
                for name, buf in pool.buffers[cfg.num_hidden_layers].items():
                    buf.copy_(eng.pool.buffers[cfg.num_hidden_layers][name])
                h = s.draft_hidden
                for i, tok in enumerate(path):  # the chain: one pair at a time, each seeing the previous
                    out = model.forward_mtp(ForwardBatch.build([BatchRequest(s.pages, s.cached_len + i, [tok])], 8),
                                            pool, h[None])
                    h = out.hidden[0]
                assert (out.logits[0] - logits[b, r]).abs().max() < 1e-4, (d, b, r, path)


def test_chunked_and_cached_prefix_mtp_prefill_equal_one_pass(dirs):
    model, cfg = get_model(dirs, "pred-dsa", "float32")
    prompt = prompts_for(cfg, (45,))[0]
    nxt = 7
    ref_pool, ref_pages, ref_draft = fresh_kv(model, cfg, prompt + [nxt], "float32")
    N, n = cfg.num_hidden_layers, len(prompt)

    def check(pool, pages, draft):
        for comp in ref_pool.buffers[N]:
            got, want = kv_rows(pool, pages, N, comp, n), kv_rows(ref_pool, ref_pages, N, comp, n)
            assert (got - want).abs().max() < 1e-4
        assert (draft - ref_draft).abs().max() < 1e-4

    # chunks [0,13) [13,20) [20,21) [21,45), each with its next token (the prompt's, then x_45)
    bounds = [(0, 13), (13, 20), (20, 21), (21, 45)]
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 16)
    pages = list(range(8))
    for a, b in bounds:
        out = model(ForwardBatch.build([BatchRequest(pages, a, prompt[a:b])], 8), pool)
        res = mtp_prefill(model, pool, pages, a, prompt[a:b], out.hidden, prompt[b] if b < n else nxt)
    check(pool, pages, res.draft_hidden)

    # the same with the next tokens unknown until the end: one-token lag through carry_hidden
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 16)
    carry = None
    for a, b in bounds:
        out = model(ForwardBatch.build([BatchRequest(pages, a, prompt[a:b])], 8), pool)
        res = mtp_prefill(model, pool, pages, a, prompt[a:b], out.hidden, nxt if b == n else None, carry)
        carry = res.carry_hidden
    assert carry is None and res.draft_logits.shape == (cfg.vocab_size,)
    check(pool, pages, res.draft_hidden)

    # a cached prefix of 24 tokens whose MTP pairs 0..23 are valid (its owner knew x_24): no carry
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 16)
    out = model(ForwardBatch.build([BatchRequest(pages, 0, prompt[:24])], 8), pool)
    mtp_prefill(model, pool, pages, 0, prompt[:24], out.hidden, next_token=prompt[24])
    out = model(ForwardBatch.build([BatchRequest(pages, 24, prompt[24:])], 8), pool)
    [res] = mtp_prefill_batch(model, pool, [MTPChunk(pages, 24, prompt[24:], out.hidden, nxt)])
    check(pool, pages, res.draft_hidden)
    with pytest.raises(ValueError, match="position 0"):
        mtp_prefill(model, pool, pages, 0, prompt[:4], out.hidden[:4], carry_hidden=out.hidden[0])


def exact_second_token(model, cfg, prompt, params):
    """P(x_{n+1}) = sum_x P(x | prompt) P(x_{n+1} | prompt, x) under the processed target distribution."""
    V = cfg.vocab_size
    st = SamplerState(params, prompt)
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 4 * (V + 1))
    first = model(ForwardBatch.build([BatchRequest([0, 1], 0, prompt)], 8), pool).logits
    p1 = probs_from_logits(first, [st])[0].double()
    reqs = [BatchRequest([4 * (v + 1), 4 * (v + 1) + 1], 0, prompt + [v]) for v in range(V)]
    second = model(ForwardBatch.build(reqs, 8), pool).logits
    p2 = probs_from_logits(second, [st] * V).double()
    return p1 @ p2


def requests_on_shared_prefix(model, pool, prompt, params):
    """What a prefill worker with a prefix cache does: the first page of the prompt is prefilled once
    (target + MTP, whose pair 7 is valid because x_8 is known), shared by every request; each request
    runs x_8 in its own page (one batched forward), samples x_9 with its seed and runs its MTP pair 8
    (one batched ``mtp_prefill_batch``, no carry: the cached pairs are valid)."""
    P = pool.page_size
    assert len(prompt) == P + 1
    shared = pool.allocator.alloc(1, "prefix")
    out = model(ForwardBatch.build([BatchRequest(shared, 0, prompt[:P])], P), pool)
    mtp_prefill(model, pool, shared, 0, prompt[:P], out.hidden, next_token=prompt[P])
    seqs = []
    for i, sp in enumerate(params):
        pool.allocator.incref(shared)
        seqs.append(SpecSeq(f"r{i}", SamplerState(sp, prompt), shared + pool.allocator.alloc(1, f"r{i}"), P,
                            None))
    pool.allocator.free(shared)  # the cache's own reference
    out = model(ForwardBatch.build([BatchRequest(s.pages, P, [prompt[P]]) for s in seqs], P), pool)
    first = sample(out.logits, [s.sampler for s in seqs]).token_ids.tolist()
    chunks = [MTPChunk(s.pages, P, [prompt[P]], out.hidden[i:i + 1], first[i]) for i, s in enumerate(seqs)]
    for s, tok, res in zip(seqs, first, mtp_prefill_batch(model, pool, chunks)):
        s.output_ids.append(tok)
        s.cached_len = P + 1
        s.draft_hidden, s.draft_logits = res.draft_hidden, res.draft_logits
    return seqs


@pytest.mark.parametrize("spec", ["5/1/6", "3/2/6"])
def test_sampling_matches_target_distribution(dirs, spec):
    """Chi-square of the 2nd generated token (the first one a speculative step emits, by accepted
    draft, residual or bonus) over 1200 seeded requests against the exact target distribution.
    The test fails below p = 1e-3 (0.1% false failures for a fresh seed; fixed seeds here)."""
    model, cfg = get_model(dirs, "pred-dense", "float32")
    prompt = [5, 9, 17, 33, 2, 71, 40, 8, 99]
    base = dict(max_tokens=2, temperature=0.8, top_p=0.95, ignore_eos=True)
    n = 1200
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 2 * n + 1)
    seqs = requests_on_shared_prefix(model, pool, prompt, [SamplingParams(seed=1000 + i, **base) for i in range(n)])
    dec = SpecDecoder(model, pool, SpecConfig.parse(spec), cfg.eos_token_ids)
    res = dec.step(seqs)
    assert all(r.finish_reason == "length" for r in res) and all(len(s.pages) == 2 for s in seqs)
    check_emitted_distribution(dec, pool, seqs, exact_second_token(model, cfg, prompt, SamplingParams(**base)))


def check_emitted_distribution(dec, pool, seqs, exact):
    """The token each request's speculative step emitted (``output_ids[1]``: accepted draft, residual or bonus)
    against the ``exact`` target distribution (chi-square); then every page back."""
    counts = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=exact.shape[0])
    assert dec.metrics.num_accepted_drafts > len(seqs) / 8  # the accept path is exercised, not only residuals
    assert chi_square_p_value(counts, exact) > P_VALUE_MIN
    for s in seqs:
        pool.allocator.free(s.pages)
    assert pool.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_in_any_batch(dirs):
    model, cfg = get_model(dirs, "pred-dense", "float32")
    prompts = prompts_for(cfg, (7, 19, 12))
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    eng = SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("3/2/6"))
    together = eng.generate(prompts, params)
    alone = eng.generate(prompts[1:2], params[1:2])
    again = eng.generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in again]
    assert alone[0].token_ids == together[1].token_ids
    assert together[0].token_ids != together[2].token_ids


def test_penalties_and_stop_conditions_match_plain(dirs):
    """Penalties see each verified node's own draft context; stop ids and EOS truncate the accepted
    tokens of a step (a stop id does not change the tokens before it, so the plain reference is the
    penalised run cut at the first stop id)."""
    model, cfg = get_model(dirs, "pred-dsa", "float32")
    prompts = prompts_for(cfg, (6, 15, 30))
    pen = dict(max_tokens=48, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, ignore_eos=True)
    ref = make_engine(model, cfg, "float32").generate(prompts, SamplingParams(**pen))
    stop = ref[1].token_ids[30]
    want = []
    for r in ref:
        cut = r.token_ids.index(stop) + 1 if stop in r.token_ids else len(r.token_ids)
        want.append((r.token_ids[:cut], "stop" if cut < len(r.token_ids) or r.token_ids[-1] == stop else "length"))
    eng = SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("5/1/6"))
    out = eng.generate(prompts, SamplingParams(stop_token_ids=(stop,), **pen))
    assert [(r.token_ids, r.finish_reason) for r in out] == want
    assert eng.metrics.accept_len > 1.5 and eng.metrics.num_emitted_tokens < eng.metrics.num_accepted_drafts + \
        eng.metrics.num_verify_steps  # some accepted tokens were cut at the stop id
    # EOS: the same cut through the decoder's eos ids (the model's own EOS never comes up here)
    seq = SpecSeq("e", SamplerState(SamplingParams(max_tokens=9), [3]), [], 1, None)
    seq.output_ids.append(4)
    dec = SpecDecoder(model, eng.pool, SpecConfig.parse("3/1/4"), eos_token_ids=(7,))
    assert dec._emit(seq, [5, 7, 8]) == [5, 7] and seq.finish_reason == "stop"
    seq.finish_reason = ""
    assert dec._emit(seq, [5, 6, 6, 6, 6, 6, 6]) == [5, 6, 6, 6, 6, 6] and seq.finish_reason == "length"
    assert len(seq.output_ids) == 9


def test_pages_return_to_the_pool_even_on_exhaustion(dirs):
    model, cfg = get_model(dirs, "pred-dense", "float32")
    prompts = prompts_for(cfg)
    eng = SpecEngine(make_engine(model, cfg, "float32", num_pages=24), SpecConfig.parse("5/1/6"))
    free0 = eng.pool.allocator.num_free
    with pytest.raises(PoolExhausted):
        eng.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
    assert eng.pool.allocator.num_free == free0 and eng.pool.allocator.owners() == {}

    # a decode worker's own page callback; the pool too small for drafts degrades to a plain step
    asked = []

    def ensure_pages(seq, num_tokens):
        need = pool.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages += pool.allocator.alloc(need, seq.req_id)
            asked.append(need)

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = SpecEngine(Engine(model, cfg, page_size=8, num_pages=1), SpecConfig.parse("5/1/6"))
    pool = eng.pool
    seq = SpecSeq("w", SamplerState(params, prompts[1][:6]), [], 0, None)
    eng.prefill(seq, prompts[1][:6])  # cached 6 of the page's 8 slots
    dec = SpecDecoder(model, pool, SpecConfig.parse("5/1/6"), cfg.eos_token_ids, ensure_pages)
    res = dec.step([seq])[0]  # no room for 6 draft slots: the root alone, one token
    assert len(res.token_ids) == 1 and dec.metrics.num_draft_tokens == 0 and asked == []
    res = dec.step([seq])[0]  # slot 7 still fits: another plain step
    assert len(res.token_ids) == 1 and seq.cached_len == 8
    with pytest.raises(PoolExhausted):
        dec.step([seq])  # not even one token fits now
    assert asked == [] and len(seq.pages) == 1
    pool.allocator.free(seq.pages)
    assert pool.allocator.num_free == 1


def test_run_speculative_and_errors(dirs):
    model, cfg = get_model(dirs, "pred-dense", "float32")
    res = run_speculative(model, cfg, prompts_for(cfg, (8,)), SamplingParams(max_tokens=20, ignore_eos=True),
                          "3/1/4")
    assert len(res.results[0].token_ids) == 20 and res.metrics.accept_len > 1
    d = res.metrics.as_dict(3)
    assert set(d) >= {"accept_len", "accept_rate_per_position", "accept_rate_at_least"}
    assert len(d["accept_rate_per_position"]) == 3
    plain_model, plain_cfg = load_model(dirs["no-mtp"], "float32", "cpu")
    with pytest.raises(ValueError, match="MTP"):
        SpecEngine(make_engine(plain_model, plain_cfg, "float32"), SpecConfig.parse("3/1/4"))
    with pytest.raises(ValueError, match="exceeds the context"):
        SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("3/1/4")).generate(
            [[3] * 10], SamplingParams(max_tokens=cfg.max_position_embeddings))


def test_scheduler_with_speculator_equals_plain_engine(dirs):
    """Local prefill (the scheduler's MTP pass ships no draft state: the first round is a plain one),
    then speculative rounds; tokens equal the plain engine's, pages all come back."""
    from decode.scheduler import DecodeScheduler, DecodeTask
    model, cfg = get_model(dirs, "pred-dsa", "float32")
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 256)
    spec = make_speculator(model, cfg, pool, "3/2/6")
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids, spec=spec)
    params = SamplingParams(max_tokens=96, ignore_eos=True, logprobs=2)
    events = {}
    for i, p in enumerate(prompts_for(cfg)):
        events[i] = []
        dec.add_local(DecodeTask(f"r{i}", p, [], params, [], 0, emit=events[i].append))
    for _ in range(200):
        if not dec.step():
            break
    ref = plain_greedy(dirs, "pred-dsa", "float32", 96)
    for i, r in enumerate(ref):
        assert [t for e in events[i] for t in e.token_ids] == r
        assert events[i][-1].finish_reason == "length" and events[i][-1].accept_len > 1.5
        # speculative rounds report every token (the scheduler passes a round's list uncut on its last event)
        lps = [lp for e in events[i][1:] for lp in e.logprobs[:len(e.token_ids)]]
        assert [lp[0] for lp in lps] == r[1:] and all(lp[1] <= 0 and len(lp[2]) == 2 for lp in lps)
    assert pool.allocator.num_used == 0 and spec.metrics.accept_len > 1.5
    assert spec.step([], lambda t, n: None) == [] and spec._drafts == {}


def test_oracle_drafts_are_lossless_and_set_the_acceptance(dirs):
    """Oracle-draft mode (``engine.speculative.oracle``) on the glm4_moe model: the MTP layer runs, the target's
    own greedy continuation (corrupted at a rate) is drafted. Output = plain greedy at every rate; rate 0
    accepts the whole chain every step (k + 1 = 4), rate 1 nothing, rate 0.3 about L(0.7, 3) = 2.53."""
    model, cfg = get_model(dirs, "pred-gqa", "float32")
    spec, n = SpecConfig.parse("3/1/4"), 64
    refs = plain_greedy(dirs, "pred-gqa", "float32", n + spec.num_steps)
    prompts = prompts_for(cfg)
    lens = {}
    for rate in (0.0, 0.3, 1.0):
        oracle = OracleDrafts(dict(zip(map(tuple, prompts), refs)), cfg.vocab_size, rate, seed=1)
        eng = SpecEngine(make_engine(model, cfg, "float32"), spec, oracle=oracle)
        out = eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        assert [o.token_ids for o in out] == [r[:n] for r in refs], rate
        assert oracle.num_proposed == eng.metrics.num_draft_tokens > 0
        lens[rate] = eng.metrics.accept_len
    assert lens[0.0] == spec.num_draft_tokens and lens[1.0] == 1.0
    assert abs(lens[0.3] - chain_accept_len(0.7, 3)) < 0.5, lens
    assert abs(chain_accept_len(1 - rate_for_accept_len(3.61, 5), 5) - 3.61) < 1e-9
    with pytest.raises(ValueError, match="greedy chains"):
        SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("3/2/6"), oracle=oracle).generate(
            prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))


def cost_model_with(times: dict[int, float], max_drafts: int = 3, accept: float = 0.9) -> DraftCostModel:
    """A cost model that has seen one batch-1 step per draft length (``times``: tokens per request -> s) and a
    per-draft acceptance of ``accept`` (1000 drafts' worth: the prior is negligible)."""
    cm = DraftCostModel(DraftCostConfig(max_drafts, decay=1.0, probe_every=0))
    for k in range(max_drafts + 1):
        assert cm.choose(1) == DraftChoice(max_drafts - k, "explore")  # each length measured once, full first
        cm.observe(1, max_drafts - k, times[max_drafts - k + 1], 0, 0)
    cm.observe(1, max_drafts, None, round(1000 * accept), 1000)
    return cm


def test_draft_cost_model_picks_plain_or_full_from_step_times():
    """Verify cheap (a dense model's k + 1 tokens cost about one): the full chain wins; verify that grows with
    the tokens (an MoE reading the union of its experts) and a low acceptance: plain decode wins; in between a
    shorter chain. Probes re-measure the stalest length every probe_every steps."""
    flat = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    assert cost_model_with(flat).choose(1) == DraftChoice(3, "best")
    steep = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}  # tokens cost linearly: L(a, k) < k + 1 never pays
    assert cost_model_with(steep).choose(1) == DraftChoice(0, "best")
    assert cost_model_with(flat, accept=0.05).choose(1) == DraftChoice(0, "best")
    knee = {1: 1.0, 2: 1.05, 3: 1.1, 4: 3.0}  # the 4th token pulls in many more experts
    cm = cost_model_with(knee)
    assert cm.choose(1) == DraftChoice(2, "best") and cm.choose(8) == DraftChoice(3, "explore")  # a new bucket
    assert abs(cm.accept_rate - 0.9) < 0.01 and cm.step_s(3, 2) is None
    assert abs(cm.tokens_per_s(1, 2) - chain_accept_len(cm.accept_rate, 2) / 1.1) < 1e-9
    probing = DraftCostModel(DraftCostConfig(1, probe_every=4))
    seen = []
    for _ in range(12):
        k, why = probing.choose(2)
        seen.append(why)
        probing.observe(2, k, {0: 1.0, 1: 1.1}[k], 0, 0)
    assert seen.count("explore") == 2 and seen.count("probe") == 2 and "best" in seen
    assert sum(probing.steps_by_drafts) == 12
    with pytest.raises(ValueError, match="max_drafts"):
        DraftCostConfig(0)


def test_draft_cost_model_keeps_greedy_output(dirs):
    """Greedy output with the cost model on (real step times: its exploration alone runs every draft length,
    then its choices; the oracle keeps acceptance high so drafting pays) equals plain greedy."""
    model, cfg = get_model(dirs, "pred-gqa", "float32")
    spec, n = SpecConfig.parse("3/1/4"), 64
    refs = plain_greedy(dirs, "pred-gqa", "float32", n + spec.num_steps)
    prompts = prompts_for(cfg)
    for oracle in (None, OracleDrafts(dict(zip(map(tuple, prompts), refs)), cfg.vocab_size, 0.2)):
        cm = DraftCostModel(DraftCostConfig(spec.num_steps, probe_every=8))
        eng = SpecEngine(make_engine(model, cfg, "float32"), spec, oracle=oracle, cost_model=cm)
        out = eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        assert [o.token_ids for o in out] == [r[:n] for r in refs]
        assert all(c > 0 for c in cm.steps_by_drafts), cm.steps_by_drafts
        assert eng.pool.allocator.num_used == 0
    with pytest.raises(ValueError, match="needs a chain"):
        SpecEngine(make_engine(model, cfg, "float32"), SpecConfig.parse("3/2/6"), cost_model=cm)


def test_scheduler_with_cost_model_equals_plain_and_exports_metrics(dirs):
    """``--spec-cost-model`` in the decode worker's real scheduler (3/1/4 on glm4_moe): the plain engine's tokens,
    and the worker's /metrics families carry the choice, the acceptance estimate and the steps by length."""
    from decode.scheduler import DecodeScheduler, DecodeTask
    from decode.server import cost_model_values
    from protos.pdserve.v1 import generation_pb2
    from worker.metrics import WorkerCollector
    model, cfg = get_model(dirs, "pred-gqa", "float32")
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 256)
    spec = make_speculator(model, cfg, pool, "3/1/4", cost_model=True)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids, spec=spec)
    events = {}
    for i, p in enumerate(prompts_for(cfg)):
        events[i] = []
        dec.add_local(DecodeTask(f"r{i}", p, [], SamplingParams(max_tokens=48, ignore_eos=True), [], 0,
                                 emit=events[i].append))
    for _ in range(200):
        if not dec.step():
            break
    for i, r in enumerate(plain_greedy(dirs, "pred-gqa", "float32", 48)):
        assert [t for e in events[i] for t in e.token_ids] == r
    assert pool.allocator.num_used == 0
    cm = spec.decoder.cost_model
    values = cost_model_values(cm)
    families = {f.name: f for f in WorkerCollector(lambda: generation_pb2.WorkerStatus(worker_id="d0"),
                                                   lambda: values.counters, lambda: values.gauges).collect()}
    steps = families["pdserve:spec_decode_steps_by_draft_tokens"].samples
    assert sorted(s.labels["num_drafts"] for s in steps if s.name.endswith("_total")) == ["0", "1", "2", "3"]
    assert sum(s.value for s in steps if s.name.endswith("_total")) == sum(cm.steps_by_drafts) > 4
    assert families["pdserve:spec_decode_draft_tokens"].samples[0].value == cm.num_drafts
    assert 0 < families["pdserve:spec_decode_draft_accept_rate"].samples[0].value < 1
    assert cost_model_values(None) == ({}, {})
