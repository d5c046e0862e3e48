"""Tensor- and expert-parallel model execution (issue 30, engine half): 2 rank processes on gloo over
127.0.0.1 against the same model at tp_size 1 (this process) and against transformers.

One module-scoped ``RankPool`` (2 ranks, one TP group) runs every job; each job loads its model with this rank's
``ParallelConfig`` (moe_parallel per job). fp32 throughout: TP2 reorders float sums (row-parallel partial sums
added by the all_reduce, per-rank expert sums), so logits agree to ``LOGITS_TOL`` and greedy tokens exactly.
"""
import os

import pytest
import torch
from ranks import TINY_DSA_MTP, RankPool, job_generate, job_logits, job_prefill_kv
from shared_helpers import TINY_GQA_MTP
from tiny import make_hf_model

from engine.checkpoint import TINY_GLM5, init_random_model, save_checkpoint
from engine.config import ModelConfig
from engine.kvcache.layout import gather_kv
from engine.load import load_model
from engine.parallel import ParallelConfig
from engine.sizing import plan_start, pool_sizing
from engine.quant.quantize import quantize_checkpoint

LOGITS_TOL = 1e-5
"""Max |TP2 - TP1| of fp32 logits (of magnitude ~1.6; measured 6-7e-7): float reassociation only."""
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 33))]
ODD_VOCAB = 311
"""Not a multiple of 2: the TP2 embedding and LM head hold 156 rows per rank, rank 1's last one padding."""
TP1 = ParallelConfig()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hidden size 64: intra-op threads only add overhead (and the two ranks use the two cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def references():
    """Memoised TP1 / transformers results, shared by the parametrised MoE modes."""
    memo = {}

    def get(key, fn, *args):
        if key not in memo:
            memo[key] = fn(*args)
        return memo[key]
    return get


def hf_greedy(kind: str, prompts: list[list[int]], n: int, **overrides) -> list[list[int]]:
    hf = make_hf_model(kind, **overrides)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(2)
    yield pool
    assert pool.close() == [0, 0]  # every rank process ended cleanly (joined, exit code 0)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    return {k: init_random_model(c, str(tmp_path_factory.mktemp(f"tp_{k}")), seed=1)
            for k, c in (("dsa", TINY_DSA_MTP), ("gqa", TINY_GQA_MTP))}


@pytest.fixture(scope="module")
def odd_dirs(tmp_path_factory):
    """Odd-vocabulary checkpoints (``ODD_VOCAB`` rows: TP2 pads to 312): transformers' tiny models without an MTP
    layer ('dsa', 'gqa') and pdserve's random ones with it ('dsa_mtp', 'gqa_mtp'; 'gqa_tied': the LM head is the
    embedding)."""
    out = {}
    for kind in ("dsa", "gqa"):
        d = str(tmp_path_factory.mktemp(f"tp_odd_{kind}"))
        make_hf_model(kind, vocab_size=ODD_VOCAB).save_pretrained(d)
        out[kind] = d
    for kind, c in (("dsa", TINY_DSA_MTP), ("gqa", TINY_GQA_MTP)):
        out[f"{kind}_mtp"] = init_random_model(dict(c, vocab_size=ODD_VOCAB),
                                               str(tmp_path_factory.mktemp(f"tp_odd_{kind}_mtp")), seed=4)
    out["gqa_tied"] = init_random_model(dict(TINY_GQA_MTP, vocab_size=ODD_VOCAB, tie_word_embeddings=True),
                                        str(tmp_path_factory.mktemp("tp_odd_tied")), seed=5)
    return out


@pytest.fixture(scope="module")
def biased_dsa_dir(tmp_path_factory):
    """GLM-5 architecture with attention biases, all of them random (the row-parallel o_proj bias included: it
    must be added once, not once per rank)."""
    d = init_random_model(dict(TINY_DSA_MTP, attention_bias=True), str(tmp_path_factory.mktemp("tp_bias")), seed=2)
    model, cfg = load_model(d, "float32", "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_checkpoint(model, cfg, d)
    return d


@pytest.fixture(scope="module")
def mx_dir(tmp_path_factory):
    bf = init_random_model(dict(TINY_GLM5, num_hidden_layers=2), str(tmp_path_factory.mktemp("tp_g5")), seed=3)
    out = str(tmp_path_factory.mktemp("tp_g5_mx"))
    quantize_checkpoint(bf, out, "mxfp4", progress=False)
    return out


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_tp2_greedy_equals_tp1_and_transformers(ranks, tiny_dirs, references, kind, moe):
    """64 greedy tokens of two prompts (chunked prefill, batched decode, DSA sparse past 16 tokens) on 2 ranks
    equal the tp_size 1 engine's and transformers' generate; each rank holds well under its TP1 weight bytes,
    GQA's pool holds one of the two KV heads per rank, and every page is back."""
    want = references(("hf", kind), hf_greedy, kind, PROMPTS, 64)
    ref = references(("tp1", kind), job_generate, tiny_dirs[kind], TP1, PROMPTS, 64)
    out = ranks.run("generate", model_dir=tiny_dirs[kind], prompts=PROMPTS, max_tokens=64, moe_parallel=moe)
    assert out[0]["tokens"] == out[1]["tokens"] == ref["tokens"] == want
    for r in out:
        assert r["pages_used"] == 0
        assert r["weight_bytes"] < 0.7 * ref["weight_bytes"]
        assert r["comm_bytes"] > 0
    if kind == "gqa":
        assert ref["kv_shape"] == {"k": [2, 16], "v": [2, 16]}
        assert out[0]["kv_shape"] == {"k": [1, 16], "v": [1, 16]}
    else:
        assert out[0]["kv_shape"] == ref["kv_shape"]  # MLA: the latent is replicated


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_tp2_speculative_mtp_equals_tp1_greedy(ranks, mtp_dirs, references, kind, moe):
    """MTP speculative decoding (3 drafts, the MTP layer split like the others) on 2 ranks: lossless, so its
    64 greedy tokens equal plain greedy decoding at tp_size 1."""
    ref = references(("mtp", kind), job_generate, mtp_dirs[kind], TP1, PROMPTS, 64)
    out = ranks.run("spec_generate", model_dir=mtp_dirs[kind], prompts=PROMPTS, max_tokens=64, moe_parallel=moe)
    assert out[0]["tokens"] == out[1]["tokens"] == ref["tokens"]
    assert out[0]["accept_len"] >= 1.0


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_tp2_odd_vocab_greedy_equals_transformers(ranks, odd_dirs, kind):
    """A 311-token vocabulary on 2 ranks (padded to 312): 32 greedy tokens of two prompts equal transformers'
    generate on the same checkpoint, and every logits row the engine sampled from was 311 wide."""
    want = hf_greedy(kind, PROMPTS, 32, vocab_size=ODD_VOCAB)
    out = ranks.run("generate", model_dir=odd_dirs[kind], prompts=PROMPTS, max_tokens=32)
    assert out[0]["tokens"] == out[1]["tokens"] == want


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_tp2_odd_vocab_speculative_mtp_equals_tp1_greedy(ranks, odd_dirs, kind):
    """MTP speculation with the odd vocabulary (the MTP layer's draft logits go through the same padded LM
    head, its inputs through the padded embedding): 32 tokens equal tp_size 1's plain greedy tokens."""
    d = odd_dirs[f"{kind}_mtp"]
    ref = job_generate(d, TP1, PROMPTS, 32)
    out = ranks.run("spec_generate", model_dir=d, prompts=PROMPTS, max_tokens=32)
    assert out[0]["tokens"] == out[1]["tokens"] == ref["tokens"]
    assert out[0]["accept_len"] >= 1.0


@pytest.mark.parametrize("kind", ["dsa_mtp", "gqa_tied"])
def test_tp2_padded_ids_are_never_sampled_or_reported(ranks, odd_dirs, kind):
    """The padding's rows load as zeros; even when its LM-head row is made to dominate (the control: the
    unsliced gather's argmax is the padded id 311), 256 draws at temperature 1 and their top-20 logprobs name
    only ids < 311, and the logprobs are tp_size 1's (the padding is outside the softmax too)."""
    ids = list(range(3, 40))
    d = odd_dirs[kind]
    ref = torch.log_softmax(torch.tensor(job_logits(d, TP1, ids))[-1], dim=-1).topk(20)
    out = ranks.run("padded_vocab", model_dir=d, ids=ids)
    assert [r["rows"] for r in out] == [[156, 156], [156, 156]]
    assert [r["num_pad_rows"] for r in out] == [0, 1]
    for r in out:
        assert r["pad_rows_zero"] and r["logits_width"] == [ODD_VOCAB, ODD_VOCAB]
        assert r["leaked_argmax"] == ODD_VOCAB
        assert max(r["sampled"]) < ODD_VOCAB and len(set(r["sampled"])) > 1
        assert max(max(t) for t in r["top_ids"]) < ODD_VOCAB
        assert r["top_ids"][0] == ref.indices.tolist()
        assert torch.allclose(torch.tensor(r["top_logprobs"]), ref.values, atol=LOGITS_TOL)


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_tp2_mxfp4_experts_greedy_equals_tp1(ranks, mx_dir, references, moe):
    """MXFP4 routed experts split on 32-element block boundaries (tp: moe_intermediate 64 -> 32 per rank) or
    by experts (ep: 4 per rank): 64 greedy tokens equal tp_size 1 on the same quantized checkpoint."""
    ref = references("mx", job_generate, mx_dir, TP1, PROMPTS, 64)
    out = ranks.run("generate", model_dir=mx_dir, prompts=PROMPTS, max_tokens=64, moe_parallel=moe)
    assert out[0]["tokens"] == out[1]["tokens"] == ref["tokens"]
    assert max(r["weight_bytes"] for r in out) < 0.7 * ref["weight_bytes"]
    # the experts' kernels and the tuned-table lookup key on the per-rank shape (hidden, inter, experts, top-k)
    assert ref["mx_shapes"] == [(128, 64, 8, 2)]
    assert out[0]["mx_shapes"] == out[1]["mx_shapes"] == [(128, 32, 8, 2) if moe == "tp" else (128, 64, 4, 1)]


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_tp2_logits_close_to_tp1(ranks, mtp_dirs, references, kind, moe):
    ids = list(range(3, 60))  # 57 tokens: DSA's top-16 selection is active
    ref = torch.tensor(references(("logits", kind), job_logits, mtp_dirs[kind], TP1, ids))
    out = ranks.run("logits", model_dir=mtp_dirs[kind], ids=ids, moe_parallel=moe)
    for logits in out:
        got = torch.tensor(logits)
        assert got.shape == ref.shape == (len(ids), TINY_DSA_MTP["vocab_size"])
        assert (got - ref).abs().max().item() < LOGITS_TOL


def test_tp2_logits_with_attention_biases(ranks, biased_dsa_dir):
    ids = list(range(3, 40))
    ref = torch.tensor(job_logits(biased_dsa_dir, TP1, ids))
    for logits in ranks.run("logits", model_dir=biased_dsa_dir, ids=ids):
        assert (torch.tensor(logits) - ref).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_rank_pools_map_to_the_full_layout(ranks, mtp_dirs, kind):
    """What KV transfer between TP sizes relies on: GQA ranks hold their KV heads (gather_kv in rank order
    gives the TP1 pool's values), MLA ranks each hold the whole latent / rope / index (replicated)."""
    ids = list(range(3, 30))
    ref = job_prefill_kv(mtp_dirs[kind], TP1, ids)
    out = ranks.run("prefill_kv", model_dir=mtp_dirs[kind], ids=ids)
    for name, full in ref.items():
        full = torch.tensor(full)
        shards = [torch.tensor(r[name]) for r in out]
        if kind == "gqa":
            assert shards[0].shape[1] == full.shape[1] // 2
        else:
            assert torch.equal(shards[0], shards[1])
        assert torch.allclose(gather_kv(ModelConfig.from_model_dir(mtp_dirs[kind]), shards), full, atol=1e-5)


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
def test_compile_decode_at_tp2_stays_eager_with_one_warning(ranks, mtp_dirs, kind):
    """The all_reduces are not inside the compiled graphs: a TP model decodes eagerly and says so once; the
    start-up warm-up (plain and speculative) runs on the rank's pool layout."""
    assert ranks.run("compile_decode", model_dir=mtp_dirs[kind]) == [(True, 1), (True, 1)]


def test_plan_start_sizes_the_rank_pool(mtp_dirs):
    """A TP rank's worker sizes its pool in its own layout (GQA: half the KV heads, so twice the pages fit)."""
    sizing = pool_sizing(None, "1MiB", None)
    full = plan_start(mtp_dirs["gqa"], "float32", None, torch.device("cpu"), 16, sizing)
    rank = plan_start(mtp_dirs["gqa"], "float32", None, torch.device("cpu"), 16, sizing, parallel=ParallelConfig(2, 1))
    assert [list(c.shape) for c in rank.layout.components] == [[1, 16], [1, 16]]
    assert rank.layout.bytes_per_page() * 2 == full.layout.bytes_per_page()
    assert rank.pool.num_pages == 2 * full.pool.num_pages


def test_tp1_model_has_no_parallel_modules(mtp_dirs):
    """tp_size 1 builds today's modules (plain embedding / LM head, no collectives on any path)."""
    model, _ = load_model(mtp_dirs["gqa"], "float32", "cpu")
    assert type(model.model.embed_tokens) is torch.nn.Embedding and type(model.lm_head) is torch.nn.Linear
    assert not model.parallel.is_tp and os.environ.get("MASTER_ADDR") is None


def test_ranks_that_disagree_on_the_model_hash_fail_loudly(ranks):
    assert ranks.run("check_same", values=["abc", "abc"]) == ["same", "same"]
    errors = ranks.run("check_same", values=["abc", "abd"])
    assert all("the 2 ranks disagree on model hash" in e for e in errors)
    assert "rank 0 has 'abc'" in errors[0] and "rank 1 has 'abd'" in errors[1]
