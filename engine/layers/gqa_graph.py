"""GLM-4.5's GQA decoder layer for decode and verify steps, as functions of tensors and constants.

The compiled decode graphs (``engine.layers.decode_graph``) trace these for ``glm4_moe``, as they trace
``mla_tokenwise`` / ``paged_mla_attention`` for GLM-5: ``gqa_tokenwise`` (input norm, q/k/v as ONE GEMM with
their biases, per-head QK norm, partial rotate-half RoPE), ``paged_gqa_attention`` (the new tokens' K/V
written into the flat pool buffers, the context gathered by slot, grouped-query attention as two bmm) and
``layer_post`` (o_proj, residual, norm, FFN). Eager decode keeps ``GQAAttention.forward`` (prefill's SDPA
flash kernel); both compute the same values to float rounding (``tests/engine/test_decode_graph``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kvcache.pool import quantize_fp8
from engine.layers import cpu_attention
from engine.layers.norm import rms_norm
from engine.layers.rotary import apply_half

KVBuf = tuple[torch.Tensor, torch.Tensor | None]
"""A KV component inside a graph: (the flat buffer [slots, ...], None) or, for an fp8 pool, (its bytes as
uint8 [slots, ...], its fp32 scales [slots, ...]) (``decode_graph.pool_views``)."""


def kv_write(b: KVBuf, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``KVPool.write`` inside a graph: store ``x`` [n, ...] at ``slots`` [n] (fp8: quantised per row, the
    bytes and the scales written; CPU has no fp8 index_copy)."""
    buf, scale = b
    if scale is None:
        buf.index_copy_(0, slots, x.to(buf.dtype))
        return
    q, s = quantize_fp8(x)
    buf.index_copy_(0, slots, q.view(torch.uint8))
    scale.index_copy_(0, slots, s)


def kv_read(b: KVBuf, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``KVPool.read`` inside a graph: the rows at ``idx`` [n] -> [n, ...] in ``dtype`` (fp8: dequantised)."""
    buf, scale = b
    if scale is None:
        return buf.index_select(0, idx).to(dtype)
    out = buf.index_select(0, idx).view(torch.float8_e4m3fn)
    return out.to(dtype) * scale.index_select(0, idx).unsqueeze(-1).to(dtype)


class GQAArgs(NamedTuple):
    """``gqa_tokenwise``'s weights and constants (``GQAAttention.tokenwise_args``; frozen while compiled)."""
    ln_w: torch.Tensor                # input_layernorm weight
    ln_eps: float
    w_qkv: torch.Tensor               # [(H + 2 KVH) * D, hidden]: q_proj, k_proj, v_proj rows
    b_qkv: torch.Tensor | None        # their biases (attention_bias)
    qn_w: torch.Tensor | None         # per-head q_norm weight [D] (use_qk_norm), else None
    kn_w: torch.Tensor | None         # per-head k_norm weight [D]
    qk_eps: float
    H: int                            # query heads
    KVH: int                          # KV heads (divides H)
    D: int                            # head_dim


class GQAConsts(NamedTuple):
    """Constants of one ``paged_gqa_attention`` call."""
    scale: float                      # softmax scale
    paged_kernel: bool = False        # attend in ``cpu_attention.paged_attention`` (CPU pools it reads as stored)


def gqa_tokenwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: GQAArgs
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [T, hidden] the layer input -> RoPE'd q [T, H, D], RoPE'd k [T, KVH, D], v [T, KVH, D]
    (``GQAAttention.forward``'s projections; q/k/v read the normed input in one GEMM)."""
    T = x.shape[0]
    h = rms_norm(x, a.ln_w, a.ln_eps)
    q, k, v = F.linear(h, a.w_qkv, a.b_qkv).split([a.H * a.D, a.KVH * a.D, a.KVH * a.D], dim=-1)
    q, k, v = q.view(T, a.H, a.D), k.view(T, a.KVH, a.D), v.view(T, a.KVH, a.D)
    if a.qn_w is not None:
        q, k = rms_norm(q, a.qn_w, a.qk_eps), rms_norm(k, a.kn_w, a.qk_eps)
    return apply_half(q, cos, sin), apply_half(k, cos, sin), v


def paged_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bufs: tuple[KVBuf, KVBuf],
                        out_slots: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor | None, c: GQAConsts
                        ) -> torch.Tensor:
    """Write the new tokens' ``k``/``v`` into the layer's flat k / v pool buffers ``bufs`` (``KVBuf``: [slots, KVH, D]) at ``out_slots``,
    then attend: requests with equal query counts, ``kv_slots`` [B, S] (padding: slot 0), ``mask`` [B, Tq, S]
    causal + valid keys (None: one decoding request sees every key). Query head h reads KV head h // G
    (SDPA's ``enable_gqa``). Returns o [T, H, D]."""
    k_buf, v_buf = bufs
    kv_write(k_buf, out_slots, k)
    kv_write(v_buf, out_slots, v)
    B, S = kv_slots.shape
    T, H, D = q.shape
    if c.paged_kernel:  # the context read in place by slot (no gathered copy; never an fp8 pool)
        o = cpu_attention.paged_attention(q.view(B, T // B, H, D), k_buf[0], v_buf[0], kv_slots, mask, c.scale)
        return o.view(T, H, -1)
    KVH = k.shape[1]
    G, tq = H // KVH, T // B
    flat = kv_slots.reshape(-1)
    kk = kv_read(k_buf, flat, q.dtype).view(B, S, KVH, D).transpose(1, 2).reshape(B * KVH, S, D)
    vv = kv_read(v_buf, flat, q.dtype).view(B, S, KVH, D).transpose(1, 2).reshape(B * KVH, S, D)
    # [B, Tq, KVH, G, D] -> [B * KVH, G * Tq, D]: the G query heads of a KV head share its keys in one bmm
    qq = q.view(B, tq, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B * KVH, G * tq, D)
    scores = torch.bmm(qq, kk.transpose(1, 2)) * c.scale  # [B * KVH, G * Tq, S]
    if mask is not None:
        scores = scores.view(B, KVH, G, tq, S).masked_fill(~mask[:, None, None], float("-inf")).view(-1, G * tq, S)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.bmm(p, vv)  # [B * KVH, G * Tq, D]
    return o.view(B, KVH, G, tq, D).permute(0, 3, 1, 2, 4).reshape(T, H, D)
