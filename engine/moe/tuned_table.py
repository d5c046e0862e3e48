"""Tuned MoE implementation tables: which routed-expert strategy to run for a token count.

Like vLLM's ``configs/E={E},N={N},device_name={name}.json``: one JSON file per (shape, device), the nearest
token-count key wins. Files ship in ``engine/moe/tuned/`` (package data) and are written by ``pdserve tune-moe``
(``engine.moe.tune``, which serving never imports). A CPU's device name carries its ISA class as well as its
model name (``cpu_AMD_EPYC_avx2`` and ``cpu_AMD_EPYC_avx512_bf16`` are different machines to a kernel).

A file records what it was measured with (``TableMeta``: format version, the strategy set's ``kernel_set`` hash,
the ISA class, the CPU model, torch's version) beside its ``{"<num_tokens>": "<impl name>"}`` table. A table
measured with another strategy set or ISA (or in the old bare format, which recorded neither) is IGNORED, with
ONE WARNING naming the file, what it records and what runs here: a timing table of other kernels must not pick
for these (the inverse of the reference deployment's trap, where a table that did not match the kernels made
its fp4 MoE take a slow default silently). ``pdserve tune-moe`` rewrites it.

A shape with no usable table on this device logs ONE loud WARNING naming the shape and the fallback, then uses
``fallback_impl``: the gather path up to ``FALLBACK_GATHER_MAX_PAIRS`` (token, expert) pairs, else the sorted path.

Whatever a table says, the memory contract of MX experts wins (``engine.moe.mx_experts``): a strategy that holds
a dense copy of a layer (``cached_*``) runs only where the user asked for it by name.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from engine import cpu_ext
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
    """The table's device key: the GPU's name, or ``cpu_<CPU model>_<ISA class>``, spaces as underscores."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"cpu_{_cpu_model()}_{isa_class(dev)}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip()).strip("_")


def isa_class(device: torch.device | str = "cpu") -> str:
    """The ISA level our CPU kernels run at in this process (``engine.cpu_ext.isa``: the host's, or a lower one
    forced by ``PDSERVE_CPU_ISA``); ``cuda`` for a GPU."""
    return "cuda" if torch.device(device).type == "cuda" else cpu_ext.isa()


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


TABLE_FORMAT = 2
"""Version of the file layout (``TableMeta`` + ``impls``); version 1 was the bare ``{tokens: impl}`` dict."""
KERNEL_SET_VERSION = 3
"""Bumped when a strategy's kernel changes what it costs (a new kernel, a new code path in one): the tables
measured before then no longer describe these kernels. 2: the fused MX CPU kernels (fused_gather / fused_sorted)
and ISA-classed device names. 3: fused_gemv (MXFP4 dotted in registers, one call a layer) and fused_gather's
MXFP4 sum order (low nibbles, then high ones, per chunk)."""


def kernel_set(impl_names: Sequence[str]) -> str:
    """Hash of the strategy set a table chooses from (the names and ``KERNEL_SET_VERSION``)."""
    text = f"{KERNEL_SET_VERSION}:" + ",".join(sorted(impl_names))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class TableMeta:
    """What a table was measured with; a table is used only where ``kernel_set`` and ``isa`` match here."""

    kernel_set: str
    """``kernel_set()`` of the strategies it timed."""
    isa: str
    """``isa_class()`` of the device it was measured on."""
    cpu: str = ""
    """The CPU model (or GPU name), for people reading the file."""
    torch: str = ""
    """torch's version when measured, for people reading the file."""

    @staticmethod
    def here(impl_names: Sequence[str], device: torch.device | str = "cpu") -> "TableMeta":
        dev = torch.device(device)
        cpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model()
        return TableMeta(kernel_set(impl_names), isa_class(dev), cpu, torch.__version__)


class Table(NamedTuple):
    """A table file's contents: its ``meta`` (None: the old bare format) and ``{num_tokens: impl}``."""

    meta: TableMeta | None
    impls: dict[int, str]


def table_json(meta: TableMeta, impls: dict[int, str]) -> str:
    """A table file's text."""
    body = {"format": TABLE_FORMAT, "kernel_set": meta.kernel_set, "isa": meta.isa, "cpu": meta.cpu,
            "torch": meta.torch, "impls": {str(t): impl for t, impl in sorted(impls.items())}}
    return json.dumps(body, indent=2) + "\n"


@functools.lru_cache(maxsize=256)
def _read_table(path: str) -> Table | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    if "impls" not in raw:  # format 1: {tokens: impl}, measured with whatever kernels existed then
        return Table(None, {int(k): str(v) for k, v in raw.items()})
    meta = TableMeta(str(raw.get("kernel_set", "")), str(raw.get("isa", "")), str(raw.get("cpu", "")),
                     str(raw.get("torch", "")))
    return Table(meta, {int(k): str(v) for k, v in raw["impls"].items()})


def load_table(shape: MoEShape, device: str, want: TableMeta | None = None,
               dirs: Sequence[str] | None = None) -> dict[int, str] | None:
    """The tuned ``{num_tokens: impl}`` table for ``shape`` on ``device`` (a device_name), or None. With ``want``
    (what runs here), a table whose kernel set or ISA differs, or that does not say, is skipped with ONE WARNING
    naming it (``warn_stale_once``)."""
    for d in TABLE_DIRS if dirs is None else dirs:
        path = os.path.join(d, shape.file_name(device))
        table = _read_table(path)
        if not table or not table.impls:
            continue
        if want is not None and (table.meta is None or (table.meta.kernel_set, table.meta.isa)
                                 != (want.kernel_set, want.isa)):
            warn_stale_once(path, shape, table.meta, want, device)
            continue
        return table.impls
    return None


def nearest_impl(table: dict[int, str], num_tokens: int) -> str:
    """The impl of the nearest token-count key (ties: the smaller key), as vLLM picks its config."""
    best = min(table, key=lambda k: (abs(k - num_tokens), k))
    return table[best]


FUSED_GATHER_MAX_PAIRS = 256
"""Untuned fallback with the fused CPU kernel: up to this many pairs ``fused_gather``, more ``fused_sorted``."""
GEMV_MAX_PAIRS_PER_EXPERT = 8
"""Untuned fallback where ``fused_gemv`` runs (MXFP4): up to this many pairs per expert on average (8 tokens an
expert: the kernel re-reads an expert's codes from cache for each 4 of its tokens, so past a few it is the
decode-once tile kernel's turn)."""


def fallback_impl(num_pairs: int, fused: bool = False, gemv: bool = False, num_experts: int = 1) -> str:
    """The untuned choice: ``fused_gemv`` (where ``gemv``: an MXFP4 layer and the kernel) up to
    GEMV_MAX_PAIRS_PER_EXPERT pairs an expert; with the fused kernel (``fused``) fused_gather / fused_sorted, which
    hold no dense layer; without it mx_gather / mx_sorted."""
    if gemv and num_pairs <= GEMV_MAX_PAIRS_PER_EXPERT * num_experts:
        return "fused_gemv"
    if fused:
        return "fused_gather" if num_pairs <= FUSED_GATHER_MAX_PAIRS else "fused_sorted"
    return "mx_gather" if num_pairs <= FALLBACK_GATHER_MAX_PAIRS else "mx_sorted"


_warned: set[str] = set()


def warn_stale_once(path: str, shape: MoEShape, got: TableMeta | None, want: TableMeta, device: str) -> bool:
    """Log, once per file, that the table at ``path`` was measured with other kernels and is ignored (and no
    untuned-shape WARNING for the same shape after it: one WARNING says it)."""
    if path in _warned:
        return False
    _warned.update((path, shape.key(device)))
    was = ("the old format, which records no kernel set or ISA" if got is None
           else f"kernel set {got.kernel_set} on {got.isa or '?'} ({got.cpu or '?'}, torch {got.torch or '?'})")
    logger.warning(
        "ignoring tuned MoE table %s: it was measured with %s, this process runs kernel set %s on %s; its choices "
        "do not describe these kernels. Rewrite it with `pdserve tune-moe --shapes %d,%d,%d,%d --dtype %s`",
        path, was, want.kernel_set, want.isa, shape.hidden, shape.inter, shape.num_experts, shape.topk, shape.dtype)
    return True


def warn_untuned_once(shape: MoEShape, device: str) -> bool:
    """Log the untuned-shape WARNING the first time ``(shape, device)`` is seen; True if it logged."""
    key = shape.key(device)
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(
        "no tuned MoE table for %s (%s) on device %s in %s: using the untuned fallback (MXFP4 with the fused CPU "
        "kernel: fused_gemv up to %d token-expert pairs an expert; with the fused CPU kernel: fused_gather up to %d "
        "token-expert pairs, else fused_sorted; without it: mx_gather up to %d, else mx_sorted); performance may be "
        "sub-optimal. Tune it with `pdserve tune-moe --shapes %d,%d,%d,%d --dtype %s`",
        shape.key(device), shape.describe(), device, ", ".join(TABLE_DIRS), GEMV_MAX_PAIRS_PER_EXPERT,
        FUSED_GATHER_MAX_PAIRS,
        FALLBACK_GATHER_MAX_PAIRS,
        shape.hidden, shape.inter, shape.num_experts, shape.topk, shape.dtype)
    return True
