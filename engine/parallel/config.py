"""How one worker's model is split over its rank processes: ``ParallelConfig``.

A worker is ``tp_size`` rank processes joined by ``torch.distributed`` (``engine.parallel.group``). Every rank
builds the same model with the dimensions below divided by ``tp_size`` (``rank_config``) and loads only its
slice of each split tensor (``engine.parallel.shard``):

=====================================  ==================  ===========================================
tensors                                split               combined by
=====================================  ==================  ===========================================
MLA q_b_proj, kv_b_proj; GQA q/k/v     attention heads     o_proj row-parallel, one all_reduce
o_proj                                 input dim (heads)
MLA q_a / kv_a / indexer, norms        replicated          (computed identically on every rank)
dense MLP and shared experts           intermediate dim    down_proj row-parallel, one all_reduce
routed experts, ``moe_parallel="tp"``  each expert's       summed into the FFN's all_reduce
                                       intermediate dim
routed experts, ``moe_parallel="ep"``  whole experts       summed into the FFN's all_reduce
router (gate, correction bias)         replicated          routing identical on every rank
embed_tokens, lm_head                  padded vocab rows   all_reduce (embedding), all_gather (logits)
=====================================  ==================  ===========================================

Any vocabulary splits (as vLLM's ``VocabParallelEmbedding`` and SGLang's): the embedding and LM head are built
with ``padded_vocab_size`` rows, the next multiple of ``tp_size``, so rank r holds ids
``vocab_split(V) = [r*Vp/tp, (r+1)*Vp/tp)``. The rows past ``vocab_size`` are zeros (``engine.parallel.shard``)
that no id looks up (every input id is checked against ``vocab_size``), and the logits all_gather keeps only
the first ``vocab_size`` columns: every consumer (sampling, logprobs, speculative verify, the MTP draft) sees
``[N, vocab_size]`` logits, so a padded id can never be sampled or reported. Every other split dimension must
divide (``validate``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import ModelConfig

MOE_PARALLEL = ("tp", "ep")
MX_BLOCK = 32
"""Elements per MX scale block (OCP MX v1.0 sec. 5): an MX expert's intermediate slice must hold whole blocks."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp_size: int = 1
    """Rank processes of one worker (the tensor-parallel world size); 1: one process, no collectives."""
    tp_rank: int = 0
    """This process's rank in ``[0, tp_size)``; rank 0 owns the worker's servicer, scheduler and KV data plane."""
    moe_parallel: str = "tp"
    """Routed experts: ``tp`` splits each expert's intermediate dim, ``ep`` gives each rank whole experts."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, tp_size={self.tp_size})")
        if self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe_parallel {self.moe_parallel!r} is not one of {MOE_PARALLEL}")

    @property
    def is_tp(self) -> bool:
        return self.tp_size > 1

    @property
    def expert_parallel(self) -> bool:
        """Routed experts partitioned across ranks (only meaningful at tp_size > 1)."""
        return self.is_tp and self.moe_parallel == "ep"

    def validate(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` (one line, naming the model's value and tp_size) when ``cfg`` cannot be split
        ``tp_size`` ways as the table above splits it."""
        tp = self.tp_size
        if tp == 1:
            return
        checks = [("num_attention_heads", cfg.num_attention_heads)]  # the vocab is padded (padded_vocab_size)
        if not cfg.is_mla:
            checks.append(("num_key_value_heads", cfg.num_key_value_heads))
        if "dense" in cfg.mlp_layer_types:
            checks.append(("intermediate_size", cfg.intermediate_size))
        if cfg.n_routed_experts:
            if cfg.n_shared_experts:
                checks.append(("moe_intermediate_size * n_shared_experts",
                               cfg.moe_intermediate_size * cfg.n_shared_experts))
            if self.moe_parallel == "ep":
                checks.append(("n_routed_experts", cfg.n_routed_experts))
            else:
                checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for name, value in checks:
            if value % tp:
                raise ValueError(f"cannot split the model {tp} ways: {name}={value} is not a multiple of "
                                 f"tp_size={tp}")
        if cfg.n_routed_experts and self.moe_parallel == "tp" and cfg.raw.get("quantization_config"):
            per_rank = cfg.moe_intermediate_size // tp
            if per_rank % MX_BLOCK:
                raise ValueError(f"cannot split MX experts {tp} ways: moe_intermediate_size / tp_size = "
                                 f"{cfg.moe_intermediate_size} / {tp} = {per_rank} is not a multiple of the "
                                 f"{MX_BLOCK}-element MX block; use moe_parallel='ep' or a smaller tp_size")

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with every dimension split across ranks divided by ``tp_size``: the shapes of this rank's
        modules (heads, KV heads, intermediate sizes; the routed experts' width under ``tp`` MoE). The vocab
        and the expert count stay whole (the embedding and LM head take ``vocab_split``, the EP experts
        ``split`` of this config's counts)."""
        if self.tp_size == 1:
            return cfg
        tp = self.tp_size
        heads = cfg.num_attention_heads // tp
        kvh = heads if cfg.is_mla else cfg.num_key_value_heads // tp  # MLA reads no KV head count
        return replace(cfg, num_attention_heads=heads, num_key_value_heads=kvh,
                       intermediate_size=cfg.intermediate_size // tp,
                       moe_intermediate_size=(cfg.moe_intermediate_size if self.moe_parallel == "ep"
                                              else cfg.moe_intermediate_size // tp))

    def split(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (``n`` divisible by ``tp_size``)."""
        k = n // self.tp_size
        return slice(self.tp_rank * k, (self.tp_rank + 1) * k)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``tp_size``: the rows of the split embedding and LM head
        (311 at tp_size 2 -> 312; unchanged at tp_size 1)."""
        return -(-vocab_size // self.tp_size) * self.tp_size

    def vocab_split(self, vocab_size: int) -> slice:
        """This rank's ids of the padded vocabulary (the last rank's may run past ``vocab_size``: padding)."""
        return self.split(self.padded_vocab_size(vocab_size))


SINGLE_RANK = ParallelConfig()
"""One process holding the whole model (the default everywhere: no split, no collectives)."""
