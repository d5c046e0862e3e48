"""``--dtype auto``: which dtype a worker computes in.

The checkpoint's own float dtype (the one holding most of its float bytes, from the safetensors headers)
where this device computes it fast, else float32:

- float32 checkpoints run in float32 (narrowing them would lose what the checkpoint holds);
- on a GPU, bfloat16 / float16 checkpoints run as stored (tensor cores);
- on a CPU, bfloat16 needs AVX512-BF16 or AMX-BF16 and float16 needs AVX512-FP16 or AMX-FP16 (the
  ``/proc/cpuinfo`` flags); without them oneDNN emulates the narrow dtype through float32 conversions,
  slower than float32 itself, so the worker runs in float32.

The choice and its reason are logged once, by the caller, at start-up.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.headers import TensorInfo, stored_float_dtype

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""What ``--dtype`` accepts."""
CPU_FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
"""``/proc/cpuinfo`` flags under which a CPU computes the dtype natively (any one suffices)."""


class DtypeChoice(NamedTuple):
    dtype: str
    """float32, bfloat16 or float16."""
    reason: str
    """Why (logged once at start-up)."""


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


def resolve_dtype(dtype: str, tensors: list[TensorInfo], device: torch.device,
                  flags: frozenset[str] | None = None) -> DtypeChoice:
    """``dtype`` as given, or for ``auto`` the checkpoint's dtype where ``device`` computes it fast."""
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
    if fast:
        return DtypeChoice(stored, f"the checkpoint is {stored} and this CPU has {'/'.join(fast)}")
    return DtypeChoice("float32", f"the checkpoint is {stored} but this CPU lacks "
                                  f"{' and '.join(CPU_FAST_FLAGS[stored])} (emulated {stored} is slower than float32)")
