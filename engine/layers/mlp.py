"""Dense SwiGLU MLP and the MoE block (router + routed experts + shared experts).

Both compute through ``ffn_tokenwise``, a function of tensors and constants (``tokenwise_args``), so the
decode graphs (``engine.layers.decode_graph``) trace the very code the eager path runs."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.cpu_gemv import linear
from engine.layers.cpu_tokenwise import silu_mul
from engine.layers.fused import FusedProjection
from engine.moe.experts import GRAPH_MOE_IMPLS, RoutedExperts
from engine.moe.router import Routing, TopkRouter, route
from engine.parallel.config import SINGLE_RANK, ParallelConfig


class FFNArgs(NamedTuple):
    """``ffn_tokenwise``'s inputs. ``w_x`` [rows, hidden] reads the input in one GEMM: its outputs are
    (router logits if ``w_router`` is None and the block routes), then gate, then up (``sizes``)."""
    w_x: torch.Tensor | None
    sizes: list[int]
    w_down: torch.Tensor | None
    w_router: torch.Tensor | None     # MoE: fp32 router weight when not fused into w_x
    routes: bool                      # an MoE block
    bias: torch.Tensor | None         # e_score_correction_bias
    route_consts: tuple               # (n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    w13: torch.Tensor | None          # routed experts run inside (``moe``'s strategy), else by the caller
    w2: torch.Tensor | None
    moe: str = "gather"               # the strategy inside a graph: ``engine.moe.experts.GRAPH_MOE_IMPLS``


def ffn_tokenwise(h: torch.Tensor, f: FFNArgs) -> tuple[torch.Tensor, Routing | None]:
    """-> (the block's output, None) when it is complete; (the shared experts' output or None, the routing)
    when the routed experts are left to the caller (``f.w13`` None)."""
    if f.w_x is not None:
        parts = linear(h, f.w_x).split(f.sizes, dim=-1)
        logits, (g, u) = (parts[0], parts[1:]) if f.routes and f.w_router is None else (None, parts)
        shared = linear(silu_mul(g, u), f.w_down)
    else:
        logits, shared = None, None
    if not f.routes:
        return shared, None
    if logits is None:
        logits = F.linear(h.float(), f.w_router)
    routing = route(logits, f.bias, *f.route_consts)
    if f.w13 is None:
        return shared, routing
    out = GRAPH_MOE_IMPLS[f.moe](h, f.w13, f.w2, routing)
    return (out if shared is None else out + shared), None


def finish_ffn(experts: nn.Module, h: torch.Tensor, shared: torch.Tensor | None, routing: Routing | None
               ) -> torch.Tensor:
    """The routed experts ``ffn_tokenwise`` left to its caller, added to the shared experts' output."""
    if routing is None:
        return shared
    out = experts(h, routing)
    return out if shared is None else out + shared


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self._gate_up = FusedProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ffn_tokenwise(x, self.tokenwise_args())[0]

    def tokenwise_args(self, experts_w: tuple | None = None) -> FFNArgs:
        w, _, sizes = self._gate_up.weight(self.gate_up_parts())
        return FFNArgs(w, sizes, self.down_proj.weight, None, False, None, (), None, None)

    def gate_up_parts(self) -> list[tuple[torch.Tensor, None]]:
        return [(self.gate_proj.weight, None), (self.up_proj.weight, None)]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_impl: str = "auto", parallel: ParallelConfig = SINGLE_RANK) -> None:
        """``cfg``: this rank's config (``ParallelConfig.rank_config``). Under expert parallelism the rank holds
        experts ``[expert_offset, expert_offset + num_local_experts)`` and its slice of the shared experts."""
        super().__init__()
        ep = parallel.tp_size if parallel.expert_parallel else 1
        self.expert_parallel = parallel.expert_parallel
        self.num_local_experts = cfg.n_routed_experts // ep
        self.expert_offset = parallel.tp_rank * self.num_local_experts if self.expert_parallel else 0
        self.gate = TopkRouter(cfg)
        self.experts = RoutedExperts(cfg, moe_impl, self.num_local_experts, 1 if self.expert_parallel else None)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // ep)
                               if cfg.n_shared_experts else None)
        self._x_proj = FusedProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return finish_ffn(self.experts, x, *ffn_tokenwise(x, self.tokenwise_args()))

    def tokenwise_args(self, experts_w: tuple | None = None) -> FFNArgs:
        """``experts_w`` = dense (w13, w2, strategy): the routed experts run inside ``ffn_tokenwise``
        (``GRAPH_MOE_IMPLS[strategy]``), else (None) the caller runs ``self.experts`` (``finish_ffn``)."""
        cfg, se, gate = self.gate.cfg, self.shared_experts, self.gate
        consts = (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        w13, w2, moe = experts_w or (None, None, "gather")
        if se is None:
            return FFNArgs(None, [], None, gate.weight.float(), True, gate.e_score_correction_bias, consts, w13, w2,
                           moe)
        if gate.weight.dtype == se.gate_proj.weight.dtype:
            # fp32 model: the router's logits and the shared expert's gate/up read x in one GEMM
            w, _, sizes = self._x_proj.weight([(gate.weight, None)] + se.gate_up_parts())
            return FFNArgs(w, sizes, se.down_proj.weight, None, True, gate.e_score_correction_bias, consts, w13, w2,
                           moe)
        w, _, sizes = se._gate_up.weight(se.gate_up_parts())
        return FFNArgs(w, sizes, se.down_proj.weight, gate.weight.float(), True, gate.e_score_correction_bias,
                       consts, w13, w2, moe)
