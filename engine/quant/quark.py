"""AMD Quark's ``quantization_config`` (config.json), read and written for OCP MX checkpoints.

What a Quark export (amd-quark 0.13, ``export_safetensors``) of an MX scheme holds:

    config.json  "quantization_config": {
        "quant_method": "quark",
        "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                           "ch_axis": -1, "is_dynamic": false, "scale_format": "e8m0",
                                           "round_method": "half_even", "scale_calculation_mode": "even", ...},
                                "input_tensors": {... "is_dynamic": true} | null, ...},
        "layer_quant_config": {"<glob>": {same shape as global_quant_config}},   overrides by module name
        "exclude": ["model.layers.0.self_attn.q_proj", ..., "lm_head"],          modules left unquantized
        ...}
    model.safetensors  "<module>.weight" uint8 codes [out, packed(in)], "<module>.weight_scale" uint8
                       E8M0 [out, in/32]; every other tensor keeps its dtype.

Quark's element dtypes map to ours: fp4 -> mxfp4, fp6_e2m3 / fp6_e3m2 -> mxfp6_*, fp8_e4m3 -> mxfp8.
Exclude entries are full module names in checkpoint naming; globs (``*``, ``?``) are honoured too.
"""
from __future__ import annotations

import fnmatch
import functools
import json
import os
from dataclasses import dataclass, field

from engine.quant.mx import MXSpec, get_mx_format

QUARK_DTYPES: dict[str, str] = {"fp4": "mxfp4", "fp6_e2m3": "mxfp6_e2m3", "fp6_e3m2": "mxfp6_e3m2",
                                "fp8_e4m3": "mxfp8"}
"""Quark ``dtype`` -> our MX format name."""
QUARK_VERSION = "0.13"


class QuantConfigError(ValueError):
    """A quantization_config pdserve cannot serve: names the field and the value."""


def _spec_from_quark(d: dict | None, where: str) -> MXSpec | None:
    if d is None:
        return None
    dtype = d.get("dtype")
    if dtype == "mx":
        raise QuantConfigError(f"{where}: dtype 'mx' (Quark's legacy scale-interleaved MX packing) is not "
                               f"supported; re-export with dtype {sorted(QUARK_DTYPES)}")
    if dtype not in QUARK_DTYPES:
        raise QuantConfigError(f"{where}.dtype = {dtype!r}: pdserve serves OCP MX only ({sorted(QUARK_DTYPES)})")
    checks = {"qscheme": ("per_group",), "scale_format": ("e8m0",), "ch_axis": (-1, 1),
              "round_method": ("half_even", None)}
    for key, allowed in checks.items():
        if d.get(key) not in allowed:
            raise QuantConfigError(f"{where}.{key} = {d.get(key)!r}: OCP MX needs one of {allowed}")
    mode = d.get("scale_calculation_mode") or "even"
    if mode not in ("even", "floor"):
        raise QuantConfigError(f"{where}.scale_calculation_mode = {mode!r}: expected 'even' or 'floor'")
    return MXSpec(get_mx_format(QUARK_DTYPES[dtype]), int(d.get("group_size") or 32), mode)


def quark_tensor_config(spec: MXSpec, is_dynamic: bool) -> dict:
    """One Quark ``QTensorConfig`` as ``export_safetensors`` writes it for an OCP MX spec."""
    dtype = next(q for q, ours in QUARK_DTYPES.items() if ours == spec.fmt.name)
    return {"dtype": dtype, "qscheme": "per_group", "group_size": spec.block_size, "ch_axis": -1,
            "is_dynamic": is_dynamic, "symmetric": None, "round_method": "half_even", "scale_type": "float",
            "scale_format": "e8m0", "scale_calculation_mode": spec.scale_mode, "observer_cls": "PerBlockMXObserver",
            "mx_element_dtype": None, "block_size": None, "zero_point_type": "int32", "is_scale_quant": False}


@dataclass(frozen=True, slots=True)
class LayerQuant:
    """Quantization of one module: its weights and (optionally) its dynamic input activations."""
    weight: MXSpec | None
    input: MXSpec | None = None


@dataclass(frozen=True, slots=True)
class QuarkConfig:
    """A parsed Quark ``quantization_config``."""

    global_quant: LayerQuant
    """Applies to every module not excluded and not matched by ``layer_quant``."""
    exclude: tuple[str, ...] = ()
    """Module names (checkpoint naming) or globs that stay unquantized."""
    layer_quant: tuple[tuple[str, LayerQuant], ...] = ()
    """(glob, config) overrides by module name, first match wins."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if any(not isinstance(e, str) for e in self.exclude):
            raise QuantConfigError(f"quantization_config.exclude must be a list of strings, got {self.exclude!r}")

    def is_excluded(self, module: str) -> bool:
        exact, globs = _split_exclude(self.exclude)
        return module in exact or any(fnmatch.fnmatchcase(module, g) for g in globs)

    def layer(self, module: str) -> LayerQuant:
        for pattern, lq in self.layer_quant:
            if fnmatch.fnmatchcase(module, pattern):
                return lq
        return self.global_quant

    def mentions_layer(self, prefix: str) -> bool:
        """Whether an exact exclude entry names a module under ``prefix`` (e.g. ``model.layers.3.``)."""
        return any(e.startswith(prefix) for e in _split_exclude(self.exclude)[0])

    @classmethod
    def from_dict(cls, qc: dict) -> "QuarkConfig":
        method = qc.get("quant_method")
        if method != "quark":
            raise QuantConfigError(f"quantization_config.quant_method = {method!r}: pdserve reads AMD Quark "
                                   "exports (quant_method 'quark') only")
        if qc.get("layer_type_quant_config"):
            raise QuantConfigError("quantization_config.layer_type_quant_config is not supported "
                                   f"(got keys {sorted(qc['layer_type_quant_config'])})")
        overrides = tuple((pattern, _layer_from_quark(lc, f"layer_quant_config[{pattern!r}]"))
                          for pattern, lc in (qc.get("layer_quant_config") or {}).items())
        return cls(_layer_from_quark(qc.get("global_quant_config") or {}, "global_quant_config"),
                   tuple(qc.get("exclude") or ()), overrides, dict(qc))

    def to_dict(self) -> dict:
        def layer(lq: LayerQuant) -> dict:
            return {"weight": quark_tensor_config(lq.weight, False) if lq.weight else None,
                    "input_tensors": quark_tensor_config(lq.input, True) if lq.input else None,
                    "output_tensors": None, "bias": None, "target_device": None}
        return {"quant_method": "quark", "version": QUARK_VERSION, "quant_mode": "eager_mode",
                "global_quant_config": layer(self.global_quant),
                "layer_quant_config": {p: layer(lq) for p, lq in self.layer_quant}, "layer_type_quant_config": {},
                "exclude": list(self.exclude), "algo_config": None, "softmax_quant_spec": None,
                "kv_cache_quant_config": {}, "kv_cache_post_rope": False,
                "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                           "weight_format": "real_quantized", "weight_merge_groups": None}}

    @classmethod
    def for_model_dir(cls, model_dir: str) -> "QuarkConfig | None":
        """The checkpoint's Quark config, or None when config.json has no quantization_config."""
        with open(os.path.join(model_dir, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
        return None if not qc else cls.from_dict(qc)


def _layer_from_quark(lc: dict, where: str) -> LayerQuant:
    return LayerQuant(_spec_from_quark(lc.get("weight"), f"{where}.weight"),
                      _spec_from_quark(lc.get("input_tensors"), f"{where}.input_tensors"))


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


@functools.lru_cache(maxsize=8)
def _split_exclude(exclude: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """(exact names, globs): GLM-5's exclude list has ~10^4 entries, looked up ~10^5 times."""
    return frozenset(e for e in exclude if not _is_glob(e)), tuple(e for e in exclude if _is_glob(e))

