"""The prefix cache's disk tier (L3): KV pages as files in a local directory, below the host tier (L2,
``prefill.host_cache``).

Pages come down through the host tier (write_back: as it evicts them; write_through: as it stores them; pages too
many for its room: straight from the pool), as rows of ``engine.kvcache.host_pool``'s slot layout (every layer and
component, fp8 scales, the MTP layer)::

    put(hash, parent, chunk, row)   scheduler thread: the row is copied and queued for the writer thread; a full
                                    queue drops the page (counted): the scheduler never waits for the disk
    writer thread                   makes room (LRU with hit credit, pinned entries skipped), writes
                                    <hash>.kv.tmp, renames it to <hash>.kv: only then is the page an entry (a hit)

A prompt whose cached prefix runs past what the host tier holds continues here::

    match_prefix(ids, start, parent) -> DiskMatch (pinned)   the pages stored for ids' full pages from ``start`` on
    restore(dm, pool_pages) -> pages restored                each file read and verified, then loaded into the
                                                             fresh pool pages straight (not through the host tier)
    release(dm)                                              unpin without restoring

On disk, one directory per pool layout, one file per page (its format: ``engine.kvcache.page_file``: a header
naming the layout, the page and its parent, the token chunk, the page's bytes and an xxh3 checksum of it all)::

    DIR/<layout hash: 16 hex digits>/<block hash: 16 hex digits>.kv

Integrity: a file is verified when it is loaded (header fields against the entry, the trailer against the bytes);
a missing, truncated or corrupt file ends the restore there: it is removed, counted (``corrupt_pages``) and the
request recomputes that page and everything after it. Files appear by rename only, so a crash leaves either a whole
page or a ``.tmp`` file (removed at the next start); what an OS crash may leave half-written fails its checksum.

Start: an exclusive lock on the layout directory (a second worker on it refuses to start), ``.tmp`` files removed,
the ``.kv`` files re-indexed by their headers (oldest modified first in the LRU; a bad header: removed), the oldest
removed until the budget holds; other layouts' directories ignored, logged once. A restart keeps the disk cache.
"""
from __future__ import annotations

import fcntl
import functools
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from engine.kvcache.host_pool import HostPagePool
from engine.kvcache.page_file import TMP_SUFFIX, PageFile, PageHeader, unlink
from engine.kvcache.pool import KVPool
from engine.memory import gib, parse_bytes
from engine.kvcache.radix import block_hash
from prefill.tier_index import BATCH_BYTES, MAX_CREDIT, Commit, LoadTimes, copy_now, lru_victims, match_chain, unpin

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
QUEUE_BYTES = 256 << 20
"""Bytes of pages the writer's queue holds at most (at least 4 pages): past that, pages are dropped, not waited for."""
AUTO = "auto"
AUTO_DISK_FRACTION = 0.5
"""``--disk-cache-bytes auto``: this fraction of the directory's free space at start (plus what it holds already)."""
_LAYOUT_DIR = re.compile(r"[0-9a-f]{16}")
_PAGE_FILE = re.compile(r"([0-9a-f]{16})\.kv")


@dataclass(eq=False, slots=True)
class _DiskEntry:
    parent_hash: int
    chunk: tuple[int, ...]
    num_bytes: int
    hits: int = 0
    credit: int = 0
    pins: int = 0


class DiskMatch(NamedTuple):
    hashes: list[int]
    """Block hashes of the matched pages, in prompt order."""
    entries: list[_DiskEntry | None]
    """Their entries, pinned until ``restore`` or ``release`` (None once unpinned)."""


@dataclass(frozen=True, slots=True)
class DiskCacheStats:
    capacity_bytes: int
    cached_pages: int
    cached_bytes: int
    hit_tokens: int
    """Prompt tokens restored from this tier (after missing the pool and the host tier)."""
    stored_pages: int
    """Pages written (files renamed into place)."""
    evicted_pages: int
    corrupt_pages: int
    """Pages whose file was missing, truncated or failed its checksum at restore (each one recomputed instead)."""
    dropped_pages: int
    """Pages not written: the queue was full, no room (every entry pinned) or the write failed."""
    indexed_pages: int
    """Pages found in the directory at start."""


class DiskCache:
    """The L3 tier of one prefill worker's prefix cache: files under ``directory``/<layout hash>, at most
    ``capacity_bytes`` of them, in ``store``'s page layout (the host tier's ``HostPagePool``)."""

    def __init__(self, directory: str, capacity_bytes: int, store: HostPagePool, pool: KVPool) -> None:
        self.store, self.pool = store, pool
        self.layout_hash, self.page_size, self.page_bytes = store.layout_hash, pool.page_size, store.page_bytes
        self.capacity_bytes = capacity_bytes
        self.dir = os.path.join(os.path.abspath(directory), f"{self.layout_hash:016x}")
        self.format = PageFile(self.layout_hash, self.page_size, self.page_bytes)
        self.file_bytes = self.format.file_bytes
        self._pin = pool.device.type == "cuda"
        self._entries: OrderedDict[int, _DiskEntry] = OrderedDict()
        """block hash -> entry (a whole file on disk), least recently used first."""
        self._inflight: set[int] = set()  # queued or being written: not a hit yet
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self.used_bytes = 0
        self.on_event: Callable[[list[int], list[int]], None] | None = None
        """Called with (block hashes stored, block hashes dropped) after each change (under the lock, from the
        writer thread or the scheduler's)."""
        self.hit_tokens = self.stored_pages = self.evicted_pages = self.corrupt_pages = self.dropped_pages = 0
        self.late_pages = 0  # matched here, not loaded in time: the request went on and recomputed them
        self.load_times = LoadTimes()  # seconds each restore took (files read, verified, copied into the pool)
        self._warned_write = self._closed = False
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = _lock_dir(self.dir)
        try:
            self.indexed_pages = self._reindex()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=max(4, QUEUE_BYTES // self.page_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="prefill-disk-writer", daemon=True)
        self._writer.start()

    # -- start --------------------------------------------------------------------------------------
    def _reindex(self) -> int:
        found = []
        with os.scandir(self.dir) as it:
            for de in it:
                if de.name.endswith(SUFFIX + TMP_SUFFIX):  # a write a crash interrupted
                    unlink(de.path)
                    continue
                m = _PAGE_FILE.fullmatch(de.name)
                if m is None:
                    continue
                h = int(m.group(1), 16)
                head = self.format.read_header(de.path, h)
                if head is None or block_hash(*head) != h:
                    logger.warning("disk prefix cache: %s is not a page of this layout; removed", de.path)
                    unlink(de.path)
                    continue
                found.append((de.stat().st_mtime_ns, h, _DiskEntry(head.parent_hash, head.chunk, self.file_bytes)))
        for _, h, e in sorted(found, key=lambda f: f[0]):
            self._entries[h] = e
            self.used_bytes += e.num_bytes
        n = len(self._entries)
        while self.used_bytes > self.capacity_bytes and self._entries:
            self._remove(next(iter(self._entries)))
            self.evicted_pages += 1
        others = self._other_layouts()
        if others:
            logger.warning("disk prefix cache: ignoring %d pages of %d other layouts in %s", sum(others.values()),
                           len(others), os.path.dirname(self.dir))
        logger.info("disk prefix cache: %s holds %d pages of this layout (%s), %d removed for the budget of %s",
                    self.dir, n, gib(n * self.file_bytes), self.evicted_pages, gib(self.capacity_bytes))
        return n

    def _other_layouts(self) -> dict[str, int]:
        root, out = os.path.dirname(self.dir), {}
        with os.scandir(root) as it:
            for de in it:
                if de.is_dir() and _LAYOUT_DIR.fullmatch(de.name) and de.path != self.dir:
                    with os.scandir(de.path) as pages:
                        out[de.name] = sum(1 for p in pages if _PAGE_FILE.fullmatch(p.name))
        return out

    # -- writes -------------------------------------------------------------------------------------
    def put(self, h: int, parent_hash: int, chunk: tuple[int, ...], row: torch.Tensor) -> None:
        """Queue page ``h`` (``row``: its ``[page_bytes]`` uint8, copied now) for the writer; a page held already is
        touched instead. Never blocks."""
        with self._lock:
            if self._closed or h in self._inflight:
                return
            e = self._entries.get(h)
            if e is not None:  # held already (a 64-bit collision with another prefix keeps the older one)
                self._entries.move_to_end(h)
                return
            item = (h, parent_hash, tuple(chunk), row.clone())
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped_pages += 1
                return
            self._inflight.add(h)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            h, parent, chunk, row = item
            stored, room = False, False
            try:
                with self._lock:
                    room = self._make_room(self.file_bytes)
                if room:
                    self.format.write(self._path(h), h, parent, chunk, row)
                    stored = True
            except Exception as e:  # noqa: BLE001 - a page that fails to be written is dropped, never the writer
                if not self._warned_write:
                    self._warned_write = True
                    logger.warning("disk prefix cache: writing %s failed (%s); pages that fail are dropped", self.dir, e)
            finally:
                with self._lock:
                    self._inflight.discard(h)
                    if stored:
                        self._entries[h] = _DiskEntry(parent, chunk, self.file_bytes)
                        self.used_bytes += self.file_bytes
                        self.stored_pages += 1
                        self._publish([h], [])
                    else:
                        self.dropped_pages += 1
                    self._idle.notify_all()

    def _make_room(self, num_bytes: int) -> bool:
        """Remove LRU entries (pinned ones and second chances skipped) until ``num_bytes`` more fit. Under the lock."""
        for h, _ in lru_victims(self._entries, lambda: self.used_bytes + num_bytes > self.capacity_bytes):
            self._remove(h)
            self.evicted_pages += 1
        return self.used_bytes + num_bytes <= self.capacity_bytes

    def _remove(self, h: int) -> None:
        """Forget entry ``h`` and delete its file. Under the lock (the writer never renames a file onto a path
        whose entry is still known, so a removal cannot delete a newer page)."""
        e = self._entries.pop(h)
        self.used_bytes -= e.num_bytes
        unlink(self._path(h))
        self._publish([], [h])

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued page is written or dropped (tests, shutdown); -> True when idle."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout=timeout_s)

    # -- lookups ------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], start: int, parent: int) -> DiskMatch:
        """The pages stored here for the full pages of ``token_ids`` from ``start`` on (``parent``: the block hash
        of the page before ``start``), pinned."""
        with self._lock:
            hashes, entries, _ = match_chain(self._entries, token_ids, start, parent, self.page_size)
        return DiskMatch(hashes, entries)

    def restore(self, dm: DiskMatch, pool_pages: Sequence[int], commit: Commit = copy_now) -> int:
        """Load the first ``len(pool_pages)`` matched pages into ``pool_pages``; unpins ``dm``. Stops at the first
        file that is missing, truncated or fails its checksum (removed, counted), or where ``commit`` refuses (cut
        off: counted late); -> pages restored. Files are read and verified in batches, outside the lock (a pinned
        entry's file is neither removed nor rewritten): a loader thread runs this (``prefill.admission``)."""
        t0 = time.perf_counter()
        n = min(len(pool_pages), len(dm.entries))
        batch = max(1, min(n, BATCH_BYTES // self.page_bytes))
        rows = torch.empty((batch, self.page_bytes), dtype=torch.uint8, pin_memory=self._pin)
        good, cut = 0, False
        while good < n:
            end = min(n, good + batch)
            ok = good
            for h, e in zip(dm.hashes[good:end], dm.entries[good:end]):
                why = self.format.read(self._path(h), h, PageHeader(e.parent_hash, e.chunk), rows[ok - good])
                if why:
                    self._drop_bad(dm, ok, why)
                    break
                ok += 1
            copy = functools.partial(self.store.load_rows, rows[:ok - good], self.pool, pool_pages[good:ok])
            cut = ok > good and not commit(ok - good, copy)
            good = good if cut else ok
            if cut or ok < end:
                break
        with self._lock:
            for h, e in zip(reversed(dm.hashes[:good]), reversed(dm.entries[:good])):  # leaf first: parents newest
                e.hits += 1
                e.credit = min(MAX_CREDIT, e.credit + 1)
                if self._entries.get(h) is e:
                    self._entries.move_to_end(h)
            self.hit_tokens += good * self.page_size
            if cut:
                self.late_pages += n - good
            self._unpin(dm)
        if good:
            self.load_times.observe(time.perf_counter() - t0)
        return good

    def _drop_bad(self, dm: DiskMatch, i: int, why: str) -> None:
        h, e = dm.hashes[i], dm.entries[i]  # failed its check (why): unpinned, removed, counted
        with self._lock:
            self.corrupt_pages += 1
            logger.warning("disk prefix cache: page %016x %s; recomputing it", h, why)
            e.pins -= 1
            dm.entries[i] = None
            if self._entries.get(h) is e:
                self._remove(h)

    def release(self, dm: DiskMatch, late: int = 0) -> None:
        """Unpin ``dm`` without restoring; ``late``: how many of its pages the request wanted but went on without."""
        with self._lock:
            self.late_pages += late
            self._unpin(dm)

    @staticmethod
    def _unpin(dm: DiskMatch) -> None:
        unpin(dm.entries)

    # -- accounting ---------------------------------------------------------------------------------
    def _path(self, h: int) -> str:
        return os.path.join(self.dir, f"{h:016x}{SUFFIX}")

    def _publish(self, stored: list[int], dropped: list[int]) -> None:
        if self.on_event is not None:
            self.on_event(stored, dropped)

    @property
    def num_pages(self) -> int:
        return len(self._entries)

    def stats(self) -> DiskCacheStats:
        return DiskCacheStats(self.capacity_bytes, len(self._entries), self.used_bytes, self.hit_tokens,
                              self.stored_pages, self.evicted_pages, self.corrupt_pages, self.dropped_pages,
                              self.indexed_pages)

    def all_hashes(self) -> list[int]:
        """Block hashes of every page on disk (a snapshot for a new cache-event subscriber)."""
        with self._lock:
            return list(self._entries)

    def reset(self) -> None:
        """Remove every unpinned page (tests and admin); queued pages are still written."""
        with self._lock:
            for h in [h for h, e in self._entries.items() if not e.pins]:
                self._remove(h)

    def close(self, drain: bool = True) -> None:
        """Stop the writer (after it wrote what is queued, when ``drain``) and unlock the directory. Idempotent."""
        with self._lock:
            closed, self._closed = self._closed, True
        if closed:
            return
        while not drain:
            try:
                h = self._queue.get_nowait()[0]
            except queue.Empty:
                break
            with self._lock:
                self._inflight.discard(h)
        self._queue.put(None)
        self._writer.join()
        os.close(self._lock_fd)


def _lock_dir(path: str) -> int:
    """An exclusive lock on ``path``'s ``.lock`` file, held for the cache's life (the fd)."""
    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"disk prefix cache {path} is in use by another process (one directory per worker)") \
            from None
    return fd


class DiskCacheSize(NamedTuple):
    capacity_bytes: int
    reason: str
    """How the size was chosen (logged at start-up)."""


def plan_disk_cache(directory: str | None, spec: str) -> DiskCacheSize:
    """``--disk-cache-dir`` / ``--disk-cache-bytes`` -> the tier's byte budget: off without a directory or with
    ``0``; a size (``64M``, ``40G``: ``engine.memory.parse_bytes``); ``auto``: ``AUTO_DISK_FRACTION`` of the
    directory's free space plus the pages it holds already. ``ValueError`` for anything else, or a size without a
    directory."""
    auto = spec.strip().lower() == AUTO
    if not directory:
        if not auto and parse_bytes(spec) > 0:
            raise ValueError(f"--disk-cache-bytes {spec} needs --disk-cache-dir")
        return DiskCacheSize(0, "off (no --disk-cache-dir)")
    if not auto:
        n = parse_bytes(spec)
        return DiskCacheSize(n, f"--disk-cache-bytes {spec}: {gib(n)}" if n else "--disk-cache-bytes 0: off")
    os.makedirs(directory, exist_ok=True)
    held = 0
    for root, _, files in os.walk(directory):
        held += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(SUFFIX))
    free = shutil.disk_usage(directory).free
    n = int((free + held) * AUTO_DISK_FRACTION)
    return DiskCacheSize(n, f"auto: {AUTO_DISK_FRACTION:g} of {gib(free)} free + {gib(held)} held: {gib(n)}")
