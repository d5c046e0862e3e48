"""GLM / DeepSeek-V3 MoE routing: sigmoid scores, bias-corrected group-limited top-k.

For each token (fp32 throughout):
  scores = sigmoid(x @ W_gate^T)                          [T, E]
  choice = scores + e_score_correction_bias                (the bias only steers *which* experts)
  group score = sum of the top-2 choice scores in each of n_group groups; keep topk_group groups
  ids = top-k of choice within the kept groups;  weights = scores[ids] (uncorrected)
  weights /= sum(weights) + 1e-20 if norm_topk_prob;  weights *= routed_scaling_factor
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class Routing(NamedTuple):
    ids: torch.Tensor      # [T, K] long
    weights: torch.Tensor  # [T, K] fp32


class TopkRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        return self.route(F.linear(x.float(), self.weight.float()))

    def route(self, logits: torch.Tensor) -> Routing:
        """Router logits ``x @ W_gate^T`` [T, E] (fp32) -> routing."""
        return route(logits, self.e_score_correction_bias, self.cfg.n_group, self.cfg.topk_group,
                     self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, self.cfg.routed_scaling_factor)


def route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
          scaling: float) -> Routing:
    """``TopkRouter.route`` as a function of tensors and constants (traced into the compiled decode graphs)."""
    E, G = logits.shape[-1], n_group
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + bias
    if G > 1:
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * scaling)
