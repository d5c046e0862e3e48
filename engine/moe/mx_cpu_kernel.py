"""The CPU fused MX MoE kernel (``csrc/mx_gemm.cpp``): built at first use, cached, or one loud WARNING.

``torch.utils.cpp_extension.load`` compiles the source with ``-O3 -march=native`` into
``$PDSERVE_HOME/torch_extensions/<name>`` where the name hashes the source and the CPU's flags, so a
shared home directory holds one build per CPU type and a changed source rebuilds. The build takes
~40 s on 2 cores the first time, milliseconds after. Without a working C++ compiler (or when the build
fails) ``kernel()`` logs ONE WARNING and returns None: the ``fused_*`` strategies are then unavailable
and ``auto`` runs the torch strategies.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from types import ModuleType

import torch

from common.env import pdserve_home
from engine.quant.mx import MXFormat, code_values

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "mx_gemm.cpp")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def build_name() -> str:
    """Extension name: a hash of the source, the CPU flags and torch's version."""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    h.update(_cpu_flags().encode())
    h.update(torch.__version__.encode())
    return f"pdserve_mx_gemm_{h.hexdigest()[:12]}"


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None after one WARNING (no compiler, or the build failed)."""
    from torch.utils import cpp_extension  # heavy optional import: only when the kernel is wanted
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.warning("MX fused CPU kernel unavailable: no C++ compiler (%r not on PATH); MX experts run the "
                       "torch strategies (dequantize, then GEMM): slower decode, more memory", compiler)
        return None
    name = build_name()
    build_dir = os.path.join(pdserve_home(), "torch_extensions", name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        return cpp_extension.load(name=name, sources=[SOURCE], build_directory=build_dir,
                                  extra_cflags=["-O3", "-march=native", "-std=c++17"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build/load failure: one loud fallback, never a crash
        logger.warning("MX fused CPU kernel unavailable: building %s failed (%s); MX experts run the torch "
                       "strategies (dequantize, then GEMM): slower decode, more memory", SOURCE, e)
        return None


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
                 block_size: int) -> torch.Tensor:
    """``y[p] = W[group_expert[g]] @ x[row_index[p]]`` for the pairs p of group g (group_start[g] <= p <
    group_start[g+1]); ``row_index`` None means p. x [M, K] fp32 -> y [P, N] fp32, from MX codes directly."""
    k = kernel()
    idx = row_index if row_index is not None else torch.empty(0, dtype=torch.long)
    return k.mx_grouped_gemm(x.contiguous(), idx, group_expert, group_start, codes, scales, lut(fmt), fmt.bits,
                             block_size)


def dequant_into(codes: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, fmt: MXFormat, block_size: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Dense weights of ``experts`` [n] into ``out[:n]`` ([>= n, N, K] fp32/bf16); returns ``out[:n]``."""
    kernel().mx_dequant_into(codes, scales, experts, lut(fmt), fmt.bits, block_size, out)
    return out[: experts.numel()]
