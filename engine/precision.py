"""``--dtype auto``: which dtype a worker computes in.

The checkpoint's own float dtype (the one holding most of its float bytes, from the safetensors headers)
where this device computes it fast, else float32:

- float32 checkpoints run in float32 (narrowing them would lose what the checkpoint holds);
- on a GPU, bfloat16 / float16 checkpoints run as stored (tensor cores);
- on a CPU, bfloat16 needs AVX512-BF16 or AMX-BF16 and float16 needs AVX512-FP16 or AMX-FP16 (the
  ``/proc/cpuinfo`` flags); without them oneDNN emulates the narrow dtype through float32 conversions,
  slower than float32 itself, so the worker runs in float32;
- and even with them, a CPU runs a model narrower than ``CPU_NARROW_MIN_HIDDEN`` in float32: its decode
  GEMMs are too small for the narrow kernels to pay (measured below).

The choice and its reason are logged once, by the caller, at start-up (a WARNING when it widens the
checkpoint's dtype: ``DtypeChoice.widened``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.headers import TensorInfo, stored_float_dtype

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""What ``--dtype`` accepts."""
CPU_FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
"""``/proc/cpuinfo`` flags under which a CPU computes the dtype natively (any one suffices)."""
CPU_NARROW_MIN_HIDDEN = 2048
"""The smallest hidden size at which ``auto`` computes a bf16 / fp16 checkpoint narrow on a CPU. Measured on
the Xeon with AMX-BF16 (docs/performance.md, "--dtype auto"; 1 thread, ``F.linear`` of x [M, H] through
[4H, H] then [H, 4H], bf16 time / fp32 time): at batch 1 (M = 1) 3.15 / 2.04 / 1.34 / 1.10 / 0.66 for
H = 128 / 256 / 512 / 1024 / 2048 (oneDNN's small-M bf16 path is slower than fp32's until the weights
outgrow the caches); at M = 32 bf16 wins from H = 128. Whole models agree: the default model (H = 128) and
the peers' glm4_moe (H = 256) decode slower in bf16 at batch 1 (eager and compiled), and the default
model's ``make demo`` knee fell from 12 to 7 requests/s. Every released GLM (H >= 4096) is above it."""


class DtypeChoice(NamedTuple):
    dtype: str
    """float32, bfloat16 or float16."""
    reason: str
    """Why (logged once at start-up)."""
    widened: bool = False
    """``auto`` computes in a wider dtype than the checkpoint's (logged as a WARNING: twice the weight memory)."""


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where there is no /proc/cpuinfo)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str, tensors: list[TensorInfo], device: torch.device, hidden_size: int,
                  flags: frozenset[str] | None = None) -> DtypeChoice:
    """``dtype`` as given, or for ``auto`` the checkpoint's dtype where ``device`` computes it fast for a
    model of ``hidden_size``."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} not in {list(DTYPE_CHOICES)}")
    if dtype != "auto":
        return DtypeChoice(dtype, "given")
    stored = stored_float_dtype(tensors)
    if stored not in CPU_FAST_FLAGS:  # float32 / float64 / no float tensors at all
        return DtypeChoice("float32", f"the checkpoint is {stored or 'not floating point'}")
    if device.type == "cuda":
        return DtypeChoice(stored, f"the checkpoint is {stored} and the GPU computes it natively")
    have = cpu_flags() if flags is None else flags
    fast = [f for f in CPU_FAST_FLAGS[stored] if f in have]
    if not fast:
        return DtypeChoice("float32", f"the checkpoint is {stored} but this CPU lacks "
                                      f"{' and '.join(CPU_FAST_FLAGS[stored])} (emulated {stored} is slower than "
                                      f"float32)", True)
    if hidden_size < CPU_NARROW_MIN_HIDDEN:
        return DtypeChoice("float32", f"the checkpoint is {stored} and this CPU has {'/'.join(fast)}, but the model's "
                                      f"hidden size {hidden_size} < {CPU_NARROW_MIN_HIDDEN}: its small GEMMs run faster "
                                      f"in float32 on a CPU (--dtype {stored} to override)", True)
    return DtypeChoice(stored, f"the checkpoint is {stored}, this CPU has {'/'.join(fast)} and the hidden size "
                               f"{hidden_size} >= {CPU_NARROW_MIN_HIDDEN}")
