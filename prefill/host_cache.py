"""The prefix cache's host tier (L2): KV pages in host memory, below the KV pool (L1, ``engine.kvcache.radix``).

A page enters by the write policy (``HostCachePolicy``)::

    write_back     when the radix cache evicts it from the pool, its KV is copied here first (the default: a page
                   costs a copy only once the pool has no room left for it)
    write_through  soon after the radix cache takes it: queued then, copied on the scheduler thread at the next
                   admission (``match_prefix``) or eviction, not on the thread that finished the request (a second
                   OpenMP team throttles every step: ``worker/omp.py``); evicting it from the pool copies nothing

A prompt whose cached prefix runs past what the pool holds continues here, page by page, where L1's match ended::

    match_prefix(ids, l1_match) -> HostMatch (entries pinned)   the pages stored for ids right after the L1 match
    restore(hm, pool_pages) -> pages restored                   checksums verified, bytes copied into fresh pool
                                                                pages (the caller hands them to RadixCache.extend)
    release(hm)                                                 unpin without restoring (no pool pages for it now)

Identity: an entry is keyed by its block hash (the chain hash from the root, ``engine.kvcache.radix.block_hash``) and keeps
its token chunk and its parent's hash, both compared on lookup: a page is restored only for the same tokens after
the same prefix. Integrity: an entry carries the pool layout's hash (``KVLayout.layout_hash``) and an xxh3 checksum
of its bytes seeded with its block hash and that layout hash, verified before the bytes are used; a page that fails
ends the restore there, is dropped and counted (``corrupt_pages``), and the request recomputes from it on.

Eviction: least recently used first. A restore touches a chain's entries leaf first and write-back stores a chain
leaf first, so a page is never older than its descendants and chains shrink from their ends. Hit counts give a
second chance: each restore of an entry earns it one more trip past the LRU end (at most ``MAX_CREDIT``). The tier
is inclusive: a restored page stays here too, so the pool evicting it again copies nothing.

Below it, optionally, the disk tier (``prefill.disk_cache``, ``self.lower``): under write-back a page this tier
evicts is queued to be written there, under write-through a page this tier stores; a prompt's match continues there
where this tier's ends (``HostMatch.disk``) and ``restore`` loads those pages too, after this tier's.

Every page stored or dropped is published (``on_event(stored, evicted)``, block hashes, as the radix cache
publishes its own), so the router can score a worker's host-tier prefix too (``router.prefix_index``).

Every call runs on the prefill scheduler's thread or under its lock (the radix cache's too, for ``on_insert`` and
``on_evict``), except ``restore``, which a loader thread runs (``prefill.admission``'s prefetch: checksums and copies
outside the tier's lock, the matched entries pinned); ``stats()`` and ``all_hashes()`` may be called from any thread.
"""
from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from engine.kvcache.host_pool import HostPagePool
from engine.kvcache.pool import KVPool
from engine.memory import gib, parse_bytes
from prefill.disk_cache import DiskCache, DiskMatch
from engine.kvcache.radix import CachedPage, Match
from prefill.tier_index import BATCH_BYTES, MAX_CREDIT, Commit, LoadTimes, copy_now, lru_victims, match_chain, unpin

logger = logging.getLogger(__name__)

AUTO = "auto"
AUTO_POOL_MULTIPLE = 2
"""``--host-cache-bytes auto``: twice the KV pool (SGLang HiCache's default host/device ratio) ..."""
AUTO_HOST_FRACTION = 0.25
"""... but at most this fraction of the host memory available when the worker starts."""


class HostCachePolicy(str, enum.Enum):
    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


@dataclass(eq=False, slots=True)
class _Entry:
    slot: int
    parent_hash: int
    chunk: tuple[int, ...]
    checksum: int
    layout_hash: int
    hits: int = 0
    credit: int = 0
    pins: int = 0


class HostMatch(NamedTuple):
    hashes: list[int]
    """Block hashes of the matched pages, in prompt order."""
    entries: list[_Entry]
    """Their entries, pinned until ``restore`` or ``release``."""
    disk: DiskMatch | None = None
    """The disk tier's pages right after these (pinned there), None without a disk tier."""

    @property
    def num_pages(self) -> int:
        """Pages matched in this tier and the disk tier."""
        return len(self.entries) + (len(self.disk.entries) if self.disk is not None else 0)


@dataclass(frozen=True, slots=True)
class HostCacheStats:
    capacity_pages: int
    cached_pages: int
    cached_bytes: int
    hit_tokens: int
    """Prompt tokens restored from this tier (after missing the pool)."""
    stored_pages: int
    """Pages copied in (write-back or write-through)."""
    evicted_pages: int
    corrupt_pages: int
    """Pages whose checksum or layout tag failed at restore (each one recomputed instead)."""
    dropped_pages: int
    """Pages not stored for want of room (every entry pinned)."""


class HostCache:
    """The L2 tier of one prefill worker's prefix cache: ``num_pages`` host pages of ``pool``'s layout."""

    def __init__(self, pool: KVPool, num_pages: int, policy: HostCachePolicy = HostCachePolicy.WRITE_BACK,
                 pin: bool | None = None) -> None:
        self.pool, self.policy = pool, HostCachePolicy(policy)
        self.page_size = pool.page_size
        self.store = HostPagePool(pool.layout, num_pages, pin=pool.device.type == "cuda" if pin is None else pin)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        """block hash -> entry, least recently used first."""
        self._pending: dict[int, CachedPage] = {}
        """write_through: pages the radix cache took, not copied yet (their pool pages are the cache's until evicted,
        and ``on_evict`` takes them out of here first)."""
        self._lock = threading.RLock()
        self.lower: DiskCache | None = None
        """The disk tier below (None: evicted pages are gone)."""
        self.on_event: Callable[[list[int], list[int]], None] | None = None
        """Called with (block hashes stored, block hashes dropped) after each change (under the lock)."""
        self._stored_log: list[int] = []
        self._dropped_log: list[int] = []
        self.hit_tokens = self.stored_pages = self.evicted_pages = self.corrupt_pages = self.dropped_pages = 0
        self.late_pages = 0
        """Pages matched here but not loaded in time (the request went on and recomputed them)."""
        self.load_times = LoadTimes()
        """Seconds each restore from this tier took (its pages verified and copied into the pool)."""

    # -- what the radix cache hands down (radix.LowerTier) -------------------------------------------
    def on_insert(self, pages: list[CachedPage]) -> None:
        if self.policy is HostCachePolicy.WRITE_THROUGH:
            with self._lock:
                self._pending.update((p.hash, p) for p in pages)

    def on_evict(self, pages: list[CachedPage]) -> None:
        with self._lock:
            for p in pages:
                self._pending.pop(p.hash, None)
            self._store(pages)

    def flush(self) -> None:
        """Copy the pages write-through queued (on the scheduler thread: ``match_prefix`` calls it)."""
        with self._lock:
            if self._pending:
                pages = list(self._pending.values())[::-1]  # leaf first, as on_evict
                self._pending.clear()
                self._store(pages)

    def _store(self, pages: Sequence[CachedPage]) -> None:
        """Copy in the pages not stored yet and touch the others; ``pages`` leaf first."""
        with self._lock:
            try:
                self._store_locked(pages)
            finally:
                self._publish()

    def _store_locked(self, pages: Sequence[CachedPage]) -> None:
        fresh, held = [], []
        for p in pages:
            e = self._entries.get(p.hash)
            if e is not None and e.chunk == p.chunk and e.parent_hash == p.parent_hash:
                self._entries.move_to_end(p.hash)
                held.append(e)
                continue
            if e is not None and e.pins:  # a 64-bit hash collision with a page being restored: keep the older
                self.dropped_pages += 1
                continue
            if e is not None:  # a 64-bit hash collision: the newer prefix wins
                self._drop(p.hash)
            fresh.append(p)
        if not fresh:
            return
        for e in held:  # making room must not evict what this call just touched
            e.pins += 1
        try:
            room = self._make_room(len(fresh))
        finally:
            for e in held:
                e.pins -= 1
        if room < len(fresh):  # keep the pages nearest the root: the leaves are useless without them
            self.dropped_pages += len(fresh) - room
            if self.lower is not None:  # ... and the disk tier takes the leaves straight from the pool
                left = fresh[:len(fresh) - room]
                for p, row in zip(left, self.store.save_rows(self.pool, [p.page for p in left])):
                    self.lower.put(p.hash, p.parent_hash, p.chunk, row)
            fresh = fresh[len(fresh) - room:]
        if not fresh:
            return
        slots = self.store.allocator.alloc(len(fresh), "host")
        self.store.save(self.pool, [p.page for p in fresh], slots)
        for p, slot in zip(fresh, slots):
            digest = self.store.checksum(slot, self._seed(p.hash))
            self._entries[p.hash] = _Entry(slot, p.parent_hash, p.chunk, digest, self.store.layout_hash)
            if self.lower is not None and self.policy is HostCachePolicy.WRITE_THROUGH:
                self.lower.put(p.hash, p.parent_hash, p.chunk, self.store.data[slot])
        self.stored_pages += len(fresh)
        self._stored_log += [p.hash for p in fresh]

    def _make_room(self, n: int) -> int:
        """Evict LRU entries (pinned ones and second chances skipped) until ``n`` slots are free; -> how many are."""
        free = self.store.allocator.num_free
        for h, e in lru_victims(self._entries, lambda: free < n):  # noqa: B023 - free is read at each check, as meant
            if self.lower is not None:  # write-back (write-through queued it at store: then this only touches it)
                self.lower.put(h, e.parent_hash, e.chunk, self.store.data[e.slot])
            self._drop(h)
            self.evicted_pages += 1
            free += 1
        return min(n, free)

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` LRU entries as making room would (down to the disk tier); -> how many."""
        with self._lock:
            before = self.evicted_pages
            try:
                self._make_room(self.store.allocator.num_free + num_pages)
            finally:
                self._publish()
            return self.evicted_pages - before

    def _drop(self, h: int) -> None:
        e = self._entries.pop(h)
        self.store.allocator.decref([e.slot])
        self._dropped_log.append(h)

    def _publish(self) -> None:
        stored, dropped = self._stored_log, self._dropped_log
        if not (stored or dropped):
            return
        self._stored_log, self._dropped_log = [], []
        if self.on_event is not None:
            self.on_event(stored, dropped)

    def _seed(self, h: int) -> int:
        return h ^ self.store.layout_hash

    # -- lookups ------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], after: Match) -> HostMatch:
        """The pages stored here for the full pages of ``token_ids`` right after ``after`` (an L1 match), pinned."""
        disk = None
        with self._lock:
            self.flush()
            hashes, entries, parent = match_chain(self._entries, token_ids, after.num_tokens, after.node.hash,
                                                  self.page_size)
            if self.lower is not None:
                disk = self.lower.match_prefix(token_ids, after.num_tokens + len(entries) * self.page_size, parent)
        return HostMatch(hashes, entries, disk)

    def restore(self, hm: HostMatch, pool_pages: Sequence[int], commit: Commit = copy_now) -> int:
        """Copy the first ``len(pool_pages)`` matched pages into ``pool_pages``, this tier's then the disk tier's;
        unpins ``hm``. Stops at the first page that fails its checksum or layout tag (dropped, counted), was dropped
        meanwhile, or that ``commit`` refuses (cut off: counted late); -> pages restored. Checksums and copies run
        outside the tier's lock (the entries are pinned: their slots are neither freed nor rewritten), so a loader
        thread may run this while the scheduler's thread uses the tier."""
        good, cut = self._restore_here(hm, pool_pages, commit)
        if hm.disk is not None and self.lower is not None:  # outside the lock: file reads
            if good == len(hm.entries) and not cut:
                good += self.lower.restore(hm.disk, pool_pages[good:], commit)
            else:
                late = min(len(pool_pages) - good, len(hm.disk.entries)) if cut else 0
                self.lower.release(hm.disk, max(0, late))
        return good

    def _restore_here(self, hm: HostMatch, pool_pages: Sequence[int], commit: Commit) -> tuple[int, bool]:
        """-> (pages of this tier restored, whether ``commit`` cut the load off)."""
        t0 = time.perf_counter()
        with self._lock:
            n = min(len(pool_pages), len(hm.entries))
            n = next((i for i in range(n) if self._entries.get(hm.hashes[i]) is not hm.entries[i]), n)
        batch = max(1, BATCH_BYTES // self.store.page_bytes)
        good, bad, cut = 0, False, False
        while good < n and not (bad or cut):
            end = min(n, good + batch)
            ok = good
            for h, e in zip(hm.hashes[good:end], hm.entries[good:end]):
                if e.layout_hash != self.store.layout_hash or self.store.checksum(e.slot, self._seed(h)) != e.checksum:
                    bad = True
                    break
                ok += 1
            if ok > good:
                copy = functools.partial(self.store.load, [e.slot for e in hm.entries[good:ok]], self.pool,
                                         pool_pages[good:ok])
                if not commit(ok - good, copy):
                    cut, bad = True, False  # the bad page, if any, was not reached: unpinned below as the rest
                    break
                good = ok
        with self._lock:
            if bad:
                h = hm.hashes[good]
                self.corrupt_pages += 1
                logger.warning("host prefix cache: page %016x failed its checksum; recomputing it", h)
                e = hm.entries[good]
                e.pins -= 1
                hm.entries[good] = None  # unpinned already
                if self._entries.get(h) is e:
                    self._drop(h)
            if cut:
                self.late_pages += n - good
            for h, e in zip(reversed(hm.hashes[:good]), reversed(hm.entries[:good])):  # leaf first: parents newest
                e.hits += 1
                e.credit = min(MAX_CREDIT, e.credit + 1)
                self._entries.move_to_end(h)
            self.hit_tokens += good * self.page_size
            self._unpin(hm)
            self._publish()
        if good:
            self.load_times.observe(time.perf_counter() - t0)
        return good, cut

    def release(self, hm: HostMatch) -> None:
        with self._lock:
            self._unpin(hm)
        if hm.disk is not None and self.lower is not None:
            self.lower.release(hm.disk)

    def close(self) -> None:
        """Copy what write-through still queues (the scheduler has stopped: no other OpenMP team runs), then close
        the disk tier below (its writer finishes what is queued). The host memory is freed with this object."""
        self.flush()
        if self.lower is not None:
            self.lower.close()

    @staticmethod
    def _unpin(hm: HostMatch) -> None:
        unpin(hm.entries)

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._entries)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def stats(self) -> HostCacheStats:
        n = len(self._entries)
        return HostCacheStats(self.store.num_pages, n, n * self.store.page_bytes, self.hit_tokens, self.stored_pages,
                              self.evicted_pages, self.corrupt_pages, self.dropped_pages)

    def reset(self) -> None:
        """Drop every unpinned entry (tests and admin)."""
        with self._lock:
            self._pending.clear()
            for h in [h for h, e in self._entries.items() if not e.pins]:
                self._drop(h)
            self._publish()

    def all_hashes(self) -> list[int]:
        """Block hashes of every page stored (a snapshot for a new cache-event subscriber)."""
        with self._lock:
            return list(self._entries)


class HostCacheSize(NamedTuple):
    num_pages: int
    reason: str
    """How the size was chosen (logged at start-up)."""


def plan_host_cache(spec: str, page_bytes: int, pool_bytes: int, host_available_bytes: int) -> HostCacheSize:
    """``--host-cache-bytes`` -> host pages: ``0`` off; a size (``64M``, ``40G``, ``8GiB``: ``engine.memory.
    parse_bytes``); ``auto``: ``AUTO_POOL_MULTIPLE`` x the KV pool, at most ``AUTO_HOST_FRACTION`` of the host's
    available memory. ``ValueError`` for anything else."""
    if spec.strip().lower() == AUTO:
        cap = int(host_available_bytes * AUTO_HOST_FRACTION)
        want = min(AUTO_POOL_MULTIPLE * pool_bytes, cap)
        n = want // page_bytes
        return HostCacheSize(n, f"auto: {AUTO_POOL_MULTIPLE} x the KV pool ({gib(pool_bytes)}), at most "
                                f"{AUTO_HOST_FRACTION:g} of {gib(host_available_bytes)} available: "
                                f"{gib(n * page_bytes)}")
    n = parse_bytes(spec) // page_bytes
    if n == 0 and parse_bytes(spec) > 0:
        raise ValueError(f"--host-cache-bytes {spec} holds no page: one page takes {page_bytes} bytes")
    return HostCacheSize(n, f"--host-cache-bytes {spec}: {gib(n * page_bytes)}" if n else "--host-cache-bytes 0: off")
