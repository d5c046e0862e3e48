"""Shared-memory transport: the decode pool lives in a /dev/shm segment a same-host sender maps.

``ShmKVPool`` is a ``KVPool`` whose buffers (and fp8 scales) are views into one file in
/dev/shm, mapped ``MAP_SHARED``. A prefill worker on the same host maps the same file
(``ShmAttachment``) and copies rows straight from its own pages into the decode pages:
only metadata (lease, per-layer "written" marks, FINISH) goes over the TCP connection.

Segment layout: a 4 KiB header (magic, 16-byte nonce, num_pages, msgpack layout) then
every tensor in (layer, component, data-then-scale) order, each 64-byte aligned
(``segment_plan``, computed identically on both sides). The nonce travels in the READY
frame; the sender refuses a segment whose header does not carry it (a stale file with a
recycled name, or a different host sharing a hostname).

A remote process that can write our pages must never write a page after it was freed.
The receiver therefore frees a shm-written reservation only after the sender acknowledges
the abort, or after the sender process is gone (``pid_alive`` on (pid, start time), which
also defeats pid reuse); offering shm requires that check to work, i.e. the same host and
pid namespace.

The whole segment is reserved when it is created (``reserve_space``): tmpfs otherwise backs
pages on first write, and a /dev/shm that fills up later turns that write into SIGBUS. If it
cannot be reserved the pool is not created (``OSError``) and the decode worker falls back to a
private pool, i.e. TCP.

The creator unlinks the file on ``close()`` (and at interpreter exit); a SIGKILLed decode
worker leaves it in /dev/shm (names start with ``pdserve-kv-<pid ns>-<pid>-``): its supervisor
(``cluster/local.py``) removes it, and so does the next pool created in that pid namespace.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import sys
import threading
import weakref
from typing import NamedTuple

import msgpack
import torch

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool, PageAllocator

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
ALIGN = 64
MAGIC = b"PDKVSHM1"
ZERO_CHUNK_BYTES = 1 << 20
"""``reserve_space``'s fallback writes zeros this many bytes at a time."""
_HEAD = struct.Struct("<8s16sQI")  # magic, nonce, num_pages, layout_len
NAME_RE = re.compile(r"^pdserve-kv-(?:([0-9a-f]{1,16})-)?([0-9a-f]{1,16})-[0-9a-f]{8}$")
"""``pdserve-kv-[<pid namespace inode>-]<pid>-<random>`` (hex): who created the segment, so a segment
left behind by a killed worker can be found and removed."""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def reap_stale_segments() -> list[str]:
    """Unlink the segments whose creator was killed before it could (SIGKILL skips its finalizer):
    only names carrying our pid namespace, whose pid runs no process now. A live pid, even a reused
    one, keeps its segment; mappings stay valid after an unlink anyway. Returns the names removed."""
    ns, removed = _pid_ns(), []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = NAME_RE.match(name)
        if m is None or not m.group(1) or int(m.group(1), 16) != ns or not ns:
            continue
        try:
            os.kill(int(m.group(2), 16), 0)
            continue  # alive (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        log.warning("kvtransfer: removed %d shm segment(s) left by killed workers: %s", len(removed),
                    ", ".join(removed))
    return removed


class TensorSlot(NamedTuple):
    layer: int
    name: str
    is_scale: bool
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def segment_plan(layout: KVLayout, num_pages: int) -> tuple[list[TensorSlot], int]:
    """Where each buffer lives in the segment; returns (slots, total segment bytes)."""
    slots, off = [], HEADER_BYTES
    for layer in range(layout.num_layers):
        for c in layout.components:
            entries = [(False, (num_pages, layout.page_size, *c.shape), layout.torch_dtype)]
            if layout.is_fp8:
                entries.append((True, (num_pages, layout.page_size, *c.scale_shape), torch.float32))
            for is_scale, shape, dtype in entries:
                off = -(-off // ALIGN) * ALIGN
                slots.append(TensorSlot(layer, c.name, is_scale, off, shape, dtype))
                n = torch.empty((), dtype=dtype).element_size()
                for s in shape:
                    n *= s
                off += n
    return slots, -(-off // ALIGN) * ALIGN


def _map_tensors(mm: mmap.mmap, layout: KVLayout, num_pages: int):
    buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_layers)]
    scales: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_layers)] if layout.is_fp8 else []
    plan, _ = segment_plan(layout, num_pages)
    for s in plan:
        count = 1
        for d in s.shape:
            count *= d
        # frombuffer keeps ``mm`` alive as long as any view exists; we never close it explicitly
        t = torch.frombuffer(mm, dtype=s.dtype, count=count, offset=s.offset).view(s.shape)
        (scales if s.is_scale else buffers)[s.layer][s.name] = t
    return buffers, scales


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_shm_space(num_bytes: int) -> None:
    """Raise ``OSError`` (ENOSPC) unless ``SHM_DIR`` has room for ``num_bytes``: a quick, early answer with a
    useful message (Docker's default /dev/shm is 64 MiB). Only ``reserve_space`` makes the room ours."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < num_bytes:
        raise OSError(errno.ENOSPC, f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the KV pool needs "
                      f"{num_bytes / 2**20:.0f} MiB (in Docker raise --shm-size)")


def reserve_space(fd: int, num_bytes: int) -> None:
    """Back every byte of the segment now, or raise ``OSError`` (ENOSPC).

    tmpfs allocates a page on its first write: a segment that is merely truncated to size can find
    /dev/shm full later (another process filled it), and the write into the mapping then kills the
    writer -- this worker, or a prefill worker copying into our pages -- with SIGBUS. ``posix_fallocate``
    allocates it all up front and fails cleanly instead. Where a filesystem cannot fallocate, writing
    zeros through ``write()`` reserves the same way (and reports ENOSPC as an error, not a signal)."""
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise OSError(e.errno, f"cannot reserve {num_bytes / 2**20:.0f} MiB in {SHM_DIR} for the KV pool: "
                          f"{os.strerror(e.errno)}") from None
    zeros = bytes(ZERO_CHUNK_BYTES)
    for off in range(0, num_bytes, ZERO_CHUNK_BYTES):
        n = min(ZERO_CHUNK_BYTES, num_bytes - off)
        if os.pwrite(fd, zeros[:n], off) != n:
            raise OSError(errno.ENOSPC, f"short write reserving the KV pool in {SHM_DIR}")


def segment_prefix(pid: int) -> str:
    """The name every segment created by process ``pid`` (of our pid namespace) starts with; a supervisor
    removes a dead worker's segments by it (``cluster/local.py`` spells the same format without importing
    torch; a test keeps the two equal)."""
    return f"pdserve-kv-{_pid_ns():x}-{pid:x}-"


class ShmKVPool(KVPool):
    """A ``KVPool`` whose storage is a named /dev/shm segment (decode side creates it).

    Same attributes and methods as ``KVPool``; ``KVPool.__init__`` is not called because it
    would first allocate the whole pool in private memory. Creation reserves the whole segment
    (``reserve_space``) or raises ``OSError`` with nothing left behind: callers fall back to a
    private pool (TCP transfers).
    """

    def __init__(self, layout: KVLayout, num_pages: int) -> None:
        self.layout = layout
        self.device = torch.device("cpu")
        self.force_staged = False  # host memory already, shared with the sender
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        reap_stale_segments()
        self.segment_name = segment_prefix(os.getpid()) + secrets.token_hex(4)
        self.nonce = secrets.token_bytes(16)
        _, self.segment_bytes = segment_plan(layout, num_pages)
        check_shm_space(self.segment_bytes)
        path = os.path.join(SHM_DIR, self.segment_name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            reserve_space(fd, self.segment_bytes)
            mm = mmap.mmap(fd, self.segment_bytes)
            prefault(mm)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, path)
        layout_bytes = msgpack.packb(layout.to_dict())
        head = _HEAD.pack(MAGIC, self.nonce, num_pages, len(layout_bytes)) + layout_bytes
        if len(head) > HEADER_BYTES:
            self.close()
            raise ValueError(f"layout too large for the {HEADER_BYTES}-byte shm header")
        mm[:len(head)] = head
        self.buffers, self.scales = _map_tensors(mm, layout, num_pages)
        for per_layer in self.scales:
            for t in per_layer.values():
                t.fill_(1.0)  # KVPool's convention for unwritten fp8 scales

    def close(self) -> None:
        """Unlink the segment name (mappings stay valid until their tensors are dropped)."""
        self._finalizer()


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
"""Linux >= 5.14 (Python's mmap module does not name it yet)."""


def prefault(mm: mmap.mmap) -> None:
    """Map every page of a fresh (reserved, zero) segment into this process now, as a private pool's
    ``torch.zeros`` does: else the pages fault in one by one as transfers first write them, mid-transfer, and
    the worker's RSS creeps up by the pool's size over its first hours (a soak read that as a leak)."""
    if MADV_POPULATE_WRITE is not None:
        try:
            mm.madvise(MADV_POPULATE_WRITE)
            return
        except OSError:  # an older kernel: EINVAL
            pass
    torch.frombuffer(mm, dtype=torch.uint8).zero_()


class ShmAttachment:
    """The sender's writable view of a receiver's ``ShmKVPool`` (buffers and scales only)."""

    def __init__(self, name: str, nonce: bytes, layout: KVLayout, num_pages: int) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"refusing shm segment name {name!r}")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            _, need = segment_plan(layout, num_pages)
            if size != need:
                raise ValueError(f"shm segment {name} is {size} bytes, layout needs {need}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, seg_nonce, seg_pages, n = _HEAD.unpack_from(mm, 0)
        seg_layout = msgpack.unpackb(mm[_HEAD.size:_HEAD.size + n]) if n <= HEADER_BYTES - _HEAD.size else None
        if magic != MAGIC or seg_nonce != nonce or seg_pages != num_pages or seg_layout != layout.to_dict():
            raise ValueError(f"shm segment {name} header does not match the receiver's handshake")
        self.layout = layout
        self.device = torch.device("cpu")
        self.page_size = layout.page_size
        self.buffers, self.scales = _map_tensors(mm, layout, num_pages)

    def flat(self, layer: int, name: str) -> torch.Tensor:
        b = self.buffers[layer][name]
        return b.view(b.shape[0] * b.shape[1], *b.shape[2:])

    def flat_scale(self, layer: int, name: str) -> torch.Tensor:
        s = self.scales[layer][name]
        return s.view(s.shape[0] * s.shape[1], *s.shape[2:])


# --- same-host identity and liveness ------------------------------------------------------------

_host_id_lock = threading.Lock()
_host_id: str | None = None


def host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes on the same running machine."""
    global _host_id
    with _host_id_lock:
        if _host_id is None:
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    boot = f.read().strip()
            except OSError:
                boot = "unknown-boot"
            _host_id = f"{socket.gethostname()}|{boot}"
        return _host_id


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None  # zombie or dead: it cannot write anything any more
    return int(fields[19])


def pid_alive(pid: int, start_time: int) -> bool:
    """True while the process that had ``start_time`` still runs (a reused pid reads as dead)."""
    return process_start_time(pid) == start_time
