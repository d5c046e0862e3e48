"""Write a model back to disk in the Hugging Face layout GLM checkpoints use.

The inverse of ``engine.loader``'s mapping table: stacked experts become per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` tensors and MTP layer ``k`` becomes
``model.layers.{num_hidden_layers + k}.*``. Used to create random test/demo models, by the
trainer of the default model and by ``pdserve quantize``.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.load import build_model
from engine.models.glm import GlmForCausalLM


def hf_tensors(model: GlmForCausalLM, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter, in checkpoint naming."""
    N, I = cfg.num_hidden_layers, cfg.moe_intermediate_size
    for name, p in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.startswith("mtp."):
            _, k, rest = name.split(".", 2)
            prefix = f"model.layers.{N + int(k)}."
            if rest.startswith("block."):
                name = prefix + rest[len("block."):]
            elif rest.startswith("shared_head_norm."):
                name = prefix + "shared_head.norm." + rest[len("shared_head_norm."):]
            else:
                name = prefix + rest
        if name.endswith("mlp.experts.w13"):
            base = name[: -len("w13")]
            for e in range(p.shape[0]):
                yield f"{base}{e}.gate_proj.weight", p[e, :I]
                yield f"{base}{e}.up_proj.weight", p[e, I:]
        elif name.endswith("mlp.experts.w2"):
            base = name[: -len("w2")]
            for e in range(p.shape[0]):
                yield f"{base}{e}.down_proj.weight", p[e]
        else:
            yield name, p


def save_checkpoint(model: GlmForCausalLM, cfg: ModelConfig, out_dir: str, dtype: torch.dtype | None = None,
                    extra_config: dict | None = None) -> None:
    """config.json + model.safetensors (contiguous copies; fp32 modules stay fp32)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in hf_tensors(model, cfg):
        keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight"))
        tensors[name] = (t if dtype is None or keep32 else t.to(dtype)).detach().contiguous().clone()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    conf = dict(cfg.raw)
    conf["num_nextn_predict_layers"] = cfg.num_mtp_layers
    if dtype is not None:
        conf["torch_dtype"] = str(dtype).removeprefix("torch.")
    conf.update(extra_config or {})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)


TINY_GLM5 = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=512, hidden_size=128,
    intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
    v_head_dim=32, qk_nope_head_dim=32, index_topk=256, index_head_dim=32, index_n_heads=4,
    first_k_dense_replace=1, max_position_embeddings=32768, rope_parameters={"rope_theta": 10000.0,
    "rope_type": "default"}, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-5,
    hidden_act="silu", norm_topk_prob=True, num_nextn_predict_layers=1,
)
"""A tiny GLM-5-architecture config (MLA, DSA, a dense first layer, 8 experts + shared, one MTP layer)."""


MEDIUM_GLM5 = dict(
    TINY_GLM5, vocab_size=32000, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
    num_experts_per_tok=8, q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=192, qk_rope_head_dim=64,
    v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32, first_k_dense_replace=1,
    max_position_embeddings=65536,
)
"""The benchmark model (``init-model --preset medium``): GLM-5's architecture (MLA with GLM-5's head dims
192/64/256, DSA indexer with GLM-5's 32 x 128 heads and index_topk 2048, one dense layer then MoE with a
shared expert, one MTP layer) at hidden 2048 with 64 routed experts top-8 of width 512 (GLM-5's 2048 / TP4).
Its routed experts are 8 x 3 x 64 x 2048 x 512 = 1.61 G parameters (3.2 GB bf16, 0.85 GB MXFP4) of a
~1.9 G-parameter, ~3.8 GB bf16 checkpoint: far past any CPU cache. Exact figures in docs/performance.md."""
PRESETS: dict[str, dict] = {"tiny": TINY_GLM5, "medium": MEDIUM_GLM5}
"""``pdserve init-model --preset`` choices."""


def init_random_model(cfg_dict: dict, out_dir: str, seed: int = 0, std: float = 0.05,
                      dtype: torch.dtype | None = None) -> str:
    """Create a random-weight checkpoint for ``cfg_dict`` in ``out_dir`` (for tests and the demo), stored in
    ``dtype`` (None: fp32) as ``save_checkpoint`` stores it."""
    cfg = ModelConfig.from_dict(cfg_dict)
    gen = torch.Generator().manual_seed(seed)
    model = build_model(cfg, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    save_checkpoint(model, cfg, out_dir, dtype=dtype)
    return out_dir


def _init_value(name: str, shape: torch.Size, gen: torch.Generator, std: float, dtype: torch.dtype) -> torch.Tensor:
    """One random tensor as ``init_random_model`` fills it (normal weights, zero biases, unit norms)."""
    if name.endswith(("e_score_correction_bias", "bias")):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) >= 2:
        return (torch.randn(shape, generator=gen) * std).to(dtype)
    return torch.ones(shape, dtype=dtype)


def _shard_of(name: str) -> str:
    m = name.split(".")
    return f"layer{int(m[2]):03d}" if name.startswith("model.layers.") else "other"


def init_random_model_streaming(cfg_dict: dict, out_dir: str, seed: int = 0, std: float = 0.02,
                                dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write a random-weight checkpoint one shard (decoder layer) at a time, never the whole model in memory.

    The model is built on the meta device for its names and shapes only; each shard's tensors are
    generated, written to ``model-{shard}.safetensors`` and freed before the next (peak memory ~ one
    layer). ``model.safetensors.index.json`` maps every name to its shard, as Hugging Face checkpoints do.
    Router gates and the indexer's weight projection stay fp32 (as ``save_checkpoint`` keeps them).
    Returns ``{"num_params": ..., "num_bytes": ..., "num_expert_params": ...}``.
    """
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        meta = GlmForCausalLM(cfg, "auto")
    os.makedirs(out_dir, exist_ok=True)
    shards: dict[str, list[tuple[str, torch.Size]]] = {}
    for name, t in hf_tensors(meta, cfg):
        shards.setdefault(_shard_of(name), []).append((name, t.shape))
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    stats = {"num_params": 0, "num_bytes": 0, "num_expert_params": 0}
    for shard, entries in shards.items():
        fname = f"model-{shard}.safetensors"
        tensors = {}
        for name, shape in entries:
            keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight"))
            t = _init_value(name, shape, gen, std, torch.float32 if keep32 else dtype)
            tensors[name] = t
            weight_map[name] = fname
            stats["num_params"] += t.numel()
            stats["num_bytes"] += t.numel() * t.element_size()
            stats["num_expert_params"] += t.numel() if ".mlp.experts." in name else 0
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": stats["num_bytes"]}, "weight_map": weight_map}, f, indent=1)
    conf = dict(cfg.raw, num_nextn_predict_layers=cfg.num_mtp_layers, torch_dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
    return stats
