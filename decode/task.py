"""What the decode scheduler keeps per request, and what a request's ``emit`` receives."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.sampling import SamplerState, SamplingParams


class State(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What a request's ``emit`` receives: new tokens and, on the last event, why it ended."""
    token_ids: list[int]
    finish_reason: str = ""
    """``stop``, ``length``, ``abort`` or ``error``; empty while running."""
    message: str = ""
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    accept_len: float = 0.0


@dataclass(eq=False)
class DecodeTask:
    req_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    """Tokens already produced (at least the first token, sampled by prefill)."""
    params: SamplingParams
    pages: list[int]
    """Pages holding the KV of ``cached_len`` tokens (``decode.admission.DecodeAdmission`` allocates and frees them)."""
    cached_len: int
    emit: Callable[[TokenEvent], None]
    deadline: float | None = None
    state: State = State.RUNNING
    abort_reason: str = ""
    sampler: SamplerState | None = None
    steps: int = 0
    emitted: int = 0
    arrival: int = 0
    """Admission order: the youngest (largest) is preempted first."""
    preemptions: int = 0
    spec_rounds: int = 0
    spec_tokens: int = 0
    spec_off: bool = False
    """Speculation stopped paying for this request (``DecodeConfig.spec_fallback``): plain steps."""
    mtp_len: int | None = None
    """Set when speculation stops (``spec_off``): the MTP layer's KV covers pairs ``0 .. mtp_len - 1`` only (plain
    steps do not write it), so the decode prefix cache keeps no page past it. None: it covers ``cached_len``."""
    draft_hidden: torch.Tensor | None = None
    """``[H]`` the MTP draft state shipped with the KV (``engine.speculative.seq.SpecSeq.draft_hidden``): the first
    round speculates. None: it verifies the last token alone and its draft extend creates the state."""

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = SamplerState(self.params, self.prompt_ids, list(self.output_ids))

