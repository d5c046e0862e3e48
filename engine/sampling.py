"""Batched token sampling with per-request parameters.

Order of operations (as vLLM / sglang): penalties on the raw logits -> temperature ->
top-k -> top-p -> min-p -> sample. Greedy (temperature 0) is an argmax over the penalised
logits. A request's ``seed`` makes its samples reproducible regardless of what else is in
the batch: each seeded request draws its own exponential noise from its own generator
(Gumbel-max via ``argmax(p / Exp(1))``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch


MAX_STOP_TOKEN_IDS = 1024
"""Most distinct stop token ids a request may name (the router refuses more, INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    """Tokens to generate (including the first, sampled by prefill)."""
    temperature: float = 0.0
    """0 = greedy."""
    top_k: int = 0
    """0 = off."""
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in prompt or output (CTRL-style divide/multiply)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output so far."""
    presence_penalty: float = 0.0
    """Subtracted once if the token occurred in the output so far."""
    stop_token_ids: frozenset[int] = frozenset()
    """Checked against every new token: a set (any iterable given is turned into one), so the check costs
    the same for 1 id or ``MAX_STOP_TOKEN_IDS``."""
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    """0 = none; n >= 1 returns the chosen token's logprob and the top-n."""

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, frozenset):
            object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs < 0 or self.logprobs > 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class SampleResult(NamedTuple):
    token_ids: torch.Tensor            # [B] long
    logprobs: torch.Tensor | None      # [B] fp32 logprob of the chosen token (post-penalty, pre-temperature)
    top_ids: torch.Tensor | None       # [B, n]
    top_logprobs: torch.Tensor | None  # [B, n]


@dataclass(slots=True)
class SamplerState:
    """Per-request state the sampler keeps across steps."""
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """In place on ``logits`` [B, V] for the rows that have penalties."""
    V = logits.shape[1]
    for b, st in enumerate(states):
        p = st.params
        if not p.has_penalties:
            continue
        out = torch.as_tensor(st.output_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=V)[:V].to(logits.dtype) if out.numel() else torch.zeros(V)
        row = logits[b]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if len(st.prompt_ids):
                seen[torch.as_tensor(list(st.prompt_ids), dtype=torch.long)] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def probs_from_logits(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Temperature + top-k + top-p + min-p -> probabilities [B, V] fp32 (rows of greedy requests: one-hot)."""
    B, V = logits.shape
    temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in states])
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else V for s in states])
    top_p = torch.tensor([s.params.top_p for s in states])
    min_p = torch.tensor([s.params.min_p for s in states])
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        sp, si = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V)[None, :]
        cum = sp.cumsum(dim=-1)
        drop = (rank >= top_k[:, None]) | ((cum - sp) >= top_p[:, None])
        drop[:, 0] = False
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, si, sp)
    if bool((min_p > 0).any()):
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    greedy = torch.tensor([s.params.greedy for s in states])
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draw(probs: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """One sample per row; seeded rows use their own generator (reproducible in any batch)."""
    noise = torch.empty_like(probs)
    shared = [b for b, s in enumerate(states) if s.generator is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_()
    for b, s in enumerate(states):
        if s.generator is not None:
            noise[b] = torch.empty(probs.shape[1]).exponential_(generator=s.generator)
    return (probs / noise).argmax(dim=-1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` -> the index of each row's first maximum: ``argmax``'s answer (ties and NaN alike),
    through ``max``, which is ~3x faster on CPU (32 x 32000 fp32, 2 threads: 258 vs 764 us)."""
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> SampleResult:
    """logits [B, V] fp32 -> one token per request (greedy rows: argmax)."""
    logits = apply_penalties(logits.float().clone() if any(s.params.has_penalties for s in states)
                             else logits.float(), states)
    if all(s.params.greedy for s in states):
        ids = greedy_ids(logits)
    else:
        ids = draw(probs_from_logits(logits, states), states)
    n = max(s.params.logprobs for s in states)
    if n == 0:
        return SampleResult(ids, None, None, None)
    lp = torch.log_softmax(logits, dim=-1)
    top = lp.topk(n, dim=-1)
    return SampleResult(ids, lp.gather(1, ids[:, None])[:, 0], top.indices, top.values)
