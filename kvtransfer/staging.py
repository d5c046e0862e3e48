"""Device KV pools on the data plane: pages reach the wire (and leave it) through pinned host staging.

The codec (``payload.py``) moves bytes between numpy views of host memory and sockets / shm. A pool
on ``cuda`` (NVIDIA or ROCm: both are ``cuda`` to torch) has no host view, so its pages pass through
a *stage*: a ``HostStage`` is a small host pool holding ``k`` whole pages of one layer, with the same
layout, that the codec handles exactly like a CPU pool (its pages are contiguous, so the socket reads
from / writes into it directly)::

    sender    send_layer(l) --(caller thread, copy stream)--> gather pages on device, D2H into a pinned
              stage, record an event; the writer awaits the event, then sends the stage like a CPU pool.
              Layer l+1's D2H runs while layer l is on the wire (the copy is issued when the forward
              finishes the layer, the write when the connection gets to it).
    receiver  the payload lands in a pinned stage (dequantized / scattered there as on a CPU pool); once
              its checksum passed, the stage's rows for exactly [ts, te) are copied H2D and scattered into
              the reserved slots on the copy stream, and an event recorded. FINISH (and any failure) waits
              for every such event before the pages change hands, so no copy lands in a page after it was
              freed (sglang #24527, vllm #56104).

Zero staging where both ends address the same memory: a staged sender whose receiver offers shm pages
(same host) copies device rows straight into them (``ShmTransport``; ``KVSender._copies_direct`` decides
per layer, before staging it).

Every stage is taken from a ``StagingBuffers`` and given back exactly once (``HostStage.release`` is
idempotent); ``num_outstanding`` is what the tests check after each failure path.

``KVPool(force_staged=True)`` sends a CPU pool through the same path (plain synchronous copies, no
events), so everything but the device copies themselves is exercised without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool
from kvtransfer.payload import split_pages

ALIGN = 64
"""Byte alignment of each section of a stage (every dtype view of it is aligned)."""
MAX_CACHED_BYTES = 256 << 20
"""Freed pinned buffers kept for reuse, in bytes (pinning is a slow syscall; the rest is freed)."""


def is_staged(pool: object) -> bool:
    """True when the codec must not touch ``pool``'s memory directly: a device pool, or a CPU pool
    forced through the staged path (``KVPool.force_staged``)."""
    device = getattr(pool, "device", torch.device("cpu"))
    return device.type != "cpu" or bool(getattr(pool, "force_staged", False))


def _layer_parts(layout: KVLayout) -> list[tuple[str, bool, tuple[int, ...], torch.dtype]]:
    """(component, is_scale, per-token shape, dtype) of one layer's storage, in codec part order."""
    parts = [(c.name, False, tuple(c.shape), layout.torch_dtype) for c in layout.components]
    if layout.is_fp8:
        parts += [(c.name, True, tuple(c.scale_shape), torch.float32) for c in layout.components]
    return parts


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def stage_bytes(layout: KVLayout, num_pages: int) -> int:
    """Bytes of a stage holding ``num_pages`` pages of one layer (sections ``ALIGN``-aligned)."""
    off = 0
    for _, _, shape, dtype in _layer_parts(layout):
        off = -(-off // ALIGN) * ALIGN + _nbytes((num_pages, layout.page_size, *shape), dtype)
    return -(-off // ALIGN) * ALIGN


class StagingBuffers:
    """Host staging memory for one pool: pinned when the pool is on a GPU. Thread-safe.

    Buffers are reused by size class (powers of two) up to ``MAX_CACHED_BYTES``; ``num_outstanding``
    counts buffers handed out and not yet released."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.num_outstanding = 0
        self.num_allocated = 0
        """Buffers ever allocated (a reuse check for tests and the benchmark)."""

    def acquire(self, num_bytes: int) -> torch.Tensor:
        size = 1 << max(12, (num_bytes - 1).bit_length())
        with self._lock:
            self.num_outstanding += 1
            free = self._free.get(size)
            if free:
                self._cached_bytes -= size
                return free.pop()
            self.num_allocated += 1
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._lock:
                self.num_outstanding -= 1
            raise

    def release(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            self.num_outstanding -= 1
            if self._cached_bytes + size <= MAX_CACHED_BYTES:
                self._free.setdefault(size, []).append(buf)
                self._cached_bytes += size


class CopyStream:
    """The side stream that device <-> host copies run on (None on CPU: copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the enclosed copies on the side stream, after everything queued so far on the current
        (compute) stream: the forward that wrote the layer, the scheduler that reserved the pages."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class HostStage:
    """``num_pages`` pages of one layer in host memory, with a ``KVPool``'s reading surface (``layout``,
    ``page_size``, ``device``, ``flat``, ``flat_scale``), so ``LayerCodec`` treats it as a CPU pool whose
    pages ``first .. first + num_pages - 1`` of a request are stage pages ``0 .. num_pages - 1``
    (``page_map``)."""

    def __init__(self, buffers: StagingBuffers, layout: KVLayout, layer: int, first: int, num_pages: int,
                 num_request_pages: int) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.device = torch.device("cpu")
        self.layer = layer
        self.first = first
        self.num_pages = num_pages
        self.page_map = np.arange(num_request_pages, dtype=np.int64) - first
        """Request page index -> stage page (only indices in [first, first + num_pages) are used)."""
        self._buffers = buffers
        self.buf: torch.Tensor | None = buffers.acquire(stage_bytes(layout, num_pages))
        self.event: torch.cuda.Event | None = None
        self.keep: list[torch.Tensor] = []
        """Device tensors an in-flight copy still reads or writes (freed once ``event`` completed)."""
        self.sections: dict[tuple[str, bool], torch.Tensor] = {}
        off, P = 0, layout.page_size
        for name, is_scale, shape, dtype in _layer_parts(layout):
            off = -(-off // ALIGN) * ALIGN
            n = _nbytes((num_pages * P, *shape), dtype)
            self.sections[(name, is_scale)] = self.buf[off:off + n].view(dtype).view(num_pages * P, *shape)
            off += n

    # --- the KVPool surface LayerCodec reads ------------------------------------------------------
    def flat(self, layer: int, name: str) -> torch.Tensor:
        return self.sections[(name, False)]

    def flat_scale(self, layer: int, name: str) -> torch.Tensor:
        return self.sections[(name, True)]

    # --- lifecycle ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The device copy into / out of the stage has finished (always true on CPU)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the device copy has finished (any thread)."""
        if self.event is not None:
            self.event.synchronize()
        self.keep.clear()

    def release(self) -> None:
        """Give the buffer back (idempotent); waits for a copy still in flight first."""
        if self.buf is None:
            return
        self.wait()
        buf, self.buf = self.buf, None
        self.sections.clear()
        self.__dict__.pop("_kvtransfer_byte_rows", None)
        self._buffers.release(buf)


def _page_rows(pool: KVPool, layer: int, name: str, is_scale: bool) -> torch.Tensor:
    """A pool tensor as one byte row per page: [num_pages, page_size * row_bytes] uint8 (a view)."""
    t = pool.scales[layer][name] if is_scale else pool.buffers[layer][name]
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def _records(rows: torch.Tensor) -> np.ndarray:
    """CPU byte rows [n, width] as n opaque numpy records (a view): numpy gathers / scatters them with one
    memcpy each, ~10x faster than torch's CPU ``index_select`` / ``index_copy_`` on byte rows."""
    arr = rows.numpy()
    return arr.view(np.dtype((np.void, arr.shape[1])))[:, 0]


def _run_start(pages: np.ndarray) -> int | None:
    """The first page when ``pages`` are one ascending run of consecutive ids (the common case), else None."""
    if not len(pages) or int(pages[-1]) - int(pages[0]) != len(pages) - 1 or (np.diff(pages) != 1).any():
        return None
    return int(pages[0])


def _slot_rows(pool: KVPool, layer: int, name: str, is_scale: bool) -> torch.Tensor:
    """A pool tensor as one byte row per slot: [num_slots, row_bytes] uint8 (a view)."""
    t = pool.flat_scale(layer, name) if is_scale else pool.flat(layer, name)
    return t.view(torch.uint8).reshape(t.shape[0], -1)


class Stager:
    """The staged path of one pool: D2H stages for the sender, H2D writes for the receiver."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.buffers = StagingBuffers(pool.device)
        self.copies = CopyStream(pool.device)

    def _span(self, token_start: int, token_end: int) -> tuple[int, int]:
        P = self.pool.page_size
        return token_start // P, -(-token_end // P)

    def stage_out(self, layer: int, pages: np.ndarray, token_start: int, token_end: int) -> HostStage:
        """Sender, caller thread: start copying the pages holding [token_start, token_end) of ``layer`` into
        a new stage (whole pages: the codec then reads the tokens it needs). Returns at once on a GPU."""
        first, last = self._span(token_start, token_end)
        stage = HostStage(self.buffers, self.pool.layout, layer, first, last - first, len(pages))
        try:
            idx = torch.from_numpy(np.array(pages[first:last], dtype=np.int64))  # a private, writable copy
            run = _run_start(idx.numpy())
            with self.copies.active():
                if self.pool.device.type != "cpu":
                    idx = idx.to(self.pool.device, non_blocking=True)
                for (name, is_scale), dst in stage.sections.items():
                    src = _page_rows(self.pool, layer, name, is_scale)
                    host = dst.view(torch.uint8).view(last - first, -1)
                    if self.pool.device.type == "cpu" and run is not None:  # one run of pages: one memcpy
                        host.copy_(src[run:run + len(idx)])
                    elif self.pool.device.type == "cpu":
                        _records(host)[:] = _records(src)[idx.numpy()]
                    else:
                        gathered = src.index_select(0, idx)  # [k, page bytes] on the device
                        host.copy_(gathered, non_blocking=True)
                        stage.keep.append(gathered)
                stage.keep.append(idx)
                stage.event = self.copies.record()
        except BaseException:
            stage.release()
            raise
        return stage

    def stage_in(self, layer: int, pages: np.ndarray, token_start: int, token_end: int) -> HostStage:
        """Receiver: an empty stage for the payload of [token_start, token_end) of ``layer``."""
        first, last = self._span(token_start, token_end)
        return HostStage(self.buffers, self.pool.layout, layer, first, last - first, len(pages))

    def write_back(self, stage: HostStage, pages: np.ndarray, token_start: int, token_end: int) -> None:
        """Receiver, after the payload was verified (and dequantized / scattered into the stage): copy the
        stage's rows of exactly [token_start, token_end) into their slots of the pool (other tokens of a
        partial first / last page are left alone). Asynchronous on a GPU: ``stage.event`` marks the end."""
        P, first = self.pool.page_size, stage.first
        sp = split_pages(pages, P, token_start, token_end)
        # whole pages move as page rows (one index_copy_ each, a row per page); the partial first / last page
        # as a slot range, so the tokens of that page this frame does not carry stay as they are
        mid = sp.mid_offset + token_start
        mid_local = (mid // P - first, mid // P - first + len(sp.mid_pages))
        on_device = self.pool.device.type != "cpu"
        with self.copies.active():
            idx = torch.from_numpy(np.array(sp.mid_pages, dtype=np.int64))
            if on_device:
                idx = idx.to(self.pool.device, non_blocking=True)
                stage.keep.append(idx)
            for (name, is_scale), src in stage.sections.items():
                page_src = src.view(torch.uint8).reshape(stage.num_pages, -1)
                slot_src = src.view(torch.uint8).reshape(stage.num_pages * P, -1)
                pieces = []
                if len(sp.mid_pages):
                    pieces.append((_page_rows(self.pool, stage.layer, name, is_scale), idx,
                                   page_src[mid_local[0]:mid_local[1]]))
                slot_dst = _slot_rows(self.pool, stage.layer, name, is_scale)
                for run, t0 in ((sp.head, token_start), (sp.tail, token_start + sp.tail_offset)):
                    if run is not None:
                        local = t0 - first * P
                        pieces.append((slot_dst[run.slot:run.slot + run.num_slots], None,
                                       slot_src[local:local + run.num_slots]))
                for dst, index, rows in pieces:
                    if on_device:
                        rows = rows.to(self.pool.device, non_blocking=True)
                        stage.keep.append(rows)
                    if index is None:
                        dst.copy_(rows)
                    elif on_device:
                        dst.index_copy_(0, index, rows)
                    elif (run := _run_start(index.numpy())) is not None:
                        dst[run:run + len(index)].copy_(rows)
                    else:
                        _records(dst)[index.numpy()] = _records(rows)
            stage.event = self.copies.record()


def release_all(stages: Sequence[HostStage]) -> None:
    """Wait for and release every stage (a reservation that completes or fails)."""
    for s in stages:
        s.release()
