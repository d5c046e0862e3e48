"""Offline quantizer: a bf16 (or fp32) Hugging Face GLM checkpoint -> AMD Quark's MX export layout.

What gets quantized (what is served well quantized): the routed experts' gate/up/down projections
of every MoE layer, and of the MTP layer unless ``quantize_mtp=False``. Everything else keeps its
dtype and its module is listed in ``quantization_config.exclude``: attention (and the DSA indexer),
router gates, embeddings, lm_head, norms, dense MLPs, shared experts -- the MTP layer's shared
expert (``model.layers.{N}.mlp.shared_experts.*``) included.

Each quantized ``<module>.weight`` [out, in] becomes uint8 codes [out, packed(in)] plus
``<module>.weight_scale`` uint8 E8M0 [out, in/32] (engine.quant.mx; Quark's packing). Fused 3-D
expert tensors (transformers' ``mlp.experts.gate_up_proj`` / ``down_proj``) are split per expert
first, as Quark's export names them. Shards are processed one at a time (peak memory ~ one input
shard) and keep their file names; tokenizer and other side files are copied across.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterator, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import ModelConfig
from engine.fingerprint import checkpoint_files
from engine.quant.mx import MXSpec, ScaleMode, get_mx_format, quantize_mx
from engine.quant.quark import LayerQuant, QuarkConfig

_LAYER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SKIP_FILES = ("config.json", "model.safetensors.index.json")


class QuantizeResult(NamedTuple):
    out_dir: str
    num_quantized: int
    """Weight tensors written as MX codes + scales."""
    num_kept: int
    """Tensors copied unchanged."""
    in_bytes: int
    out_bytes: int
    exclude: list[str]


def _split_fused(name: str, t: torch.Tensor, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
    m = _FUSED.match(name)
    if not m:
        yield name, t
        return
    base = m.group(1)
    for e in range(t.shape[0]):
        if m.group(3) == "down_proj":
            yield f"{base}.{e}.down_proj.weight", t[e]
        else:
            yield f"{base}.{e}.gate_proj.weight", t[e, :inter]
            yield f"{base}.{e}.up_proj.weight", t[e, inter:]


def _quantizable(name: str, cfg: ModelConfig, quantize_mtp: bool) -> bool:
    m = _LAYER_EXPERT.match(name)
    if not m:
        return False
    layer = int(m.group(1))
    return cfg.is_moe_layer(layer) and (quantize_mtp or layer < cfg.num_hidden_layers)


def quantize_checkpoint(in_dir: str, out_dir: str, fmt: str = "mxfp4", scale_mode: ScaleMode = "even",
                        quantize_mtp: bool = True, act_format: str | None = None,
                        progress: bool = True) -> QuantizeResult:
    """Write ``out_dir``: ``in_dir``'s checkpoint with routed experts in ``fmt`` (Quark export layout).

    ``act_format`` adds a dynamic ``input_tensors`` spec (Quark's W4A4-style schemes); the default
    None is weight-only (Quark's ``mxfp4_weight_only``).
    """
    if os.path.abspath(in_dir) == os.path.abspath(out_dir):
        raise ValueError("--out must differ from --model")
    with open(os.path.join(in_dir, "config.json")) as f:
        raw_cfg = json.load(f)
    if raw_cfg.get("quantization_config"):
        raise ValueError(f"{in_dir} is already quantized (config.json has a quantization_config)")
    cfg = ModelConfig.from_dict(raw_cfg)
    spec = MXSpec(get_mx_format(fmt), 32, scale_mode)
    act = MXSpec(get_mx_format(act_format), 32, scale_mode) if act_format else None
    os.makedirs(out_dir, exist_ok=True)
    files = checkpoint_files(in_dir)
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    weight_map: dict[str, str] = {}
    kept_modules: set[str] = set()
    n_q = n_kept = in_bytes = out_bytes = 0
    bar = tqdm(total=total, desc=f"quantize {fmt}", unit="tensor", disable=not progress)
    for path in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for src_name in f.keys():
                t = f.get_tensor(src_name)
                in_bytes += t.numel() * t.element_size()
                for name, w in _split_fused(src_name, t, cfg.moe_intermediate_size):
                    if _quantizable(name, cfg, quantize_mtp):
                        q = quantize_mx(w, spec.fmt, spec.scale_mode, spec.block_size)
                        out[name] = q.codes.contiguous()
                        out[name + "_scale"] = q.scales.contiguous()
                        n_q += 1
                    else:
                        out[name] = w.contiguous()
                        n_kept += 1
                        if name.endswith(".weight"):
                            kept_modules.add(name[: -len(".weight")])
                bar.update(1)
        fname = os.path.basename(path)
        save_file(out, os.path.join(out_dir, fname), metadata={"format": "pt"})
        out_bytes += sum(v.numel() * v.element_size() for v in out.values())
        weight_map.update({n: fname for n in out})
    bar.close()
    exclude = sorted(kept_modules)
    qc = QuarkConfig(LayerQuant(spec, act), tuple(exclude))
    raw_cfg["quantization_config"] = qc.to_dict()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw_cfg, f, indent=2, sort_keys=True)
    if os.path.exists(os.path.join(in_dir, "model.safetensors.index.json")):
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": out_bytes}, "weight_map": weight_map}, f, indent=2)
    copy_side_files(in_dir, out_dir)
    return QuantizeResult(out_dir, n_q, n_kept, in_bytes, out_bytes, exclude)


def copy_side_files(in_dir: str, out_dir: str) -> list[str]:
    """Copy tokenizer files and everything else that is not weights or config.json."""
    copied = []
    for fname in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, fname)
        if os.path.isfile(src) and not fname.endswith(".safetensors") and fname not in _SKIP_FILES:
            shutil.copy2(src, os.path.join(out_dir, fname))
            copied.append(fname)
    return copied
