"""Routing policies. Prefill policies register by name; decode ordering and the local-prefill decision are
plain functions.

A policy sees ``Candidate`` views (id, load, pages) of the workers currently in rotation, never the
workers themselves, so it is pure and cheap to benchmark. ``load`` is what the router knows best: the
calls it has outstanding at the worker, or the worker's own running + queued count when that is higher
(another router may be sending work too).
"""
from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple, Sequence

from router.config import RouterConfig
from router.prefix_index import PrefixIndex, PromptHashes


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    load: int
    """Outstanding requests at the worker."""
    pages_free: int = 0
    pages_total: int = 0
    supports_local_prefill: bool = False
    """Decode workers only: the worker can prefill a prompt itself (unless its ``info['local_prefill'] == '0'``)."""


class Choice(NamedTuple):
    worker_id: str
    matched_tokens: int
    """Prompt tokens the chosen worker is believed to hold (0 unless cache-aware)."""
    reason: str


class PrefillPolicy(abc.ABC):
    """Picks one prefill worker for a prompt. ``candidates`` is never empty; ``prompt`` may be None
    (no page size known yet). Implementations must be fast: they run once per request on the event loop."""

    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Candidate], prompt: PromptHashes | None, index: PrefixIndex) -> Choice: ...


POLICIES: dict[str, Callable[[RouterConfig], PrefillPolicy]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


def make_policy(cfg: RouterConfig) -> PrefillPolicy:
    return POLICIES[cfg.routing](cfg)


@register("round_robin")
class RoundRobinPolicy(PrefillPolicy):
    def __init__(self, cfg: RouterConfig | None = None) -> None:
        self._next = 0

    def choose(self, candidates, prompt, index):
        c = candidates[self._next % len(candidates)]
        self._next += 1
        return Choice(c.worker_id, 0, "round_robin")


@register("random")
class RandomPolicy(PrefillPolicy):
    def __init__(self, cfg: RouterConfig | None = None, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates, prompt, index):
        return Choice(self._rng.choice(candidates).worker_id, 0, "random")


@register("least_load")
class LeastLoadPolicy(PrefillPolicy):
    def __init__(self, cfg: RouterConfig | None = None) -> None:
        self._tie = 0

    def choose(self, candidates, prompt, index):
        self._tie += 1
        n = len(candidates)
        # rotate the tie-break so equal loads spread instead of piling on the first worker
        best = min(range(n), key=lambda i: (candidates[i].load, (i - self._tie) % n))
        return Choice(candidates[best].worker_id, 0, "least_load")


@register("cache_aware")
class CacheAwarePolicy(PrefillPolicy):
    """SGLang-style: when loads are imbalanced (max - min > abs threshold and max > rel threshold * min)
    route to the least-loaded worker; otherwise to the longest prefix the workers really hold (their cache
    events), ties going to the lighter load and then to the worker holding fewer blocks (spreads the cache).
    A prefix's blocks in a worker's host tier count ``host_hit_weight`` each, in its disk tier
    ``disk_hit_weight``, its KV pool's 1: for the same length a device hit beats a host hit, which beats a disk
    hit, which beats nothing."""

    def __init__(self, cfg: RouterConfig | None = None) -> None:
        cfg = cfg or RouterConfig()
        self.abs_threshold = cfg.balance_abs_threshold
        self.rel_threshold = cfg.balance_rel_threshold
        self.host_weight = cfg.host_hit_weight
        self.disk_weight = cfg.disk_hit_weight
        self._least = LeastLoadPolicy()
        self._tie = 0

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold

    def choose(self, candidates, prompt, index):
        if prompt is None or len(candidates) == 1 or self.imbalanced(candidates):
            c = self._least.choose(candidates, prompt, index)
            return Choice(c.worker_id, 0, "least_load" if len(candidates) > 1 else "only")
        matched = index.match_tiers(prompt, [c.worker_id for c in candidates])
        self._tie += 1
        n = len(candidates)

        def key(i: int):
            c = candidates[i]
            m = matched[c.worker_id]
            return (-(m.device + self.host_weight * m.host + self.disk_weight * m.disk), c.load, index.num_blocks(c.worker_id),
                    (i - self._tie) % n)
        best = candidates[min(range(n), key=key)]
        m = matched[best.worker_id]
        reason = "prefix" if m.device else "host_prefix" if m.host else "disk_prefix" if m.disk else "cold"
        return Choice(best.worker_id, (m.device + m.host + m.disk) * prompt.page_size, reason)


def order_decode(candidates: Sequence[Candidate], need_pages: int, resident: dict[str, int] | None = None,
                 tokens_per_load: int = 0, max_credit: float = 0.0) -> list[Candidate]:
    """Decode workers in the order to try a reservation: those whose last known free pages fit the request
    first, by fewest running requests then most free pages; the rest after (their numbers may be stale).

    Residency (decode-side prefix reuse): ``resident`` maps a worker to the prompt tokens it already holds (its
    prefix cache events); each ``tokens_per_load`` of them take one request off its load, at most ``max_credit``
    requests, so the worker holding a session's last turn gets its next one unless it is that much busier
    (resident prefix vs decode load: crowding one worker with its sessions slows all its streams)."""
    resident = resident or {}

    def credit(c: Candidate) -> float:
        return min(max_credit, resident.get(c.worker_id, 0) / tokens_per_load) if tokens_per_load else 0.0

    def key(c: Candidate):
        return (c.pages_free < need_pages, c.load - credit(c), -resident.get(c.worker_id, 0), -c.pages_free)
    return sorted(candidates, key=key)


def use_local_prefill(prompt_len: int, cfg: RouterConfig, decode: Candidate) -> bool:
    """Conditional disaggregation: prefill short prompts (every prompt when ``cfg.aggregated``) on the decode
    worker itself when it can."""
    return (cfg.aggregated or prompt_len < cfg.local_prefill_below) and decode.supports_local_prefill
