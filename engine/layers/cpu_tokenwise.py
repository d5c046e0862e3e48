"""Token-wise bf16 ops of a prompt's layers in one pass each (``csrc/tokenwise.cpp``): RMSNorm, the residual
add + RMSNorm, SwiGLU's silu(g) * u (AVX-512; torch's silu ran on one thread: 3 x 0.32 ms of a 2k prompt), and
rotate-half RoPE (torch: four concatenations, a negation, two products and a sum; 766 vs 220
us on one core for 2k tokens x 4 heads x 64). torch runs a bf16 RMSNorm as seven passes (cast up, square, mean, rsqrt, scale, cast down, weight),
each slow in bf16 on a CPU: the nine norms of a 2k-token glm4_moe prompt took ~27 of its 63 ms on one core.

Eager CPU bf16 only: compiled graphs trace torch's ops (inductor fuses them itself), and without the kernel (no
compiler: one WARNING from ``engine.cpu_ext``) torch's ops run.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine import cpu_ext

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "tokenwise.cpp")


@functools.cache
def kernel() -> cpu_ext.Kernel | None:
    return cpu_ext.build("pdserve_tokenwise", SOURCE, "bf16 RMSNorm runs torch's ops")


def usable(x: torch.Tensor, dim: int = 2) -> bool:
    """``x`` [rows, dim] (``dim`` 3: [rows, heads, head_dim]) bf16 on a CPU with contiguous rows, outside a graph
    being traced, and the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == dim and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and kernel() is not None)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` (the kernel's result is torch's, bf16 roundings included, on AVX-512 CPUs)."""
    if usable(g) and usable(u) and kernel().simd():
        return kernel().silu_mul(g, u)
    return F.silu(g) * u
