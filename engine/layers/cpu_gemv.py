"""Small-M bf16 linear for decode steps (``csrc/gemv.cpp``, issue 44): ``y = x @ w.T + b`` for x [M <= 8, K],
reading each weight row once, the N rows split across the threads, the bf16 weights widened in registers or
multiplied as bf16 pairs (AVX512-BF16, AVX-512 or AVX2 + FMA by the build's ISA level, ``engine.cpu_ext``; scalar on a generic CPU). A decode step of a
bandwidth-bound model is mostly these reads (attention projections, the dense MLP, shared experts, lm_head), and
the bf16 GEMM of a few rows reads them well below the machine's bandwidth (bench/bench_roofline.py).

Eager CPU bf16 only, on by default (``enable``; ``$PDSERVE_GEMV=0`` at start-up turns it off): its sums run in
another order than oneDNN's, so a logit can round one bf16 ulp apart from ``F.linear`` (compiled graphs trace
``F.linear``); the engine's bf16 equality tests (against transformers, greedy decode) hold with it on. Without the
kernel (no compiler: one WARNING from ``engine.cpu_ext``) ``F.linear`` runs.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from common.env import gemv_enabled
from engine import cpu_ext

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gemv.cpp")
MAX_M = 8
"""The most rows the kernel takes (above it the GEMM's compute matters and ``F.linear`` runs)."""


def kernel(level: str | None = None) -> cpu_ext.Kernel | None:
    """The compiled extension for ``level`` (default: the process's, ``cpu_ext.isa()``), or None after one WARNING."""
    return _kernel(level or cpu_ext.isa())


@functools.cache
def _kernel(level: str) -> cpu_ext.Kernel | None:
    return cpu_ext.build("pdserve_gemv", SOURCE, "small-M bf16 linears run F.linear", level)


def path(level: str | None = None) -> str:
    """``avx512_bf16`` / ``avx512`` / ``avx2`` / ``scalar`` (the build's SIMD) when enabled, ``off`` when not, ``torch`` unbuilt."""
    if not _enabled[0]:
        return "off"
    k = kernel(level)
    return "torch" if k is None else k.simd()


_enabled: list[bool] = [gemv_enabled()]


def enable(on: bool = True) -> None:
    """Route eager small-M bf16 linears through the kernel (``True``) or ``F.linear`` (``False``)."""
    _enabled[0] = on


def enabled() -> bool:
    return _enabled[0]


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x [1..MAX_M, K] and w [N, K] bf16 on a CPU, w's rows contiguous, outside a traced graph, enabled and built."""
    return (_enabled[0] and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.device.type == "cpu" and w.dim() == 2 and w.stride(1) == 1
            and not torch.compiler.is_compiling() and kernel() is not None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: through the kernel where ``usable``, else ``F.linear`` itself."""
    if usable(x, w):
        return kernel().linear(x, w, b)
    return F.linear(x, w, b)
