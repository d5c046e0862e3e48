"""The prefill worker's page owner, as ``decode.admission`` is decode's: every KV page a prefill request holds is
granted and given back here; the scheduler asks.

A request's pages walk::

    admit() ──> cached prefix (pool hits locked in the radix cache, host-tier hits restored into fresh pages)
            └─> private pages for the rest (LRU leaves evicted first when the pool is short)
                     │ chunks computed, KV shipped (the request's sink)
                     ▼
    release(insert=True): the new full pages go into the radix cache, the tail is freed, the match unlocked
    release():            (failed, cancelled) private pages freed, the match unlocked

A refused admission (``PoolExhausted``) holds nothing: its matches are released before it raises. Runs under the
scheduler's lock.
"""
from __future__ import annotations

from typing import Protocol

from engine.kvcache.pool import KVPool, PoolExhausted
from prefill.host_cache import HostCache
from prefill.radix import Match, RadixCache


class PagedRequest(Protocol):
    """What admission reads and sets on a request (``prefill.scheduler.PrefillTask``)."""
    req_id: str
    token_ids: list[int]
    pages: list[int]
    match: Match | None
    num_cached: int
    computed: int


class PrefillAdmission:
    def __init__(self, pool: KVPool, cache: RadixCache, host: HostCache | None = None) -> None:
        self.pool, self.cache, self.host = pool, cache, host
        """The pool, its radix prefix cache, and the cache's host tier (None: off)."""

    def admit(self, task: PagedRequest) -> None:
        """Give ``task`` its pages: the longest cached prefix (pool, then host tier) and private pages for the
        rest; sets ``task.match``, ``num_cached``, ``computed`` and ``pages``. ``PoolExhausted``: nothing is held."""
        ids, P = task.token_ids, self.pool.page_size
        match = self.cache.match_prefix(ids)
        host = self.host.match_prefix(ids, match) if self.host is not None else None
        n_hit = match.num_tokens + (host.num_pages * P if host is not None else 0)
        if n_hit >= len(ids):  # at least one token must run to produce logits: recompute the last page
            n_hit -= P
        n_host = max(0, n_hit // P - len(match.pages))  # restored into pool pages allocated with the private ones
        need = self.pool.pages_for(len(ids)) - n_hit // P + n_host
        if need > self.pool.allocator.num_free:
            self.cache.evict(need - self.pool.allocator.num_free)
        try:
            private = self.pool.allocator.alloc(need, task.req_id)
        except PoolExhausted:
            self.cache.release(match)
            if host is not None:
                self.host.release(host)
            raise
        if host is not None:  # a bad checksum ends the restore: the pages meant for it and after are recomputed
            restored = self.host.restore(host, private[:n_host])
            match, private = self.cache.extend(match, ids, private[:restored]), private[restored:]
            n_hit = min(n_hit, match.num_tokens)
        task.match, task.num_cached, task.computed = match, n_hit, n_hit
        task.pages = match.pages[:n_hit // P] + private

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
