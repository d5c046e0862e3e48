"""Acceptance statistics of speculative decoding (the numbers sglang and vLLM report)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecMetrics:
    num_verify_steps: int = 0
    """Request-steps verified (a batch of B requests counts B)."""
    num_accepted_drafts: int = 0
    """Drafts accepted by verification (before truncation at a stop condition)."""
    num_emitted_tokens: int = 0
    """Tokens appended to outputs (after truncation)."""
    num_draft_tokens: int = 0
    """Draft tokens verified (tree nodes below the root)."""
    num_moved_kv: int = 0
    """Accepted tree nodes off the contiguous best chain whose target KV was moved to its slot."""
    accepted_at_depth: list[int] = field(default_factory=list)
    """``[d - 1]``: request-steps that accepted a draft at depth d."""

    def record(self, num_accepted: int, num_drafts: int, num_emitted: int) -> None:
        self.num_verify_steps += 1
        self.num_accepted_drafts += num_accepted
        self.num_draft_tokens += num_drafts
        self.num_emitted_tokens += num_emitted
        if len(self.accepted_at_depth) < num_accepted:
            self.accepted_at_depth += [0] * (num_accepted - len(self.accepted_at_depth))
        for d in range(num_accepted):
            self.accepted_at_depth[d] += 1

    @property
    def accept_len(self) -> float:
        """Mean tokens produced per verify step: 1 + mean accepted drafts."""
        return 1.0 + self.num_accepted_drafts / self.num_verify_steps if self.num_verify_steps else 0.0

    def acceptance_rate(self, max_depth: int) -> list[float]:
        """Per draft depth d = 1..max_depth: fraction of steps that accepted a draft at depth d."""
        n = max(self.num_verify_steps, 1)
        return [(self.accepted_at_depth[d] if d < len(self.accepted_at_depth) else 0) / n for d in range(max_depth)]

    def conditional_acceptance(self, max_depth: int) -> list[float]:
        """P(accept at depth d | accepted at depth d - 1): the per-position acceptance of a chain."""
        rates = [1.0] + self.acceptance_rate(max_depth)
        return [rates[d + 1] / rates[d] if rates[d] > 0 else 0.0 for d in range(max_depth)]

    def as_dict(self, max_depth: int) -> dict:
        return {"accept_len": round(self.accept_len, 4), "verify_steps": self.num_verify_steps,
                "accepted_drafts": self.num_accepted_drafts, "draft_tokens": self.num_draft_tokens,
                "emitted_tokens": self.num_emitted_tokens, "moved_kv": self.num_moved_kv,
                "acceptance_rate": [round(r, 4) for r in self.acceptance_rate(max_depth)],
                "conditional_acceptance": [round(r, 4) for r in self.conditional_acceptance(max_depth)]}
