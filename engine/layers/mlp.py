"""Dense SwiGLU MLP and the MoE block (router + routed experts + shared experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.fused import FusedProjection
from engine.moe.experts import RoutedExperts
from engine.moe.router import TopkRouter


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self._gate_up = FusedProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up(x)))

    def gate_up_parts(self) -> list[tuple[torch.Tensor, None]]:
        return [(self.gate_proj.weight, None), (self.up_proj.weight, None)]

    def gate_up(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self._gate_up(x, self.gate_up_parts())

    @staticmethod
    def act(gate_up: list[torch.Tensor]) -> torch.Tensor:
        return F.silu(gate_up[0]) * gate_up[1]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = RoutedExperts(cfg, moe_impl)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self._x_proj = FusedProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        se = self.shared_experts
        if se is None:
            return self.experts(x, self.gate(x))
        if not self.gate.weight.dtype == se.gate_proj.weight.dtype == x.dtype:
            return self.experts(x, self.gate(x)) + se(x)
        # fp32 model: the router's logits and the shared expert's gate/up read x in one GEMM
        logits, *gate_up = self._x_proj(x, [(self.gate.weight, None)] + se.gate_up_parts())
        out = self.experts(x, self.gate.route(logits))
        return out + se.down_proj(se.act(gate_up))
