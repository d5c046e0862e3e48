"""Radix prefix cache over token ids at page granularity: a prefill worker's L1 tier (``prefill.admission``) and a
decode worker's cache of finished requests' pages (``decode.admission``: decode-side prefix reuse).

Each node below the root holds exactly one full KV page: the page for ``page_size`` tokens
that follow its parent's tokens. The cache owns one allocator reference to every page in
the tree; requests borrow cached pages read-only by *locking* the path they matched
(``lock_ref``), and a locked node is never evicted. Eviction removes least-recently-used
unlocked leaves and frees their pages.

Lifecycle of a request's prefix::

    match_prefix(ids) -> Match (path locked)     pages usable read-only, never evicted meanwhile
    insert(ids, pages) after prefill             new full pages handed to the cache (dups freed)
    release(match)                               unlock; the pages stay cached, now evictable

Every stored or evicted page is published as a block hash (a chain hash of the token
chunks from the root), so a router can score workers by the prefixes they really hold.

A lower tier (``LowerTier``: the host-memory cache of ``prefill.host_cache``) sees every page the
cache takes (``on_insert``, for write-through) and every page it evicts, while the page still
holds its KV (``on_evict``, for write-back). Pages a lower tier restores come back with
``extend(match, ...)``, which also moves the request's lock to the longer path.
"""
from __future__ import annotations

import hashlib
import itertools
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

from engine.kvcache.pool import PageAllocator

_clock = itertools.count()


def block_hash(parent: int, chunk: Sequence[int]) -> int:
    """64-bit chained hash of a page of token ids (stable across processes and machines)."""
    h = hashlib.blake2b(struct.pack(f"<Q{len(chunk)}I", parent, *chunk), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Block hashes of every full page of ``token_ids`` (what a router compares with cache events)."""
    out, parent = [], 0
    for i in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[i:i + page_size])
        out.append(parent)
    return out


@dataclass(eq=False)
class _Node:
    chunk: tuple[int, ...]
    page: int
    hash: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    pages: list[int]
    """Cached pages covering ``num_tokens`` tokens, in order (read-only)."""
    num_tokens: int
    node: _Node
    """Deepest matched node; the whole path to it is locked until ``release``."""


class CachedPage(NamedTuple):
    """One page of the tree as a lower tier sees it."""
    hash: int
    """Its block hash (``block_hash(parent_hash, chunk)``)."""
    parent_hash: int
    """The block hash of the page before it (0 for a prefix's first page)."""
    chunk: tuple[int, ...]
    """The ``page_size`` token ids it holds the KV of."""
    page: int
    """Its KV pool page (valid only during the call)."""


class LowerTier(Protocol):
    """A cache below this one; both calls run under the cache's lock while every page named holds its KV."""

    def on_insert(self, pages: list[CachedPage]) -> None:
        """Pages the cache just took, root first."""

    def on_evict(self, pages: list[CachedPage]) -> None:
        """Pages about to be freed, leaves first (a page's descendants before it)."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    cached_pages: int
    evictable_pages: int
    hit_tokens: int
    query_tokens: int


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int,
                 on_event: Callable[[list[int], list[int]], None] | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node((), -1, 0, None)
        self.on_event = on_event
        """Called with (stored block hashes, evicted block hashes)."""
        self.lower: LowerTier | None = None
        """The tier below (None: evicted pages are gone)."""
        self._num_pages = 0
        self._lock = threading.RLock()
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- queries -------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> Match:
        """Longest cached prefix in full pages; locks the matched path. ``count``: add it to the hit / query
        counters (a look-ahead that may be repeated at admission passes False and ``count_query``s if it is
        kept)."""
        P = self.page_size
        with self._lock:
            node, pages, t = self.root, [], next(_clock)
            for i in range(0, len(token_ids) - P + 1, P):
                child = node.children.get(tuple(token_ids[i:i + P]))
                if child is None:
                    break
                node = child
                node.last_access = t
                pages.append(node.page)
            self._lock_path(node, +1)
            if count:
                self.count_query(len(pages) * P, len(token_ids))
            return Match(pages, len(pages) * P, node)

    def count_query(self, hit_tokens: int, query_tokens: int) -> None:
        with self._lock:
            self.hit_tokens += hit_tokens
            self.query_tokens += query_tokens

    def release(self, match: Match) -> None:
        with self._lock:
            self._lock_path(match.node, -1)

    def _lock_path(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            node.lock_ref += delta
            if node.lock_ref < 0:
                raise RuntimeError("radix lock released more often than taken")
            node = node.parent

    # -- updates -------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Hand the full pages of a prefilled sequence to the cache.

        ``pages[i]`` holds tokens ``[i * P, (i + 1) * P)``. Pages already in the tree (same
        prefix) keep the cached copy; the caller's duplicate is freed. Pages past the last full
        page are not touched (the caller frees them). Returns how many pages the cache took.
        """
        P = self.page_size
        n_full = min(len(token_ids) // P, len(pages))
        stored: list[int] = []
        with self._lock:
            node, taken, t = self.root, 0, next(_clock)
            dup: list[int] = []
            new: list[CachedPage] = []
            for i in range(n_full):
                chunk = tuple(token_ids[i * P:(i + 1) * P])
                child = node.children.get(chunk)
                if child is None:
                    child = _Node(chunk, pages[i], block_hash(node.hash, chunk), node)
                    node.children[chunk] = child
                    self._num_pages += 1
                    self.allocator.set_owner([pages[i]], "radix")
                    stored.append(child.hash)
                    new.append(_cached(child))
                    taken += 1
                elif child.page != pages[i]:
                    dup.append(pages[i])
                child.last_access = t
                node = child
            if dup:
                self.allocator.decref(dup)
            if new and self.lower is not None:
                self.lower.on_insert(new)
        if stored and self.on_event:
            self.on_event(stored, [])
        return taken

    def extend(self, match: Match, token_ids: Sequence[int], pages: Sequence[int]) -> Match:
        """Append ``pages`` (restored by a lower tier: the KV of the full pages of ``token_ids`` right after
        ``match``) below ``match``'s node; returns the longer match, locked, and unlocks ``match``. The cache
        takes the pages (a page whose prefix is cached meanwhile is freed and the cached one used)."""
        P, start = self.page_size, match.num_tokens
        if start + len(pages) * P > len(token_ids):
            raise ValueError(f"{len(pages)} pages after {start} tokens need more than {len(token_ids)} tokens")
        stored, dup, out = [], [], list(match.pages)
        with self._lock:
            node, t = match.node, next(_clock)
            for i, page in enumerate(pages):
                chunk = tuple(token_ids[start + i * P:start + (i + 1) * P])
                child = node.children.get(chunk)
                if child is None:
                    child = _Node(chunk, page, block_hash(node.hash, chunk), node)
                    node.children[chunk] = child
                    self._num_pages += 1
                    self.allocator.set_owner([page], "radix")
                    stored.append(child.hash)
                elif child.page != page:
                    dup.append(page)
                child.last_access = t
                node = child
                out.append(node.page)
            self._lock_path(node, +1)
            self._lock_path(match.node, -1)
            if dup:
                self.allocator.decref(dup)
        if stored and self.on_event:
            self.on_event(stored, [])
        return Match(out, len(out) * P, node)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked LRU leaves; returns how many were freed."""
        with self._lock:
            leaves = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0]
            victims: list[_Node] = []
            while len(victims) < num_pages and leaves:
                leaves.sort(key=lambda n: n.last_access)
                node = leaves.pop(0)
                parent = node.parent
                del parent.children[node.chunk]
                victims.append(node)
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    leaves.append(parent)
            if victims and self.lower is not None:  # before the pages are freed: they still hold the KV
                self.lower.on_evict([_cached(n) for n in victims])
            # freed in reverse, as one by one before: a chain evicted leaf first is allocated again root first
            if victims:
                self.allocator.decref([n.page for n in reversed(victims)])
            self._num_pages -= len(victims)
            evicted_hashes = [n.hash for n in victims]
            freed = len(victims)
        if evicted_hashes and self.on_event:
            self.on_event([], evicted_hashes)
        return freed

    def reset(self) -> None:
        """Drop every unlocked page (for tests and admin)."""
        self.evict(self._num_pages)

    # -- accounting ----------------------------------------------------------------------
    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def num_evictable(self) -> int:
        """Pages evictable now (unlocked, all descendants unlocked)."""
        with self._lock:
            return sum(1 for n in self._iter_nodes() if n.lock_ref == 0)

    def stats(self) -> CacheStats:
        return CacheStats(self._num_pages, self.num_evictable(), self.hit_tokens, self.query_tokens)

    def all_hashes(self) -> list[int]:
        with self._lock:
            return [n.hash for n in self._iter_nodes()]


def _cached(node: _Node) -> CachedPage:
    return CachedPage(node.hash, node.parent.hash, node.chunk, node.page)
