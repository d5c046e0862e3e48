"""Attention in our own CPU kernels.

* Prompts: causal bf16 prefill attention (``csrc/prefill_attention.cpp``): AMX brgemm for the two GEMMs, AVX-512
  for the online softmax, keys past the diagonal never touched. On CPUs with AMX (``usable``); elsewhere torch's
  ``scaled_dot_product_attention``.
* Decode and verify steps: paged attention (``csrc/decode_attention.cpp``, the op
  ``torch.ops.pdserve_cpu.decode_attention``, usable inside the compiled decode graphs): each query reads its
  request's keys straight from the pool by slot, no gathered copy of the context, fp32 online softmax over fixed
  key blocks, so a decode step and a verify step round alike (``paged_attention``). Any CPU with a compiler.

Where a kernel did not build (one WARNING from ``engine.cpu_ext``) torch's ops run as before.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from engine import cpu_ext

MIN_TOKENS = 64
"""Prompts (chunks) shorter than this keep torch's SDPA: the kernel's packing and scheduling cost more than they
save. Measured on the Xeon (AMX, 1 thread, 4 heads / 2 KV heads, head_dim 64, us, torch / ours): 17 tokens 29 / 34,
32: 31 / 36, 64: 47 / 44, 128: 95 / 77, 256: 252 / 161, 512: 904 / 483, 1024: 2,865 / 1,559."""

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "prefill_attention.cpp")
DECODE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "decode_attention.cpp")
LOG2E = 1.4426950408889634


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension where this CPU has AMX and it built, else None."""
    if not cpu_ext.has_amx():
        return None
    k = cpu_ext.build("pdserve_prefill_attention", SOURCE, "prefill attention runs torch's SDPA")
    return k if k is not None and k.supported() else None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel computes this prompt's attention: bf16 on a CPU with AMX, at least ``MIN_TOKENS`` queries, head
    dims it takes."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[0] >= MIN_TOKENS
            and q.shape[-1] % 2 == 0 and v.shape[-1] % 16 == 0 and kernel() is not None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[T, H, D]``, k ``[S, Hk, D]``, v ``[S, Hk, Dv]`` (bf16, last two dims contiguous; Hk divides H)
    -> ``[T, H, Dv]``: query i at position S - T + i attends to keys 0 .. S - T + i."""
    return kernel().prefill_attention(q, k, v, scale)


@functools.cache
def decode_kernel() -> bool:
    """Whether ``torch.ops.pdserve_cpu.decode_attention`` is registered (built and loaded here, with its fake
    implementation for torch.compile's tracing)."""
    if cpu_ext.build("pdserve_decode_attention", DECODE_SOURCE,
                     "decode / verify attention gathers the context and runs torch's ops") is None:
        return False

    @torch.library.register_fake("pdserve_cpu::decode_attention")
    def _(q, k, v, slots, mask):
        return q.new_empty((*q.shape[:3], v.shape[-1]))
    return True


def paged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q ``[B, Tq, H, D]`` over the flat pool buffers k ``[slots, Hk, D]`` / v ``[slots, Hk, Dv]`` at request b's
    ``kv_slots[b]`` (``[B, S]``), ``mask`` ``[B, Tq, S]`` (True: attend; None: every query sees all S keys)
    -> ``[B, Tq, H, Dv]`` in q's dtype (computed in fp32)."""
    o = torch.ops.pdserve_cpu.decode_attention((q.float() * (scale * LOG2E)).contiguous(), k_buf, v_buf,
                                               kv_slots.contiguous(), None if mask is None else mask.contiguous())
    return o.to(q.dtype)
