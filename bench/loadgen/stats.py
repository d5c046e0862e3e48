"""From one step's request records to its figures, and the knee of a sweep.

Definitions (``window`` is the step's measured window, ``measured`` the requests sent inside it):
- offered RPS: requests scheduled inside the window / window length (the Poisson draw's rate).
- sustained RPS: successful requests that *finished* inside the window / window length; under overload it
  falls below the offered rate. It can exceed it only by requests carried in from before the window
  (``num_carried_in``: the warm-up's backlog finishing inside the window), which the report states.
- tok/s (per node): prompt tokens of successful requests whose first token arrived in the window, plus
  their output tokens that arrived in the window, / window length / nodes.
- latencies (measured, successful requests; percentiles interpolate linearly, as numpy's default):
  TTFT = send -> first token; ITL = gap between consecutive token-carrying chunks (a speculative chunk
  carries several tokens: one gap); TPOT = (last token - first token) / (tokens - 1) per request;
  E2E = send -> end of stream; stream tok/s = 1 / TPOT (output speed after the first token).
- success rate: OK / measured; every other status is counted by name in ``failures``.
- cache hit: sum usage.cached_tokens / sum usage.prompt_tokens over measured successful requests.
- goodput: measured successful requests meeting every SLO term / window length.
- within SLO (the knee test): TTFT p95 <= SLO ttft and success rate >= SLO success.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.runner import RequestRecord, StepRecords

DRIFT_WARN = 2.0
"""TTFT median of the window's second half over its first half beyond which a step is flagged unsteady."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True, slots=True)
class Dist:
    """Summary of one latency (seconds) or rate."""
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values: Iterable[float]) -> "Dist":
        v = [x for x in values if x is not None and math.isfinite(x)]
        if not v:
            return cls()
        return cls(percentile(v, 50), percentile(v, 95), percentile(v, 99), float(np.mean(v)), len(v))


@dataclass(frozen=True, slots=True)
class StepStats:
    label: str
    kind: str
    rate: float
    """The swept value: requests/s, concurrency or trace speed-up."""
    window_s: float
    num_sent: int
    """All requests of the step, warm-up included."""
    num_measured: int
    num_ok: int
    success_rate: float | None
    failures: dict[str, int]
    """Measured requests per failure status (gRPC code name, finish:error, DRAIN_TIMEOUT, ...)."""
    failure_examples: dict[str, str]
    """One server message per failure status."""
    offered_rps: float
    """Requests scheduled inside the window / window (the Poisson draw's actual rate, not the nominal one)."""
    sustained_rps: float
    num_carried_in: int
    """Successful requests that finished inside the window but were scheduled before it (warm-up backlog):
    why the sustained rate can exceed the offered one."""
    input_tok_s: float
    """Per node."""
    output_tok_s: float
    """Per node."""
    total_tok_s: float
    """Per node: input + output."""
    ttft: Dist
    itl: Dist
    tpot: Dist
    e2e: Dist
    stream_tok_s: Dist
    server_ttft: Dist
    queue: Dist
    """Time in prefill workers' queues."""
    router_queue: Dist
    """Time in the router's admission queue, waiting for decode room (part of TTFT)."""
    prefill: Dist
    cache_hit: float | None
    target_cache_hit: float
    kv_bytes_per_req: float | None
    kv_s_per_req: float | None
    accept_len: float | None
    goodput_rps: float
    goodput_frac: float | None
    within_slo: bool
    length_mismatches: int
    """Successful requests whose completion_tokens differ from the requested output length."""
    send_lag_p95_s: float | None
    """How late the client sent versus its schedule (a loaded client inflates TTFT by about this)."""
    ttft_drift: float | None
    """TTFT median of the window's second half / first half; >> 1: a queue is building (not steady)."""
    cost_per_mtok: float | None = None
    cost_per_mtok_output: float | None = None
    tok_per_joule: float | None = None
    warnings: list[str] = field(default_factory=list)


def _meets(r: RequestRecord, slo: Slo) -> bool:
    tpot, e2e = r.tpot_s, r.e2e_s
    return (r.ttft_s is not None and r.ttft_s <= slo.ttft_s
            and (slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s)
            and (slo.e2e_s is None or (e2e is not None and e2e <= slo.e2e_s)))


def _throughput(sr: StepRecords) -> tuple[float, float, int, int]:
    """(input tokens, output tokens, completed requests, of those scheduled before the window) inside the
    window, successful requests only."""
    ws, we = sr.window_start_s, sr.window_end_s
    inp = out = done = carried = 0
    for r in sr.records:
        if not r.ok:
            continue
        if r.t_first is not None and ws <= r.t_first < we:
            inp += r.prompt_tokens or r.input_len
        out += sum(n for t, n in zip(r.chunk_times, r.chunk_tokens) if ws <= t < we)
        ended = r.t_end is not None and ws <= r.t_end < we
        done += ended
        carried += ended and r.t_sched < ws
    return inp, out, done, carried


def _drift(ok: list[RequestRecord]) -> float | None:
    by_send = sorted(ok, key=lambda r: r.t_send)
    half = len(by_send) // 2
    if half < 2:
        return None
    first = percentile([r.ttft_s for r in by_send[:half]], 50)
    second = percentile([r.ttft_s for r in by_send[half:]], 50)
    return second / first if first and first > 0 else None


def step_stats(sr: StepRecords, cfg: BenchConfig) -> StepStats:
    measured = sr.measured
    ok = [r for r in measured if r.ok]
    bad = [r for r in measured if not r.ok]
    window, nodes, slo = sr.window_s, cfg.nodes, cfg.slo
    inp, out, done, carried = _throughput(sr)
    ttft = Dist.of(r.ttft_s for r in ok)
    success = len(ok) / len(measured) if measured else None
    prompt = sum(r.prompt_tokens for r in ok)
    good = sum(_meets(r, slo) for r in ok)
    accept = [r.accept_len for r in ok if r.accept_len > 0]
    total_tok_s = (inp + out) / window / nodes
    output_tok_s = out / window / nodes
    warnings = []
    if not measured:
        warnings.append(f"{sr.step.label}: no request was sent in the measured window; lengthen --duration")
    drift = _drift(ok)
    if drift is not None and drift > DRIFT_WARN:
        warnings.append(f"{sr.step.label}: TTFT grew {drift:.1f}x across the window - a queue is building "
                        "(offered load beyond capacity, not a steady state)")
    mismatches = sum(r.completion_tokens != r.output_len for r in ok)
    if mismatches:
        warnings.append(f"{sr.step.label}: {mismatches} requests returned a different number of tokens than asked")
    cost = cfg.cost_per_hour
    return StepStats(
        label=sr.step.label, kind=sr.step.kind, rate=sr.step.value, window_s=window, num_sent=len(sr.records),
        num_measured=len(measured), num_ok=len(ok), success_rate=success,
        failures=dict(sorted(Counter(r.status for r in bad).items())),
        failure_examples={r.status: r.detail for r in reversed(bad)},
        offered_rps=len(measured) / window, sustained_rps=done / window, num_carried_in=carried,
        input_tok_s=inp / window / nodes, output_tok_s=output_tok_s, total_tok_s=total_tok_s,
        ttft=ttft, itl=Dist.of(g for r in ok for g in np.diff(r.chunk_times).tolist()),
        tpot=Dist.of(r.tpot_s for r in ok), e2e=Dist.of(r.e2e_s for r in ok),
        stream_tok_s=Dist.of(1.0 / r.tpot_s for r in ok if r.tpot_s), server_ttft=Dist.of(r.server_ttft_s for r in ok),
        queue=Dist.of(r.queue_s for r in ok), router_queue=Dist.of(r.router_queue_s for r in ok), prefill=Dist.of(r.prefill_s for r in ok),
        cache_hit=sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        target_cache_hit=cfg.cache_hit,
        kv_bytes_per_req=float(np.mean([r.kv_transfer_bytes for r in ok])) if ok else None,
        kv_s_per_req=float(np.mean([r.kv_transfer_s for r in ok])) if ok else None,
        accept_len=float(np.mean(accept)) if accept else None,
        goodput_rps=good / window, goodput_frac=good / len(measured) if measured else None,
        within_slo=bool(ok) and ttft.p95 is not None and ttft.p95 <= slo.ttft_s and success >= slo.min_success,
        length_mismatches=mismatches,
        send_lag_p95_s=percentile([r.t_send - r.t_sched for r in measured], 95), ttft_drift=drift,
        cost_per_mtok=cost / (total_tok_s * 3600) * 1e6 if cost and total_tok_s > 0 else None,
        cost_per_mtok_output=cost / (output_tok_s * 3600) * 1e6 if cost and output_tok_s > 0 else None,
        tok_per_joule=total_tok_s / cfg.power_watts if cfg.power_watts else None,
        warnings=warnings)


class Knee(NamedTuple):
    """Where a sweep crossed its SLO, as indices into its steps."""
    last_good: int | None
    """The highest rate within the SLO (None: every rate broke it)."""
    first_bad: int | None
    """The lowest rate above ``last_good``: it and every rate above it broke the SLO (None: none did)."""
    noise: tuple[int, ...] = ()
    """Rates that broke the SLO below ``last_good``: a higher rate passed, so they are not the capacity."""

    @property
    def found(self) -> bool:
        """A knee exists only where the sweep crossed the SLO: a good rate below the bad ones."""
        return self.last_good is not None and self.first_bad is not None


def find_knee(rates: Sequence[float], within: Sequence[bool]) -> Knee:
    """The knee: the highest rate within the SLO, if the rates above it all broke it.

    The break is confirmed from above: a rate that broke the SLO below one that passed is reported as noise
    (a busy machine, a cold prefix cache), not as the capacity, since the server demonstrably served more.
    ``last_good`` is None when every rate violates the SLO, ``first_bad`` None when the highest rate passed
    (then there is no knee, only "none up to the highest rate").
    """
    if len(rates) != len(within):
        raise ValueError(f"rates and within must have one length, got {len(rates)} and {len(within)}")
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    cut = max((pos + 1 for pos, i in enumerate(order) if within[i]), default=0)  # past the highest good rate
    return Knee(order[cut - 1] if cut else None, order[cut] if cut < len(order) else None,
                tuple(i for i in order[:cut] if not within[i]))
