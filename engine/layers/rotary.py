"""Rotary position embeddings, both layouts GLM uses.

* ``interleaved`` (GLM-5 MLA and its DSA indexer): pairs ``(x0, x1), (x2, x3), ...`` rotate together;
  the output is laid out ``[rotated evens, rotated odds]`` exactly as transformers'
  ``apply_rotary_pos_emb_interleave`` (queries and keys are permuted alike, so dot products are unchanged).
* ``half`` (GLM-4.5 GQA): ``rotate_half`` on the first ``rotary_dim`` dims, the rest pass through.
"""
from __future__ import annotations

import torch

from engine.layers import cpu_tokenwise


class RotaryTable:
    """cos/sin of ``position * inv_freq`` in fp32, cached up to the longest position seen."""

    def __init__(self, rotary_dim: int, theta: float, device: torch.device) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq = self.inv_freq.to(device)
        self._cos = torch.empty(0, rotary_dim // 2, device=device)
        self._sin = torch.empty(0, rotary_dim // 2, device=device)
        self._last: tuple | None = None
        """(positions, dtype, cos, sin) of the last lookup: every layer of a forward asks for the same
        positions tensor (``ForwardBatch.positions``, never written in place), so the gather runs once
        per forward, not once per layer."""

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 4096)
        pos = torch.arange(n, dtype=torch.float, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, rotary_dim / 2]
        self._cos, self._sin = freqs.cos(), freqs.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin ``[T, rotary_dim / 2]`` in ``dtype`` (cast like transformers does). Callers must not
        write to them (they are shared by the layers of one forward)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._grow(need)
        cos = self._cos.index_select(0, positions).to(dtype)
        sin = self._sin.index_select(0, positions).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin


_CIS: tuple | None = None
"""(cos, sin, cos + i sin) of the last complex rotation: the layers of a forward share one cos/sin pair
(``RotaryTable.lookup``), so the complex factors are built once per forward."""


def _cis(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    global _CIS
    memo = _CIS
    if memo is not None and memo[0] is cos and memo[1] is sin:
        return memo[2]
    cis = torch.complex(cos, sin)
    _CIS = (cos, sin, cis)
    return cis


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, ..., r]``; cos/sin ``[T, r/2]``. Output ``[rotated evens, rotated odds]``.

    fp32/fp64: each (even, odd) pair is one complex number times ``cos + i sin``, bitwise what the real
    formula below gives (the same two rounded products and one rounded sum per output) in 5 ops instead
    of 11 (24 -> 10 us per call; 12 calls per decode step of the default model)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    if (x.dtype in (torch.float32, torch.float64) and x.stride(-1) == 1 and cos.dtype == x.dtype
            and not torch.compiler.is_compiling()):  # inductor fuses the real formula into one loop
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2))) * _cis(cos, sin).view(shape)
        return torch.view_as_real(z).transpose(-1, -2).flatten(-2)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, head_dim]``; rotate-half on the first ``2 * cos.shape[-1]`` dims."""
    if cos.dtype == sin.dtype == x.dtype and cpu_tokenwise.usable(x, 3) and x.stride(1) == x.shape[2]:
        return cpu_tokenwise.kernel().rope_half(x, cos, sin)  # eager bf16 on a CPU: one pass, the same rounding
    half = cos.shape[-1]
    rot = 2 * half
    c = torch.cat([cos, cos], dim=-1)[:, None, :]
    s = torch.cat([sin, sin], dim=-1)[:, None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * c + rotated * s, xp], dim=-1)
