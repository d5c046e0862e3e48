"""Which prefill worker really holds which prefix: a global block-hash index fed by the workers' cache events.

A prefill worker's radix cache publishes every page it stores or evicts as a *block hash*: a 64-bit
blake2b chain hash of the page's token ids and its parent's hash (``engine.kvcache.radix.block_hash``; the
same function is reimplemented here because the router must not import ``prefill``, and a test checks
both agree). Because the hash is chained, a worker holding block ``i`` of a prompt holds exactly that
prefix, so a longest-prefix match is a walk down the prompt's block hashes that stops at the first miss.

The walk is lazy: block hashes are computed only while some worker still matches, so a cold prompt
costs one hash whatever its length.

Tiers: a prefill worker also publishes the pages its host-memory tier stores and drops (``host_stored``,
``host_evicted``; ``prefill.host_cache``). Its prefix lookup walks its KV pool first and continues in its host
tier where the pool's match ends, so ``match_tiers`` reports, per worker, the blocks held on the device and the
blocks after those held in host memory (restored into the pool instead of recomputed). Below the host tier, a worker
may have a local-disk tier (``disk_stored``, ``disk_evicted``; ``prefill.disk_cache``): its lookup continues there
where the host tier's ends, and so does ``match_tiers``.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Iterable, NamedTuple, Sequence


@functools.lru_cache(maxsize=64)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<Q{num_tokens}I")


def block_hash(parent: int, chunk: Sequence[int]) -> int:
    """64-bit chained hash of a page of token ids; equal to ``engine.kvcache.radix.block_hash``."""
    h = hashlib.blake2b(_packer(len(chunk)).pack(parent, *chunk), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Block hashes of every full page of ``token_ids``."""
    return list(PromptHashes(token_ids, page_size).iter_all())


class PromptHashes:
    """The chained block hashes of one prompt, computed on demand and memoised."""

    __slots__ = ("token_ids", "page_size", "num_blocks", "_hashes")

    def __init__(self, token_ids: Sequence[int], page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.token_ids = token_ids
        self.page_size = page_size
        self.num_blocks = len(token_ids) // page_size
        self._hashes: list[int] = []

    def __getitem__(self, i: int) -> int:
        hashes = self._hashes
        if i < len(hashes):
            return hashes[i]
        if i >= self.num_blocks:
            raise IndexError(i)
        P, ids = self.page_size, self.token_ids
        parent = hashes[-1] if hashes else 0
        for k in range(len(hashes), i + 1):
            parent = block_hash(parent, ids[k * P:(k + 1) * P])
            hashes.append(parent)
        return parent

    def iter_all(self):
        for i in range(self.num_blocks):
            yield self[i]


class TierMatch(NamedTuple):
    """A worker's matched prefix in blocks: ``device`` in its KV pool, then ``host`` more in its host tier, then
    ``disk`` more in its disk tier."""
    device: int
    host: int
    disk: int = 0


class PrefixIndex:
    """Block hashes held per worker and tier. Not thread-safe: used from the router's event loop only."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        """block hash -> workers holding it in their KV pool"""
        self._by_worker: dict[str, set[int]] = {}
        self._host_by_worker: dict[str, set[int]] = {}
        """worker -> block hashes in its host tier (looked up per worker only: no reverse map)"""
        self._disk_by_worker: dict[str, set[int]] = {}
        """worker -> block hashes in its disk tier (as the host tier's)"""

    def apply(self, worker_id: str, stored: Iterable[int] = (), evicted: Iterable[int] = (),
              reset: bool = False, host_stored: Iterable[int] = (), host_evicted: Iterable[int] = (),
              disk_stored: Iterable[int] = (), disk_evicted: Iterable[int] = ()) -> None:
        """Apply one cache event (``reset`` drops what was known first; ``stored``, ``host_stored`` and
        ``disk_stored`` are then snapshots)."""
        if reset:
            self.drop(worker_id)
        _apply(self._holders, self._by_worker, worker_id, stored, evicted)
        _apply(None, self._host_by_worker, worker_id, host_stored, host_evicted)
        _apply(None, self._disk_by_worker, worker_id, disk_stored, disk_evicted)

    def drop(self, worker_id: str) -> None:
        """Forget a worker's blocks (its event stream broke or it left)."""
        _drop(self._holders, self._by_worker, worker_id)
        _drop(None, self._host_by_worker, worker_id)
        _drop(None, self._disk_by_worker, worker_id)

    def num_blocks(self, worker_id: str) -> int:
        """Blocks in the worker's KV pool."""
        return len(self._by_worker.get(worker_id, ()))

    def num_host_blocks(self, worker_id: str) -> int:
        return len(self._host_by_worker.get(worker_id, ()))

    def num_disk_blocks(self, worker_id: str) -> int:
        return len(self._disk_by_worker.get(worker_id, ()))

    def holds(self, worker_id: str, h: int) -> bool:
        return h in self._by_worker.get(worker_id, ())

    def match(self, prompt: PromptHashes, worker_ids: Iterable[str]) -> dict[str, int]:
        """Matched prefix length in *blocks* in each of ``worker_ids``' KV pool (0 when nothing matches)."""
        result = dict.fromkeys(worker_ids, 0)
        alive = {w for w in result if self._by_worker.get(w)}
        i = 0
        while alive and i < prompt.num_blocks:
            holders = self._holders.get(prompt[i])
            nxt = alive & holders if holders else set()
            for w in alive - nxt:
                result[w] = i
            alive = nxt
            i += 1
        for w in alive:
            result[w] = i
        return result

    def match_tiers(self, prompt: PromptHashes, worker_ids: Iterable[str]) -> dict[str, TierMatch]:
        """``match``, then for each worker the blocks right after its pool's match that its host tier holds, then
        the blocks right after those that its disk tier holds."""
        out = {}
        for w, device in self.match(prompt, worker_ids).items():
            host = _run(self._host_by_worker.get(w), prompt, device)
            disk = _run(self._disk_by_worker.get(w), prompt, device + host)
            out[w] = TierMatch(device, host, disk)
        return out


def _run(mine: set[int] | None, prompt: PromptHashes, start: int) -> int:
    """How many of the prompt's blocks from ``start`` on ``mine`` holds, one after the other."""
    i = start
    while mine and i < prompt.num_blocks and prompt[i] in mine:
        i += 1
    return i - start


def _apply(holders: dict[int, set[str]] | None, by_worker: dict[str, set[int]], worker_id: str,
           stored: Iterable[int], evicted: Iterable[int]) -> None:
    """One tier's event: ``by_worker`` and, when kept, the reverse map ``holders``."""
    mine = by_worker.setdefault(worker_id, set())
    for h in evicted:
        if h in mine:
            mine.discard(h)
            if holders is not None:
                who = holders[h]
                who.discard(worker_id)
                if not who:
                    del holders[h]
    for h in stored:
        if h not in mine:
            mine.add(h)
            if holders is not None:
                holders.setdefault(h, set()).add(worker_id)


def _drop(holders: dict[int, set[str]] | None, by_worker: dict[str, set[int]], worker_id: str) -> None:
    for h in by_worker.pop(worker_id, ()):
        who = holders.get(h) if holders is not None else None
        if who is not None:
            who.discard(worker_id)
            if not who:
                del holders[h]
