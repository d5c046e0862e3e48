"""How the decode scheduler speculates: one adapter between it and a ``Speculator``.

The scheduler hands every step's running requests to ``SpeculationAdapter.step``, which runs one speculative
round (draft + verify) for the requests speculation still pays for and the scheduler's plain step for the
others. It measures what a round costs in plain steps (round time / its verify forward's time, an EMA) and,
with ``DecodeConfig.spec_fallback``, moves a request whose tokens per round stay below that cost to plain
decoding after ``spec_probe_rounds`` rounds (``DecodeTask.spec_off``, for the rest of the request: its MTP
KV is no longer kept). Greedy output is the same either way.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from decode.config import DecodeConfig
from decode.task import DecodeTask

logger = logging.getLogger(__name__)


class Speculator(Protocol):
    """A speculative decoder: one draft + verify round for a batch; returns new tokens per task."""

    def step(self, tasks: list[DecodeTask], ensure_pages: Callable[[DecodeTask, int], None]) -> list[list[int]]: ...

    def accept_len(self, task: DecodeTask) -> float: ...

    @property
    def last_verify_s(self) -> float: ...


class SpeculationAdapter:
    """The decode scheduler's one way to speculation (see the module doc)."""

    def __init__(self, speculator: Speculator, config: DecodeConfig) -> None:
        self.speculator, self.config = speculator, config
        self.num_fallbacks = 0
        """Requests switched to plain decoding."""
        self.round_cost = 0.0
        """EMA of a speculative round's time over its verify forward's time (~ plain steps per round)."""

    def step(self, tasks: list[DecodeTask], ensure_pages: Callable[[DecodeTask, int], None],
             plain_step: Callable[[list[DecodeTask]], list[list[int]]]) -> list[list[int]]:
        """One speculative round for the requests it pays for, ``plain_step`` for the others -> new tokens
        per task (untruncated; the scheduler checks stop conditions)."""
        spec = [t for t in tasks if not t.spec_off]
        plain = [t for t in tasks if t.spec_off]
        out: dict[str, list[int]] = {}
        if spec:
            t0 = time.perf_counter()
            toks = self.speculator.step(spec, ensure_pages)
            dt, verify = time.perf_counter() - t0, self.speculator.last_verify_s
            if verify > 0:
                ratio = dt / verify
                self.round_cost = ratio if not self.round_cost else 0.8 * self.round_cost + 0.2 * ratio
            for t, tk in zip(spec, toks):
                out[t.req_id] = tk
                if tk:
                    t.spec_rounds += 1
                    t.spec_tokens += len(tk)
                    self._maybe_fall_back(t)
        if plain:
            for t, tk in zip(plain, plain_step(plain)):
                out[t.req_id] = tk
        return [out.get(t.req_id, []) for t in tasks]

    def accept_len(self, task: DecodeTask) -> float:
        """Tokens per round of ``task`` (a request that stopped speculating reports its rounds' figure)."""
        return task.spec_tokens / task.spec_rounds if task.spec_off else self.speculator.accept_len(task)

    def _maybe_fall_back(self, task: DecodeTask) -> None:
        if not self.config.spec_fallback or task.spec_rounds < self.config.spec_probe_rounds or not self.round_cost:
            return
        per_round = task.spec_tokens / task.spec_rounds
        if per_round < self.round_cost:
            task.spec_off = True
            task.mtp_len = task.cached_len  # plain steps from here on write no MTP KV
            self.num_fallbacks += 1
            logger.info("%s: speculation off (%.2f tokens per round, a round costs %.2f plain steps)",
                        task.req_id, per_round, self.round_cost)
