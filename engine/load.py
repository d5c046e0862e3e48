"""Build a model from a directory: config, MTP layers, dtype, device, weights (quantized checkpoints too).

``load_model(model_dir)`` is what every worker, benchmark and test calls; ``build_model`` makes the empty
module on a device (``engine.checkpoint`` uses it to write random checkpoints).
"""
from __future__ import annotations

import logging
import time

import torch

from engine.config import ModelConfig
from engine.kernels import log_kernel_report
from engine.layers import cpu_attention, cpu_tokenwise
from engine.loader import checkpoint_names, detect_mtp_layers, load_weights
from engine.models.glm import GlmForCausalLM
from engine.moe import moe_cpu_kernel
from engine.moe.experts import RoutedExperts
from engine.parallel.config import SINGLE_RANK, ParallelConfig
from engine.parallel.shard import shard_fn
from engine.quant.prepare import prepare_model_for_checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP32_MODULES = ("mlp.gate", "indexer.weights_proj")
"""Kept in fp32 whatever the model dtype (router logits and DSA weights, as the reference does)."""


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` (NVIDIA or ROCm; both are ``cuda`` in torch) when available, else ``cpu``."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        logger.info("no CUDA/ROCm device available: running on CPU")
        return torch.device("cpu")
    return torch.device(device)


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                moe_impl: str = "auto", parallel: ParallelConfig = SINGLE_RANK) -> GlmForCausalLM:
    with torch.device("meta"):
        model = GlmForCausalLM(cfg, moe_impl, parallel)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, mod in model.named_modules():
        if name.endswith(FP32_MODULES):
            mod.float()
    return model.eval()


def load_model(model_dir: str, dtype: str = "float32", device: str = "auto", moe_impl: str = "auto",
               parallel: ParallelConfig = SINGLE_RANK) -> tuple[GlmForCausalLM, ModelConfig]:
    """The model of ``model_dir`` -> (this rank's shard of it, the WHOLE model's config). ``parallel``: which
    rank of a tensor-parallel worker this process is (it keeps only its slice of each split tensor;
    ``engine.parallel.shard``); ``ValueError`` when the model cannot be split that way."""
    cfg = ModelConfig.from_model_dir(model_dir)
    cfg = detect_mtp_layers(cfg, checkpoint_names(model_dir))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
    parallel.validate(cfg)
    model = build_model(cfg, DTYPES[dtype], resolve_device(device), moe_impl, parallel)
    t0 = time.perf_counter()
    extra_rules = prepare_model_for_checkpoint(model, cfg, model_dir)  # quantized checkpoints: MX experts + rules
    load_weights(model, model_dir, cfg, extra_rules, shard_fn(cfg, parallel))
    if any(isinstance(m, RoutedExperts) and moe_cpu_kernel.supports(m.w13, m.w2)
           for m in model.modules()):
        moe_cpu_kernel.available()  # build the fused MoE kernel (or warn) while loading, not at the first prefill
    if dtype == "bfloat16" and model.lm_head.weight.device.type == "cpu":
        cpu_tokenwise.kernel()  # likewise the bf16 token-wise and prompt attention kernels
        cpu_attention.kernel()
    if not cfg.is_mla and model.lm_head.weight.device.type == "cpu":
        cpu_attention.decode_kernel()  # and the GQA decode / verify attention (any dtype)
    if model.lm_head.weight.device.type == "cpu":
        log_kernel_report()  # once per process: the path each hot CPU op takes (builds the rest of the kernels)
    logger.info("loaded %s (%s, %d layers + %d MTP%s) in %.2fs", model_dir, cfg.model_type,
                cfg.num_hidden_layers, cfg.num_mtp_layers,
                f", tp rank {parallel.tp_rank}/{parallel.tp_size} {parallel.moe_parallel} MoE" if parallel.is_tp else "",
                time.perf_counter() - t0)
    return model, cfg
