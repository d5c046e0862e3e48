"""Make a built model match a quantized checkpoint before the strict loader fills it.

``prepare_model_for_checkpoint(model, cfg, model_dir)`` (called by ``load_model`` between
``build_model`` and ``load_weights``):

1. reads config.json's ``quantization_config`` (none: nothing to do, no rules);
2. decides, for every routed-experts module, dense or MX: excluded (all of its experts' gate/up/down
   in ``exclude``) -> dense; otherwise MX in the format the config gives it. Names are compared in
   checkpoint naming, so ``mtp.0.block.mlp.experts`` is decided by ``model.layers.{N}.mlp.experts.*``.
   A layer the quantizer never saw (no exclude entry, no scale tensor, e.g. an MTP layer that
   transformers drops and Quark copies through from the source checkpoint) stays dense;
3. checks the decision against the checkpoint's tensor names, shapes and dtypes (read from the
   safetensors headers, no data) and raises ``CheckpointError`` naming the tensor, the expected and
   found shape/dtype and the module when they disagree -- a wrong exclude list fails here, clearly;
4. swaps each MX module's ``RoutedExperts`` for ``MXRoutedExperts`` and returns the loader rules that
   map ``...experts.{e}.{gate,up,down}_proj.{weight,weight_scale}`` into its buffers, plus a guard
   that rejects quantization tensors anywhere else (pdserve quantizes routed experts only).

Excluded modules keep their dense parameters, so they load as bf16/fp32 through the ordinary rules
wherever their names differ (``model.layers.{N}.mlp.shared_experts.*`` -> ``mtp.0.block.mlp.shared_experts``).
"""
from __future__ import annotations

import logging
import re
from typing import NamedTuple

from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.loader import CheckpointError, Rule, Target, checkpoint_files
from engine.moe import mx_cpu_kernel
from engine.moe.experts import RoutedExperts
from engine.moe.mx_experts import DENSE_TO_MX, DequantCache, MXRoutedExperts
from engine.quant.mx import MXSpec
from engine.quant.quark import LayerQuant, QuarkConfig, QuantConfigError

logger = logging.getLogger(__name__)

PROJS = ("gate_proj", "up_proj", "down_proj")
QUANT_SUFFIXES = (".weight_scale", ".input_scale", ".output_scale", ".weight_zero_point", ".input_zero_point")
_EXPERT_TENSOR = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                            r"\.(?P<kind>weight|weight_scale)$")
_MTP_MODULE = re.compile(r"^mtp\.(\d+)\.block\.(.*)$")
_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+\.)")


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    """safetensors dtype code: "U8", "BF16", "F32", "F8_E4M3", ..."""


class ExpertsPlan(NamedTuple):
    module: str
    """Our module name, e.g. ``mtp.0.block.mlp.experts``."""
    ckpt: str
    """Its checkpoint prefix, e.g. ``model.layers.3.mlp.experts``."""
    quant: LayerQuant | None
    """None: dense."""
    reason: str


def checkpoint_index(model_dir: str) -> dict[str, TensorInfo]:
    """Name -> (shape, dtype) of every checkpoint tensor, from the safetensors headers only."""
    index: dict[str, TensorInfo] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                index[name] = TensorInfo(tuple(sl.get_shape()), sl.get_dtype())
    return index


def checkpoint_module(module: str, cfg: ModelConfig) -> str:
    """Our module name -> checkpoint module name (the inverse of the loader's MTP rule)."""
    m = _MTP_MODULE.match(module)
    return f"model.layers.{cfg.num_hidden_layers + int(m.group(1))}.{m.group(2)}" if m else module


def plan_experts(model: nn.Module, cfg: ModelConfig, qc: QuarkConfig, index: dict[str, TensorInfo]
                 ) -> list[ExpertsPlan]:
    plans = []
    quantized_layers = {m.group(1) for k in index if k.endswith(QUANT_SUFFIXES) and (m := _LAYER_PREFIX.match(k))}
    for name, mod in model.named_modules():
        if not isinstance(mod, RoutedExperts):
            continue
        ckpt = checkpoint_module(name, cfg)
        names = [f"{ckpt}.{e}.{p}" for e in range(cfg.n_routed_experts) for p in PROJS]
        excluded = [qc.is_excluded(n) for n in names]
        specs = {qc.layer(n) for n in names}
        layer_prefix = ckpt.split(".mlp.")[0] + "."
        has_scales = any(n + ".weight_scale" in index for n in names)
        seen = has_scales or layer_prefix in quantized_layers or qc.mentions_layer(layer_prefix)
        if all(excluded):
            plans.append(ExpertsPlan(name, ckpt, None, "listed in quantization_config.exclude"))
        elif any(excluded):
            a, b = names[excluded.index(True)], names[excluded.index(False)]
            raise CheckpointError(f"quantization_config.exclude lists {a!r} but not {b!r}: pdserve quantizes a "
                                  f"routed-experts module ({name!r}) all or nothing")
        elif len(specs) > 1:
            raise CheckpointError(f"layer_quant_config gives the experts of {ckpt!r} different formats: "
                                  f"{sorted(map(str, specs))}; one format per experts module is supported")
        elif (lq := specs.pop()).weight is None:
            plans.append(ExpertsPlan(name, ckpt, None, "no weight quantization configured"))
        elif not seen:
            plans.append(ExpertsPlan(name, ckpt, None, f"layer {layer_prefix[:-1]!r} is not covered by the "
                                     "quantization (no exclude entry, no scales): kept as stored"))
        else:
            plans.append(ExpertsPlan(name, ckpt, lq, "quantized"))
    return plans


def _expected(spec: MXSpec | None, rows: int, k: int) -> tuple[TensorInfo, TensorInfo | None]:
    if spec is None:
        return TensorInfo((rows, k), "float"), None
    return TensorInfo(spec.codes_shape((rows, k)), "U8"), TensorInfo(spec.scales_shape((rows, k)), "U8")


def check_plan(plan: ExpertsPlan, cfg: ModelConfig, index: dict[str, TensorInfo]) -> None:
    """Raise CheckpointError where the checkpoint's expert tensors contradict the plan."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    spec = plan.quant.weight if plan.quant else None
    for e in range(cfg.n_routed_experts):
        for proj in PROJS:
            rows, k = (H, I) if proj == "down_proj" else (I, H)
            n = f"{plan.ckpt}.{e}.{proj}"
            want_w, want_s = _expected(spec, rows, k)
            w, s = index.get(n + ".weight"), index.get(n + ".weight_scale")
            dst = f"{plan.module}.{'w2' if proj == 'down_proj' else 'w13'}"
            if spec is None:
                if s is not None or (w is not None and w.dtype == "U8"):
                    raise CheckpointError(
                        f"checkpoint tensor {n + '.weight'!r} is {_desc(w)} with a weight_scale {_desc(s)}, but "
                        f"{n!r} is not quantized per quantization_config ({plan.reason}): the model expects a "
                        f"dense {(rows, k)} float tensor for {dst!r}[{e}]; is the exclude list right?")
                continue
            why = f"{n!r} is not in quantization_config.exclude, so it must be {spec.fmt.name}"
            if w is not None and (w.dtype != "U8" or w.shape != want_w.shape):
                raise CheckpointError(
                    f"checkpoint tensor {n + '.weight'!r} is {_desc(w)}, expected uint8 {want_w.shape} codes "
                    f"(+ weight_scale uint8 {want_s.shape}) for {dst}_codes[{e}]: {why}; is the exclude list right?")
            if w is not None and s is None:
                raise CheckpointError(f"checkpoint tensor {n + '.weight_scale'!r} is missing: {why} "
                                      f"(uint8 {want_w.shape} codes + uint8 {want_s.shape} E8M0 scales)")
            if s is not None and (s.dtype != "U8" or s.shape != want_s.shape):
                raise CheckpointError(f"checkpoint tensor {n + '.weight_scale'!r} is {_desc(s)}, expected uint8 "
                                      f"{want_s.shape} E8M0 scales for {dst}_scales[{e}] ({spec.fmt.name}, block "
                                      f"{spec.block_size})")


def _desc(t: TensorInfo | None) -> str:
    return "absent" if t is None else f"{t.dtype} {t.shape}"


def _mx_rule(prefixes: dict[str, str], inter: int) -> Rule:
    def rule_quark_mx(name: str, cfg: ModelConfig) -> Target | None:
        m = _EXPERT_TENSOR.match(name)
        if not m or m["base"] not in prefixes:
            return None
        module, e = prefixes[m["base"]], int(m["e"])
        kind = "codes" if m["kind"] == "weight" else "scales"
        if m["proj"] == "down_proj":
            return Target(f"{module}.w2_{kind}", "quark-mx-expert", (e,))
        rows = slice(0, inter) if m["proj"] == "gate_proj" else slice(inter, 2 * inter)
        return Target(f"{module}.w13_{kind}", "quark-mx-expert", (e, rows))
    return rule_quark_mx


def rule_quark_guard(name: str, cfg: ModelConfig) -> Target | None:
    """Quantization tensors the MX rule did not take: a module pdserve cannot serve quantized."""
    if name.endswith(QUANT_SUFFIXES):
        module = name.rsplit(".", 1)[0]
        raise CheckpointError(f"checkpoint tensor {name!r}: module {module!r} is stored quantized, but pdserve "
                              "serves MX weights only for the routed experts of layers that quantization_config "
                              "does not exclude; keep it bf16 (add it to exclude) when quantizing")
    return None


def prepare_model_for_checkpoint(model: nn.Module, cfg: ModelConfig, model_dir: str) -> list[Rule]:
    """Swap routed experts to MX where ``model_dir`` is quantized; return the loader's extra rules.

    Returns [] for an unquantized checkpoint. Raises CheckpointError (a ValueError) on a checkpoint
    that contradicts its own quantization_config, QuantConfigError on a config pdserve cannot serve.
    """
    try:
        qc = QuarkConfig.for_model_dir(model_dir)
    except QuantConfigError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    if qc is None:
        return []
    index = checkpoint_index(model_dir)
    plans = plan_experts(model, cfg, qc, index)
    for plan in plans:
        check_plan(plan, cfg, index)
    mx_prefixes = {p.ckpt: p.module for p in plans if p.quant is not None}
    for name, _info in index.items():
        m = _EXPERT_TENSOR.match(name)
        if name.endswith(QUANT_SUFFIXES) and not (m and m["base"] in mx_prefixes):
            rule_quark_guard(name, cfg)
    cache: DequantCache | None = None
    for plan in plans:
        if plan.quant is None:
            logger.info("%s: dense (%s)", plan.module, plan.reason)
            continue
        parent_name, _, attr = plan.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        old: RoutedExperts = getattr(parent, attr)
        device = old.w13.device
        impl = DENSE_TO_MX.get(old.impl, old.impl)
        if cache is None and impl.startswith("cached_"):  # the user asked for a dense copy by name: only then
            cache = DequantCache(DequantCache.default_budget(device))
        num_experts, two_inter, hidden = old.w13.shape  # this rank's shape (engine.parallel splits I or E)
        setattr(parent, attr, MXRoutedExperts(num_experts, hidden, two_inter // 2, old.topk, plan.quant.weight,
                                              plan.quant.input, impl=impl, device=device, cache=cache))
    n_mx = len(mx_prefixes)
    if n_mx and cache_device_is_cpu(model):
        mx_cpu_kernel.available()  # build the fused kernel (or warn) while loading, not at the first request
    logger.info("%s: %d of %d routed-experts modules are MX (%s)", model_dir, n_mx, len(plans),
                ", ".join(sorted({p.quant.weight.fmt.name for p in plans if p.quant})) or "none")
    return [_mx_rule(mx_prefixes, cfg.moe_intermediate_size), rule_quark_guard] if n_mx else [rule_quark_guard]


def cache_device_is_cpu(model: nn.Module) -> bool:
    return any(m.w13_codes.device.type == "cpu" for m in model.modules() if isinstance(m, MXRoutedExperts))


def quantized_experts(model: nn.Module) -> dict[str, MXRoutedExperts]:
    """The MX experts modules of a model, by name (for metrics and tests)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MXRoutedExperts)}


class ExpertMemory(NamedTuple):
    """Bytes the routed experts of a model hold resident (for worker status and the no-dense-copy checks)."""

    mx_bytes: int
    """Packed MX codes + E8M0 scales."""
    dense_bytes: int
    """Dense (bf16 / fp32) routed-expert weights: layers that are not quantized."""
    cache_bytes: int
    """Dequantized copies held by the DequantCache(s) of the MX layers."""

    @property
    def resident_bytes(self) -> int:
        return self.mx_bytes + self.dense_bytes + self.cache_bytes


def expert_memory(model: nn.Module) -> ExpertMemory:
    mx = dense = 0
    caches: dict[int, DequantCache] = {}
    for m in model.modules():
        if isinstance(m, MXRoutedExperts):
            mx += m.weight_bytes()
            if m.cache is not None:
                caches[id(m.cache)] = m.cache
        elif isinstance(m, RoutedExperts):
            dense += sum(p.numel() * p.element_size() for p in (m.w13, m.w2))
    return ExpertMemory(mx, dense, sum(c.used_bytes for c in caches.values()))


def expert_status(model: nn.Module) -> dict[str, str]:
    """Worker status fields: resident routed-expert bytes (all, and the MX part) and the MX strategies that ran."""
    mem = expert_memory(model)
    ran = sorted({m.last_impl for m in model.modules() if isinstance(m, MXRoutedExperts) and m.last_impl})
    return {"routed_expert_bytes": str(mem.resident_bytes), "routed_expert_mx_bytes": str(mem.mx_bytes),
            "moe_impls": ",".join(ran)}


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (shared tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


__all__ = ["prepare_model_for_checkpoint", "checkpoint_index", "checkpoint_module", "plan_experts", "check_plan",
           "quantized_experts", "model_weight_bytes", "TensorInfo", "ExpertsPlan", "ExpertMemory", "expert_memory",
           "expert_status"]
