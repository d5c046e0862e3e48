"""The prefill worker's page owner, as ``decode.admission`` is decode's: every KV page a prefill request holds is
granted and given back here; the scheduler asks.

A request's pages walk::

    arrival ──prefetch()──> (loader thread) cached prefix matched: pool hits locked in the radix cache; the host and
            │               disk tiers' pages get fresh pool pages, pinned to the request, and load into them there
            │               (checksums verified, files read: never on the scheduler's thread)
    admit() ──> loading:      False, the request waits; the scheduler runs the others (a request that arrived without
            │                 a prefetch, or lost it, starts one here)
            ├─> loaded / cut: the pages loaded join the radix cache, the rest (a bad, missing or late page and after)
            │                 stay the request's, recomputed with its tail
            └─> private pages for the rest (LRU leaves evicted first when the pool is short)
                     │ chunks computed, KV shipped (the request's sink)
                     ▼
    release(insert=True): the new full pages go into the radix cache, the tail is freed, the match unlocked
    release():            (failed, cancelled) private pages freed, the match unlocked
    drop_prefetch():      (cancelled, deadline, failed or shut down while queued) the prefetch's pages freed and its
                          match unlocked: at once when its load has ended, else by the loader thread when it ends (a
                          page is never freed while a copy into it may still run)

A refused admission (``PoolExhausted``) holds nothing new: its matches are released before it raises (a finished
prefetch stays the request's). Everything but the loads runs under the scheduler's lock (``lock``).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Protocol

from engine.kvcache.pool import KVPool, PoolExhausted
from prefill.host_cache import HostCache, HostMatch
from engine.kvcache.radix import Match, RadixCache
from worker.omp import serial_here

logger = logging.getLogger(__name__)

NUM_LOADERS = 2
"""Loader threads: a slow read of one request's prefix does not hold up the next one's."""
PREFETCH_POOL_FRACTION = 0.5
"""Queued requests' prefetches hold at most this fraction of the pool; past it a request loads when admitted."""


class Admitted(enum.Enum):
    """How an admission ended (``admit``'s RUNNING or LOADING; the scheduler's NO_ROOM and FAILED)."""
    RUNNING = "running"
    LOADING = "loading"
    """Its prefix is still loading from the host or disk tier."""
    NO_ROOM = "no room"
    """Not enough pages yet."""
    FAILED = "failed"
    """It can never fit: failed."""


@dataclass(eq=False)
class Prefetch:
    """One request's prefix being loaded from the host and disk tiers into ``pages`` (a loader thread copies)."""
    match: Match
    """The device tier's match, locked: the loaded pages continue it."""
    host: HostMatch
    """The lower tiers' match (pinned there until the load ends)."""
    pages: list[int]
    """Fresh pool pages, the request's, one per lower-tier page to load."""
    num_hit: int
    """Prompt tokens the request starts from when every page loads."""
    t_start: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    loaded: int = 0
    """``pages[:loaded]`` hold their KV (verified), under ``lock``."""
    cut: bool = False
    """No copy runs any more (the request went on without the rest, or left), under ``lock``."""
    done: bool = False
    """The loader returned (the tiers unpinned), under the scheduler's lock."""
    dropped: bool = False
    """The request left while the load ran: the loader frees the pages when it ends."""

    def commit(self, n: int, copy: Callable[[], None]) -> bool:
        """``tier_index.Commit``: copy the next ``n`` pages unless cut off."""
        with self.lock:
            if self.cut:
                return False
            copy()
            self.loaded += n
            return True

    def cut_off(self) -> int:
        """No more copies; -> pages loaded (their copies are complete)."""
        with self.lock:
            self.cut = True
            return self.loaded


class PagedRequest(Protocol):
    """What admission reads and sets on a request (``prefill.task.PrefillTask``)."""
    req_id: str
    token_ids: list[int]
    pages: list[int]
    match: Match | None
    num_cached: int
    computed: int
    prefetch: Prefetch | None
    query_counted: bool
    """Its prefix query is in the cache's hit / query counters: once per request, however many lookups it takes
    (a prefetch given back and looked up again at admission, an admission refused and tried again)."""


class _Lookup(NamedTuple):
    match: Match
    host: HostMatch | None
    num_hit: int
    num_lower: int
    """Pages of the hit that the host and disk tiers hold."""


class PrefillAdmission:
    def __init__(self, pool: KVPool, cache: RadixCache, host: HostCache | None = None,
                 lock: threading.Condition | None = None, prefetch: bool = True) -> None:
        self.pool, self.cache, self.host = pool, cache, host
        """The pool, its radix prefix cache, and the cache's host tier (None: off)."""
        self.lock = lock or threading.Condition()
        """The scheduler's lock (notified when a load ends)."""
        self._loader = ThreadPoolExecutor(NUM_LOADERS, "prefill-loader", initializer=serial_here) \
            if host is not None and prefetch else None
        """None: no prefetch, the lower tiers' pages load at admission on the caller's thread (the scheduler's: the
        behaviour before prefetch, kept to measure against, ``PrefillConfig.prefetch``)."""
        self.num_prefetch_pages = 0
        """Pool pages held by prefetches not yet admitted."""
        self.num_loading = 0

    # -- prefetch ---------------------------------------------------------------------------------------
    def prefetch(self, task: PagedRequest, is_waiting: Callable[[], bool]) -> None:
        """A request arrived: look its prefix up and load the lower tiers' pages on a loader thread now, not when
        it is admitted (``is_waiting()``, under the lock: whether it still waits for admission). Never blocks."""
        if self._loader is not None:
            self._loader.submit(self._prefetch_now, task, is_waiting)

    def _prefetch_now(self, task: PagedRequest, is_waiting: Callable[[], bool]) -> None:
        with self.lock:
            if task.prefetch is not None or not is_waiting():
                return
            look = self._lookup(task, count=False)  # admission looks up again unless this prefetch is kept
            cap = int(self.pool.num_pages * PREFETCH_POOL_FRACTION)
            if not look.num_lower or self.num_prefetch_pages + look.num_lower > cap:
                self._unlock(look)  # nothing to load, or the cap: it loads when admitted
                return
            try:
                pf = self._start(task, look)
            except PoolExhausted:
                return
            self._count_query(task, look.match)
        self._load(pf)

    def _lookup(self, task: PagedRequest, count: bool = True) -> _Lookup:
        ids, P = task.token_ids, self.pool.page_size
        match = self.cache.match_prefix(ids, count=False)
        if count:
            self._count_query(task, match)
        host = self.host.match_prefix(ids, match) if self.host is not None else None
        n_hit = match.num_tokens + (host.num_pages * P if host is not None else 0)
        if n_hit >= len(ids):  # at least one token must run to produce logits: recompute the last page
            n_hit -= P
        return _Lookup(match, host, n_hit, max(0, n_hit // P - len(match.pages)))

    def _count_query(self, task: PagedRequest, match: Match) -> None:
        """``task``'s L1 query into the cache's hit / query counters, once per request."""
        if not task.query_counted:
            self.cache.count_query(match.num_tokens, len(task.token_ids))
            task.query_counted = True

    def _unlock(self, look: _Lookup) -> None:
        self.cache.release(look.match)
        if look.host is not None:
            self.host.release(look.host)

    def _alloc(self, n: int, owner: str) -> list[int]:
        if n > self.pool.allocator.num_free:
            self.cache.evict(n - self.pool.allocator.num_free)
        return self.pool.allocator.alloc(n, owner)

    def _start(self, task: PagedRequest, look: _Lookup) -> Prefetch:
        """Pool pages for the lower tiers' part of ``look``, held as ``task``'s prefetch. ``PoolExhausted``: the
        lookup released, nothing held."""
        try:
            pages = self._alloc(look.num_lower, task.req_id)
        except PoolExhausted:
            self._unlock(look)
            raise
        task.prefetch = pf = Prefetch(look.match, look.host, pages, look.num_hit)
        self.num_prefetch_pages += len(pages)
        self.num_loading += 1
        return pf

    def _load(self, pf: Prefetch) -> None:
        """Loader thread: the lower tiers' pages into ``pf.pages``, then ``pf`` done (freed if its request left)."""
        try:
            if not pf.cut:
                self.host.restore(pf.host, pf.pages, pf.commit)
            else:
                self.host.release(pf.host)
        except Exception:  # noqa: BLE001 - a load that fails recomputes the rest, never ends the loader
            logger.exception("prefix cache load failed; the request recomputes what did not load")
            pf.cut_off()
            self.host.release(pf.host)  # whatever the restore left pinned (an unpin happens once per entry)
        finally:
            with self.lock:
                pf.done = True
                self.num_loading -= 1
                if pf.dropped:
                    self._free(pf)
                self.lock.notify_all()

    def _free(self, pf: Prefetch) -> None:
        self.num_prefetch_pages -= len(pf.pages)
        self.pool.allocator.decref(pf.pages)
        self.cache.release(pf.match)
        pf.pages = []

    def cut_if_late(self, task: PagedRequest, timeout_s: float, now: float) -> None:
        """A load running past ``timeout_s``: the request goes on with what has loaded (``admit``)."""
        pf = task.prefetch
        if pf is not None and not pf.done and now - pf.t_start > timeout_s:
            pf.cut_off()

    def drop_prefetch(self, task: PagedRequest) -> bool:
        """The request leaves before admission (or gives its prefetch back): its prefetch's pages and match go
        back, now or when the load ends; -> whether it held one."""
        pf, task.prefetch = task.prefetch, None
        if pf is None:
            return False
        pf.cut_off()
        if pf.done:
            self._free(pf)
        else:
            pf.dropped = True
        return True

    def reclaim(self, tasks: Iterable[PagedRequest]) -> tuple[bool, bool]:
        """Give back the finished prefetches of ``tasks`` (queued, behind one that cannot fit otherwise); they load
        again when admitted. -> (any page freed, any load still running)."""
        freed = running = False
        for t in tasks:
            if t.prefetch is not None and t.prefetch.done:
                freed |= self.drop_prefetch(t)
            elif t.prefetch is not None:
                running = True
        return freed, running

    def close(self) -> None:
        """Wait for the loads in flight (their requests have left: each frees its pages as it ends). Call without
        the lock."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)

    # -- admission ------------------------------------------------------------------------------------
    def admit(self, task: PagedRequest) -> Admitted:
        """Give ``task`` its pages: the longest cached prefix (pool, then the host and disk tiers) and private pages
        for the rest; sets ``task.match``, ``num_cached``, ``computed`` and ``pages`` (RUNNING). LOADING: its prefix
        is still loading (a load starts here if none was prefetched). ``PoolExhausted``: nothing more is held."""
        pf = task.prefetch
        if pf is None:
            look = self._lookup(task)
            if look.num_lower:
                pf = self._start(task, look)
                if self._loader is None:
                    self._load(pf)  # synchronous, on this thread (no prefetch)
                else:
                    self._loader.submit(self._load, pf)
                    return Admitted.LOADING
            else:
                if look.host is not None:
                    self.host.release(look.host)
                self._grant(task, look.match, look.num_hit, [])
                return Admitted.RUNNING
        if not (pf.done or pf.cut):
            return Admitted.LOADING
        P, restored = self.pool.page_size, pf.cut_off()
        n_hit = pf.num_hit if restored == len(pf.pages) else pf.match.num_tokens + restored * P
        self._grant(task, pf.match, n_hit, pf.pages, restored)
        task.prefetch = None
        self.num_prefetch_pages -= len(pf.pages)
        pf.pages = []  # the request's now: the loader (if it still runs) frees nothing
        return Admitted.RUNNING

    def _grant(self, task: PagedRequest, match: Match, n_hit: int, loaded: list[int], restored: int = 0) -> None:
        """``loaded[:restored]`` continue ``match`` (into the radix cache), ``loaded[restored:]`` and new pages are
        the request's private ones. ``PoolExhausted``: nothing changed (a lookup without a prefetch is released)."""
        P = self.pool.page_size
        need = self.pool.pages_for(len(task.token_ids)) - n_hit // P - (len(loaded) - restored)
        try:
            private = self._alloc(need, task.req_id)
        except PoolExhausted:
            if not loaded:
                self.cache.release(match)
            raise
        if loaded:
            match = self.cache.extend(match, task.token_ids, loaded[:restored])
            n_hit = min(n_hit, match.num_tokens)
        task.match, task.num_cached, task.computed = match, n_hit, n_hit
        task.pages = match.pages[:n_hit // P] + loaded[restored:] + private

    def release(self, task: PagedRequest, insert: bool = False) -> None:
        """Give a task's pages back: cached ones unlocked, private ones to the cache (``insert``: its KV is
        complete) or freed."""
        P = self.pool.page_size
        n_shared = task.num_cached // P
        private = task.pages[n_shared:]
        if insert and private:
            # the cache takes the new full pages (freeing any it already holds); the tail is ours to free
            self.cache.insert(task.token_ids, task.pages)
            rest = private[max(0, len(task.token_ids) // P - n_shared):]
            if rest:
                self.pool.allocator.decref(rest)
        elif private:
            self.pool.allocator.decref(private)
        task.pages = []
        if task.match is not None:
            self.cache.release(task.match)
            task.match = None
        self.drop_prefetch(task)
