"""Fused MX strategies: routed-expert GEMMs computed from the packed codes, no dense copy of a layer.

Same ``fn(module, x, routing)`` contract as the strategies in ``engine.moe.mx_experts`` (which registers
these in ``MX_MOE_IMPLS``):

* ``fused_gather``  the CPU kernel (``engine.moe.mx_cpu_kernel``): each active expert's weight rows are
                    decoded into a per-thread tile of 4 rows and dotted with every pair routed to it, for
                    W13 then W2. Weight bytes read per step are the MX bytes (4.25 bits a weight for MXFP4).
                    Batch-invariant: each output is one fp32 dot in a fixed order, whatever T is, so decode
                    and speculative verify round alike (``auto`` runs it for decode when the kernel builds).
* ``fused_gemv``    decode shapes (a few tokens per expert), MXFP4: the whole layer in one kernel call
                    (``mx_cpu_kernel.moe_fp4``): the pairs grouped in C++, each selected expert's codes dotted
                    in registers (never decoded into a tile; read once per call for up to 4 of its tokens), and the
                    same ATen ops as ``fused_gather`` between the GEMMs and after: bit for bit ``fused_gather``'s
                    result at the same ISA level (so ``auto`` may switch between them at any batch size and a
                    decode and a verify still round alike), without its ~20 Python-level ops per layer.
* ``fused_sorted``  prefill shapes: per active expert, the kernel dequantizes it into a transient one-expert
                    buffer (2I x H; freed after the call) and the library GEMM runs on it. Never more than
                    one expert dense.
* ``triton``        the Triton grouped GEMM over MXFP4 (``engine.moe.mx_triton``): ``cuda`` devices, or
                    CPU tensors under ``TRITON_INTERPRET=1`` (tests).

Activations: fp32 and bf16 (bf16 inputs are widened to fp32 for the kernel, whose fp32 outputs are rounded
back to bf16 after each GEMM, as a bf16 GEMM rounds its output). Other dtypes are not offered (``can_run``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from common.env import mx_gemv_enabled
from engine.moe import mx_cpu_kernel
from engine.moe.router import Routing
from engine.quant.mx import get_mx_format

FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""Activation dtypes the fused strategies take."""


class PairGroups(NamedTuple):
    """(token, expert) pairs sorted by expert (stable), as the kernels take them."""

    order: torch.Tensor
    """[P] index t*K + k of each sorted pair in ``routing.ids.reshape(-1)``."""
    tok: torch.Tensor
    """[P] source token of each sorted pair."""
    experts: torch.Tensor
    """[G] the active experts, increasing."""
    starts: torch.Tensor
    """[G + 1] int64: group g holds sorted pairs starts[g] .. starts[g+1]-1."""


def pair_groups(routing: Routing, num_experts: int) -> PairGroups:
    K = routing.ids.shape[1]
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    experts = torch.nonzero(counts).flatten()
    starts = torch.zeros(experts.numel() + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(counts[experts], 0, out=starts[1:])
    return PairGroups(order, order // K, experts, starts)


def combine(ys_sorted: torch.Tensor, groups: PairGroups, routing: Routing) -> torch.Tensor:
    """Sorted pair outputs [P, H] -> the routing-weighted sum per token [T, H], summed over k in top-k order
    (``mx_gather``'s combine, so the two round alike)."""
    T, K = routing.ids.shape
    ys = torch.empty_like(ys_sorted)
    ys[groups.order] = ys_sorted
    return (ys.view(T, K, -1) * routing.weights.unsqueeze(-1).to(ys.dtype)).sum(dim=1)


def swiglu(h: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``h [..., 2I]`` (gate then up) -> ``qdq(silu(gate) * up)`` ``[..., I]``: every MX strategy's activation."""
    inter = h.shape[-1] // 2
    return qdq(F.silu(h[..., :inter]) * h[..., inter:])


def _swiglu(m, h: torch.Tensor) -> torch.Tensor:
    return swiglu(h, m.qdq_act)


_gemv_enabled: list[bool] = [mx_gemv_enabled()]


def enable_gemv(on: bool = True) -> None:
    """Let ``auto`` pick ``fused_gemv`` (``True``, the default; ``$PDSERVE_MX_GEMV=0`` at start-up: not) or not
    (benchmarks comparing it with ``fused_gather``). Forcing it by name runs it either way."""
    _gemv_enabled[0] = on


def gemv_ok(fmt: str, block_size: int, qdq_free: bool) -> bool:
    """Whether ``fused_gemv`` computes this layer: MXFP4 in blocks of a multiple of 32, no activation quantization."""
    return fmt == "mxfp4" and block_size % 32 == 0 and qdq_free


def gemv_enabled() -> bool:
    return _gemv_enabled[0]


def fused_gemv(m, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    if not gemv_ok(m.spec.fmt.name, m.spec.block_size, m.act_spec is None):  # forced on a layer it cannot compute
        return fused_gather(m, x, routing)  # the same bits
    return mx_cpu_kernel.moe_fp4(x, routing.ids, routing.weights, m.w13_codes, m.w13_scales, m.w2_codes, m.w2_scales,
                                 m.spec.block_size)


def fused_gather(m, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    return _gather(x, routing, MXGraphWeights(m.w13_codes, m.w13_scales, m.spec.fmt.name, m.spec.block_size),
                   MXGraphWeights(m.w2_codes, m.w2_scales, m.spec.fmt.name, m.spec.block_size), m.qdq_act)


class MXGraphWeights(NamedTuple):
    """One MX weight of a layer (``w13`` or ``w2``) as the compiled decode graphs take it (``FFNArgs.w13`` /
    ``w2`` with strategy ``mx_fused``): the codes, their E8M0 scales, and the format's name and block size."""

    codes: torch.Tensor
    """[E, N, packed(K)] uint8."""
    scales: torch.Tensor
    """[E, N, K / block_size] uint8."""
    fmt: str
    block_size: int


def _gather(x: torch.Tensor, routing: Routing, w13: MXGraphWeights, w2: MXGraphWeights,
            qdq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fused_gather``'s math on tensors: ``x [T, H]`` -> ``[T, H]``; ``qdq`` quantizes the GEMM inputs."""
    fmt, bs = get_mx_format(w13.fmt), w13.block_size
    g = pair_groups(routing, w13.codes.shape[0])
    h = mx_cpu_kernel.grouped_gemm(qdq(x).float(), g.tok, g.experts, g.starts, w13.codes, w13.scales, fmt,
                                   bs).to(x.dtype)  # [P, 2I]
    a = swiglu(h, qdq).float()  # [P, I], already in sorted order
    y = mx_cpu_kernel.grouped_gemm(a, None, g.experts, g.starts, w2.codes, w2.scales, fmt, bs).to(x.dtype)  # [P, H]
    return combine(y, g, routing)


def _no_qdq(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.library.custom_op("pdserve_cpu::mx_fused_gather", mutates_args=())
def mx_fused_gather_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_codes: torch.Tensor,
                       w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor, fmt: str,
                       block_size: int) -> torch.Tensor:
    """``fused_gather`` (no activation quantization) as one opaque op, so the compiled decode graphs run the MX
    kernel from the codes (its data-dependent pair grouping inside, out of the tracer's sight) and hold no dense
    copy; and, being bit for bit the kernels eager decode runs, round exactly as eager decode does. MXFP4 runs
    ``fused_gemv``'s one call (the same bits, fewer ops)."""
    if gemv_enabled() and gemv_ok(fmt, block_size, True):
        return mx_cpu_kernel.moe_fp4(x, ids, weights, w13_codes, w13_scales, w2_codes, w2_scales, block_size)
    return _gather(x, Routing(ids, weights), MXGraphWeights(w13_codes, w13_scales, fmt, block_size),
                   MXGraphWeights(w2_codes, w2_scales, fmt, block_size), _no_qdq)


@mx_fused_gather_op.register_fake
def _(x, ids, weights, w13_codes, w13_scales, w2_codes, w2_scales, fmt, block_size):
    return torch.empty_like(x)


def moe_mx_fused(x: torch.Tensor, w13: MXGraphWeights, w2: MXGraphWeights, routing: Routing) -> torch.Tensor:
    """The graphs' ``mx_fused`` strategy (``engine.moe.experts.GRAPH_MOE_IMPLS``)."""
    return mx_fused_gather_op(x, routing.ids, routing.weights, w13.codes, w13.scales, w2.codes, w2.scales, w13.fmt,
                              w13.block_size)


def fused_sorted(m, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    g = pair_groups(routing, m.num_experts)
    spec, H, I = m.spec, m.hidden, m.inter
    xs = m.qdq_act(x)[g.tok]  # [P, H] grouped by expert
    ys = torch.empty_like(xs)
    w13 = torch.empty(1, 2 * I, H, dtype=x.dtype)  # one expert at a time, reused, freed on return
    w2 = torch.empty(1, H, I, dtype=x.dtype)
    starts = g.starts.tolist()
    for i, e in enumerate(g.experts.split(1)):
        s0, s1 = starts[i], starts[i + 1]
        mx_cpu_kernel.dequant_into(m.w13_codes, m.w13_scales, e, spec.fmt, spec.block_size, w13)
        h = F.linear(xs[s0:s1], w13[0])
        mx_cpu_kernel.dequant_into(m.w2_codes, m.w2_scales, e, spec.fmt, spec.block_size, w2)
        ys[s0:s1] = F.linear(_swiglu(m, h), w2[0])
    return combine(ys, g, routing)


def cpu_fused_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the CPU fused strategies can run here (builds the kernel the first time; one WARNING if not)."""
    return device.type == "cpu" and dtype in FUSED_DTYPES and mx_cpu_kernel.available()
