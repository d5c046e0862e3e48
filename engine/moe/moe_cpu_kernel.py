"""The fused bf16 CPU MoE kernel (``csrc/moe_cpu.cpp``, AMX brgemm on VNNI-packed weights): the ``fused_cpu``
strategy of ``engine.moe.experts``. Built by ``engine.cpu_ext`` at first use on CPUs with AMX, cached, or one
loud WARNING (no compiler, failed build): then ``available()`` is False and ``auto`` runs the torch strategies.

Weights are packed once per layer (``PackedExperts``: a second copy of the layer's expert weights, the same
number of bytes) and kept while the layer's experts hold at most ``PACK_CACHE_MAX_BYTES``; larger layers pack
per call (only by name: ``auto`` does not pick the kernel for them).
"""
from __future__ import annotations

import functools
import os
from types import ModuleType
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


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (no AMX: silently; no compiler or a failed build: one WARNING)."""
    if not cpu_ext.has_amx():
        return None
    return cpu_ext.build("pdserve_moe_cpu", SOURCE, "bf16 MoE prefill runs the torch strategies (sorted/grouped)")


def available() -> bool:
    return kernel() is not None


def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The kernel runs these weights: CPU bf16, even hidden and intermediate sizes (VNNI pairs along K)."""
    H, I = w2.shape[1], w2.shape[2]
    return (w13.device.type == "cpu" and w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16
            and H % 2 == 0 and I % 2 == 0)


def cacheable(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return w13.numel() * w13.element_size() + w2.numel() * w2.element_size() <= PACK_CACHE_MAX_BYTES


class PackedExperts(NamedTuple):
    """A layer's expert weights in brgemm's VNNI tiles, and what they were packed from."""
    w13: torch.Tensor
    w2: torch.Tensor
    source: tuple[int, int, int, int]
    """(data_ptr, _version) of w13 and w2 when packed: a changed weight repacks."""


def _source(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, int]:
    return (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version)


def pack(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """Pack ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (bf16) for ``fused_moe``."""
    if not supports(w13, w2):
        raise ValueError(f"fused_cpu needs CPU bf16 experts with even hidden/intermediate sizes; got w13 "
                         f"{tuple(w13.shape)} {w13.dtype} on {w13.device}, w2 {tuple(w2.shape)}")
    k = kernel()
    with torch.no_grad():
        return PackedExperts(k.pack_vnni(w13.contiguous(), TILE_GATE_UP, True),
                             k.pack_vnni(w2.contiguous(), TILE_DOWN, False), _source(w13, w2))


def fresh(packed: PackedExperts | None, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return packed is not None and packed.source == _source(w13, w2)


def fused_moe(x: torch.Tensor, packed: PackedExperts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` bf16, routing ``ids [T, K]`` / ``weights [T, K]`` -> ``[T, H]`` bf16: the routing-weighted sum
    of each token's experts' ``w2 (silu(gate x) * up x)``."""
    chunk = max(CHUNK_MIN_TOKENS, CHUNK_BYTES // (2 * ids.shape[1] * x.shape[1]))
    with record_function("moe_fused_cpu"):  # pybind calls are invisible to torch's profiler otherwise
        return kernel().fused_moe(x.contiguous(), packed.w13, packed.w2, ids.contiguous(),
                                  weights.float().contiguous(), TILE_GATE_UP, TILE_DOWN, BLOCK_ROWS, chunk)
