"""GEMM row counts that repeat, on CPU.

oneDNN (bf16 / fp16) and MKL's JIT (fp32) build a kernel per new GEMM shape: ~1.7 ms per first-seen bf16
shape on the Xeon of docs/performance.md (50 GEMMs of random M in [300, 1500), 256 x 256, 2 threads: 82 ms
first-seen vs 7 ms repeated). Two places make shapes repeat:

* the routed experts' eager strategies run each expert's GEMMs over ``row_bucket(n)`` rows (padding the
  varying per-expert counts: ``engine.moe.experts``);
* prefill steps of a bf16 / fp16 model on CPU take ``bucket_floor`` tokens (``Engine.prefill``, the prefill
  worker's scheduler): every dense GEMM of the step then sees a row count from the same small set, the
  leftover tokens go in the next step. Prompts of random lengths around 2k prefilled at 21.8k tok/s where a
  fixed 2048 ran at 31.3k (peers' glm4_moe, bf16): each new length paid 20-45 ms of kernel builds. fp32 showed
  no such cost end to end (15.5k vs 15.8k tok/s), so its steps keep their lengths.

Other devices keep exact shapes (their GEMM libraries build nothing per shape).
"""
from __future__ import annotations

import torch

EXACT_ROWS = 16
"""Row counts up to this stay exact (few distinct shapes; decode-sized steps)."""
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


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
