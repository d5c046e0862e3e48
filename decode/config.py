"""The decode scheduler's settings (``decode.scheduler.DecodeScheduler``) and a decode worker's flags
(``DecodeWorkerConfig``, read by ``decode.server``)."""
from __future__ import annotations

from dataclasses import dataclass

from worker.config import PREFIX_CACHE_CHOICES, WorkerConfig


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    max_running: int = 64
    """Requests running or on their way (reserved transfers, local prefills) at once; ``Reserve`` refuses past it."""
    spec_fallback: bool = True
    """Switch a request to plain decoding once its speculation costs more than it gains: after
    ``spec_probe_rounds`` rounds, if its tokens per round are below the round's cost in plain steps (round time
    / its verify forward's time, both measured by the worker). Greedy output is unchanged; the request's MTP KV
    is no longer kept, so the switch is for the rest of the request."""
    spec_probe_rounds: int = 8
    """Speculative rounds a request runs before ``spec_fallback`` judges it."""
    recompute_chunk: int = 2048
    """Tokens per forward when a preempted request's KV is recomputed."""
    prefill_chunk: int = 2048
    """Local prefill (``add_local``: conditional disaggregation, or every prompt in aggregated mode): tokens of one
    prompt per step; a longer prompt continues over the next steps, decode steps of the running requests between."""
    prefill_budget: int = 2048
    """Local prefill tokens of all prompts in one step (one forward, then one decode step over the running
    requests): bounds how long a prefilling prompt holds up the streams that are running. At least
    ``prefill_chunk``."""

    prefill_threads: int = 0
    """torch intra-op threads of a local prefill forward (0: the process's setting, which decode steps keep), for a
    worker whose decode steps run on fewer threads than its share of the cores (``--threads-per-worker``). The one-
    thread decode default this was made for (2 cores: two decode threads had stalled) is gone: the stall was a second
    OpenMP team in the process (``worker.omp``; docs/performance.md)."""

    def __post_init__(self) -> None:
        if self.prefill_threads < 0:
            raise ValueError(f"prefill_threads must be >= 0, got {self.prefill_threads}")
        for name in ("max_running", "spec_probe_rounds", "recompute_chunk", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_budget < self.prefill_chunk:
            raise ValueError(f"prefill_budget ({self.prefill_budget}) must be >= prefill_chunk "
                             f"({self.prefill_chunk})")


@dataclass(frozen=True, slots=True)
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker's flags: the common ones, its KV port, speculation and its scheduler's
    (``DecodeConfig``)."""

    kv_port: int = 0
    """port of the KV data plane (0: any free port, printed in the PDSERVE_READY line)"""
    speculative: str = "5/1/6"
    """STEPS/TOPK/DRAFT_TOKENS, or 'off'"""
    no_speculative: bool = False
    """decode without speculation (as --speculative off)"""
    spec_cost_model: bool = False
    """choose each speculative step's draft length (0: a plain step) from measured step times and the running
    acceptance (engine/speculative/cost.py; greedy chains, TOPK 1)"""
    no_spec_fallback: bool = False
    """keep speculating for every request even when its drafts are rarely accepted (default: a request whose
    tokens per round stay below a round's cost in plain steps decodes plainly)"""
    max_running: int = 64
    """requests running or on their way (reserved transfers, local prefills) at once; Reserve refuses past it"""
    prefill_chunk: int = 2048
    """local prefill (aggregated mode, --local-prefill-below): prompt tokens per step, decode steps between"""
    prefill_budget: int = 2048
    """local prefill tokens of all prompts in one step (at least --prefill-chunk)"""
    prefill_threads: int = 0
    """torch threads of local prefill forwards (0: --threads; decode steps keep --threads)"""
    compile: bool = False
    """run decode / verify steps through compiled graphs (torch.compile; warmed up before serving)"""
    quantized_model: str | None = None
    """serve these (e.g. MXFP4) weights instead"""
    shm: bool = False
    """put the KV pool in shared memory (same-host transfers)"""
    prefix_cache: str = "on"
    """keep finished requests' KV pages as an evictable prefix cache (decode-side reuse: the next turn of a session
    ships only the tail of its prompt) or off"""

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_CACHE_CHOICES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHE_CHOICES}, got {self.prefix_cache!r}")
