"""What the prefill scheduler keeps per request, its configuration, and what a request's ``on_done`` receives."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.kvcache.radix import Match
from engine.sampling import SamplingParams
from prefill.admission import Prefetch
from prefill.sink import KVSink, LocalSink


class QueueFull(RuntimeError):
    pass


class RequestAborted(RuntimeError):
    def __init__(self, req_id: str, reason: str) -> None:
        super().__init__(f"request {req_id} aborted: {reason}")
        self.reason = reason


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    TRANSFERRING = "transferring"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


LOAD_TIMEOUT_S = 2.0
"""Default seconds a request waits for its prefix to load from the host / disk tier (``--load-timeout-s``)."""


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    chunk_size: int = 2048
    """Max new tokens of one request per forward (a 20k prompt takes 10 steps)."""
    max_batch_tokens: int = 4096
    """Token budget of one forward over all scheduled chunks."""
    max_queue: int = 64
    """Queued requests beyond this are refused (RESOURCE_EXHAUSTED), never buffered."""
    max_running: int = 16
    load_timeout_s: float = LOAD_TIMEOUT_S
    """A prefix still loading from the host / disk tier this long goes on with what has loaded (the rest recomputed)."""
    prefetch: bool = True
    """Load a lower tier's prefix on a loader thread from arrival; False: at admission, on the scheduler's thread."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_batch_tokens < self.chunk_size:
            raise ValueError(f"need 1 <= chunk_size ({self.chunk_size}) <= max_batch_tokens "
                             f"({self.max_batch_tokens})")
        if self.max_queue < 1 or self.max_running < 1 or self.load_timeout_s < 0:
            raise ValueError(f"need max_queue ({self.max_queue}) and max_running ({self.max_running}) >= 1, "
                             f"load_timeout_s ({self.load_timeout_s}) >= 0")


@dataclass(frozen=True, slots=True)
class PrefillResult:
    req_id: str
    first_token: int
    first_logprob: float | None
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    first_top: tuple[list[int], list[float]] = ([], [])
    """The ``params.logprobs`` most likely first tokens and their logprobs (empty lists when not asked)."""


@dataclass(eq=False)
class PrefillTask:
    req_id: str
    token_ids: list[int]
    params: SamplingParams
    on_done: Callable[[PrefillResult | BaseException], None]
    sink: KVSink = field(default_factory=LocalSink)
    priority: int = 0
    deadline: float | None = None
    """``time.monotonic()`` after which the request is aborted."""
    state: State = State.QUEUED
    match: Match | None = None
    prefetch: Prefetch | None = None
    """Its prefix loading from the host and disk tiers while it is queued (``prefill.admission``)."""
    query_counted: bool = False
    """Its prefix query is in the radix cache's hit / query counters (``prefill.admission``: once per request)."""
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    computed: int = 0
    sink_started: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_start: float = 0.0
    abort_reason: str = ""
    first_token: int = -1
    first_logprob: float | None = None
    first_top: tuple[list[int], list[float]] = ([], [])
    draft_hidden: torch.Tensor | None = None
    """``[H]`` the MTP draft state after the last chunk (shipped with the KV when the decode side asks)."""
    t_forward_done: float = 0.0
    transfer_deadline: float | None = None
    """``time.monotonic()`` past which its finished transfer is cancelled (``KVSink.timeout_s`` after the forward)."""
    transfer_aborted: bool = False
    """Its sink was told to abort after ``finish`` (once: the sink's future then fails and answers the request)."""
