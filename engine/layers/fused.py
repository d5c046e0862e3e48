"""Several projections of the same input as one GEMM.

Small models are bound by per-op overhead (a decode step of the default model is ~650 torch ops), so
projections that read the same activation run as one ``F.linear`` over their concatenated weights (a few rows:
our GEMV kernel where enabled, ``engine.layers.cpu_gemv``).
The checkpoint layout is untouched: the concatenation is derived from the modules' own parameters and
rebuilt whenever one is replaced or written in place (loading, quantization, tests poking weights).
"""
from __future__ import annotations

import torch

from engine.layers.cpu_gemv import linear


class FusedProjection:
    """``__call__(x, [(weight, bias), ...])`` -> one output per (weight, bias), from one GEMM.

    Weights must share dtype and device (callers fuse only those that do)."""

    __slots__ = ("_key", "_weight", "_bias", "_sizes")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight = self._bias = None
        self._sizes: list[int] = []

    def __call__(self, x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        if len(parts) == 1:
            return [linear(x, parts[0][0], parts[0][1])]
        w, b, sizes = self.weight(parts)
        return list(linear(x, w, b).split(sizes, dim=-1))

    def weight(self, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
               ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """-> the concatenated weight, bias (or None) and the output sizes of ``parts`` (rebuilt if stale)."""
        key = tuple((w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))
                    for w, b in parts)
        if key != self._key:
            ws = [w.detach() for w, _ in parts]
            self._weight = torch.cat(ws)
            self._bias = None
            if any(b is not None for _, b in parts):
                self._bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, (_, b)
                                        in zip(ws, parts)])
            self._sizes = [w.shape[0] for w in ws]
            self._key = key
        return self._weight, self._bias, self._sizes
