"""Speculative decoding configuration, spelled like sglang's flags.

``SpecConfig.parse("3/1/4")`` = ``--speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4``: a chain of 3 drafts, 4 tokens verified per step (the
last accepted token plus the drafts). ``"3/2/6"`` = a draft tree: 3 MTP forwards, each
expanding the 2 best children of the 2 best frontier nodes, of which the 5 best-scoring
nodes (cumulative draft log-prob) are verified together with the last accepted token.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecConfig:
    num_steps: int
    """Draft depth: MTP forwards per speculative step (sglang ``--speculative-num-steps``)."""
    eagle_topk: int = 1
    """Children expanded per frontier node and frontier width (``--speculative-eagle-topk``); 1 = a chain."""
    num_draft_tokens: int = 2
    """Tokens verified per step, the last accepted token included (``--speculative-num-draft-tokens``)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"eagle_topk must be >= 1, got {self.eagle_topk}")
        if self.num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (the last token plus one draft), "
                             f"got {self.num_draft_tokens}")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"a chain (eagle_topk 1) verifies num_steps + 1 tokens: num_draft_tokens must be "
                             f"{self.num_steps + 1}, got {self.num_draft_tokens} ({self})")
        if self.num_draft_tokens - 1 > self.num_candidates:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} needs {self.num_draft_tokens - 1} drafts but "
                             f"{self.num_steps} steps of top-{self.eagle_topk} propose only {self.num_candidates}")

    @classmethod
    def parse(cls, text: str) -> "SpecConfig":
        """``"num_steps/eagle_topk/num_draft_tokens"``, e.g. ``"5/1/6"``."""
        parts = text.strip().split("/")
        if len(parts) != 3:
            raise ValueError(f"speculative config must look like 'steps/topk/draft_tokens' (e.g. '3/1/4'), "
                             f"got {text!r}")
        try:
            steps, topk, tokens = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"speculative config {text!r}: three integers expected") from None
        return cls(steps, topk, tokens)

    def __str__(self) -> str:
        return f"{self.num_steps}/{self.eagle_topk}/{self.num_draft_tokens}"

    @property
    def is_chain(self) -> bool:
        return self.eagle_topk == 1

    @property
    def num_drafts(self) -> int:
        """Draft tokens verified per step (tree nodes below the root)."""
        return self.num_draft_tokens - 1

    @property
    def num_candidates(self) -> int:
        """Draft nodes proposed before pruning: k at depth 1, k * k at each further depth."""
        k = self.eagle_topk
        return k + (self.num_steps - 1) * k * k

    @property
    def num_step_slots(self) -> int:
        """KV slots a step writes past the cached length: the verified tokens (all layers) or the
        draft tree's MTP entries (the MTP layer), whichever reaches further."""
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.eagle_topk)
