"""GEMM row counts that repeat, on CPU.

oneDNN (bf16 / fp16) and MKL's JIT (fp32) build a kernel per new GEMM shape: ~1.7 ms per first-seen bf16
shape on the Xeon of docs/performance.md (50 GEMMs of random M in [300, 1500), 256 x 256, 2 threads: 82 ms
first-seen vs 7 ms repeated). Two places make shapes repeat:

* the routed experts' eager strategies run each expert's GEMMs over ``row_bucket(n)`` rows (padding the
  varying per-expert counts: ``engine.moe.experts``);
* the prefill worker's steps of a bf16 / fp16 model on CPU take ``bucket_floor`` tokens (its scheduler trims
  a step's last chunk and carries the rest to the next step): every dense GEMM of the step then sees a row
  count from the same small set. Prompts of random lengths in [1900, 2150) prefilled at 24.2k tok/s (warm)
  with exact lengths and 26.3k in bucketed chunks (a fixed 2048: 31k; peers' glm4_moe, bf16): each new length
  paid 20-45 ms of kernel builds. fp32 showed no such cost end to end (15.5k vs 15.8k tok/s), so its steps keep
  their lengths. The offline ``Engine`` keeps its chunks: its plain and speculative greedy runs are compared
  token for token in bf16 (tests/engine/test_spec.py), and other chunk boundaries move a near-tie there.

Other devices keep exact shapes (their GEMM libraries build nothing per shape).
"""
from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")

EXACT_ROWS = 16
"""Row counts up to this stay exact (few distinct shapes; decode-sized steps)."""
REDUCED_PRECISION = (torch.bfloat16, torch.float16)
"""Narrow float dtypes: their prefill steps are bucketed here; models in them that speculate keep their routed
experts out of the decode graphs (``engine.layers.decode_graph``)."""


def row_bucket(n: int, device: torch.device) -> int:
    """``n`` rows rounded up so that shapes repeat: on CPU one of 8 sizes per octave above ``EXACT_ROWS`` (at most
    12.5% more rows), elsewhere ``n``."""
    if device.type != "cpu" or n <= EXACT_ROWS:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def bucket_floor(n: int) -> int:
    """The largest CPU row bucket <= ``n`` (``row_bucket(m) == m``; at least 7/8 of ``n`` above ``EXACT_ROWS``)."""
    if n <= EXACT_ROWS:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return n // step * step


def buckets_steps(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill steps of a model of ``dtype`` on ``device`` take ``bucket_floor`` tokens."""
    return device.type == "cpu" and dtype in REDUCED_PRECISION


def bucket_chunks(chunks: list[tuple[T, int, int]]) -> list[tuple[T, int, int]]:
    """A step's ``(request, start, end)`` chunks trimmed from the end until their total is a row bucket
    (``bucket_floor``: at most 1/8 fewer tokens): the step's GEMMs then reuse their kernels. A chunk cut to nothing
    waits for the next step; the first chunk always keeps a token."""
    chunks = list(chunks)
    while chunks:
        total = sum(e - s for _, s, e in chunks)
        excess = total - bucket_floor(total)
        if excess == 0:
            break
        req, s, e = chunks[-1]
        if e - s > excess:
            chunks[-1] = (req, s, e - excess)
            break
        chunks.pop()
    return chunks
