"""``ModelProxy``: what rank 0's schedulers hold instead of the model when the worker has follower ranks.

It has the model's interface; each model call (``forward``, ``mtp_kv``, ``forward_mtp``, ``logits``) and
``move_kv`` is broadcast to the followers (``worker.ranks``) and then run locally with the same inputs,
so every rank runs the same step (and, with a sharded model, meets its peers in the same collectives).
Everything else (``cfg``, ``has_mtp``, ``lm_head``, ...) is rank 0's model's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.models.glm import ForwardResult, GlmForCausalLM
from engine.parallel import SINGLE_RANK
from engine.speculative.decoder import move_kv
from worker.ranks import RankGroup, batch_tensors


def _logits(out: ForwardResult) -> torch.Tensor:
    return out.logits


class ModelProxy:
    def __init__(self, model: GlmForCausalLM, group: RankGroup) -> None:
        self._model, self.group = model, group

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    @property
    def has_mtp(self) -> bool:
        return self._model.has_mtp

    def __call__(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> ForwardResult:
        return self.forward(batch, pool, all_logits)

    def forward(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> ForwardResult:
        meta, tensors = batch_tensors(batch)
        return self.group.call("forward", {**meta, "all_logits": all_logits}, tensors, pool,
                               lambda: self._model(batch, pool, all_logits), _logits)

    def mtp_kv(self, batch: ForwardBatch, pool: KVPool, prev_hidden: torch.Tensor, k: int = 0) -> None:
        meta, tensors = batch_tensors(batch)
        return self.group.call("mtp_kv", {**meta, "k": k}, {**tensors, "prev_hidden": prev_hidden}, pool,
                               lambda: self._model.mtp_kv(batch, pool, prev_hidden, k))

    def forward_mtp(self, batch: ForwardBatch, pool: KVPool, prev_hidden: torch.Tensor, k: int = 0,
                    all_logits: bool = False) -> ForwardResult:
        meta, tensors = batch_tensors(batch)
        return self.group.call("forward_mtp", {**meta, "k": k, "all_logits": all_logits},
                               {**tensors, "prev_hidden": prev_hidden}, pool,
                               lambda: self._model.forward_mtp(batch, pool, prev_hidden, k, all_logits), _logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.call("logits", {}, {"hidden": hidden}, None, lambda: self._model.logits(hidden),
                               lambda out: out)

    def move_kv(self, pool: KVPool, layers: range, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``engine.speculative.decoder.move_kv`` on every rank (a pool write outside a model call)."""
        self.group.call("move_kv", {"start": layers.start, "stop": layers.stop}, {"src": src, "dst": dst}, pool,
                        lambda: move_kv(pool, layers, src, dst))


class RankModel(NamedTuple):
    model: "GlmForCausalLM | ModelProxy"
    """what the schedulers call (a ``ModelProxy`` driving the followers with ``--tp`` > 1)"""
    local: GlmForCausalLM
    """this rank's own model (shard)"""
    cfg: ModelConfig
    layout: KVLayout
    """rank 0's KV pool layout (split GQA heads under TP)"""


def load_rank_model(weights_dir: str, dtype: str, device: str, layout: KVLayout, ranks: RankGroup | None,
                    weights_hash: str) -> RankModel:
    """A worker's model on rank 0: its shard loaded, the followers (``ranks``, None at tp 1) checked ready on
    ``weights_hash``, and the pool layout of this rank (``layout``: the whole model's, from ``start_plan``)."""
    local, cfg = load_model(weights_dir, dtype, device, parallel=ranks.parallel if ranks is not None else SINGLE_RANK)
    if ranks is None:
        return RankModel(local, local, cfg, layout)
    ranks.wait_ready(weights_hash, cfg)
    return RankModel(ModelProxy(local, ranks), local, cfg,
                     KVLayout.for_model(cfg, layout.page_size, layout.kv_dtype, parallel=ranks.parallel))
