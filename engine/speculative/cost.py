"""A cost model for the draft length: per step, the number of drafts that maximizes expected tokens per second.

Speculation's speed-up is not the acceptance length: a step that drafts ``k`` tokens costs ``k - 1`` MTP
forwards, a target verify of ``k + 1`` tokens per request and the draft extend, and on an MoE the verify
reads the union of the experts its ``k + 1`` tokens route to (up to 48 of 64 experts for 6 tokens top-8),
so at a large batch (every expert already read by plain decode) or a low acceptance it can lose. The model:

* ``T(b, n)``: seconds of a whole speculative step (drafts, verify, extend) at batch bucket ``b`` (the batch
  size rounded up to a power of two) with ``n = k + 1`` tokens per request; ``n = 1`` is the plain step
  (``k = 0``: no draft forward, a 1-token verify and a 1-token extend, which keeps the MTP KV so a later step
  can speculate again). An EMA of observed durations (``ema`` the weight of a new one).
* ``a``: the per-draft acceptance, accepted / tested drafts over the recent steps (counts decayed by ``decay``
  per step, ``prior_accept`` with weight ``prior_weight`` before any), what a chain of i.i.d. drafts accepts.
* the expected tokens per request of a ``k`` chain: ``L(a, k) = (1 - a^(k+1)) / (1 - a)``
  (``engine.speculative.oracle.chain_accept_len``), so the rate is ``b * L(a, k) / T(b, k + 1)`` and
  ``choose`` takes the best ``k`` in ``0 .. max_drafts`` (ties: the shorter draft).

An option never measured at a bucket is run once first (exploration), and every ``probe_every`` steps of
a bucket the option measured longest ago is run once (its time and, for ``k > 0``, the acceptance stay
fresh while plain decoding); probes are counted, not logged. A change of the chosen length at a bucket is
logged. Greedy chains only (a tree's acceptance is not ``L(a, k)``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.speculative.oracle import chain_accept_len

logger = logging.getLogger(__name__)


def batch_bucket(batch_size: int) -> int:
    """The batch size rounded up to a power of two (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass(frozen=True, slots=True)
class DraftCostConfig:
    max_drafts: int
    """The longest chain (``SpecConfig.num_steps``); ``choose`` answers ``0 .. max_drafts``."""
    ema: float = 0.2
    """Weight of a new step duration in its (bucket, tokens per request) average."""
    decay: float = 0.98
    """Per-step decay of the accepted / tested draft counts (~50 steps of memory)."""
    prior_accept: float = 0.5
    """Per-draft acceptance assumed before any draft is tested."""
    prior_weight: float = 4.0
    """Drafts' worth of weight of ``prior_accept``."""
    probe_every: int = 64
    """Steps of a bucket between two re-measurements of its stalest option (0: never)."""

    def __post_init__(self) -> None:
        if self.max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {self.max_drafts}")
        if not 0.0 < self.ema <= 1.0 or not 0.0 < self.decay <= 1.0:
            raise ValueError(f"ema and decay must be in (0, 1], got {self.ema}, {self.decay}")
        if not 0.0 <= self.prior_accept <= 1.0 or self.prior_weight <= 0.0 or self.probe_every < 0:
            raise ValueError(f"bad prior / probe settings: {self}")


class DraftChoice(NamedTuple):
    num_drafts: int
    reason: str
    """``best`` (the model's pick), ``explore`` (never measured here) or ``probe`` (re-measured)."""


@dataclass(slots=True)
class _Bucket:
    step_s: dict[int, float] = field(default_factory=dict)
    """Tokens per request -> EMA seconds of a step."""
    last_seen: dict[int, int] = field(default_factory=dict)
    """Tokens per request -> this bucket's step count when it was last measured."""
    num_steps: int = 0
    best: int = -1
    """The last ``best`` choice (-1: none yet)."""


class DraftCostModel:
    """``choose(batch_size)`` before a step, ``observe(...)`` after it (see the module docstring)."""

    def __init__(self, config: DraftCostConfig) -> None:
        self.config = config
        self._buckets: dict[int, _Bucket] = {}
        self._accepted = 0.0
        self._tested = 0.0
        self.num_drafts = config.max_drafts
        """The last choice (exported as a gauge)."""
        self.steps_by_drafts = [0] * (config.max_drafts + 1)
        """``[k]``: steps run with ``k`` drafts (exploration and probes included)."""
        self.num_changes = 0
        """Times the best length at a bucket changed."""

    @property
    def accept_rate(self) -> float:
        """Per-draft acceptance ``a`` (decayed counts with the prior)."""
        c = self.config
        return (self._accepted + c.prior_accept * c.prior_weight) / (self._tested + c.prior_weight)

    def step_s(self, batch_size: int, tokens_per_request: int) -> float | None:
        """EMA seconds of a step (None: not measured at this bucket)."""
        b = self._buckets.get(batch_bucket(batch_size))
        return None if b is None else b.step_s.get(tokens_per_request)

    def tokens_per_s(self, batch_size: int, num_drafts: int) -> float | None:
        """Expected tokens per second of a ``num_drafts`` step at ``batch_size`` (None: not measured)."""
        t = self.step_s(batch_size, num_drafts + 1)
        if t is None:
            return None
        return batch_bucket(batch_size) * chain_accept_len(self.accept_rate, num_drafts) / max(t, 1e-12)

    def best(self, batch_size: int) -> int:
        """The measured option with the highest expected tokens per second (the shorter one on a tie)."""
        rates = [(r, -k) for k in range(self.config.max_drafts + 1)
                 if (r := self.tokens_per_s(batch_size, k)) is not None]
        return -max(rates)[1] if rates else self.config.max_drafts

    def choose(self, batch_size: int) -> DraftChoice:
        c, bb = self.config, batch_bucket(batch_size)
        b = self._buckets.setdefault(bb, _Bucket())
        options = range(c.max_drafts, -1, -1)  # the full draft first
        unmeasured = [k for k in options if k + 1 not in b.step_s]
        if unmeasured:
            choice = DraftChoice(unmeasured[0], "explore")
        elif c.probe_every and b.num_steps and b.num_steps % c.probe_every == 0:
            choice = DraftChoice(min(options, key=lambda k: b.last_seen[k + 1]), "probe")
        else:
            choice = DraftChoice(self.best(batch_size), "best")
            if choice.num_drafts != b.best:
                if b.best >= 0:
                    self.num_changes += 1
                logger.info("speculation at batch <= %d: %d drafts per step (was %s; accept rate %.3f, expected "
                            "%s tok/s by drafts)", bb, choice.num_drafts, b.best if b.best >= 0 else "unset",
                            self.accept_rate, [round(self.tokens_per_s(batch_size, k) or 0.0, 1)
                                               for k in range(c.max_drafts + 1)])
                b.best = choice.num_drafts
        self.num_drafts = choice.num_drafts
        return choice

    def observe(self, batch_size: int, num_drafts: int, step_s: float | None, num_accepted: int,
                num_tested: int) -> None:
        """After a step: its duration (None: a mixed step, some requests drafted less; not timed) and the
        drafts tested / accepted over its requests."""
        c = self.config
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        b.num_steps += 1
        self.steps_by_drafts[num_drafts] += 1
        self._accepted = self._accepted * c.decay + num_accepted
        self._tested = self._tested * c.decay + num_tested
        if step_s is not None:
            n = num_drafts + 1
            old = b.step_s.get(n)
            b.step_s[n] = step_s if old is None else old + c.ema * (step_s - old)
            b.last_seen[n] = b.num_steps
