"""Lossless verification of a draft tree against the target's distributions.

``p[i]`` is the target's processed distribution (penalties, temperature, top-k, top-p, min-p:
``engine.sampling``) for the token *after* node ``i``, given the path root..i.

Greedy: walk from the root; at node i accept the child whose token is ``argmax p[i]``; at the
first node with no such child emit ``argmax p[i]`` (the correction, or the bonus at a leaf).
The emitted tokens are exactly what greedy decoding produces.

Chain under sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``x_i ~ q_i``; accept
with probability ``min(1, p(x_i) / q_i(x_i))``; at the first rejection emit a sample of
``norm(max(0, p - q_i))`` and stop; if every draft is accepted emit a bonus sample of ``p`` at the
last node. Each emitted token is then distributed exactly as ``p``.

Tree under sampling: recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024)
with the deterministic proposals the EAGLE-2 tree makes, i.e. ``q = delta(x)`` for each child
tried. With a residual ``r`` (initially ``p[i]``), child ``x`` is accepted with probability
``min(1, r(x) / delta_x(x)) = r(x) / sum(r)``; on rejection ``r <- max(0, r - delta_x) = r`` with
``x`` removed. If every child is rejected, emit a sample of ``norm(r)``. By induction over the
siblings tried, ``P(emit y) = p(y)`` for every y, so the whole walk samples the target exactly.

Every random number a request uses comes from its own generator when it has a seed, in an order
that depends only on that request's drafts and outcomes: seeded results are reproducible in any
batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.speculative.tree import DraftTree


class VerifyResult(NamedTuple):
    path: list[int]
    """Accepted draft nodes, root excluded, in depth order."""
    token_ids: list[int]
    """Tokens to emit: the accepted drafts, then the correction or bonus token."""


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=gen))


def _sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """Inverse-CDF draw from ``probs [V]`` (need not be normalised; zero-probability tokens are never drawn).
    One uniform per draw (``torch.multinomial`` is ~10x slower for a single sample on CPU)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def verify_greedy(tree: DraftTree, target_ids: list[int]) -> VerifyResult:
    """``target_ids[i]`` = argmax of the target at node i."""
    path, node = [], 0
    while True:
        t = target_ids[node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == t), None)
        if nxt is None:
            return VerifyResult(path, [tree.tokens[c] for c in path] + [t])
        path.append(nxt)
        node = nxt


def verify_chain_sampling(tree: DraftTree, p: torch.Tensor, gen: torch.Generator | None) -> VerifyResult:
    """``p [N, V]`` target probs at each node; ``tree.draft_probs [N - 1, V]`` the q each draft was drawn from."""
    q = tree.draft_probs
    if q is None:
        raise ValueError("chain sampling verification needs the draft distributions")
    path = []
    for i in range(1, tree.num_nodes):
        x = tree.tokens[i]
        px, qx = float(p[i - 1, x]), float(q[i - 1, x])
        if _uniform(gen) * qx < px:  # accept with probability min(1, px / qx)
            path.append(i)
            continue
        resid = (p[i - 1] - q[i - 1]).clamp_min(0.0)
        total = float(resid.sum())
        # total == 0 only if p <= q everywhere, i.e. p == q, where rejection has probability 0: rounding
        last = _sample(resid / total if total > 0 else p[i - 1], gen)
        return VerifyResult(path, tree.tokens[1:i] + [last])
    return VerifyResult(path, tree.tokens[1:] + [_sample(p[-1], gen)])


def verify_tree_sampling(tree: DraftTree, p: torch.Tensor, gen: torch.Generator | None) -> VerifyResult:
    """Recursive rejection sampling over siblings with deterministic proposals (see the module doc)."""
    path, node = [], 0
    while True:
        resid = p[node].clone()
        for c in tree.children[node]:
            x = tree.tokens[c]
            rx, total = float(resid[x]), float(resid.sum())
            if _uniform(gen) * total < rx:
                path.append(c)
                node = c
                break
            resid[x] = 0.0
        else:
            total = float(resid.sum())
            last = _sample(resid / total if total > 0 else p[node], gen)
            return VerifyResult(path, [tree.tokens[c] for c in path] + [last])
