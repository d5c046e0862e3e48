"""The Triton grouped MoE GEMM over MXFP4 weights (``triton`` strategy of MXRoutedExperts).

Pairs sorted by expert are cut into blocks of BLOCK_M pairs of one expert (vLLM's ``moe_align_block_size``
idea, without padding the activations: rows past a group's end are masked). Program (b, n) computes
``y[pairs of block b, n-tile] = x[rows] @ W[e]^T`` over K in BLOCK_K steps: it loads the packed bytes
[BLOCK_N, BLOCK_K/2] and their E8M0 scales, decodes both nibbles arithmetically (E2M1: sign, 2 exponent bits,
1 mantissa bit; OCP MX v1.0 section 5.3.3) times 2^(s-127), and multiplies the even and the odd columns of x
by the low and the high nibbles (``tl.dot`` twice), so no interleave is needed. fp32 activations use
IEEE-precision dots (no TF32), bf16/fp16 ones the dtype's tensor-core dot (MXFP4 values are exact in both).
Under the interpreter bf16/fp16 tiles are widened to fp32 before an IEEE dot: triton 3.9's interpreter
returns garbage for ``tl.dot`` on bf16 operands (measured: a 16x16 bf16 product off by 2.2e10 while the
same loads widened to fp32 round-trip exactly), and the widened dot is the same math (bf16 x bf16 products
are exact in fp32, the GPU's bf16 dot accumulates in fp32), up to summation order.
Each output is one dot over K in a fixed tile order whatever the number of pairs: batch-invariant.

Runs on ``cuda`` tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, numpy;
correctness tests only). Without Triton installed ``can_run`` is False and ``auto`` never picks it.
A scale byte 0 (2^-127) is an fp32 subnormal that GPU kernels may flush to zero: such blocks decode to 0.
"""
from __future__ import annotations

import os

import torch

from engine.moe.mx_fused import combine, pair_groups
from engine.moe.router import Routing
from engine.quant.mx import MXSpec

try:  # optional dependency (the ``test`` extra installs it; CUDA torch wheels ship it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on boxes without triton
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
"""Tile: pairs, output rows, reduced elements (BLOCK_K a multiple of the MX block 32)."""
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def can_run(device: torch.device, dtype: torch.dtype, spec: MXSpec) -> bool:
    """Triton installed, a ``cuda`` device (or the interpreter), MXFP4 with 32-element blocks."""
    return (triton is not None and (device.type == "cuda" or interpreting()) and spec.fmt.bits == 4
            and spec.block_size == 32 and dtype in TRITON_DTYPES)


if triton is not None:
    @triton.jit
    def _fp4_value(c):
        """E2M1 code (int32, 0..15) -> fp32 value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
        e = (c >> 1) & 3
        m = (c & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where((c & 8) != 0, -mag, mag)

    @triton.jit
    def _mxfp4_moe_kernel(x_ptr, row_ptr, y_ptr, codes_ptr, scales_ptr, blk_expert_ptr, blk_start_ptr,
                          blk_end_ptr, N, K, stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_ym,
                          HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(blk_expert_ptr + pid_b).to(tl.int64)
        p0 = tl.load(blk_start_ptr + pid_b)
        p1 = tl.load(blk_end_ptr + pid_b)
        offs_m = p0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < p1
        if HAS_ROWS:
            rows = tl.load(row_ptr + offs_m, mask=m_mask, other=0)
        else:
            rows = offs_m
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_j = tl.arange(0, BLOCK_K // 2)  # packed byte within the K tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + 2 * offs_j  # the even element of each byte
            k_mask = kk < K
            xm = m_mask[:, None] & k_mask[None, :]
            x_base = x_ptr + rows[:, None] * stride_xm + kk[None, :]
            x_even = tl.load(x_base, mask=xm, other=0.0)  # [BLOCK_M, BLOCK_K/2]
            x_odd = tl.load(x_base + 1, mask=xm, other=0.0)
            wm = n_mask[:, None] & k_mask[None, :]
            b = tl.load(codes_ptr + e * stride_ce + offs_n[:, None] * stride_cn + (kk // 2)[None, :], mask=wm,
                        other=0).to(tl.int32)  # [BLOCK_N, BLOCK_K/2]
            s = tl.load(scales_ptr + e * stride_se + offs_n[:, None] * stride_sn + (kk // 32)[None, :], mask=wm,
                        other=127).to(tl.int32)
            scale = tl.where(s == 255, float("nan"), tl.exp2((s - 127).to(tl.float32)))
            w_lo = _fp4_value(b & 15) * scale
            w_hi = _fp4_value(b >> 4) * scale
            if IEEE:  # fp32 dots (exact products of bf16/fp16 inputs too)
                x_even = x_even.to(tl.float32)
                x_odd = x_odd.to(tl.float32)
                acc += tl.dot(x_even, tl.trans(w_lo), input_precision="ieee")
                acc += tl.dot(x_odd, tl.trans(w_hi), input_precision="ieee")
            else:  # tensor-core dots in the activations' dtype; MXFP4 values are exact in bf16 / fp16
                acc += tl.dot(x_even, tl.trans(w_lo.to(x_even.dtype)))
                acc += tl.dot(x_odd, tl.trans(w_hi.to(x_odd.dtype)))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def grouped_gemm(x: torch.Tensor, row_index: torch.Tensor | None, experts: torch.Tensor, starts: torch.Tensor,
                 codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``y[p] = W[experts[g]] @ x[row_index[p]]`` for the pairs of group g (``starts`` as in
    ``mx_fused.PairGroups``); x [M, K] fp32/bf16/fp16, codes [E, N, K/2] MXFP4, scales [E, N, K/32] -> y [P, N]
    fp32."""
    x = x.contiguous()
    N, K = codes.shape[1], x.shape[1]
    counts = starts[1:] - starts[:-1]
    nblk = (counts + BLOCK_M - 1) // BLOCK_M  # [G]
    blk_group = torch.repeat_interleave(torch.arange(experts.numel(), device=x.device), nblk)
    first = torch.cumsum(nblk, 0) - nblk
    blk_start = starts[:-1][blk_group] + (torch.arange(blk_group.numel(), device=x.device) - first[blk_group]) * BLOCK_M
    blk_end = starts[1:][blk_group]
    P = int(starts[-1])
    y = torch.empty(P, N, dtype=torch.float32, device=x.device)
    if blk_group.numel() == 0:
        return y
    rows = row_index if row_index is not None else starts  # unused when HAS_ROWS is False
    grid = (blk_group.numel(), triton.cdiv(N, BLOCK_N))
    _mxfp4_moe_kernel[grid](x, rows, y, codes, scales, experts[blk_group].contiguous(), blk_start.contiguous(),
                            blk_end.contiguous(), N, K, x.stride(0), codes.stride(0), codes.stride(1),
                            scales.stride(0), scales.stride(1), y.stride(0), HAS_ROWS=row_index is not None,
                            IEEE=x.dtype == torch.float32 or interpreting(), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def triton_moe(m, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The ``triton`` strategy: W13, SwiGLU, W2 and the top-k combine, GEMMs from the MXFP4 codes."""
    g = pair_groups(routing, m.num_experts)
    h = grouped_gemm(m.qdq_act(x), g.tok, g.experts, g.starts, m.w13_codes, m.w13_scales).to(x.dtype)  # [P, 2I]
    I = m.inter
    a = m.qdq_act(torch.nn.functional.silu(h[:, :I]) * h[:, I:])
    y = grouped_gemm(a, None, g.experts, g.starts, m.w2_codes, m.w2_scales).to(x.dtype)  # [P, H]
    return combine(y, g, routing)
