# over 400 lines: the MX routed experts and every implementation the tuned table chooses from.
"""Routed experts with OCP MX weights (MXFP4 / MXFP6 / MXFP8) and their execution strategies.

Storage (buffers, filled by the loader from Quark-layout checkpoints; K = the reduced dim):

    w13_codes  [E, 2I, packed(H)] uint8   gate rows 0..I-1, up rows I..2I-1 (as RoutedExperts.w13)
    w13_scales [E, 2I, H/32]      uint8   E8M0
    w2_codes   [E, H, packed(I)]  uint8
    w2_scales  [E, H, I/32]       uint8

packed(K) = K/2 (fp4), 3K/4 (fp6), K (fp8); see engine.quant.mx for the bit layouts. The math is
RoutedExperts' (y = sum_k w_k * W2_e (silu(G_e x) * U_e x)) on dequantized weights. With an
activation spec (Quark's dynamic ``input_tensors``), each expert GEMM input (x, and the SwiGLU
output before W2) is quantized-dequantized per row in blocks of 32, as Quark's W4A4 emulation does.

Strategies (``MX_MOE_IMPLS``; same ``fn(module, x, routing)`` contract, same result up to float
summation order):

* ``mx_sorted``   pairs sorted by expert; per active expert: dequantize it, two GEMMs. Only one
                  expert's weights are ever dense: the memory-light path for prefill.
* ``mx_grouped``  active experts dequantized together (in chunks of <= GROUP_MAX_BYTES) and each
                  expert's tokens padded to the busiest expert's count: two batched GEMMs per chunk.
* ``mx_gather``   dequantize the distinct selected experts once, then per-pair batched GEMVs: tiny
                  batches (decode), no per-expert Python loop.
* ``mx_dense``    every token through every expert (one GEMM each side), routing weights as a dense
                  [T, E] mask: wasteful in FLOPs but branch-free; for a handful of tokens.
* ``cached_sorted`` / ``cached_gather`` / ``cached_dense``  dequantize the whole layer once into a shared, bounded
                  ``DequantCache`` (LRU over layers) and run the sorted/gather/dense math. They break the
                  memory contract of MX weights (a dense copy of every layer they touch), so they run only
                  where the user forced one by name (``--moe-impl cached_gather``): only then do the layers
                  get a cache (``engine.quant.prepare``), and without one ``can_run`` says no, whatever a
                  tuned table or the compiled graphs would prefer.
* ``fused_gemv`` / ``fused_gather`` / ``fused_sorted`` / ``triton``  GEMMs from the codes themselves
                  (engine.moe.mx_fused): for MXFP4 decode shapes the whole layer in one CPU kernel call dotting
                  the codes in registers (``fused_gemv``, bit for bit ``fused_gather``), the CPU tile kernel for decode
                  shapes, one transient dense expert at a time for prefill shapes, the
                  Triton grouped GEMM on ``cuda``. No dense copy of a layer ever exists.

``auto``: decode-sized batches (<= FALLBACK_GATHER_MAX_PAIRS pairs) run a batch-invariant strategy:
``fused_gemv`` (MXFP4) or ``fused_gather`` on CPU where the kernel builds, ``triton`` on ``cuda`` where Triton imports, else
``mx_gather``. Larger batches pick from the tuned table (engine.moe.tuned_table; nearest token-count key) for
this shape and device, or the untuned fallback with one WARNING per shape; never a ``cached_*`` strategy
(``AUTO_IMPLS``).
``last_impl`` names what ran.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe import mx_fused, mx_triton, tuned_table
from engine.moe.experts import gather_gemv
from engine.moe.router import Routing
from engine.quant.mx import MXSpec, MXTensor, dequantize_mx, packed_dim, qdq_mx, quantize_mx

logger = logging.getLogger(__name__)

GROUP_MAX_BYTES = 256 << 20
"""Most dequantized weight bytes mx_grouped holds at once."""
CACHE_FRACTION = 0.25
"""Default DequantCache budget: this fraction of the device's free memory at load time."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class DequantCache:
    """Dequantized expert weights of whole layers, least recently used evicted past ``budget_bytes``.

    One cache is shared by all MX layers of a model. A layer bigger than the whole budget is never
    cached (``fits`` is False) and its ``cached_*`` strategies are unavailable.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @staticmethod
    def default_budget(device: torch.device | str) -> int:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return int(free * CACHE_FRACTION)
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pages = 1 << 30
        return int(pages * CACHE_FRACTION)

    def fits(self, num_bytes: int) -> bool:
        return num_bytes <= self.budget_bytes

    def get(self, key: tuple, num_bytes: int, make: Callable[[], tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        while self._entries and self.used_bytes + num_bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= sum(t.numel() * t.element_size() for t in old)
        value = make()
        self._entries[key] = value
        self.used_bytes += num_bytes
        return value

    def drop(self, owner: int) -> None:
        for key in [k for k in self._entries if k[0] == owner]:
            old = self._entries.pop(key)
            self.used_bytes -= sum(t.numel() * t.element_size() for t in old)


class MXRoutedExperts(nn.Module):
    """Routed experts whose weights are MX codes + E8M0 scales; ``forward(x, routing)`` as RoutedExperts."""

    def __init__(self, num_experts: int, hidden: int, inter: int, topk: int, spec: MXSpec,
                 act_spec: MXSpec | None = None, impl: str = "auto", device: torch.device | str = "cpu",
                 cache: DequantCache | None = None) -> None:
        super().__init__()
        E, H, I, bs = num_experts, hidden, inter, spec.block_size
        for name, k in (("hidden", H), ("moe_intermediate_size", I)):
            if k % bs or packed_dim(spec.fmt, k) * 8 != k * spec.fmt.bits:
                raise ValueError(f"{spec.fmt.name} experts need {name}={k} divisible by block_size={bs}")
        if impl != "auto" and impl not in MX_MOE_IMPLS:
            raise ValueError(f"unknown MX MoE impl {impl!r}; known: auto, {sorted(MX_MOE_IMPLS)}")
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("w13_codes", torch.zeros(E, 2 * I, packed_dim(spec.fmt, H), **u8))
        self.register_buffer("w13_scales", torch.zeros(E, 2 * I, H // bs, **u8))
        self.register_buffer("w2_codes", torch.zeros(E, H, packed_dim(spec.fmt, I), **u8))
        self.register_buffer("w2_scales", torch.zeros(E, H, I // bs, **u8))
        self.spec, self.act_spec = spec, act_spec
        self.num_experts, self.hidden, self.inter, self.topk = E, H, I, topk
        self.shape = tuned_table.MoEShape(H, I, E, topk, spec.fmt.name)
        self.impl = impl
        self.cache = cache
        self.max_transient_bytes = DequantCache.default_budget(device)
        """Most dense weight bytes one forward may materialise (strategies above it are skipped)."""
        self.last_impl = ""
        """Strategy the last forward ran (reported in worker metrics)."""
        self._table: dict[int, str] | None = None
        self._table_loaded = False
        self._graph_weights: tuple | None = None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dense(cls, w13: torch.Tensor, w2: torch.Tensor, topk: int, spec: MXSpec, **kw) -> "MXRoutedExperts":
        """Quantize stacked dense weights w13 [E, 2I, H], w2 [E, H, I] (tests, benchmarks, eval)."""
        E, two_i, H = w13.shape
        m = cls(E, H, two_i // 2, topk, spec, device=w13.device, **kw)
        with torch.no_grad():
            for codes, scales, w in ((m.w13_codes, m.w13_scales, w13), (m.w2_codes, m.w2_scales, w2)):
                for e in range(E):
                    q = quantize_mx(w[e], spec.fmt, spec.scale_mode, spec.block_size)
                    codes[e].copy_(q.codes)
                    scales[e].copy_(q.scales)
        return m

    @classmethod
    def random(cls, shape: tuned_table.MoEShape, spec: MXSpec, device: torch.device | str = "cpu",
               cache: DequantCache | None = None, seed: int = 0) -> "MXRoutedExperts":
        """Random codes and scales near 2^-6 (for timing: no dense weights are ever materialised)."""
        m = cls(shape.num_experts, shape.hidden, shape.inter, shape.topk, spec, device=device, cache=cache)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for buf in (m.w13_codes, m.w2_codes):
                codes = torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8)
                if spec.fmt.bits == 8:  # no e4m3 NaN codes (S.1111.111)
                    codes = torch.where(codes & 0x7F == 0x7F, codes ^ 1, codes)
                buf.copy_(codes)
            for buf in (m.w13_scales, m.w2_scales):
                buf.copy_(torch.randint(118, 123, buf.shape, generator=gen, dtype=torch.uint8))
        return m

    # -- weights -----------------------------------------------------------------------------

    def dequant(self, which: str, experts: torch.Tensor | int | None, dtype: torch.dtype) -> torch.Tensor:
        """Dense weights of ``which`` ("w13" or "w2") for ``experts`` (an index, a 1-D index tensor
        or None = all): [2I, H] / [H, I] for an int, else [n, 2I, H] / [n, H, I]."""
        codes, scales = (self.w13_codes, self.w13_scales) if which == "w13" else (self.w2_codes, self.w2_scales)
        if experts is not None:
            codes, scales = codes[experts], scales[experts]
        shape = (*scales.shape[:-1], scales.shape[-1] * self.spec.block_size)
        mx = MXTensor(codes, scales, self.spec.fmt, torch.Size(shape), dtype, self.spec.block_size)
        return dequantize_mx(mx, dtype)

    def dense_bytes(self, dtype: torch.dtype) -> int:
        return 3 * self.num_experts * self.hidden * self.inter * _itemsize(dtype)

    def weight_bytes(self) -> int:
        """Bytes of the packed codes and scales."""
        return sum(b.numel() * b.element_size() for b in (self.w13_codes, self.w13_scales, self.w2_codes, self.w2_scales))

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-layer dense (w13, w2), from the DequantCache when there is one."""
        make = lambda: (self.dequant("w13", None, dtype), self.dequant("w2", None, dtype))  # noqa: E731
        if self.cache is None:
            return make()
        return self.cache.get((id(self), dtype, self.w13_codes.device), self.dense_bytes(dtype), make)

    def clear_cache(self) -> None:
        if self.cache is not None:
            self.cache.drop(id(self))

    def gather_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Dense (w13, w2) for running ``cached_gather`` elsewhere (the compiled decode graphs: bit for bit
        ``_gather``'s math): only where the user forced ``cached_gather`` (a dense copy, by name), with no
        activation quantization, and the whole layer fits the DequantCache. None otherwise: the MX layer then
        keeps its 4-bit contract in the graphs too."""
        if self.impl != "cached_gather" or self.act_spec is not None or not self.can_run("cached_gather", dtype):
            return None
        self.last_impl = "cached_gather"
        return self.dense_weights(dtype)

    def graph_weights(self, dtype: torch.dtype) -> tuple[mx_fused.MXGraphWeights, mx_fused.MXGraphWeights, str] | None:
        """The layer's MX weights for the compiled decode graphs' ``mx_fused`` strategy (the fused CPU kernel as
        one op inside the graph, from the codes: no dense copy), where ``auto`` would run ``fused_gather``
        eagerly: automatic choice, no activation quantization, the kernel runs here in ``dtype``. None
        otherwise (the graphs then try ``gather_weights``, else run the layer eagerly)."""
        if self.impl != "auto" or self.act_spec is not None or not self.can_run("fused_gather", dtype):
            return None
        if self._graph_weights is None:  # the buffers are frozen while compiled: one pair of handles
            fmt, bs = self.spec.fmt.name, self.spec.block_size
            self._graph_weights = (mx_fused.MXGraphWeights(self.w13_codes, self.w13_scales, fmt, bs),
                                   mx_fused.MXGraphWeights(self.w2_codes, self.w2_scales, fmt, bs), "mx_fused")
        self.last_impl = "fused_gather"
        return self._graph_weights

    def qdq_act(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.act_spec is None else qdq_mx(x, self.act_spec)

    # -- strategy choice ---------------------------------------------------------------------

    def transient_bytes(self, name: str, num_tokens: int, dtype: torch.dtype) -> int:
        """Dense bytes strategy ``name`` materialises for one forward of ``num_tokens`` (weights only)."""
        per_expert = self.dense_bytes(dtype) // self.num_experts
        pairs = num_tokens * self.topk
        if name in ("fused_gemv", "fused_gather", "triton"):  # a few decoded rows per thread, no dense weights
            return 0
        if name in ("mx_gather", "cached_gather"):  # per-pair weight copies (+ the distinct experts)
            return (pairs + min(pairs, self.num_experts)) * per_expert
        if name in ("mx_dense", "cached_dense"):
            return self.dense_bytes(dtype) + num_tokens * self.num_experts * 3 * self.inter * _itemsize(dtype)
        if name == "mx_grouped":
            return min(GROUP_MAX_BYTES, min(pairs, self.num_experts) * per_expert)
        return per_expert

    def can_run(self, name: str, dtype: torch.dtype, num_tokens: int = 1) -> bool:
        """Whether ``name`` fits: cached_* need the layer to fit the cache, and no strategy may
        materialise more than ``max_transient_bytes``. fused_* need the CPU kernel (fp32/bf16), triton a
        ``cuda`` device (or TRITON_INTERPRET=1) with Triton installed and an MXFP4 layer."""
        dev = self.w13_codes.device
        if name.startswith("fused_") and not mx_fused.cpu_fused_ok(dev, dtype):
            return False
        if name == "fused_gemv" and not (mx_fused.gemv_enabled() and mx_fused.gemv_ok(
                self.spec.fmt.name, self.spec.block_size, self.act_spec is None)):
            return False
        if name == "triton" and not mx_triton.can_run(dev, dtype, self.spec):
            return False
        if name.startswith("cached_") and (self.cache is None or not self.cache.fits(self.dense_bytes(dtype))):
            return False
        transient = self.transient_bytes(name, num_tokens, dtype)
        if name.startswith("cached_"):
            transient -= self.dense_bytes(dtype) if name == "cached_dense" else 0
        return transient <= self.max_transient_bytes

    def pick(self, num_tokens: int, dtype: torch.dtype = torch.float32) -> str:
        if self.impl != "auto":
            return self.impl
        if num_tokens * self.topk <= tuned_table.FALLBACK_GATHER_MAX_PAIRS:
            # decode and speculative verify: a batch-invariant strategy whatever a table says, so a 1-token
            # decode and a 6-token verify round alike (lossless greedy speculation; a table's cached_dense
            # rounds differently at each T).
            return self.decode_impl(dtype)
        if not self._table_loaded:
            dev = tuned_table.device_name(self.w13_codes.device)
            self._table = tuned_table.load_table(self.shape, dev,
                                                 tuned_table.TableMeta.here(list(MX_MOE_IMPLS), self.w13_codes.device))
            self._table_loaded = True
            if self._table is None:
                tuned_table.warn_untuned_once(self.shape, dev)
        fused = self.can_run("fused_gather", dtype, num_tokens)
        gemv = self.can_run("fused_gemv", dtype, num_tokens)
        pairs = num_tokens * self.topk
        name = (tuned_table.nearest_impl(self._table, num_tokens) if self._table
                else tuned_table.fallback_impl(pairs, fused, gemv, self.num_experts))
        if name not in AUTO_IMPLS or not self.can_run(name, dtype, num_tokens):  # the memory contract wins
            name = tuned_table.fallback_impl(pairs, fused, gemv, self.num_experts)
            if not self.can_run(name, dtype, num_tokens):
                name = "mx_sorted"  # one expert dense at a time: always fits
        return name

    def decode_impl(self, dtype: torch.dtype) -> str:
        """``auto``'s batch-invariant strategy for decode-sized batches: the fused kernel of this device when
        it runs here (no dense copy), else per-step dequantizing of the selected experts only."""
        for name in ("fused_gemv", "fused_gather", "triton"):
            if self.can_run(name, dtype, 1):
                return name
        return "mx_gather"

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        name = self.pick(x.shape[0], x.dtype)
        self.last_impl = name
        return MX_MOE_IMPLS[name](self, x, routing)

    def extra_repr(self) -> str:
        act = f", act={self.act_spec.fmt.name}" if self.act_spec else ""
        return (f"E={self.num_experts}, H={self.hidden}, I={self.inter}, topk={self.topk}, "
                f"{self.spec.fmt.name}/{self.spec.scale_mode}{act}, impl={self.impl}")


# ---------------------------------------------------------------------------------------------
# Strategies: fn(module, x [T, H], routing) -> [T, H]


def _swiglu(m: MXRoutedExperts, h: torch.Tensor) -> torch.Tensor:
    return mx_fused.swiglu(h, m.qdq_act)


class _Sorted:
    """(token, expert) pairs grouped by expert: ``tok`` [P] source token of each sorted pair."""

    def __init__(self, routing: Routing, num_experts: int) -> None:
        T, K = routing.ids.shape
        flat = routing.ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.tok = self.order // K
        self.counts = torch.bincount(flat, minlength=num_experts)
        self.weights = routing.weights.reshape(-1)[self.order]

    def combine(self, x: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        ys = ys * self.weights[:, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, self.tok, ys)


def mx_sorted(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    s = _Sorted(routing, m.num_experts)
    xs = m.qdq_act(x)[s.tok]  # [P, H] grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(s.counts.tolist()):
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], m.dequant("w13", e, x.dtype))
        ys[start:start + n] = F.linear(_swiglu(m, h), m.dequant("w2", e, x.dtype))
        start += n
    return s.combine(x, ys)


def mx_grouped(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    s = _Sorted(routing, m.num_experts)
    active = torch.nonzero(s.counts).flatten()  # [A]
    cnt = s.counts[active]
    starts = torch.cumsum(cnt, 0) - cnt
    group = torch.repeat_interleave(torch.arange(active.numel(), device=x.device), cnt)  # [P]
    slot = torch.arange(group.numel(), device=x.device) - starts[group]  # position within its expert
    xs = m.qdq_act(x)[s.tok]
    ys = torch.empty_like(xs)
    max_n = int(cnt.max())
    per_expert = 3 * m.hidden * m.inter * x.element_size()
    chunk = max(1, GROUP_MAX_BYTES // per_expert)
    cnt_l, starts_l = cnt.tolist(), starts.tolist()
    for a0 in range(0, active.numel(), chunk):
        a1 = min(a0 + chunk, active.numel())
        p0, p1 = starts_l[a0], starts_l[a1 - 1] + cnt_l[a1 - 1]
        g, sl = group[p0:p1] - a0, slot[p0:p1]
        xp = x.new_zeros(a1 - a0, max_n, m.hidden)  # [G, max_n, H], padded
        xp[g, sl] = xs[p0:p1]
        h = torch.bmm(xp, m.dequant("w13", active[a0:a1], x.dtype).transpose(1, 2))  # [G, max_n, 2I]
        y = torch.bmm(_swiglu(m, h), m.dequant("w2", active[a0:a1], x.dtype).transpose(1, 2))  # [G, max_n, H]
        ys[p0:p1] = y[g, sl]
    return s.combine(x, ys)


def _gather(m: MXRoutedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    T, K = ids.shape
    flat = ids.reshape(-1)
    h = gather_gemv(w13, flat, m.qdq_act(x).repeat_interleave(K, dim=0))  # [T*K, 2I]
    y = gather_gemv(w2, flat, _swiglu(m, h))  # [T*K, H]
    return (y.view(T, K, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)


def mx_gather(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    uniq, inv = torch.unique(routing.ids, return_inverse=True)  # dequantize each selected expert once
    w13, w2 = m.dequant("w13", uniq, x.dtype), m.dequant("w2", uniq, x.dtype)
    return _gather(m, x, inv.view_as(routing.ids), routing.weights, w13, w2)


def _dense(m: MXRoutedExperts, x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor
           ) -> torch.Tensor:
    T, E, I = x.shape[0], m.num_experts, m.inter
    h = F.linear(m.qdq_act(x), w13.reshape(E * 2 * I, m.hidden)).view(T, E, 2 * I)
    coef = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter_(1, routing.ids, routing.weights.to(x.dtype))
    a = _swiglu(m, h) * coef.unsqueeze(-1)  # [T, E, I]; unselected experts weigh 0
    return torch.bmm(a.transpose(0, 1), w2.transpose(1, 2)).sum(dim=0)  # [E, T, H] -> [T, H]


def mx_dense(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    return _dense(m, x, routing, m.dequant("w13", None, x.dtype), m.dequant("w2", None, x.dtype))


def cached_sorted(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    w13, w2 = m.dense_weights(x.dtype)
    s = _Sorted(routing, m.num_experts)
    xs = m.qdq_act(x)[s.tok]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(s.counts.tolist()):
        if n:
            h = F.linear(xs[start:start + n], w13[e])
            ys[start:start + n] = F.linear(_swiglu(m, h), w2[e])
            start += n
    return s.combine(x, ys)


def cached_gather(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    w13, w2 = m.dense_weights(x.dtype)
    return _gather(m, x, routing.ids, routing.weights, w13, w2)


def cached_dense(m: MXRoutedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    w13, w2 = m.dense_weights(x.dtype)
    return _dense(m, x, routing, w13, w2)


MXMoEFn = Callable[[MXRoutedExperts, torch.Tensor, Routing], torch.Tensor]
MX_MOE_IMPLS: dict[str, MXMoEFn] = {
    "mx_sorted": mx_sorted,
    "mx_grouped": mx_grouped,
    "mx_gather": mx_gather,
    "mx_dense": mx_dense,
    "cached_sorted": cached_sorted,
    "cached_gather": cached_gather,
    "cached_dense": cached_dense,
    "fused_gemv": mx_fused.fused_gemv,
    "fused_gather": mx_fused.fused_gather,
    "fused_sorted": mx_fused.fused_sorted,
    "triton": mx_triton.triton_moe,
}
AUTO_IMPLS = tuple(n for n in MX_MOE_IMPLS if not n.startswith("cached_"))
"""The strategies ``auto`` may pick: every one that holds no dense copy of a layer (``cached_*`` run by name only,
whatever a tuned table says)."""
DENSE_TO_MX = {"sorted": "mx_sorted", "grouped": "mx_grouped", "gather": "mx_gather", "dense": "mx_dense",
               "fused_cpu": "auto"}
"""A dense strategy forced with ``--moe-impl`` maps to its MX analogue on quantized layers (``fused_cpu``, for
dense bf16 weights only, to ``auto``)."""
