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

Decode-side prefix reuse (``prefix_cache``): a request that finishes hands the full pages of its prompt + output
whose KV is final to a radix cache (``engine.kvcache.radix.RadixCache``, the prefill worker's L1 class), where
they stay evictable, LRU first, counted in ``num_free``. Every allocation here evicts cached pages before it
gives up, so the cache never refuses a request room. ``reserve`` matches the next prompt against it, **pins**
the longest cached prefix for the request (a whole number of pages, at least one token short of the prompt)
and reserves pages for the rest only; the prefill worker then ships the KV from that token on::

    reserve(ids) ──> prefix pinned (Match locked) + RESERVED tail ──wait_transfer──> claimed ──release()──┐
        │                 │ cancel(), a failed transfer, an expired one (sweep_pins): unpinned            │
        │                 ▼                                                                                 ▼
        │             (nothing shipped for the prefix)                  finished: full final pages -> cache
        └── nothing cached: the answer is 0, everything is shipped      otherwise: pages freed, prefix unpinned

A local prefill (``alloc_prompt``: aggregated mode, short prompts) holds its resident prefix the same way and
computes only the rest.

Which KV is final at the end: positions ``0 .. cached_len - 1`` (the last output token was never fed) of the
tokens that were emitted, one short of them so the next token is known. With an MTP layer that the worker reads
(``mtp``: it speculates), pair ``i`` of the MTP layer's KV is token ``i + 1`` with the target's hidden ``i``:
every cached page's last pair was written with the token after the page, which is remembered per page, and a
match stops before a page whose remembered token is not the prompt's next one (the pair would be another
sequence's); a request that stopped speculating (``DecodeTask.mtp_len``) caches nothing past its last MTP pair.
The draft state still comes with the shipped tail (prefill computes it from the whole prompt).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, NamedTuple, Sequence

from decode.task import DecodeTask, State
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.kvcache.radix import Match, RadixCache
from kvtransfer import KVReceiver, TransferResult, TransferState, TransferTicket
from worker.ranks import RankFailure, RankGroup


class Reservation(NamedTuple):
    """``DecodeAdmission.reserve``'s answer."""
    ticket: TransferTicket
    """For the KV of the prompt's tokens from ``resident_tokens`` on (``ticket.num_tokens`` of them)."""
    resident_tokens: int
    """Prompt tokens whose KV this worker already holds, pinned for the request (a multiple of the page size)."""


class DecodeAdmission:
    def __init__(self, pool: KVPool, receiver: KVReceiver | None = None, ranks: RankGroup | None = None,
                 prefix_cache: bool = False, mtp: bool = False,
                 on_cache_event: Callable[[list[int], list[int]], None] | None = None) -> None:
        self.pool = pool
        """The scheduler's pool: the pages of running requests."""
        self.receiver = receiver
        """The KV data plane (None: a scheduler without transfers, local prefills only)."""
        self.ranks = ranks
        """``worker.ranks.RankGroup`` of a tensor-parallel worker (None at tp 1). Its followers allocate nothing:
        they write and read the page ids rank 0 names, so a page kept in the prefix cache here still holds every
        rank's KV (their slices under split heads) the next time a request reads it."""
        self.cache = RadixCache(pool.allocator, pool.page_size, on_cache_event) if prefix_cache else None
        """Finished requests' pages (decode-side prefix reuse; None: off)."""
        self.mtp = mtp
        """The worker reads the MTP layer's KV (it speculates): a cached page's last MTP pair must be right."""
        self._next_token: dict[int, int] = {}
        """Cached page -> the token after its last one (its last MTP pair's input), with ``mtp``."""
        self._pinned: dict[str, Match] = {}
        """Reserved requests' resident prefixes (their transfer not yet complete)."""
        self._held: dict[str, Match] = {}
        """Claimed requests' resident prefixes (the first pages of ``DecodeTask.pages``), until ``release``."""
        self._lock = threading.RLock()
        self.reuse_hit_tokens = 0
        """Prompt tokens found resident at reservation (not shipped)."""
        self.reserved_tokens = 0
        """Prompt tokens of every reservation (the denominator of the reuse hit rate)."""
        self.received_bytes = 0
        """KV payload bytes of the completed transfers (what prefill workers shipped here)."""

    # -- RESERVED: pages set aside for an incoming transfer -------------------------------------
    @property
    def num_reserved(self) -> int:
        """Reservations whose KV is on its way (counted as running by ``DecodeScheduler.refusal``)."""
        return 0 if self.receiver is None else self.receiver.stats().num_active

    def reserve(self, req_id: str, num_tokens: int, prompt_ids: Sequence[int] = ()) -> Reservation:
        """Pages for the KV of a ``num_tokens``-token prompt (``prompt_ids``: its tokens, to match against the
        prefix cache): the resident prefix is pinned, pages are reserved for the rest, cached pages evicted for
        them first. ``TransferError(NO_CAPACITY)`` when they do not fit, ``ValueError`` for a bad or duplicate
        id: a refused reservation pins and holds nothing."""
        receiver = self._receiver()
        with self._lock:
            if req_id in self._pinned or req_id in self._held:
                raise ValueError(f"request {req_id!r} already holds a reservation")
            match = self._match(prompt_ids[:num_tokens]) if self.cache is not None and len(prompt_ids) > 1 else None
            resident = match.num_tokens if match is not None else 0
            try:
                self._make_room(self.pool.pages_for(num_tokens) - resident // self.pool.page_size)
                ticket = receiver.reserve(req_id, num_tokens - resident)
            except BaseException:
                if match is not None:
                    self.cache.release(match)
                raise
            if resident:
                self._pinned[req_id] = match
            elif match is not None:
                self.cache.release(match)
            self.reuse_hit_tokens += resident
            self.reserved_tokens += num_tokens
            return Reservation(ticket, resident)

    def _match(self, ids: Sequence[int]) -> Match:
        """The cached prefix of ``ids`` to reuse, locked: full pages, at least one token short of ``ids``, and
        with ``mtp`` only up to the first page whose last MTP pair was written with another next token."""
        P, cache = self.pool.page_size, self.cache
        match = cache.match_prefix(ids[:len(ids) - 1])
        n = len(match.pages)
        if self.mtp:
            while n and self._next_token.get(match.pages[n - 1]) != ids[n * P]:
                n -= 1
        if n < len(match.pages):
            shorter = cache.match_prefix(ids[:n * P])
            cache.release(match)
            match = shorter
        return match

    async def wait_transfer(self, req_id: str, timeout_s: float) -> TransferResult:
        """The complete, verified transfer of ``req_id`` (``TransferError`` on failure: its pages are freed,
        its resident prefix unpinned). Runs on the receiver's loop, as ``reserve`` and ``cancel``."""
        try:
            res = await self._receiver().wait_complete(req_id, timeout_s)
        except BaseException:
            self._unpin(req_id)
            raise
        with self._lock:
            match = self._pinned.pop(req_id, None)
            if match is not None:
                self._held[req_id] = match
            self.received_bytes += res.num_bytes
        return res

    def cancel(self, req_id: str, reason: str) -> bool:
        """End ``req_id``'s reservation, freeing its pages and unpinning its resident prefix (idempotent); False
        when the receiver knows none. A claimed request keeps its pages (``release`` frees them)."""
        if self.receiver is None:
            return False
        known = self.receiver.poll(req_id) is not None
        self.receiver.cancel(req_id, reason)
        return self._unpin(req_id) or known

    def sweep_pins(self) -> int:
        """Unpin the resident prefixes of reservations the receiver ended by itself (expired, stalled, failed
        before anyone waited for them) -> how many. On the receiver's loop (as ``wait_transfer``, which moves a
        completed one out of the pins before anything else runs there)."""
        if self.receiver is None:
            return 0
        gone = [r for r in list(self._pinned) if self.receiver.poll(r) in (None, TransferState.FAILED)]
        return sum(self._unpin(r) for r in gone)

    def _unpin(self, req_id: str, pins: dict[str, Match] | None = None) -> bool:
        """Release ``req_id``'s resident prefix from ``pins`` (``_pinned``; ``_held`` for a claim that failed: that
        request never runs, so ``release`` never sees it) -> whether it had one."""
        with self._lock:
            match = (self._pinned if pins is None else pins).pop(req_id, None)
            if match is not None:
                self.cache.release(match)
            return match is not None

    # -- the hand-over: RESERVED -> RUNNING ----------------------------------------------------
    async def claim(self, res: TransferResult) -> list[int]:
        """The request's pages in the scheduler's pool for a complete transfer ``res``: its resident prefix (held
        since ``wait_transfer``), then the received tail. At tp 1 the tail is the received pages. Replicated KV
        (MLA): rank 0's received pages are copied to the followers. Split KV (GQA heads under TP): the tail landed
        whole in the landing pool; each rank takes its heads into new pages of the scheduler's pool and the landing
        pages are freed. The resident prefix is in every rank's pool already (kept from an earlier request). On
        ``PoolExhausted`` or ``RankFailure`` every page of the request is freed and its prefix unpinned before it
        propagates."""
        page_ids = list(res.page_ids)
        with self._lock:
            held = self._held.get(res.req_id)
        prefix = [] if held is None else list(held.pages)
        if self.ranks is None:
            return prefix + page_ids
        landing, pool = self._receiver().pool, self.pool
        if landing is pool:
            try:
                await asyncio.to_thread(self.ranks.mirror_pages, pool, page_ids)
            except RankFailure:
                pool.allocator.decref(page_ids)
                self._unpin(res.req_id, self._held)
                raise
            return prefix + page_ids
        dst: list[int] = []
        try:
            dst = self._alloc(len(page_ids), res.req_id)
            await asyncio.to_thread(self.ranks.scatter_pages, landing, page_ids, pool, dst)
        except (PoolExhausted, RankFailure):
            if dst:
                pool.allocator.decref(dst)
            self._unpin(res.req_id, self._held)
            raise
        finally:
            landing.allocator.decref(page_ids)
        return prefix + dst

    # -- RUNNING: the pages of a request the scheduler runs ------------------------------------
    def alloc_prompt(self, task: DecodeTask) -> None:
        """Pages for a local prefill of ``task``'s whole prompt and its first token (``PoolExhausted``:
        nothing is kept). With the prefix cache the resident prefix is held for it and ``task.cached_len`` set to
        its length: only the rest is computed (``ValueError`` for an id that already holds one)."""
        P, ids = self.pool.page_size, task.prompt_ids
        with self._lock:
            if task.req_id in self._pinned or task.req_id in self._held:
                raise ValueError(f"duplicate request id {task.req_id!r}")
            match = self._match(ids) if self.cache is not None and len(ids) > 1 else None
            resident = match.num_tokens if match is not None else 0
            try:
                pages = self._alloc(self.pool.pages_for(len(ids) + 1) - resident // P, task.req_id)
            except BaseException:
                if match is not None:
                    self.cache.release(match)
                raise
            if resident:
                self._held[task.req_id] = match
                pages = list(match.pages) + pages
            elif match is not None:
                self.cache.release(match)
            self.reuse_hit_tokens += resident
            self.reserved_tokens += len(ids)
            task.pages, task.cached_len = pages, resident

    def grow(self, task: DecodeTask, num_tokens: int) -> None:
        """Grow ``task.pages`` to hold ``num_tokens`` tokens (``PoolExhausted`` when the pool cannot)."""
        need = self.pool.pages_for(num_tokens) - len(task.pages)
        if need > 0:
            task.pages += self._alloc(need, task.req_id)

    def alloc_resume(self, task: DecodeTask, num_tokens: int, headroom: int) -> bool:
        """Pages for a preempted request's ``num_tokens`` tokens and its next one, once ``headroom`` pages
        more are free too (a page per running request, so it is not preempted again at once); False: not yet."""
        need = self.pool.pages_for(num_tokens + 1)
        if self.num_free < need + headroom:
            return False
        task.pages = self._alloc(need, task.req_id)
        return True

    def release(self, task: DecodeTask) -> None:
        """Give ``task``'s pages back (finished, cancelled, failed or preempted); idempotent. A finished request's
        full pages whose KV is final go to the prefix cache (with ``prefix_cache``), the rest are freed; its
        resident prefix is unpinned."""
        with self._lock:
            held = self._held.pop(task.req_id, None)
            n_shared = len(held.pages) if held is not None else 0
            pages, task.pages = task.pages, []
            n_keep = 0
            if self.cache is not None and task.state is State.FINISHED and pages:
                n_keep = min(self.final_len(task) // self.pool.page_size, len(pages))
                self._insert(task.prompt_ids + task.output_ids, pages, n_keep)
            rest = pages[max(n_keep, n_shared):]
            if rest:
                self.pool.allocator.decref(rest)
            if held is not None:
                self.cache.release(held)

    def final_len(self, task: DecodeTask) -> int:
        """Tokens from the start whose KV is final in ``task.pages`` (every layer, the MTP layer's with ``mtp``),
        one short of the emitted tokens so the token after them is known."""
        n = min(task.cached_len, len(task.prompt_ids) + len(task.output_ids) - 1)
        return min(n, task.mtp_len) if self.mtp and task.mtp_len is not None else n

    def _insert(self, seq: list[int], pages: list[int], n_keep: int) -> None:
        """``pages[:n_keep]`` (the KV of ``seq``'s first ``n_keep`` pages) into the cache; the pages it takes
        are the last ones walked (the walk creates nodes only once it leaves the tree), duplicates it frees."""
        P = self.pool.page_size
        taken = self.cache.insert(seq[:n_keep * P], pages[:n_keep])
        if self.mtp:
            for i in range(n_keep - taken, n_keep):
                self._next_token[pages[i]] = seq[(i + 1) * P]

    # -- accounting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free pages, cached ones that nothing pins included (evicted when asked for)."""
        free = self.pool.allocator.num_free
        return free if self.cache is None else free + self.cache.num_evictable()

    @property
    def num_cached(self) -> int:
        """Pages in the prefix cache (pinned ones included)."""
        return 0 if self.cache is None else self.cache.num_pages

    def _make_room(self, num_pages: int) -> None:
        """Evict cached pages, LRU first, until ``num_pages`` are free (or nothing more can go)."""
        short = num_pages - self.pool.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)

    def _alloc(self, num_pages: int, owner: str) -> list[int]:
        with self._lock:
            self._make_room(num_pages)
            return self.pool.allocator.alloc(num_pages, owner)

    def landing_info(self) -> dict[str, str]:
        """Pages of the landing pool in use (a TP worker with split KV heads receives KV there first)."""
        landing = None if self.receiver is None else self.receiver.pool
        return {} if landing is None or landing is self.pool else \
            {"kv_landing_pages_used": str(landing.allocator.num_used)}

    def _receiver(self) -> KVReceiver:
        if self.receiver is None:
            raise RuntimeError("this decode worker has no KV receiver: it takes local prefills only")
        return self.receiver
