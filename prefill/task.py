"""What the prefill scheduler keeps per request, and what a request's ``on_done`` receives."""
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
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


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
    transfer_aborted: bool = False
    """Its sink was told to abort after ``finish`` (once: the sink's future then fails and answers the request)."""
