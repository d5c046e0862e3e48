"""Oracle drafts: controlled acceptance for benchmarking speculation (off unless a benchmark asks for it).

The real MTP layer still runs every draft forward (its cost is what is measured), but the tokens it
proposes are replaced by an oracle's: the target's own greedy continuation of the request (computed
beforehand by plain greedy decoding of the same prompt), each proposed token corrupted with probability
``corrupt_rate`` (seeded). A corrupted token is never the target's greedy token, so under greedy
verification every draft is accepted with probability ``a = 1 - corrupt_rate`` independently, and a
chain of ``k`` drafts gives a mean acceptance length (tokens per verify step) of

    L(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

``rate_for_accept_len(3.61, 5)`` solves it for the rate that lands at a chosen value. Verification is
untouched, so the output is the target's greedy decoding whatever the oracle proposes (lossless).
Greedy chains only: a tree or a sampled request is refused (its acceptance is not the oracle's to set).
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative.seq import SpecSeq


def chain_accept_len(a: float, k: int) -> float:
    """Expected tokens per verify step of a ``k``-draft chain with per-draft acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def rate_for_accept_len(accept_len: float, k: int) -> float:
    """The corruption rate whose chain of ``k`` drafts accepts ``accept_len`` tokens per step on average."""
    if not 1.0 <= accept_len <= k + 1:
        raise ValueError(f"a chain of {k} drafts accepts between 1 and {k + 1} tokens per step, got {accept_len}")
    lo, hi = 0.0, 1.0  # L(a, k) grows with a: bisect on a
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_accept_len(mid, k) < accept_len else (lo, mid)
    return 1.0 - (lo + hi) / 2


class OracleDrafts:
    """Replaces a greedy chain's draft tokens by the reference continuation, corrupted at ``corrupt_rate``.

    ``references`` maps a prompt (token tuple) to the target's greedy output for it; it must run at least
    ``num_steps`` tokens past what is generated (``max_tokens + num_steps``), else the drafts past its end are
    the MTP layer's own. A request whose output has left its reference (it was not greedy) keeps the MTP's."""

    def __init__(self, references: dict[tuple[int, ...], Sequence[int]], vocab_size: int, corrupt_rate: float,
                 seed: int = 0) -> None:
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate must be in [0, 1], got {corrupt_rate}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 to corrupt a token, got {vocab_size}")
        self.references = {tuple(p): list(r) for p, r in references.items()}
        self.vocab_size, self.corrupt_rate = vocab_size, corrupt_rate
        self.generator = torch.Generator().manual_seed(seed)
        self.num_proposed = 0
        """Draft tokens the oracle replaced."""
        self.num_corrupted = 0

    def replace(self, seq: SpecSeq, depth: int, mtp_token: int) -> int:
        """The draft at ``depth`` (1 = the token after ``seq.last_token``) in place of ``mtp_token``."""
        out = seq.output_ids
        ref = self.references.get(tuple(seq.sampler.prompt_ids))
        i = len(out) - 1 + depth  # the reference index of that draft
        if ref is None or i >= len(ref) or ref[len(out) - 1] != out[-1]:
            return mtp_token
        self.num_proposed += 1
        u, shift = torch.rand(1, generator=self.generator).item(), torch.randint(
            1, self.vocab_size, (1,), generator=self.generator).item()
        if u >= self.corrupt_rate:
            return ref[i]
        self.num_corrupted += 1
        return (ref[i] + shift) % self.vocab_size  # any token but the reference one


def greedy_references(engine: Engine, prompts: Sequence[Sequence[int]], num_tokens: int
                      ) -> dict[tuple[int, ...], list[int]]:
    """The oracle's references: plain greedy decoding of ``prompts`` on ``engine`` (no EOS stop), ``num_tokens``
    each (generate ``max_tokens + spec.num_steps`` so the last step's drafts are covered too)."""
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    return {tuple(p): r.token_ids for p, r in zip(prompts, engine.generate(prompts, params))}
