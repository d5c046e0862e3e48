"""Tuned MoE implementation tables: which routed-expert strategy to run for a token count.

Like vLLM's ``configs/E={E},N={N},device_name={name}.json``: one JSON file per (shape, device),
``{"<num_tokens>": "<impl name>"}``, the nearest token-count key wins. Files ship in
``engine/moe/tuned/`` (package data) and are written by ``pdserve tune-moe`` (``engine.moe.tune``, which serving never imports).

A shape with no table on this device logs ONE loud WARNING naming the shape and the fallback
(the reference deployment's fp4 MoE silently ran a default until someone tuned it), then uses
``fallback_impl``: the gather path up to ``FALLBACK_GATHER_MAX_PAIRS`` (token, expert) pairs,
else the sorted path.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.moe.experts import GATHER_MAX_PAIRS
from engine.quant.mx import get_mx_format

logger = logging.getLogger(__name__)

TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
TABLE_DIRS: list[str] = [TUNED_DIR]
"""Where run-time lookups search, in order (the shipped tables)."""
FALLBACK_GATHER_MAX_PAIRS = GATHER_MAX_PAIRS
"""Untuned fallback: up to this many (token, expert) pairs run ``mx_gather``, more run ``mx_sorted``; the
same bound as the dense experts' batch-invariant gather, and MX experts gather up to it whatever a table
says (decode and speculative verify must round alike)."""


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The problem one routed-expert layer solves (the table key, with the device)."""

    hidden: int
    """Model dim H (input and output of an expert)."""
    inter: int
    """Expert intermediate size I (``moe_intermediate_size``; vLLM's N)."""
    num_experts: int
    """Routed experts E."""
    topk: int
    """Experts per token."""
    dtype: str = "mxfp4"
    """Weight format: an MX format name."""

    def __post_init__(self) -> None:
        if min(self.hidden, self.inter, self.num_experts, self.topk) < 1 or self.topk > self.num_experts:
            raise ValueError(f"bad MoE shape {self}")

    def key(self, device_name: str) -> str:
        return (f"E={self.num_experts},N={self.inter},H={self.hidden},topk={self.topk},"
                f"dtype={self.dtype},device_name={device_name}")

    def file_name(self, device_name: str) -> str:
        return self.key(device_name) + ".json"

    def describe(self) -> str:
        return f"model_dim {self.hidden}, moe_inter {self.inter}, E {self.num_experts}, top-{self.topk}, {self.dtype}"

    def mx_weight_bytes(self) -> int:
        bits = get_mx_format(self.dtype).bits
        numel = 3 * self.num_experts * self.hidden * self.inter
        return numel * bits // 8 + numel // 32

    def dense_weight_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return 3 * self.num_experts * self.hidden * self.inter * torch.empty((), dtype=dtype).element_size()


NAMED_SHAPES: dict[str, MoEShape] = {
    "glm5": MoEShape(6144, 2048, 256, 8),
    "glm5-s4": MoEShape(1536, 512, 64, 8),
    "tiny": MoEShape(128, 64, 8, 2),
    "peer": MoEShape(256, 128, 16, 4),
}
"""``glm5``: GLM-5's routed experts; ``glm5-s4``: the same with dims and experts / 4 (fits a small
CPU box); ``tiny``: the default model (TINY_GLM5, until the trained default ships); ``peer``: the
bench peer model (hidden 256, moe_inter 128, 16 experts top-4)."""
DEFAULT_SHAPES = ("glm5", "glm5-s4", "tiny", "peer")


def parse_shape(text: str, dtype: str = "mxfp4") -> MoEShape:
    """A named shape (``glm5``, ``tiny``, ...) or ``H,N,E,topk`` (model_dim, moe_inter, experts, top-k)."""
    if text in NAMED_SHAPES:
        s = NAMED_SHAPES[text]
        return MoEShape(s.hidden, s.inter, s.num_experts, s.topk, dtype)
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r}: expected one of {sorted(NAMED_SHAPES)} or H,N,E,topk")
    h, n, e, k = (int(p) for p in parts)
    return MoEShape(h, n, e, k, dtype)


def device_name(device: torch.device | str = "cpu") -> str:
    """The table's device key: the GPU's name, or ``cpu_<CPU model>``, spaces as underscores."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = "cpu_" + _cpu_model()
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip()).strip("_")


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# ---------------------------------------------------------------------------------------------
# Lookup at run time


@functools.lru_cache(maxsize=256)
def _read_table(path: str) -> dict[int, str] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(k): str(v) for k, v in raw.items()}


def load_table(shape: MoEShape, device: str, dirs: Sequence[str] | None = None) -> dict[int, str] | None:
    """The tuned ``{num_tokens: impl}`` table for ``shape`` on ``device`` (a device_name), or None."""
    for d in TABLE_DIRS if dirs is None else dirs:
        table = _read_table(os.path.join(d, shape.file_name(device)))
        if table:
            return table
    return None


def nearest_impl(table: dict[int, str], num_tokens: int) -> str:
    """The impl of the nearest token-count key (ties: the smaller key), as vLLM picks its config."""
    best = min(table, key=lambda k: (abs(k - num_tokens), k))
    return table[best]


FUSED_GATHER_MAX_PAIRS = 256
"""Untuned fallback with the fused CPU kernel: up to this many pairs ``fused_gather``, more ``fused_sorted``."""


def fallback_impl(num_pairs: int, fused: bool = False) -> str:
    """The untuned choice: with the fused kernel (``fused``) fused_gather / fused_sorted, which hold no dense
    layer; without it mx_gather / mx_sorted."""
    if fused:
        return "fused_gather" if num_pairs <= FUSED_GATHER_MAX_PAIRS else "fused_sorted"
    return "mx_gather" if num_pairs <= FALLBACK_GATHER_MAX_PAIRS else "mx_sorted"


_warned: set[str] = set()


def warn_untuned_once(shape: MoEShape, device: str) -> bool:
    """Log the untuned-shape WARNING the first time ``(shape, device)`` is seen; True if it logged."""
    key = shape.key(device)
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(
        "no tuned MoE table for %s (%s) on device %s in %s: using the untuned fallback (with the fused CPU "
        "kernel: fused_gather up to %d token-expert pairs, else fused_sorted; without it: mx_gather up to %d, else "
        "mx_sorted); performance may be sub-optimal. Tune it with `pdserve tune-moe --shapes %d,%d,%d,%d --dtype %s`",
        shape.key(device), shape.describe(), device, ", ".join(TABLE_DIRS), FUSED_GATHER_MAX_PAIRS,
        FALLBACK_GATHER_MAX_PAIRS,
        shape.hidden, shape.inter, shape.num_experts, shape.topk, shape.dtype)
    return True
