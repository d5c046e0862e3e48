"""Routed experts and their execution strategies.

Weights are stacked per layer: ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``.
An expert computes ``w2 @ (silu(gate x) * (up x))``; the layer output is the routing-weighted sum
over each token's top-k experts.

Strategies (registered by name in ``MOE_IMPLS``; all give the same result up to float rounding):

* ``sorted``: sort (token, expert) pairs by expert, one GEMM per expert that has tokens. Best for
  prefill, where each expert sees many tokens.
* ``grouped``: scatter the sorted pairs into a padded ``[E, max_count, H]`` buffer and run the whole
  layer as two batched GEMMs. One kernel instead of E small ones (small GEMMs run far below peak on
  CPU); used when the padding stays under ``GROUPED_MAX_PAD`` times the real work and the busiest expert
  has at most ``GROUPED_MAX_COUNT`` rows.
* ``gather``: gather each pair's expert weights and run one GEMV per pair (``pair_gemv``): no sort,
  no per-expert Python loop, but a weight copy per pair. ``auto`` picks it for a few tokens because it is
  batch-invariant (one GEMV per pair whatever T is): a 1-token decode and a 6-token speculative
  verify then round identically, which lossless greedy speculation needs (a 1-ulp difference can
  flip DSA's hard top-k).
* ``fused_cpu``: bf16 on CPUs (``engine.moe.moe_cpu_kernel``, a C++ kernel): per block of one expert's pairs,
  AMX brgemm on prepacked VNNI weights (ISA level amx) or a bf16 GEMM on the weights as stored (below it), with
  silu * up and the routing weight fused, then one weighted sum per token; no per-expert torch ops. ``auto``
  picks it from ``FUSED_CPU_MIN_PAIRS`` pairs where it was measured faster: amx, avx512, avx2, not avx512_bf16
  (``moe_cpu_kernel.TORCH_LEVELS``).
* ``dense``: every token through every expert (two batched GEMMs over the stacked weights, no copy),
  routing weights as a dense ``[T, E]`` matrix with zeros for unselected experts. Fastest for a few
  tokens on small E, but its GEMMs round differently at different T, so only by name (``--moe-impl``).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers import cpu_gemv
from engine.moe import moe_cpu_kernel, mx_fused
from engine.moe.router import Routing
from engine.shapes import row_bucket

logger = logging.getLogger(__name__)

GATHER_MAX_PAIRS = 16
"""``auto`` runs ``gather`` up to this many (token, expert) pairs (batch-invariant decode/verify).
Measured on the default model's shape (E=8, H=I=128, top-2, fp32, 1 thread; us per layer, gather with
``pair_gemv``): T=1 gather 114 / dense 141 / sorted 184 / grouped 229; T=8 dense 271 / grouped 325 /
gather 385 / sorted 486; T=32 grouped 394 / dense 521 / sorted 591 / gather 1299."""
GROUPED_MAX_PAD = 4.0
"""``grouped`` computes E * max_count rows for T * K real ones; beyond this ratio ``sorted`` wins."""
GROUPED_MAX_COUNT = 256
"""... and ``grouped`` only while the busiest expert has at most this many rows: its batched GEMMs beat
``sorted``'s per-expert ones while they are small. Measured (2 threads, Xeon, us per layer, sorted / grouped),
glm4_moe's layer (E=16, top-4, bf16): T=8 1,261 / 432 (padding 1.5), T=128 1,732 / 645, T=512 (max count 146)
2,899 / 2,509, T=2048 (max ~600) 7,700 / 11,200; fp32 T=8 at padding 2.5 678 / 333; the default model's
(E=8, top-2, fp32) T=512 1,100 / 932."""

FUSED_CPU_MIN_PAIRS = 17
"""``auto`` runs ``fused_cpu`` (bf16, kernel built and ``moe_cpu_kernel.available`` at this ISA level, layer small
enough to keep its packed weights) from this many (token, expert) pairs: always above ``GATHER_MAX_PAIRS``, whose
batch-invariant path decode and verify keep. On AMX it wins at every larger size measured: glm4_moe's layer (E=16, H=256, I=128, top-4, bf16, Xeon with AMX,
the second core busy; ms per layer fused_cpu / grouped / sorted), 1 thread: T=5 (20 pairs) 0.14 / 0.54 / 1.36,
T=16 0.26 / 0.71 / 1.99, T=64 0.25 / 0.91 / 2.14, T=256 0.53 / 1.68 / 2.43, T=1024 2.19 / 9.01 / 5.87,
T=2048 4.24 / 20.8 / 11.7; 2 threads: T=16 0.29 / 0.51 / 1.85, T=256 0.35 / 1.11 / 2.37, T=2048 2.61 / 15.3 / 10.9."""


def moe_sorted(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    T, K = routing.ids.shape
    P = T * K
    flat = routing.ids.reshape(-1)  # [P]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // K
    # each expert's GEMMs run over row_bucket(n) rows: the rows past its own n belong to the next expert (or to
    # the zero slack at the end); their outputs land in the next expert's rows of ``ys``, which that expert
    # then overwrites, so shapes repeat with no copy
    slack = max((row_bucket(n, x.device) - n for n in counts if n), default=0)
    xs = x.new_empty(P + slack, x.shape[1])  # [P (+ slack), H] grouped by expert
    torch.index_select(x, 0, tok, out=xs[:P])
    xs[P:] = 0
    # the routing weight scales the activation (the down projection is linear): no pass over the outputs
    wts = torch.cat([routing.weights.reshape(-1)[order].to(x.dtype), x.new_zeros(slack)])[:, None]
    ys = x.new_empty(P + slack, x.shape[1])
    I = w2.shape[2]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        nb = row_bucket(n, x.device)
        h = F.linear(xs[start:start + nb], w13[e])
        a = F.silu(h[:, :I]).mul_(h[:, I:]).mul_(wts[start:start + nb])
        torch.mm(a, w2[e].t(), out=ys[start:start + nb])
        start += n
    return torch.zeros_like(x).index_add_(0, tok, ys[:P])


def _sort_pairs(routing: Routing, num_experts: int):
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return flat, order, counts


def moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    T, K = routing.ids.shape
    E, I = w13.shape[0], w2.shape[2]
    flat, order, counts = _sort_pairs(routing, E)
    expert = flat[order]  # [T*K] expert of each sorted pair
    slot = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
    tok = order // K
    buf = x.new_zeros(E, row_bucket(int(counts.max()), x.device), x.shape[1])  # [E, max_count (bucketed), H]
    buf[expert, slot] = x[tok]
    h = torch.bmm(buf, w13.transpose(1, 2))  # [E, max_count, 2I]
    y = torch.bmm(F.silu(h[..., :I]) * h[..., I:], w2.transpose(1, 2))  # [E, max_count, H]
    ys = y[expert, slot] * routing.weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, ys)


PAIR_COPY_MAX_BYTES = 4 << 20
"""Above this many bytes per expert matrix the ``gather`` path stops copying weights per pair (GLM-5's
w13 is 48 MB in bf16: 8 pairs would move ~600 MB per layer per decode step) and runs one GEMV per pair
straight from the stacked weights instead (a Python loop over <= GATHER_MAX_PAIRS pairs; on a GPU each is
one kernel). Which of the two runs depends only on the model's shapes, never on T, so decode and verify
still round alike."""


def gather_gemv(w: torch.Tensor, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w [E, R, C]`` stacked weights, ``flat [P]`` the expert of each pair, ``x [P, C]`` -> ``[P, R]``: each
    pair's expert matrix times its input, the same computation whatever P is. Small experts: a per-pair
    weight copy and ``pair_gemv``; above ``PAIR_COPY_MAX_BYTES``: one GEMV per pair, no copy."""
    if cpu_gemv.usable(x[:1], w[0]):  # our GEMV (where enabled): each pair's expert read once in place, no copy
        return torch.cat([cpu_gemv.linear(x[p:p + 1], w[e]) for p, e in enumerate(flat.tolist())])
    if w[0].numel() * w.element_size() > PAIR_COPY_MAX_BYTES:
        return torch.stack([F.linear(x[p], w[e]) for p, e in enumerate(flat.tolist())])
    return pair_gemv(w.index_select(0, flat), x)


def pair_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w [P, R, C]`` (a fresh per-pair weight copy: overwritten), ``x [P, C]`` -> ``[P, R]``, each pair's
    rows dotted with its input.

    fp32: an in-place multiply and a last-dim sum. Each output's reduction runs the same way whatever P
    is (checked bitwise for P = 1 .. 32 at the default and GLM-5 shapes), so a 1-token decode and a
    6-token verify round alike; and at these sizes it is 2.7x faster than ``bmm``, whose batched GEMVs
    reach ~1.4 GFLOP/s here (default model, T = 8: 246 vs 668 us per layer). Other dtypes keep ``bmm``
    (fp32 accumulation without rounding each product to bf16)."""
    if w.dtype == torch.float32:
        return w.mul_(x.unsqueeze(1)).sum(-1)
    return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


def moe_gather(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    T, K = routing.ids.shape
    flat = routing.ids.reshape(-1)
    I = w2.shape[2]
    h = gather_gemv(w13, flat, x.repeat_interleave(K, dim=0))  # [T*K, 2I]
    y = gather_gemv(w2, flat, F.silu(h[:, :I]) * h[:, I:])  # [T*K, H]
    y = y.view(T, K, -1) * routing.weights.unsqueeze(-1).to(y.dtype)
    return y.sum(dim=1)


def moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    T, E, I = x.shape[0], w13.shape[0], w2.shape[2]
    h = torch.matmul(x, w13.transpose(1, 2))  # [E, T, 2I]
    y = torch.bmm(F.silu(h[..., :I]) * h[..., I:], w2.transpose(1, 2))  # [E, T, H]
    coef = torch.zeros(T, E, dtype=y.dtype, device=x.device).scatter_(1, routing.ids, routing.weights.to(y.dtype))
    return torch.einsum("te,eth->th", coef, y)  # unselected experts weigh 0


def moe_gather_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``moe_gather`` as multiply-sums in fp32 that a compiled graph fuses with the weight gather: one reduction
    kernel reads each pair's expert rows in place (no per-pair weight copy, no small-M GEMM). Only inside graphs
    of models without verify steps (``DecodeGraphs.experts_in_graph``): it rounds unlike the eager paths. Eager,
    it would materialise an fp32 copy of every pair's weights."""
    T, K = routing.ids.shape
    flat = routing.ids.reshape(-1)
    I = w2.shape[2]
    xr = x.repeat_interleave(K, dim=0).float()
    h = (w13.index_select(0, flat).float() * xr.unsqueeze(1)).sum(-1).to(x.dtype)  # [T*K, 2I]
    a = (F.silu(h[:, :I]) * h[:, I:]).float()
    y = (w2.index_select(0, flat).float() * a.unsqueeze(1)).sum(-1).to(x.dtype)  # [T*K, H]
    y = y.view(T, K, -1) * routing.weights.unsqueeze(-1).to(y.dtype)
    return y.sum(dim=1)


def moe_dense_graph(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``moe_dense`` with the gate/up GEMM over all experts at once (``x`` against ``w13`` as one [E * 2I, H]
    matrix): every token through every expert, the stacked weights read once; the graphs' choice for larger
    batches of few experts (``DecodeGraphs.experts_in_graph``)."""
    T, (E, I2, H) = x.shape[0], w13.shape
    I = I2 // 2
    h = F.linear(x, w13.reshape(E * I2, H)).view(T, E, I2).transpose(0, 1)  # [E, T, 2I]
    y = torch.bmm(F.silu(h[..., :I]) * h[..., I:], w2.transpose(1, 2))  # [E, T, H]
    coef = torch.zeros(T, E, device=x.device).scatter_(1, routing.ids, routing.weights.float())
    # the weighted sum in fp32 (a fused reduction inside the graph): unselected experts weigh 0
    return (coef.t().unsqueeze(-1) * y.float()).sum(0).to(x.dtype)


def moe_fused_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing,
                  packed: moe_cpu_kernel.PackedExperts | None = None) -> torch.Tensor:
    """The fused CPU kernel on ``packed`` (``moe_cpu_kernel.pack`` of w13/w2; None: packed for this call only).
    ``ValueError`` for weights it cannot run (not CPU bf16, odd sizes)."""
    if packed is None:
        packed = moe_cpu_kernel.pack(w13, w2)
    return moe_cpu_kernel.fused_moe(x.to(torch.bfloat16), packed, routing.ids, routing.weights).to(x.dtype)


MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Routing], torch.Tensor]
MOE_IMPLS: dict[str, MoEFn] = {"sorted": moe_sorted, "grouped": moe_grouped, "gather": moe_gather,
                             "dense": moe_dense, "fused_cpu": moe_fused_cpu}


GRAPH_MOE_IMPLS: dict[str, MoEFn] = {"gather": moe_gather, "gather_fused": moe_gather_fused,
                                     "dense": moe_dense_graph, "mx_fused": mx_fused.moe_mx_fused}
"""Routed-expert strategies inside the compiled decode graphs (``FFNArgs.moe``); ``mx_fused`` takes MX weights
(``mx_fused.MXGraphWeights``) where the others take dense ones."""


MX_ONLY_IMPLS = ("mx_sorted", "mx_grouped", "mx_gather", "mx_dense", "cached_sorted", "cached_gather", "cached_dense",
                 "fused_gemv", "fused_gather", "fused_sorted", "triton")
"""Strategies of MX-quantized experts (``engine.moe.mx_experts.MX_MOE_IMPLS``): forcing one (``--moe-impl``)
applies it to the quantized layers; dense layers then choose as ``auto``."""


class RoutedExperts(nn.Module):
    """Dense-weight (bf16/fp32) routed experts. ``impl`` forces a strategy; ``auto`` picks by size."""

    def __init__(self, cfg: ModelConfig, impl: str = "auto", num_experts: int | None = None,
                 topk: int | None = None) -> None:
        """``num_experts``: experts held here (None: all of ``cfg``'s; fewer under expert parallelism),
        ``topk``: experts each input row is routed to (None: ``cfg``'s top-k; 1 under expert parallelism,
        whose rows are single (token, expert) pairs)."""
        super().__init__()
        E, H, I = num_experts or cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.topk = topk or cfg.num_experts_per_tok
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        if impl != "auto" and impl not in MOE_IMPLS and impl not in MX_ONLY_IMPLS:
            raise ValueError(f"unknown MoE impl {impl!r}; known: auto, {sorted(MOE_IMPLS)}, MX layers: "
                             f"{list(MX_ONLY_IMPLS)}")
        self.impl = impl
        self.last_impl = ""
        """Strategy the last forward ran (reported in worker metrics)."""
        self._packed: moe_cpu_kernel.PackedExperts | None = None
        """The weights in ``fused_cpu``'s VNNI tiles (a second copy, kept while ``moe_cpu_kernel.cacheable``)."""

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def gather_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13, w2) for running the gather path elsewhere (the compiled decode graphs), when ``pick`` would
        run it for decode-sized batches; None when another strategy is forced."""
        if self.impl not in ("auto", "gather") and self.impl not in MX_ONLY_IMPLS:
            return None
        self.last_impl = "gather"
        return self.w13, self.w2

    def pick(self, routing: Routing) -> str:
        if self.impl != "auto" and self.impl not in MX_ONLY_IMPLS:
            return self.impl
        if routing.ids.numel() <= GATHER_MAX_PAIRS:
            return "gather"
        if routing.ids.numel() >= FUSED_CPU_MIN_PAIRS and self.fused_cpu_ready():
            return "fused_cpu"
        counts = torch.bincount(routing.ids.reshape(-1), minlength=self.w13.shape[0])
        most = int(counts.max())
        small = most <= GROUPED_MAX_COUNT and self.w13.shape[0] * most <= GROUPED_MAX_PAD * routing.ids.numel()
        return "grouped" if small else "sorted"

    def fused_cpu_ready(self) -> bool:
        """``auto`` may run ``fused_cpu``: CPU bf16 weights the kernel supports, small enough to keep packed, and
        the kernel built (at its first use; ``engine.load`` asks while loading)."""
        return (moe_cpu_kernel.supports(self.w13, self.w2) and moe_cpu_kernel.cacheable(self.w13, self.w2)
                and moe_cpu_kernel.available())

    def packed(self) -> moe_cpu_kernel.PackedExperts | None:
        """The kept VNNI copy of the weights (packed now when missing or stale), or None when the layer is too
        large to keep one (``fused_cpu`` then packs per call)."""
        if not moe_cpu_kernel.cacheable(self.w13, self.w2):
            return None
        if not moe_cpu_kernel.fresh(self._packed, self.w13, self.w2):
            self._packed = moe_cpu_kernel.pack(self.w13, self.w2)
        return self._packed

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        name = self.pick(routing)
        self.last_impl = name
        if name == "fused_cpu":
            return moe_fused_cpu(x, self.w13, self.w2, routing, self.packed())
        return MOE_IMPLS[name](x, self.w13, self.w2, routing)
