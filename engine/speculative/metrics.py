"""Acceptance statistics of speculative decoding (the numbers sglang and vLLM report).

Counted per request-step (a batch of B requests verified together counts B). For draft depth
``d = 1 .. num_steps`` (depth 1 = the first draft after the last accepted token):

* a step *drafted* depth d when its draft tree had a node at depth d;
* a step *reached* depth d when verification put a depth-d draft to the test: it accepted at
  least ``d - 1`` drafts and the node its accepted path had reached at depth ``d - 1`` has
  children (a chain that rejected at depth 2 never tests depth 3; a pruned tree's accepted node
  may have no child left to try);
* a step *accepted* depth d when its accepted path has at least d drafts.

``accept_rate_per_position[d-1] = accepted[d-1] / reached[d-1]``: the probability that the draft
at depth d is accepted, given verification got that far (the per-position acceptance of a chain;
for a tree: that one of the depth-d children of the accepted node is accepted).
``accept_rate_at_least[d-1] = accepted[d-1] / drafted[d-1]``: the unconditional fraction of
drafting steps that accepted at least d drafts. When every step drafts to the same depth,
``accept_rate_at_least[d-1]`` is the product of ``accept_rate_per_position[:d]``.

Steps without drafts (no draft state yet, or no room in the pool: a plain step) count in
``num_verify_steps`` and ``accept_len`` but draft no depth, so they leave the rates alone.
``record`` may run on a scheduler thread while another thread reads a ``snapshot()``: both hold a lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence


class SpecStats(NamedTuple):
    """A consistent copy of the counters, with the rates derived from them (see the module docstring)."""
    num_verify_steps: int
    num_accepted_drafts: int
    num_draft_tokens: int
    num_emitted_tokens: int
    accept_len: float
    drafted_at_depth: list[int]
    reached_at_depth: list[int]
    accepted_at_depth: list[int]
    accept_rate_per_position: list[float]
    """``[d-1]``: P(the depth-d draft is accepted | the step drafted depth d and accepted d - 1 drafts)."""
    accept_rate_at_least: list[float]
    """``[d-1]``: fraction of the steps that drafted depth d which accepted at least d drafts."""


class StepDepths(NamedTuple):
    tree_depth: int
    """Deepest draft of the step's tree (0: a plain step)."""
    tested_depth: int
    """Deepest depth verification tried a draft at: the accepted drafts, plus one if the last accepted
    node (or the root) has children."""


def step_depths(depths: Sequence[int], children: Sequence[Sequence[int]], path: Sequence[int]) -> StepDepths:
    """A draft tree's ``depths`` / ``children`` and the accepted ``path`` (node ids, root excluded)."""
    last = path[-1] if path else 0
    return StepDepths(max(depths), len(path) + (1 if children[last] else 0))


def _ratios(num: list[int], den: list[int]) -> list[float]:
    """``num[i] / den[i]``, 0.0 where nothing was counted (``den[i] == 0``)."""
    return [n / d if d else 0.0 for n, d in zip(num, den)]


def _pad(counts: list[int], n: int) -> list[int]:
    return (counts + [0] * n)[:n]


@dataclass(slots=True)
class SpecMetrics:
    num_verify_steps: int = 0
    """Request-steps verified (a batch of B requests counts B), plain (draft-free) steps included."""
    num_accepted_drafts: int = 0
    """Drafts accepted by verification (before truncation at a stop condition)."""
    num_emitted_tokens: int = 0
    """Tokens appended to outputs (after truncation)."""
    num_draft_tokens: int = 0
    """Draft tokens verified (tree nodes below the root)."""
    num_moved_kv: int = 0
    """Accepted tree nodes off the contiguous best chain whose target KV was moved to its slot."""
    drafted_at_depth: list[int] = field(default_factory=list)
    """``[d - 1]``: request-steps whose draft tree had a node at depth d."""
    reached_at_depth: list[int] = field(default_factory=list)
    """``[d - 1]``: request-steps that drafted depth d and accepted at least d - 1 drafts."""
    accepted_at_depth: list[int] = field(default_factory=list)
    """``[d - 1]``: request-steps that accepted a draft at depth d (at least d drafts)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, num_accepted: int, num_drafts: int, num_emitted: int, tree_depth: int,
               tested_depth: int) -> None:
        """One request-step: ``num_accepted`` drafts accepted (the accepted path's length) out of
        ``num_drafts`` verified in a tree of depth ``tree_depth`` (0 for a plain step) where drafts
        down to ``tested_depth`` were tried (``step_depths``)."""
        if not (0 <= num_accepted <= tested_depth <= min(num_accepted + 1, tree_depth) and tree_depth <= num_drafts
                and (tree_depth == 0) == (num_drafts == 0)):
            raise ValueError(f"inconsistent speculative step: {num_accepted} accepted, {num_drafts} drafts, "
                             f"tree depth {tree_depth}, tested to depth {tested_depth}")
        with self._lock:
            self.num_verify_steps += 1
            self.num_accepted_drafts += num_accepted
            self.num_draft_tokens += num_drafts
            self.num_emitted_tokens += num_emitted
            for counts in (self.drafted_at_depth, self.reached_at_depth, self.accepted_at_depth):
                counts += [0] * (tree_depth - len(counts))
            for d in range(tree_depth):  # index d is depth d + 1
                self.drafted_at_depth[d] += 1
                self.reached_at_depth[d] += d < tested_depth
                self.accepted_at_depth[d] += d < num_accepted

    @property
    def accept_len(self) -> float:
        """Mean tokens produced per verify step: 1 + mean accepted drafts."""
        return 1.0 + self.num_accepted_drafts / self.num_verify_steps if self.num_verify_steps else 0.0

    def snapshot(self, max_depth: int) -> SpecStats:
        """The counters and rates for depths 1..``max_depth`` (zero-padded), read consistently."""
        with self._lock:
            drafted, reached, accepted = (_pad(c, max_depth) for c in
                                          (self.drafted_at_depth, self.reached_at_depth, self.accepted_at_depth))
            return SpecStats(self.num_verify_steps, self.num_accepted_drafts, self.num_draft_tokens,
                             self.num_emitted_tokens, self.accept_len, drafted, reached, accepted,
                             _ratios(accepted, reached), _ratios(accepted, drafted))

    def accept_rate_per_position(self, max_depth: int) -> list[float]:
        """Per draft depth d = 1..max_depth: P(accepted | reached), see the module docstring."""
        return self.snapshot(max_depth).accept_rate_per_position

    def accept_rate_at_least(self, max_depth: int) -> list[float]:
        """Per draft depth d = 1..max_depth: fraction of drafting steps that accepted at least d drafts."""
        return self.snapshot(max_depth).accept_rate_at_least

    def as_dict(self, max_depth: int) -> dict:
        s = self.snapshot(max_depth)
        return {"accept_len": round(s.accept_len, 4), "verify_steps": s.num_verify_steps,
                "accepted_drafts": s.num_accepted_drafts, "draft_tokens": s.num_draft_tokens,
                "emitted_tokens": s.num_emitted_tokens, "moved_kv": self.num_moved_kv,
                "accept_rate_per_position": [round(r, 4) for r in s.accept_rate_per_position],
                "accept_rate_at_least": [round(r, 4) for r in s.accept_rate_at_least]}
