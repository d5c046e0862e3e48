"""What the prefix cache's lower tiers (``prefill.host_cache``, ``prefill.disk_cache``) share: an LRU index of
entries keyed by block hash, each with its ``chunk`` / ``parent_hash`` (a match checks both), ``pins`` (a
pinned entry is never evicted) and ``credit`` (second chances banked from restores, at most ``MAX_CREDIT``);
callers hold their tier's lock. And ``LoadTimes``, the load latency histogram each tier keeps."""
from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from typing import Callable, Iterator, Protocol, Sequence

from engine.kvcache.radix import block_hash

MAX_CREDIT = 3
"""Most second chances an entry banks from its restores."""


class TierEntry(Protocol):
    parent_hash: int
    chunk: tuple[int, ...]
    pins: int
    credit: int


def lru_victims(entries: OrderedDict[int, TierEntry], short: Callable[[], bool]) -> Iterator[tuple[int, TierEntry]]:
    """The entries to evict, LRU first, while ``short()``: a pinned entry moves to the MRU end, one with credit
    spends one and moves there too. The caller removes each yielded entry from ``entries`` before the next."""
    budget = len(entries) * (MAX_CREDIT + 2)  # every entry moves at most MAX_CREDIT + 1 times
    while short() and entries and budget > 0:
        budget -= 1
        h, e = next(iter(entries.items()))
        if e.pins or e.credit:
            if not e.pins:
                e.credit -= 1
            entries.move_to_end(h)
            continue
        yield h, e


def match_chain(entries: dict[int, TierEntry], token_ids: Sequence[int], start: int, parent: int, page_size: int
                ) -> tuple[list[int], list[TierEntry], int]:
    """The entries for the full pages of ``token_ids`` from ``start`` on, each chained to the one before
    (``parent``: the block hash of the page before ``start``), pinned -> (hashes, entries, the last hash)."""
    hashes, found = [], []
    for i in range(start, len(token_ids) - page_size + 1, page_size):
        chunk = tuple(token_ids[i:i + page_size])
        h = block_hash(parent, chunk)
        e = entries.get(h)
        if e is None or e.chunk != chunk or e.parent_hash != parent:
            break
        e.pins += 1
        hashes.append(h)
        found.append(e)
        parent = h
    return hashes, found, parent


def unpin(matched: list[TierEntry | None]) -> None:
    """Unpin a match's entries once (each slot set to None)."""
    for i, e in enumerate(matched):
        if e is not None:
            e.pins -= 1
            matched[i] = None


LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the load latency histogram's buckets (seconds; one more, +Inf, takes the rest)."""


class LoadTimes:
    """A latency histogram of one tier's loads (one observation per request that loaded pages from the tier: its
    pages read, verified and copied into the pool), safe to observe from the loader threads and read from any."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LOAD_BUCKETS_S) + 1)
        self.sum_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LOAD_BUCKETS_S, seconds)
        with self._lock:
            self._counts[i] += 1
            self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self._counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, +Inf last (Prometheus' histogram buckets)."""
        with self._lock:
            counts = list(self._counts)
        return list(zip([f"{b:g}" for b in LOAD_BUCKETS_S] + ["+Inf"], itertools.accumulate(counts)))


Commit = Callable[[int, Callable[[], None]], bool]
"""``commit(n, copy)``: a tier's restore calls it for each batch of verified pages, ``copy()`` copying the next ``n``
into the pool; it runs ``copy`` and returns True, or returns False without running it when the load was cut off
(the request went on without the rest: ``prefill.admission``), and the restore stops there."""


def copy_now(n: int, copy: Callable[[], None]) -> bool:
    """The ``Commit`` of a restore nobody cuts off (a synchronous one)."""
    copy()
    return True


BATCH_BYTES = 8 << 20
"""A restore verifies and copies pages in batches of about this many bytes (at least one page), so a cut-off
load stops within one batch."""
