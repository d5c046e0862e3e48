"""The decode worker's page owner: every KV page a decode request holds is allocated and freed here.

A request's pages walk one lifecycle, whichever way its KV arrives::

    reserve() ──> RESERVED ──KV frames──> (the receiver's RECEIVING) ──claim()──> RUNNING ──release()──> freed
       │             │                                                              ▲  │
       │             └──expiry, stall, cancel(), bad frame: the receiver frees them  │  │ grow() one page at a time
       │                                                                             │  ▼
    alloc_prompt() (local prefill, aggregated mode) ─────────────────────────────> RUNNING
                                                     preempted: release(), later alloc_resume() ──┘

While RESERVED / RECEIVING the pages sit in ``kvtransfer.ticket.ReservationManager`` (the data plane frames
must match its ticket; it frees a failed transfer's pages itself); ``claim`` is the hand-over, after which
they belong to the request (``DecodeTask.pages``) until ``release``. The servicer (``Reserve``, ``Decode``,
``Abort``), the scheduler (local prefills, growth, finish) and preemption ask this object; none of them
touches the pool's allocator. On a tensor-parallel worker with split KV heads the KV lands in a separate
landing pool and ``claim`` moves it into the scheduler's pool (the landing pages are freed there).
"""
from __future__ import annotations

import asyncio

from decode.task import DecodeTask
from engine.kvcache.pool import KVPool
from kvtransfer import KVReceiver, TransferResult, TransferTicket
from worker.ranks import RankFailure, RankGroup


class DecodeAdmission:
    def __init__(self, pool: KVPool, receiver: KVReceiver | None = None, ranks: RankGroup | None = None) -> None:
        self.pool = pool
        """The scheduler's pool: the pages of running requests."""
        self.receiver = receiver
        """The KV data plane (None: a scheduler without transfers, local prefills only)."""
        self.ranks = ranks
        """``worker.ranks.RankGroup`` of a tensor-parallel worker (None at tp 1)."""

    # -- RESERVED: pages set aside for an incoming transfer -------------------------------------
    @property
    def num_reserved(self) -> int:
        """Reservations whose KV is on its way (counted as running by ``DecodeScheduler.refusal``)."""
        return 0 if self.receiver is None else self.receiver.stats().num_active

    def reserve(self, req_id: str, num_tokens: int) -> TransferTicket:
        """Pages for ``num_tokens`` tokens of incoming KV (``TransferError(NO_CAPACITY)`` when they do not fit,
        ``ValueError`` for a bad or duplicate id): a refused reservation holds no page."""
        return self._receiver().reserve(req_id, num_tokens)

    async def wait_transfer(self, req_id: str, timeout_s: float) -> TransferResult:
        """The complete, verified transfer of ``req_id`` (``TransferError`` on failure: its pages are freed)."""
        return await self._receiver().wait_complete(req_id, timeout_s)

    def cancel(self, req_id: str, reason: str) -> bool:
        """End ``req_id``'s reservation, freeing its pages (idempotent); False when the receiver knows none."""
        if self.receiver is None:
            return False
        known = self.receiver.poll(req_id) is not None
        self.receiver.cancel(req_id, reason)
        return known

    # -- the hand-over: RESERVED -> RUNNING ----------------------------------------------------
    async def claim(self, res: TransferResult) -> list[int]:
        """The request's pages in the scheduler's pool for a complete transfer ``res``. At tp 1 they are the
        received pages. Replicated KV (MLA): rank 0's pages are copied to the followers. Split KV (GQA heads
        under TP): the pages landed whole in the landing pool; each rank takes its heads into new pages of the
        scheduler's pool and the landing pages are freed. On ``PoolExhausted`` or ``RankFailure`` every page
        of the request is freed before it propagates."""
        page_ids = list(res.page_ids)
        if self.ranks is None:
            return page_ids
        landing, pool = self._receiver().pool, self.pool
        if landing is pool:
            try:
                await asyncio.to_thread(self.ranks.mirror_pages, pool, page_ids)
            except RankFailure:
                pool.allocator.decref(page_ids)
                raise
            return page_ids
        try:
            dst = pool.allocator.alloc(len(page_ids), res.req_id)
            try:
                await asyncio.to_thread(self.ranks.scatter_pages, landing, page_ids, pool, dst)
            except RankFailure:
                pool.allocator.decref(dst)
                raise
            return dst
        finally:
            landing.allocator.decref(page_ids)

    # -- RUNNING: the pages of a request the scheduler runs ------------------------------------
    def alloc_prompt(self, task: DecodeTask) -> None:
        """Pages for a local prefill of ``task``'s whole prompt and its first token (``PoolExhausted``:
        nothing is kept)."""
        task.pages = self.pool.allocator.alloc(self.pool.pages_for(len(task.prompt_ids) + 1), task.req_id)

    def grow(self, task: DecodeTask, num_tokens: int) -> None:
        """Grow ``task.pages`` to hold ``num_tokens`` tokens (``PoolExhausted`` when the pool cannot)."""
        need = self.pool.pages_for(num_tokens) - len(task.pages)
        if need > 0:
            task.pages += self.pool.allocator.alloc(need, task.req_id)

    def alloc_resume(self, task: DecodeTask, num_tokens: int, headroom: int) -> bool:
        """Pages for a preempted request's ``num_tokens`` tokens and its next one, once ``headroom`` pages
        more are free too (a page per running request, so it is not preempted again at once); False: not yet."""
        need = self.pool.pages_for(num_tokens + 1)
        if self.pool.allocator.num_free < need + headroom:
            return False
        task.pages = self.pool.allocator.alloc(need, task.req_id)
        return True

    def release(self, task: DecodeTask) -> None:
        """Give ``task``'s pages back to the pool (finished, cancelled, failed or preempted); idempotent."""
        if task.pages:
            self.pool.allocator.decref(task.pages)
            task.pages = []

    # -- accounting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.allocator.num_free

    def landing_info(self) -> dict[str, str]:
        """Pages of the landing pool in use (a TP worker with split KV heads receives KV there first)."""
        landing = None if self.receiver is None else self.receiver.pool
        return {} if landing is None or landing is self.pool else \
            {"kv_landing_pages_used": str(landing.allocator.num_used)}

    def _receiver(self) -> KVReceiver:
        if self.receiver is None:
            raise RuntimeError("this decode worker has no KV receiver: it takes local prefills only")
        return self.receiver
