"""ParallelConfig: clear one-line errors for splits the model cannot take (any vocab splits: padded); a dead rank
makes its peer raise."""
import time

import pytest
import torch
from ranks import start_dying_pair

from engine.checkpoint import TINY_GLM5
from engine.config import ModelConfig
from engine.loader import CheckpointError
from engine.parallel import ParallelConfig, all_reduce_, destroy_tp_group, init_tp_group
from engine.parallel.shard import vocab_rows

GLM5 = ModelConfig.from_dict(TINY_GLM5)  # 4 heads, vocab 512, inter 256, moe_inter 64, 8 experts


def _quantized(cfg: ModelConfig) -> ModelConfig:
    return ModelConfig.from_dict(dict(cfg.raw, quantization_config={"quant_method": "quark"}))


@pytest.mark.parametrize("pc,cfg,message", [
    (ParallelConfig(3, 0), GLM5, "num_attention_heads=4 is not a multiple of tp_size=3"),
    (ParallelConfig(8, 0), GLM5, "num_attention_heads=4 is not a multiple of tp_size=8"),
    (ParallelConfig(4, 0, "ep"), ModelConfig.from_dict(dict(TINY_GLM5, n_routed_experts=6, num_attention_heads=8)),
     "n_routed_experts=6 is not a multiple of tp_size=4"),
    (ParallelConfig(4, 1), _quantized(GLM5), "moe_intermediate_size / tp_size = 64 / 4 = 16 is not a multiple of"
                                            " the 32-element MX block"),
    (ParallelConfig(2, 0), ModelConfig.from_dict(dict(TINY_GLM5, model_type="glm4_moe", num_key_value_heads=1,
                                                      head_dim=32)), "num_key_value_heads=1"),
])
def test_validate_names_the_dimension(pc, cfg, message):
    with pytest.raises(ValueError, match="cannot split") as e:
        pc.validate(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_validate_accepts_what_splits():
    ParallelConfig(2, 1).validate(_quantized(GLM5))  # 64 / 2 = 32: whole MX blocks
    ParallelConfig(4, 3, "ep").validate(_quantized(GLM5))  # experts split, each whole
    ParallelConfig().validate(ModelConfig.from_dict(dict(TINY_GLM5, vocab_size=511)))  # tp 1 splits nothing
    ParallelConfig(2, 1).validate(ModelConfig.from_dict(dict(TINY_GLM5, vocab_size=511)))  # the vocab is padded


@pytest.mark.parametrize("tp,vocab,padded", [(1, 311, 311), (2, 311, 312), (2, 128, 128), (4, 311, 312),
                                             (8, 311, 312), (8, 313, 320)])
def test_padded_vocab_splits_into_equal_rank_shares(tp, vocab, padded):
    """Rank shares are contiguous, equal, cover the padded vocabulary in rank order, and only the last ranks'
    run past the real ids (every real id has exactly one owner)."""
    shares = [ParallelConfig(tp, r).vocab_split(vocab) for r in range(tp)]
    assert ParallelConfig(tp, 0).padded_vocab_size(vocab) == padded
    assert [s.stop - s.start for s in shares] == [padded // tp] * tp
    assert shares[0].start == 0 and shares[-1].stop == padded
    assert all(a.stop == b.start for a, b in zip(shares, shares[1:]))


def test_vocab_rows_pad_the_last_share_with_zeros():
    """The loader's cut of a [311, H] embedding: rank 0 rows 0..155, rank 1 rows 156..310 and one zero row;
    a checkpoint whose rows disagree with the config's vocab_size is refused (padding would hide it)."""
    t = torch.arange(311 * 3, dtype=torch.float32).reshape(311, 3) + 1
    r0, r1 = (vocab_rows("lm_head.weight", t, 311, ParallelConfig(2, r)) for r in (0, 1))
    assert torch.equal(r0, t[:156]) and r1.shape == (156, 3)
    assert torch.equal(r1[:155], t[156:]) and not r1[155].any()
    with pytest.raises(CheckpointError, match="312 rows, the config's vocab_size is 311"):
        vocab_rows("lm_head.weight", torch.zeros(312, 3), 311, ParallelConfig(2, 0))


@pytest.mark.parametrize("kw,message", [(dict(tp_size=0), "tp_size must be >= 1"),
                                        (dict(tp_size=2, tp_rank=2), "tp_rank 2 is outside"),
                                        (dict(moe_parallel="dp"), "moe_parallel 'dp'")])
def test_bad_parallel_config(kw, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kw)


def test_tp_layer_without_a_group_raises():
    """A TP model in a process that joined no group fails loudly instead of computing with half the heads."""
    init_tp_group(ParallelConfig(), 0)  # tp 1: no process group, collectives are no-ops
    try:
        assert all_reduce_(torch.ones(2)).tolist() == [1.0, 1.0]
    finally:
        destroy_tp_group()
    with pytest.raises(RuntimeError, match="joined no TP group"):
        all_reduce_(torch.ones(2))


def test_a_dead_rank_makes_the_other_raise_not_hang():
    """Rank 1 dies right after joining; rank 0's next all_reduce raises within the 5 s group timeout (gloo
    sees the closed connection) instead of waiting forever. Both processes are joined."""
    timeout_s = 5.0
    procs, results = start_dying_pair(timeout_s)
    t0 = time.monotonic()
    outcome, elapsed = results.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert outcome != "no error", "the surviving rank's all_reduce returned although its peer was dead"
    assert elapsed < timeout_s + 5, (outcome, elapsed)
    assert time.monotonic() - t0 < 60
    print(f"surviving rank: {outcome} after {elapsed:.2f}s")
