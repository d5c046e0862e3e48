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


def init_random_model(cfg_dict: dict, out_dir: str, seed: int = 0, std: float = 0.05) -> str:
    """Create a random-weight checkpoint for ``cfg_dict`` in ``out_dir`` (for tests and the demo)."""
    from engine.runtime import build_model
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
    save_checkpoint(model, cfg, out_dir)
    return out_dir
