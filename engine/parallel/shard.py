"""Load-time sharding: which slice of each checkpoint tensor a rank keeps (``shard_fn``).

The strict loader (``engine.loader.load_weights``) maps a checkpoint tensor to a model parameter (and, for
stacked experts, an index into it) in the model's FULL coordinates; ``shard_fn`` then cuts the tensor to this
rank's slice and rewrites the index into the rank's smaller parameter, or drops the tensor (an expert another
rank owns under expert parallelism). Each rank therefore holds only its slice; the full tensor lives only
while it is read. Rules, by parameter name (first match):

=============================================================  ==========================================
parameter                                                      rank r keeps
=============================================================  ==========================================
``model.embed_tokens.weight``, ``lm_head.weight``              vocab rows ``vocab_split(V)`` (dim 0),
                                                               zero rows past V (the padding)
``*.q_b_proj.weight``, ``*.kv_b_proj.weight``,                 output rows ``split(rows)`` (dim 0):
``*.{q,k,v}_proj.{weight,bias}``, ``*.{gate,up}_proj.weight``  whole heads / intermediate units
``*.o_proj.weight``, ``*.down_proj.weight``                    input columns ``split(cols)`` (dim 1)
``*.o_proj.bias``                                              rank 0 the bias, others zeros (the
                                                               all_reduce adds it once)
``*.experts.w13{,_codes,_scales}`` (tp MoE)                    gate rows ``split(I)`` and up rows
                                                               ``I + split(I)``
``*.experts.w2{,_codes,_scales}`` (tp MoE)                     the last dim ``split`` (codes: packed bytes
                                                               of whole MX blocks, scales: blocks)
``*.experts.*`` (ep MoE)                                       experts ``split(E)``
anything else (norms, MLA down-projections, DSA indexer,       all of it (replicated)
router, MTP eh_proj)
=============================================================  ==========================================
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.loader import CheckpointError, ShardFn, Target
from engine.parallel.config import ParallelConfig

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
COLUMN = (".q_b_proj.weight", ".kv_b_proj.weight", ".q_proj.weight", ".q_proj.bias", ".k_proj.weight",
          ".k_proj.bias", ".v_proj.weight", ".v_proj.bias", ".gate_proj.weight", ".up_proj.weight")
ROW = (".o_proj.weight", ".down_proj.weight")
ROW_BIAS = (".o_proj.bias",)
EXPERT_W13 = (".experts.w13", ".experts.w13_codes", ".experts.w13_scales")
EXPERT_W2 = (".experts.w2", ".experts.w2_codes", ".experts.w2_scales")


def _split(t: torch.Tensor, dim: int, pc: ParallelConfig) -> torch.Tensor:
    s = pc.split(t.shape[dim])
    return t.narrow(dim, s.start, s.stop - s.start)


def vocab_rows(name: str, t: torch.Tensor, vocab_size: int, pc: ParallelConfig) -> torch.Tensor:
    """Rank ``pc.tp_rank``'s rows of the ``[V, H]`` embedding / LM head ``name``, zero rows filling its share of
    the padded vocabulary past ``V`` (``ParallelConfig.padded_vocab_size``)."""
    if t.shape[0] != vocab_size:  # padding would hide it: say so, as tp_size 1's shape check would
        raise CheckpointError(f"shape mismatch for checkpoint tensor {name!r}: {t.shape[0]} rows, the config's "
                              f"vocab_size is {vocab_size}")
    own = pc.vocab_split(vocab_size)
    real = t[own.start:min(own.stop, vocab_size)]
    pad = own.stop - own.start - real.shape[0]
    return real if pad == 0 else torch.cat([real, real.new_zeros(pad, *t.shape[1:])])


def shard_fn(cfg: ModelConfig, pc: ParallelConfig) -> ShardFn | None:
    """The loader's sharding step for rank ``pc.tp_rank`` of ``cfg`` (None at tp_size 1: nothing to cut)."""
    if not pc.is_tp:
        return None
    inter = cfg.moe_intermediate_size
    experts = pc.split(cfg.n_routed_experts) if cfg.n_routed_experts else slice(0, 0)

    def experts_ep(target: Target, t: torch.Tensor) -> tuple[Target, torch.Tensor] | None:
        if not target.index:  # fused [E, ...] tensor
            return target, t[experts]
        e = target.index[0]
        if not experts.start <= e < experts.stop:
            return None  # another rank's expert
        return Target(target.param, target.rule, (e - experts.start, *target.index[1:])), t

    def experts_tp(target: Target, t: torch.Tensor, w13: bool) -> tuple[Target, torch.Tensor]:
        if not w13:  # [..., H, I]: this rank's intermediate columns (whole MX blocks: ParallelConfig.validate)
            return target, _split(t, t.dim() - 1, pc)
        if not target.index:  # fused [E, 2I, K]: gate rows then up rows
            own = pc.split(inter)
            return target, torch.cat([t[:, own], t[:, inter + own.start:inter + own.stop]], dim=1)
        e, rows = target.index  # rows: slice(0, I) (gate) or slice(I, 2I) (up) of the full w13
        local = inter // pc.tp_size
        start = rows.start // pc.tp_size
        return Target(target.param, target.rule, (e, slice(start, start + local))), _split(t, 0, pc)

    def shard(target: Target, t: torch.Tensor) -> tuple[Target, torch.Tensor] | None:
        name = target.param
        if name.endswith(EXPERT_W13 + EXPERT_W2):
            if pc.moe_parallel == "ep":
                return experts_ep(target, t)
            return experts_tp(target, t, name.endswith(EXPERT_W13))
        if name in VOCAB:
            return target, vocab_rows(name, t, cfg.vocab_size, pc)
        if name.endswith(COLUMN):
            return target, _split(t, 0, pc)
        if name.endswith(ROW):
            return target, _split(t, 1, pc)
        if name.endswith(ROW_BIAS):
            return target, t if pc.tp_rank == 0 else torch.zeros_like(t)
        return target, t

    return shard
