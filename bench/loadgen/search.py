"""The knee search of ``--rps auto`` / ``--concurrency auto``: which rate to run next, given what the
steps so far said.

    RAMP      start, 2x start, 4x start, ... (the last one capped at max_rate) until a step breaks the SLO
    BISECT    between the last good and the first bad rate, halving the bracket until first_bad - last_good
              <= resolution (a share of last_good, or an absolute rate; concurrency stops one apart)
    SATURATE  one step at SATURATION_FACTOR x the knee, so the report shows the throughput flattening while the
              offered load keeps growing (skipped when an earlier step already ran that high). It also confirms
              the break: if it passes the SLO, the bracket was noise (a busy machine, a cold prefix cache) and
              the search goes back to RAMP from this rate.
    DONE      with a StopReason

A step is good when it is within the SLO (``StepStats.within_slo``: TTFT p95 and success rate). The search
never decides on the time bound: the sweep asks ``next_rate()`` only while a step still fits its budget, and
calls ``stop(StopReason.TIME)`` otherwise. The reported knee is computed from the steps afterwards
(``stats.find_knee``), so a list sweep and an auto sweep are judged by one rule.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

RAMP_FACTOR = 2.0
SATURATION_FACTOR = 1.5


class Phase(enum.Enum):
    RAMP = "ramp"
    BISECT = "bisect"
    SATURATE = "saturate"
    DONE = "done"


class StopReason(enum.Enum):
    RESOLUTION = "the bracket is within the resolution"
    MAX_RATE = "max rate reached within the SLO"
    LOWEST_BREAKS = "the first rate already breaks the SLO"
    TIME = "the time bound (--max-duration) left no room for another step"
    EMPTY = "a step had no request in its window (lengthen --duration): it says nothing about the SLO"


@dataclass(frozen=True, slots=True)
class SearchConfig:
    kind: str
    """'rps' or 'concurrency' (integer rates)."""
    start: float
    """First rate of the ramp."""
    max_rate: float
    """The ramp's last rate."""
    resolution: str
    """BenchConfig.resolution: '10%' or an absolute rate."""

    def __post_init__(self) -> None:
        if not 0 < self.start <= self.max_rate:
            raise ValueError(f"need 0 < start <= max_rate, got start={self.start} max_rate={self.max_rate}")


class KneeSearch:
    """Proposes rates; ``record(rate, within)`` after every step. ``resolution_for(good)`` is the stop width."""

    def __init__(self, cfg: SearchConfig, resolution_for) -> None:
        self.cfg, self.resolution_for = cfg, resolution_for
        self.phase = Phase.RAMP
        self.stop_reason: StopReason | None = None
        self.last_good: float | None = None
        self.first_bad: float | None = None
        self.tested: dict[float, bool] = {}
        self.noise: list[float] = []
        """First-bad rates that a higher passing rate showed to be noise."""

    def _integer(self, rate: float, up: bool) -> float:
        if self.cfg.kind != "concurrency":
            return rate
        return float(max(1, math.ceil(rate) if up else math.floor(rate)))

    def stop(self, reason: StopReason) -> None:
        self.phase, self.stop_reason = Phase.DONE, reason

    def next_rate(self) -> float | None:
        """The next rate to run, or None when the search is done (``stop_reason`` says why)."""
        if self.phase is Phase.RAMP:
            if self.last_good is None:
                return self._integer(self.cfg.start, up=True)
            if self.last_good >= self.cfg.max_rate:
                self.stop(StopReason.MAX_RATE)
                return None
            return min(self._integer(self.last_good * RAMP_FACTOR, up=True), self.cfg.max_rate)
        if self.phase is Phase.BISECT:
            good, bad = self.last_good, self.first_bad
            mid = self._integer((good + bad) / 2, up=False)
            if bad - good <= self.resolution_for(good) or not good < mid < bad:
                self.phase = Phase.SATURATE
                return self.next_rate()
            rounded = float(f"{mid:.3g}")  # short labels: "rps 1.41", not "rps 1.4142135"
            return rounded if good < rounded < bad else mid
        if self.phase is Phase.SATURATE:
            target = self._integer(self.last_good * SATURATION_FACTOR, up=True)
            if any(r >= target for r in self.tested):
                self.stop(StopReason.RESOLUTION)
                return None
            return target
        return None

    def record(self, rate: float, within: bool, empty: bool = False) -> None:
        """What the step at ``rate`` said; ``empty``: it measured no request (the search cannot go on)."""
        self.tested[rate] = within
        if empty:
            self.stop(StopReason.EMPTY)
            return
        if self.phase is Phase.SATURATE:
            if not within:
                self.stop(StopReason.RESOLUTION)
                return
            self.noise.append(self.first_bad)  # the server served more than the "break": ramp on from here
            self.last_good, self.first_bad, self.phase = rate, None, Phase.RAMP
            return
        if within:
            if self.first_bad is None or rate < self.first_bad:
                self.last_good = max(rate, self.last_good or rate)
            return
        self.first_bad = min(rate, self.first_bad or rate)
        if self.last_good is None or self.first_bad <= self.last_good:
            self.stop(StopReason.LOWEST_BREAKS)
        elif self.phase is Phase.RAMP:
            self.phase = Phase.BISECT
