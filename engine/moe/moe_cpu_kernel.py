"""The fused bf16 CPU MoE kernel (``csrc/moe_cpu.cpp``): the ``fused_cpu`` strategy of ``engine.moe.experts``.
Built by ``engine.cpu_ext`` at first use for the process's ISA level, cached, or one loud WARNING (no compiler,
failed build): then ``available()`` is False and ``auto`` runs the torch strategies.

Two GEMM routes (``path``): ``amx``, AMX brgemm on VNNI-packed weights (ISA level amx); below it ``cpublas::gemm``
on the weights as stored (the path is named after the level: avx512_bf16 / avx512 / avx2).

On the amx route weights are packed once per layer (``PackedExperts``: a second copy of the layer's expert
weights, the same number of bytes) and kept while the layer's experts hold at most ``PACK_CACHE_MAX_BYTES``;
larger layers pack per call (only by name: ``auto`` does not pick the kernel for them). The gemm route's
"packed" weights are the weights themselves (no copy).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
from torch.profiler import record_function

from engine import cpu_ext


SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "moe_cpu.cpp")

TILE_GATE_UP = 64
"""Gate (and as many up) columns per w13 tile: one brgemm computes ``[rows, 2 * TILE_GATE_UP]`` in fp32."""
TILE_DOWN = 256
"""Output columns per w2 tile."""
BLOCK_ROWS = 32
"""Pairs of one expert per work item (brgemm's M)."""
CHUNK_BYTES = 4 << 20
"""The kernel runs a chunk of tokens at a time whose per-pair outputs (tokens * top-k * H bf16) take about this
many bytes (at least ``CHUNK_MIN_TOKENS`` tokens): they stay in cache until summed."""
CHUNK_MIN_TOKENS = 256
PACK_CACHE_MAX_BYTES = 64 << 20
"""A layer's packed copy is cached while its expert weights (w13 + w2) take at most this many bytes (glm4_moe
test model: 3 MiB per layer). Above it a cached copy would double the experts' memory, which model sizing does
not count: ``auto`` then keeps the torch strategies and a forced ``fused_cpu`` packs per call."""


TORCH_LEVELS = frozenset({"avx512_bf16"})
"""Routes at which ``auto`` keeps the torch strategies: the gemm route at avx512_bf16, where torch's bf16 GEMMs run
in oneDNN's AVX512-BF16 kernels and ours in MKL's (``bf16_gemm.h``: torch's cpublas::gemm is not exported; MKL
reached 62-81 GFLOP/s there against oneDNN's ~200 at [1024, 256] x [256, 256]). Measured on the EPYC Zen 4, 1 thread
(the other core shared), glm4_moe's layer (E=16, H=256, I=128, top-4, bf16), ms, sorted / grouped / fused_cpu:

* avx512_bf16: T=16 1.65 / 0.48 / 0.50, T=64 1.49 / 0.85 / 0.90, T=128 2.01 / 1.20 / 1.64, T=256 2.87 / 2.32 /
  3.33, T=1024 7.26 / 8.53 / 14.7, T=4096 29.7 / 40.0 / 71.5: torch's strategies;
* avx512 (oneDNN held to AVX512_CORE: bf16 emulated): T=16 2.12 / 1.16 / 0.70, T=64 3.38 / 3.19 / 1.05, T=256
  12.2 / 10.5 / 3.36, T=1024 37.1 / 60.3 / 24.5, T=4096 231 / 265 / 100: the kernel;
* avx2 (torch, MKL and oneDNN held to AVX2): T=64 4.46 / 5.62 / 1.10, T=256 17.2 / 20.5 / 4.20, T=1024 75.6 / 90.7
  / 15.4, T=4096 296 / 316 / 60.1: the kernel.
"""


def kernel(level: str | None = None) -> cpu_ext.Kernel | None:
    """The compiled extension for ``level`` (default: the process's, ``cpu_ext.isa()``), or None (a generic CPU;
    no compiler or a failed build: one WARNING)."""
    return _kernel(level or cpu_ext.isa())


@functools.cache
def _kernel(level: str) -> cpu_ext.Kernel | None:
    if level == cpu_ext.GENERIC:
        return None
    return cpu_ext.build_routed("fused MoE", "pdserve_moe_cpu", SOURCE,
                                "bf16 MoE prefill runs the torch strategies (sorted/grouped)", level,
                                lambda k: k.have_gemm())


def route(level: str | None = None) -> str:
    """The GEMM route ``fused_moe`` takes at ``level`` (the kernel built): ``amx`` (brgemm) or the level itself
    (cpublas-like gemm; ``avx512_bf16`` on an AMX CPU whose torch cannot pack bf16)."""
    level = level or cpu_ext.isa()
    if level != "amx":
        return level
    return "amx" if kernel(level).could_pack() else "avx512_bf16"


def path(level: str | None = None) -> str:
    """What ``auto`` runs bf16 MoE prefill in at ``level``: the kernel's ``route``, or ``torch`` (not built, or a
    route in ``TORCH_LEVELS``; ``fused_cpu`` by name still runs the kernel there)."""
    if kernel(level) is None:
        return "torch"
    r = route(level)
    return "torch" if r in TORCH_LEVELS else r


def available(level: str | None = None) -> bool:
    """``auto`` may run the kernel at ``level``: it built and was measured faster there (``TORCH_LEVELS``)."""
    return path(level) != "torch"


def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The kernel runs these weights: CPU bf16, even hidden and intermediate sizes (VNNI pairs along K)."""
    H, I = w2.shape[1], w2.shape[2]
    return (w13.device.type == "cpu" and w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16
            and H % 2 == 0 and I % 2 == 0)


def cacheable(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return w13.numel() * w13.element_size() + w2.numel() * w2.element_size() <= PACK_CACHE_MAX_BYTES


class PackedExperts(NamedTuple):
    """A layer's expert weights as the kernel's route reads them, and what they were packed from."""
    w13: torch.Tensor
    w2: torch.Tensor
    source: tuple[int, int, int, int]
    """(data_ptr, _version) of w13 and w2 when packed: a changed weight repacks."""
    level: str
    """The ISA level packed for: at ``amx`` (``brgemm``) the VNNI tiles, else the weights themselves."""

    @property
    def brgemm(self) -> bool:
        return route(self.level) == "amx"


def _source(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, int]:
    return (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version)


def pack(w13: torch.Tensor, w2: torch.Tensor, level: str | None = None) -> PackedExperts:
    """Pack ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (bf16) for ``fused_moe`` at ``level`` (default: the
    process's)."""
    if not supports(w13, w2):
        raise ValueError(f"fused_cpu needs CPU bf16 experts with even hidden/intermediate sizes; got w13 "
                         f"{tuple(w13.shape)} {w13.dtype} on {w13.device}, w2 {tuple(w2.shape)}")
    level = level or cpu_ext.isa()
    if route(level) != "amx":  # the gemm route reads the weights as stored
        return PackedExperts(w13.detach().contiguous(), w2.detach().contiguous(), _source(w13, w2), level)
    k = kernel(level)
    with torch.no_grad():
        return PackedExperts(k.pack_vnni(w13.contiguous(), TILE_GATE_UP, True),
                             k.pack_vnni(w2.contiguous(), TILE_DOWN, False), _source(w13, w2), level)


def fresh(packed: PackedExperts | None, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return packed is not None and packed.source == _source(w13, w2)


def fused_moe(x: torch.Tensor, packed: PackedExperts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` bf16, routing ``ids [T, K]`` / ``weights [T, K]`` -> ``[T, H]`` bf16: the routing-weighted sum
    of each token's experts' ``w2 (silu(gate x) * up x)``."""
    chunk = max(CHUNK_MIN_TOKENS, CHUNK_BYTES // (2 * ids.shape[1] * x.shape[1]))
    with record_function("moe_fused_cpu"):  # pybind calls are invisible to torch's profiler otherwise
        return kernel(packed.level).fused_moe(x.contiguous(), packed.w13, packed.w2, ids.contiguous(),
                                              weights.float().contiguous(), TILE_GATE_UP, TILE_DOWN, BLOCK_ROWS,
                                              chunk, packed.brgemm)
