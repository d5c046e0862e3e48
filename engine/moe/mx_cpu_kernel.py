"""The CPU fused MX MoE kernel (``csrc/mx_gemm.cpp``), built by ``engine.cpu_ext`` at first use for the process's
ISA level, cached, or one loud WARNING: without it the ``fused_*`` strategies are unavailable and ``auto`` runs the
torch strategies. Its SIMD (``path``) follows the build's flags: AVX-512 at the avx512 levels and amx, AVX2 + FMA
at avx2, scalar on a generic CPU.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from engine import cpu_ext
from engine.quant.mx import MXFormat, code_values, get_mx_format

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "mx_gemm.cpp")


def kernel(level: str | None = None) -> cpu_ext.Kernel | None:
    """The compiled extension for ``level`` (default: the process's, ``cpu_ext.isa()``), or None after one WARNING
    (no compiler, or the build failed)."""
    return _kernel(level or cpu_ext.isa())


@functools.cache
def _kernel(level: str) -> cpu_ext.Kernel | None:
    return cpu_ext.build("pdserve_mx_gemm", SOURCE, "MX experts run the torch strategies (dequantize, then "
                         "GEMM): slower decode, more memory", level)


def path(level: str | None = None) -> str:
    """The SIMD the kernel runs at ``level``: ``avx512``, ``avx2`` or ``scalar`` (its build's), or ``torch``."""
    k = kernel(level)
    return "torch" if k is None else k.simd()


_disabled: list[str] = []


def disable(reason: str) -> None:
    """Switch the fused strategies off in this process (benchmarks comparing against the torch path)."""
    logger.warning("MX fused CPU kernel disabled: %s", reason)
    _disabled.append(reason)


def available() -> bool:
    return not _disabled and kernel() is not None


@functools.cache
def lut(fmt: MXFormat) -> torch.Tensor:
    """float32 [2^bits] code -> element value (the kernel's table)."""
    return code_values(fmt).contiguous()


def grouped_gemm(x: torch.Tensor, row_index: torch.Tensor | None, group_expert: torch.Tensor,
                 group_start: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: MXFormat,
                 block_size: int, level: str | None = None, scalar: bool = False) -> torch.Tensor:
    """``y[p] = W[group_expert[g]] @ x[row_index[p]]`` for the pairs p of group g (group_start[g] <= p <
    group_start[g+1]); ``row_index`` None means p. x [M, K] fp32 -> y [P, N] fp32, from MX codes directly.
    ``level``: the build to run (default: the process's; a test forces a lower one); ``scalar``: its scalar code
    (what a generic CPU's build runs)."""
    k = kernel(level)
    idx = row_index if row_index is not None else torch.empty(0, dtype=torch.long)
    return k.mx_grouped_gemm(x.contiguous(), idx, group_expert, group_start, codes, scales, lut(fmt), fmt.bits,
                             block_size, scalar)


def moe_fp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_codes: torch.Tensor,
            w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor, block_size: int,
            level: str | None = None, scalar: bool = False) -> torch.Tensor:
    """The routed experts of an MXFP4 layer in one call (``fused_gemv``): x [T, H] fp32/bf16, ``ids`` / ``weights``
    [T, k] -> [T, H] in x's dtype; bit for bit ``fused_gather`` (no activation quantization) at the same level.
    Each selected expert's codes are dotted in registers, read once per call for up to 4 of its tokens."""
    return kernel(level).mx_moe_fp4(x, ids, weights, w13_codes, w13_scales, w2_codes, w2_scales,
                                    lut(get_mx_format("mxfp4")), block_size, scalar)


def dequant_into(codes: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, fmt: MXFormat, block_size: int,
                 out: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """Dense weights of ``experts`` [n] into ``out[:n]`` ([>= n, N, K] fp32/bf16); returns ``out[:n]``."""
    kernel(level).mx_dequant_into(codes, scales, experts, lut(fmt), fmt.bits, block_size, out)
    return out[: experts.numel()]
