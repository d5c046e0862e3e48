"""Recompute preemption (vLLM's) for the decode scheduler: who gives up its pages when the pool is short, and
how a preempted request comes back.

When the pool runs out, the youngest running request is preempted: its pages are freed, its tokens so far are
kept, and once enough pages are free again (plus a page of headroom per running request, so it is not
preempted again at once) its KV is recomputed from the prompt and the tokens it already produced, chunked,
with the MTP layer's KV as a prefill worker ships it (``engine.speculative.prefill.prefill_forward``); it continues
as if nothing happened: the client sees a pause, not an error. A request that cannot fit even alone in the
whole pool ends with a clear error. A running request is never ended or starved for room that reservations
of incoming transfers hold: when it is the only one left to run it waits for them, keeping its pages
(``num_waiting``; the scheduler's ``refusal()`` turns new reservations away meanwhile).

Every method but ``recompute`` runs under the scheduler's lock; it owns the running list and passes it in.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from common.reasons import FinishReason
from decode.config import DecodeConfig
from decode.admission import DecodeAdmission
from decode.task import DecodeTask
from engine.kvcache.pool import PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.speculative.prefill import PrefillChunk, prefill_forward

logger = logging.getLogger(__name__)

Finish = Callable[[DecodeTask, str, str], None]
"""The scheduler's ``(task, finish reason, message)``: ends a request, frees its pages, emits its last event."""


class Resume(NamedTuple):
    """``PreemptionManager.take_resumable``'s answer."""
    task: DecodeTask | None
    """The request to recompute now (its pages allocated), or None."""
    num_tokens: int
    """How many of its tokens to recompute (prompt + output but the last output token, the next input)."""
    progressed: bool
    """Something changed: a request to resume, or one ended because it cannot fit in the whole pool."""


class PreemptionManager:
    def __init__(self, model: GlmForCausalLM, admission: DecodeAdmission, config: DecodeConfig, finish: Finish,
                 draft: bool = False) -> None:
        self.model, self.admission, self.config, self._finish = model, admission, config, finish
        self.pool = admission.pool
        self.draft = draft
        """Recompute the MTP draft state too (the scheduler speculates): the request speculates at once."""
        self.preempted: list[DecodeTask] = []
        """Waiting for pages, oldest preemption first; their pages are freed, their tokens kept."""
        self.num_preemptions = 0
        self.num_waiting = 0
        """Running requests that skipped the last step waiting for pages held by reservations."""

    def make_room(self, running: list[DecodeTask]) -> list[DecodeTask]:
        """Give every running request the page its next token needs, oldest first, preempting the youngest
        while the pool is short; -> the requests that run this step.

        A request ends for lack of room only when it alone needs more than the whole pool. When it is the
        only one left to run and the rest of the pool is held by others (reservations of incoming
        transfers, local prefills) it waits for them, keeping its pages, and skips the step; meanwhile
        ``refusal()`` turns new reservations away, so what holds the pool can only shrink: a transfer
        completes (its request then runs and, being younger, is preempted first), fails or expires."""
        waiting: list[DecodeTask] = []
        for task in sorted(running, key=lambda t: t.arrival):
            while task in running:
                try:
                    self.admission.grow(task, task.cached_len + 1)
                    break
                except PoolExhausted as e:
                    need = self.pool.pages_for(task.cached_len + 1)
                    if need > self.pool.num_pages:
                        self._finish(task, FinishReason.ERROR,
                                     f"decode KV pool exhausted: {e}; this request alone needs {need} pages, more "
                                     f"than the pool's {self.pool.num_pages}")
                        break
                    victim = max((t for t in running if t not in waiting), key=lambda t: t.arrival)
                    if victim is task and all(t is task or t in waiting for t in running):
                        waiting.append(task)  # the pages it needs are held by others than running requests
                        break
                    self._preempt(victim, running)
        self.num_waiting = len(waiting)
        return [t for t in running if t not in waiting]

    def _preempt(self, task: DecodeTask, running: list[DecodeTask]) -> None:
        running.remove(task)
        self.admission.release(task)
        task.cached_len = 0
        task.preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(task)
        logger.info("preempted %s (%d tokens so far): KV pool full, %d running", task.req_id,
                    len(task.prompt_ids) + len(task.output_ids), len(running))

    def take_resumable(self, num_running: int) -> Resume:
        """The oldest preempted request, its pages allocated, once the pool can hold it; recompute it outside
        the lock (``recompute``), then it runs again. Ends it when it cannot fit in the whole pool."""
        if not self.preempted:
            return Resume(None, 0, False)
        task = self.preempted[0]
        n = len(task.prompt_ids) + len(task.output_ids) - 1  # the last output token is the next input
        need = self.pool.pages_for(n + 1)
        if need > self.pool.num_pages:
            self.preempted.pop(0)
            self._finish(task, FinishReason.ERROR,
                         f"decode KV pool exhausted: this request needs {need} pages, the pool has {self.pool.num_pages}")
            return Resume(None, 0, True)
        if not self.admission.alloc_resume(task, n, num_running):
            return Resume(None, 0, False)
        self.preempted.pop(0)
        return Resume(task, n, True)

    def recompute(self, task: DecodeTask, n: int) -> None:
        """KV of the first ``n`` tokens of prompt + output into ``task.pages``, chunked; the MTP layer's too
        (its pair i is token i+1 with the main model's hidden i), as a prefill worker ships it."""
        seq = task.prompt_ids + task.output_ids
        step = self.config.recompute_chunk
        for s in range(0, n, step):
            e = min(n, s + step)
            # the token after the chunk is known: nothing is sampled, no MTP pair deferred
            [res] = prefill_forward(self.model, self.pool, [PrefillChunk(task.pages, s, seq[s:e], seq[e],
                                                                          draft=e == n and self.draft)])
            task.draft_hidden = res.draft_hidden  # the last chunk's: the request speculates at once

    def take_ended(self, now: float) -> list[DecodeTask]:
        """Remove and return the preempted requests that were aborted or passed their deadline (the scheduler
        ends them like running ones)."""
        ended = [t for t in self.preempted if t.abort_reason or (t.deadline is not None and now > t.deadline)]
        for t in ended:
            self.preempted.remove(t)
        return ended
