"""What the prefix cache's lower tiers (``prefill.host_cache``, ``prefill.disk_cache``) share: an LRU index of
entries keyed by block hash, each with its ``chunk`` / ``parent_hash`` (a match checks both), ``pins`` (a
pinned entry is never evicted) and ``credit`` (second chances banked from restores, at most ``MAX_CREDIT``).
Callers hold their tier's lock."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator, Protocol, Sequence

from prefill.radix import block_hash

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
