"""Strict safetensors loader with an explicit checkpoint-name -> module-name mapping table.

Every checkpoint tensor is consumed by exactly one rule or explicitly ignored by one; every
model parameter (and every expert slice of a stacked parameter) must be filled. A mismatch in
name, shape or dtype raises ``CheckpointError`` naming the tensor, the expected and actual
shape/dtype and the rule that mapped it. This is the guard against the classic serving bug of
loading an MTP layer's bf16 weights into 4-bit slots because its names did not match.

The mapping table (``RULES``), applied first match wins:

====================================================  =============================================
checkpoint name                                       module name
====================================================  =============================================
model.layers.{N+k}.{enorm,hnorm,eh_proj}.*            mtp.{k}.{enorm,hnorm,eh_proj}.*
model.layers.{N+k}.shared_head.norm.*                 mtp.{k}.shared_head_norm.*
model.layers.{N+k}.{embed_tokens,shared_head.head}.*  ignored: shared with the main model (as sglang)
model.layers.{N+k}.{rest}                             mtp.{k}.block.{rest} (then the rules below)
*.mlp.experts.{e}.{gate,up}_proj.weight               *.mlp.experts.w13[e, :I] / [e, I:]
*.mlp.experts.{e}.down_proj.weight                    *.mlp.experts.w2[e]
*.mlp.experts.gate_up_proj / down_proj (fused 3-D)    *.mlp.experts.w13 / w2
*.rotary_emb.inv_freq                                 ignored (recomputed)
anything else                                         the same name
====================================================  =============================================
(N = num_hidden_layers.) Quantized checkpoints add rules through ``extra_rules`` (see engine.quant).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.fingerprint import CheckpointError, checkpoint_files

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor goes."""
    param: str
    """Module parameter name; empty when ignored."""
    rule: str
    """Name of the rule that produced this target (for error messages)."""
    index: tuple = ()
    """Sub-slice of the parameter (``(e,)`` or ``(e, slice)``) for stacked experts."""


Rule = Callable[[str, ModelConfig], "Target | None"]
ShardFn = Callable[[Target, torch.Tensor], "tuple[Target, torch.Tensor] | None"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def rule_mtp(name: str, cfg: ModelConfig) -> Target | None:
    m = _LAYER.match(name)
    if not m or int(m.group(1)) < cfg.num_hidden_layers:
        return None
    k, rest = int(m.group(1)) - cfg.num_hidden_layers, m.group(2)
    if k >= cfg.num_mtp_layers:
        return None
    head = rest.split(".")[0]
    if head in ("enorm", "hnorm", "eh_proj"):
        return Target(f"mtp.{k}.{rest}", "mtp")
    if rest.startswith("shared_head.norm."):
        return Target(f"mtp.{k}.shared_head_norm.{rest[len('shared_head.norm.'):]}", "mtp")
    if head == "embed_tokens" or rest.startswith("shared_head.head."):
        return Target("", "mtp-shared-with-main-model")
    return _expert_or_same(f"mtp.{k}.block.{rest}", cfg, "mtp-block")


def _expert_or_same(name: str, cfg: ModelConfig, rule: str) -> Target:
    m = _EXPERT.match(name)
    if m:
        base, e, which = m.group(1), int(m.group(2)), m.group(3)
        I = cfg.moe_intermediate_size
        if which == "down_proj":
            return Target(f"{base}.w2", f"{rule}+expert", (e,))
        sl = slice(0, I) if which == "gate_proj" else slice(I, 2 * I)
        return Target(f"{base}.w13", f"{rule}+expert", (e, sl))
    m = _FUSED.match(name)
    if m:
        return Target(f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", f"{rule}+fused-experts")
    if name.endswith("rotary_emb.inv_freq"):
        return Target("", "recomputed")
    return Target(name, rule)


def rule_default(name: str, cfg: ModelConfig) -> Target:
    return _expert_or_same(name, cfg, "same-name")


def iter_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_names(model_dir: str) -> list[str]:
    names = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def detect_mtp_layers(cfg: ModelConfig, names: list[str]) -> ModelConfig:
    """Trust the checkpoint over config.json for how many MTP layers exist."""
    idx = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    found = len([i for i in idx if i >= cfg.num_hidden_layers])
    if found != cfg.num_mtp_layers:
        if cfg.num_mtp_layers:
            logger.warning("config.json declares %d MTP layers but the checkpoint holds %d; using %d",
                           cfg.num_mtp_layers, found, found)
        cfg = dataclasses.replace(cfg, num_mtp_layers=found)
    return cfg


def _compatible(src: torch.dtype, dst: torch.dtype) -> bool:
    return src.is_floating_point == dst.is_floating_point


def load_weights(model: torch.nn.Module, model_dir: str, cfg: ModelConfig,
                 extra_rules: list[Rule] | None = None, shard: ShardFn | None = None) -> None:
    """Load every tensor of ``model_dir`` into ``model``; raise ``CheckpointError`` on any mismatch.
    ``shard`` (tensor parallelism, ``engine.parallel.shard``) cuts each mapped tensor to this rank's slice and
    rewrites its target, or returns None for a tensor this rank does not hold."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    filled: dict[str, int] = {}
    rules: list[Rule] = list(extra_rules or []) + [rule_mtp]
    for name, tensor in iter_tensors(model_dir):
        target = next((t for r in rules if (t := r(name, cfg)) is not None), None) or rule_default(name, cfg)
        if not target.param:
            logger.debug("ignored %s (rule %s)", name, target.rule)
            continue
        if target.param not in params:
            raise CheckpointError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} maps to "
                                  f"{target.param!r} (rule {target.rule}), which the model does not have")
        if shard is not None:
            cut = shard(target, tensor)
            if cut is None:
                continue
            target, tensor = cut
        dst = params[target.param]
        view = dst[target.index] if target.index else dst
        if tuple(view.shape) != tuple(tensor.shape):
            raise CheckpointError(f"shape mismatch for checkpoint tensor {name!r}: expected "
                                  f"{tuple(view.shape)} for {target.param!r}{_fmt(target.index)}, got "
                                  f"{tuple(tensor.shape)} (rule {target.rule}); is the quantization config / "
                                  "exclude list right?")
        if not _compatible(tensor.dtype, dst.dtype):
            raise CheckpointError(f"dtype mismatch for checkpoint tensor {name!r}: {tensor.dtype} cannot load "
                                  f"into {target.param!r} of dtype {dst.dtype} (rule {target.rule}); "
                                  "is the quantization config / exclude list right?")
        with torch.no_grad():
            view.copy_(tensor.to(dst.dtype))
        filled[target.param] = filled.get(target.param, 0) + view.numel()
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [f"{n} {tuple(p.shape)}" for n, p in params.items()
               if filled.get(n, 0) != p.numel() and n not in tied and not n.startswith("_")]
    if missing:
        raise CheckpointError(f"{len(missing)} model parameters were not (fully) loaded from {model_dir}: "
                              + ", ".join(missing[:20]))


def _fmt(index: tuple) -> str:
    if not index:
        return ""
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"
