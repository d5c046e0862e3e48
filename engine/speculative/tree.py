"""The draft tree one request verifies in a speculative step.

Node 0 is the root: the last accepted token ``x_C`` at position ``C`` (the request's cached
length). Every other node is a draft token at position ``C + depth``. Nodes are stored in DFS
preorder with each node's children ordered by draft score (best first), so

* parents come before children (the ``[N, N]`` ancestor mask is lower-triangular), and
* the best chain root -> best child -> best grandchild ... occupies nodes ``0..d`` contiguously:
  when verification accepts along it, the target KV written by the verify forward already sits
  in the slots ``C..C+d`` the sequence needs; any other path is moved there (``SpecDecoder``).

A chain (``eagle_topk == 1``) is the degenerate tree ``0 -> 1 -> 2 ...`` whose mask is causal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftTree:
    tokens: list[int]
    """Token of every node; ``tokens[0]`` is the root (last accepted token)."""
    parents: list[int]
    """Parent node of every node; ``parents[0] == -1``."""
    depths: list[int]
    """Depth of every node (root 0): node ``i`` sits at position ``cached_len + depths[i]``."""
    children: list[list[int]]
    """Children of every node, best draft score first (the order siblings are tried in)."""
    draft_probs: torch.Tensor | None = None
    """Chain sampling only: ``[N - 1, V]``, row ``i - 1`` = the draft distribution node ``i`` was drawn from."""

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def mask(self) -> torch.Tensor:
        """``[N, N]`` bool: node i sees node j iff j is i or an ancestor of i."""
        n = self.num_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            m[i, i] = True
            if self.parents[i] >= 0:
                m[i] |= m[self.parents[i]]
        return m

    def path_tokens(self, node: int) -> list[int]:
        """Draft tokens from depth 1 down to ``node`` (the root excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    @classmethod
    def chain(cls, root: int, drafts: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        n = len(drafts) + 1
        return cls([root] + list(drafts), list(range(-1, n - 1)), list(range(n)),
                   [[i + 1] for i in range(n - 1)] + [[]], draft_probs)

    @classmethod
    def from_candidates(cls, root: int, tokens: list[int], parents: list[int], order: list[int]) -> "DraftTree":
        """Build from candidate lists (``parents[c]`` = candidate index or -1 for the root) and
        ``order``: the kept candidates, best score first, closed under ancestors."""
        kept = set(order)
        kids: dict[int, list[int]] = {-1: []}
        for c in order:  # best first, so every child list ends up best first
            p = parents[c]
            if p != -1 and p not in kept:
                raise ValueError(f"draft candidate {c} kept without its parent {p}")
            kids.setdefault(p, []).append(c)
        out = cls([root], [-1], [0], [[]])
        stack = [(c, 0) for c in reversed(kids[-1])]
        while stack:  # DFS preorder, best child first
            c, parent_node = stack.pop()
            node = len(out.tokens)
            out.tokens.append(tokens[c])
            out.parents.append(parent_node)
            out.depths.append(out.depths[parent_node] + 1)
            out.children.append([])
            out.children[parent_node].append(node)
            stack.extend((g, node) for g in reversed(kids.get(c, [])))
        return out
