"""Arrival processes for open-loop load.

Poisson arrivals at rate ``λ`` have exponential inter-arrival times with mean ``1/λ`` (the memoryless
stream of independent users; the convention of vLLM's and SGLang's serving benchmarks). The schedule is
drawn up front from its own seeded stream, so it does not depend on how fast the server answers.
"""
from __future__ import annotations

import numpy as np

_ARRIVAL_STREAM = 0x5EED_00A1


def poisson_arrivals(rate: float, horizon_s: float, seed: int, step: int = 0) -> np.ndarray:
    """Send times in ``[0, horizon_s)`` of a Poisson process with ``rate`` requests/s; ``step`` picks an
    independent stream per sweep step.  Returns a sorted float64 array (may be empty)."""
    if not rate > 0 or horizon_s < 0:
        raise ValueError(f"need rate > 0 and horizon_s >= 0, got {rate} and {horizon_s}")
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM, step])
    # Draw in blocks of the expected count plus slack until the horizon is covered.
    times: list[np.ndarray] = []
    t = 0.0
    block = max(16, int(rate * horizon_s * 1.2) + 16)
    while t < horizon_s:
        gaps = rng.exponential(1.0 / rate, block)
        ts = t + np.cumsum(gaps)
        times.append(ts)
        t = float(ts[-1])
    out = np.concatenate(times) if times else np.empty(0)
    return out[out < horizon_s]
