"""Moving one layer's rows between a pool and the wire (or another pool), with as few copies as possible.

Token t of a request lives in slot ``pages[t // page_size] * page_size + t % page_size`` of
each ``pool.flat(layer, name)``. Prefill and decode page ids differ, but the page size is
the same on both sides (the handshake checks it), so page boundaries fall on the same
tokens and a token range splits into *runs*: stretches where consecutive pages are
consecutive ids, i.e. contiguous memory.

Payload of a LAYER frame for tokens [ts, te), n = te - ts (``LayerCodec.parts``)::

    for each component:  rows   [n, *shape]        wire dtype (pool dtype, or fp8)
    if fp8 (pool or wire): for each component: scales [n, *scale_shape] fp32

Receive: when runs are long the socket writes straight into the page tensors (one
``recv_into`` target per run and component: zero copies); when pages are fragmented (or
the wire is fp8 into a bf16 pool) the payload lands in one staging buffer and is scattered
page by page (one copy, numpy record indexing). Send mirrors it: long runs go out of the
page tensors directly, fragmented pages are gathered once. Host memory only: a GPU pool's
pages pass through pinned host stages that this module treats as small CPU pools
(``staging.py``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool, quantize_fp8
from kvtransfer.config import WireDType

DIRECT_MIN_VIEW_BYTES = 64 * 1024
"""Below this average size per run, gather/scatter through staging beats many small syscalls."""
MAX_COPY_RUNS = 32
"""shm: up to this many runs per part are copied with ``copy_`` each, more with a page gather/scatter."""


class Run(NamedTuple):
    """``num_slots`` contiguous slots starting at ``slot`` (one side) or ``src``/``dst`` (paired)."""

    slot: int
    num_slots: int


class PairedRun(NamedTuple):
    src_slot: int
    dst_slot: int
    num_slots: int


class Part(NamedTuple):
    """One section of a layer payload."""

    name: str
    is_scale: bool
    row_bytes: int


def page_array(pages: Sequence[int]) -> np.ndarray:
    """Page ids as int64 numpy (convert once per request; every helper below slices it for free)."""
    return np.asarray(pages, dtype=np.int64)


def _pages_np(pages: Sequence[int] | np.ndarray, first: int, last: int) -> np.ndarray:
    return np.asarray(pages[first:last], dtype=np.int64)


def _breaks(*page_lists: Sequence[int] | np.ndarray, first: int, last: int) -> np.ndarray:
    """Indices (relative to ``first``) of the pages that start a new run in any of the lists."""
    jumps = np.zeros(max(0, last - first - 1), dtype=bool)
    for pages in page_lists:
        jumps |= np.diff(_pages_np(pages, first, last)) != 1
    return np.flatnonzero(jumps) + 1


def _span(page_size: int, token_start: int, token_end: int) -> tuple[int, int]:
    return token_start // page_size, -(-token_end // page_size)


def _run_tokens(breaks: np.ndarray, first: int, last: int, page_size: int, token_start: int,
                token_end: int) -> list[tuple[int, int, int]]:
    """(page index, first token, token count) of each run."""
    out = []
    for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), last - first]):
        t0 = max(token_start, (first + a) * page_size)
        out.append((first + a, t0, min(token_end, (first + b) * page_size) - t0))
    return out


def slot_runs(pages: Sequence[int] | np.ndarray, page_size: int, token_start: int, token_end: int,
              breaks: np.ndarray | None = None) -> list[Run]:
    """Contiguous slot runs holding tokens [token_start, token_end) of a request with ``pages``."""
    first, last = _span(page_size, token_start, token_end)
    if breaks is None:
        breaks = _breaks(pages, first=first, last=last)
    return [Run(int(pages[i]) * page_size + t0 - i * page_size, n)
            for i, t0, n in _run_tokens(breaks, first, last, page_size, token_start, token_end)]


def paired_runs(src_pages: Sequence[int] | np.ndarray, dst_pages: Sequence[int] | np.ndarray, page_size: int,
                token_start: int, token_end: int, breaks: np.ndarray | None = None) -> list[PairedRun]:
    """Runs contiguous on both sides (they break where either side's next page is not adjacent)."""
    first, last = _span(page_size, token_start, token_end)
    if breaks is None:
        breaks = _breaks(src_pages, dst_pages, first=first, last=last)
    return [PairedRun(int(src_pages[i]) * page_size + t0 - i * page_size,
                      int(dst_pages[i]) * page_size + t0 - i * page_size, n)
            for i, t0, n in _run_tokens(breaks, first, last, page_size, token_start, token_end)]


class PageSplit(NamedTuple):
    """Tokens [token_start, token_end) split into a partial first page, whole pages, a partial last page."""

    head: Run | None
    mid_pages: np.ndarray
    """Page ids of the whole pages, in token order."""
    mid_offset: int
    """Row of the payload section where the whole pages begin."""
    tail: Run | None
    tail_offset: int


def split_pages(pages: Sequence[int], page_size: int, token_start: int, token_end: int) -> PageSplit:
    P = page_size
    t, head = token_start, None
    if t % P or token_end - t < P:
        n = min(token_end, (t // P + 1) * P) - t
        head = Run(int(pages[t // P]) * P + t % P, n)
        t += n
    full_end = max(t, token_end // P * P)
    mid = _pages_np(pages, t // P, full_end // P)
    tail = Run(int(pages[full_end // P]) * P, token_end - full_end) if full_end < token_end else None
    return PageSplit(head, mid, t - token_start, tail, full_end - token_start)


def _page_records(rows: np.ndarray, page_size: int) -> np.ndarray:
    """``rows`` [num_slots, row_bytes] uint8 as a 1-D array with one opaque record per page (a view).

    numpy's fancy indexing moves such records with one memcpy each: ~10x faster than torch's
    per-row ``index_copy_`` / ``index_select`` on byte rows on this CPU.
    """
    width = page_size * rows.shape[1]
    return rows.reshape(-1, width).view(np.dtype((np.void, width)))[:, 0]


# Byte rows are numpy arrays (``LayerCodec.byte_rows``): a numpy slice costs ~1 us where a torch view
# costs ~10-20 us, and a small frame takes a dozen of them on each side; numpy copies as fast as torch.

def gather_rows(rows: np.ndarray, pages: Sequence[int], page_size: int, token_start: int,
                token_end: int) -> list[np.ndarray]:
    """Rows of [token_start, token_end) in token order, as pieces (views of ``rows`` where contiguous)."""
    sp = split_pages(pages, page_size, token_start, token_end)
    out = []
    if sp.head is not None:
        out.append(rows[sp.head.slot:sp.head.slot + sp.head.num_slots])
    if len(sp.mid_pages):
        recs = _page_records(rows, page_size)[sp.mid_pages]  # one gather, page records
        out.append(recs.view(np.uint8).reshape(-1, rows.shape[1]))
    if sp.tail is not None:
        out.append(rows[sp.tail.slot:sp.tail.slot + sp.tail.num_slots])
    return out


def scatter_rows(rows: np.ndarray, src: np.ndarray, pages: Sequence[int], page_size: int, token_start: int,
                 token_end: int) -> None:
    """Write ``src`` [n, row_bytes] (token order) into the slots of [token_start, token_end)."""
    sp = split_pages(pages, page_size, token_start, token_end)
    if sp.head is not None:
        rows[sp.head.slot:sp.head.slot + sp.head.num_slots] = src[:sp.head.num_slots]
    if len(sp.mid_pages):
        body = np.ascontiguousarray(src[sp.mid_offset:sp.tail_offset])
        _page_records(rows, page_size)[sp.mid_pages] = body.reshape(len(sp.mid_pages), -1).view(
            np.dtype((np.void, page_size * rows.shape[1])))[:, 0]
    if sp.tail is not None:
        rows[sp.tail.slot:sp.tail.slot + sp.tail.num_slots] = src[sp.tail_offset:]


def copy_pages(s_rows: np.ndarray, d_rows: np.ndarray, src_pages: Sequence[int], dst_pages: Sequence[int],
               page_size: int, token_start: int, token_end: int) -> None:
    """Rows of [token_start, token_end) from ``src_pages`` into the same tokens' slots in ``dst_pages``,
    without staging them in token order: the two sides share the page split, so whole pages move as
    records and the partial first / last page directly."""
    ss = split_pages(src_pages, page_size, token_start, token_end)
    ds = split_pages(dst_pages, page_size, token_start, token_end)
    for a, b in ((ss.head, ds.head), (ss.tail, ds.tail)):
        if a is not None:
            d_rows[b.slot:b.slot + b.num_slots] = s_rows[a.slot:a.slot + a.num_slots]
    sm, dm = ss.mid_pages, ds.mid_pages
    if not len(sm):
        return
    srec, drec = _page_records(s_rows, page_size), _page_records(d_rows, page_size)
    if _is_run(sm):  # one pass: scatter straight from a view of the source run
        drec[dm] = srec[sm[0]:sm[0] + len(sm)]
    elif _is_run(dm):  # one pass: gather straight into the destination run
        np.take(srec, sm, out=drec[dm[0]:dm[0] + len(dm)])
    else:  # both scattered: numpy stages the gathered records once
        drec[dm] = srec[sm]


def _is_run(pages: np.ndarray) -> bool:
    return int(pages[-1]) - int(pages[0]) == len(pages) - 1 and bool((np.diff(pages) == 1).all())


def as_bytes(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class LayerCodec:
    """Byte layout of a layer payload for one (pool layout, wire dtype) pair."""

    def __init__(self, layout: KVLayout, wire: WireDType) -> None:
        if wire is WireDType.FP8_E4M3 and layout.is_fp8:
            wire = WireDType.NATIVE  # the pool already is fp8: ship it as is
        self.layout = layout
        self.wire = wire
        self.quantized = wire is WireDType.FP8_E4M3
        elem = 1 if (layout.is_fp8 or self.quantized) else torch.empty((), dtype=layout.torch_dtype).element_size()
        parts = [Part(c.name, False, c.numel * elem) for c in layout.components]
        if layout.is_fp8 or self.quantized:
            parts += [Part(c.name, True, max(1, _prod(c.scale_shape)) * 4) for c in layout.components]
        self.parts = tuple(parts)
        self.bytes_per_token = sum(p.row_bytes for p in parts)

    def nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    @staticmethod
    def rows(pool: KVPool, layer: int, part: Part) -> torch.Tensor:
        """The pool storage of ``part`` as bytes: [num_slots, row_bytes] uint8 (a view)."""
        t = pool.flat_scale(layer, part.name) if part.is_scale else pool.flat(layer, part.name)
        return t.view(torch.uint8).reshape(t.shape[0], -1)

    def direct_runs(self, pages: Sequence[int] | np.ndarray, page_size: int, token_start: int,
                    token_end: int) -> list[Run] | None:
        """The runs, when they are few and long enough to move bytes straight between socket and
        pages (one syscall target each); None when a gather/scatter through staging is better."""
        if self.quantized:
            return None
        first, last = _span(page_size, token_start, token_end)
        breaks = _breaks(pages, first=first, last=last)
        if self.nbytes(token_end - token_start) // ((len(breaks) + 1) * len(self.parts)) < DIRECT_MIN_VIEW_BYTES:
            return None
        return slot_runs(pages, page_size, token_start, token_end, breaks)

    def _views(self, pool: KVPool, layer: int, runs: list[Run]) -> list[memoryview]:
        out = []
        for part in self.parts:
            rows = self.byte_rows(pool, layer, part)
            out += [memoryview(rows[r.slot:r.slot + r.num_slots].reshape(-1)) for r in runs]
        return out

    def _gathered(self, pool: KVPool, layer: int, pages: Sequence[int], token_start: int,
                  token_end: int) -> list[memoryview]:
        """The rows of [token_start, token_end) as byte views in wire order, one page-granular gather per
        part (for fragmented pages; long runs are viewed in place by ``_views``)."""
        return [memoryview(piece.reshape(-1)) for part in self.parts
                for piece in gather_rows(self.byte_rows(pool, layer, part), pages, pool.page_size, token_start,
                                         token_end)]

    def byte_rows(self, pool: KVPool, layer: int, part: Part) -> np.ndarray:
        """``rows()`` as a numpy array, made once per (pool, layer, part): slicing numpy costs ~1 us where
        the torch views cost ~20 us, and every frame takes 3+ views on each side (a 20k-token request
        ships ~50 frames). The pool's storage never moves, and the cache lives on the pool object."""
        cache = pool.__dict__.setdefault("_kvtransfer_byte_rows", {})
        key = (layer, part.name, part.is_scale)
        arr = cache.get(key)
        if arr is None:
            arr = cache[key] = self.rows(pool, layer, part).numpy()
        return arr

    # --- sender ----------------------------------------------------------------------------------
    def source_views(self, pool: KVPool, layer: int, pages: Sequence[int], token_start: int,
                     token_end: int) -> list[memoryview]:
        """The payload as byte views, in wire order: the pool's own memory where runs are long,
        else one page-granular gather per part (and, for an fp8 wire, the quantized rows)."""
        n = token_end - token_start
        P = pool.page_size
        runs = self.direct_runs(pages, P, token_start, token_end)
        if runs is not None:
            return self._views(pool, layer, runs)
        if not self.quantized:
            return self._gathered(pool, layer, pages, token_start, token_end)
        data, scales = [], []
        for c in self.layout.components:
            rows = torch.from_numpy(np.concatenate(gather_rows(self.byte_rows(pool, layer, Part(c.name, False, 0)),
                                                               pages, P, token_start, token_end)))
            q, scale = quantize_fp8(rows.view(self.layout.torch_dtype).view(n, *c.shape))
            data.append(as_bytes(q))
            scales.append(as_bytes(scale.contiguous()))
        return data + scales

    # --- receiver --------------------------------------------------------------------------------
    def sink_views(self, pool: KVPool, layer: int, pages: Sequence[int], token_start: int, token_end: int,
                   staging: Callable[[int], torch.Tensor]) -> tuple[list[memoryview], Callable[[], None] | None]:
        """Where the payload's bytes go, and what to run once they are all there (scatter/dequant)."""
        n = token_end - token_start
        P = pool.page_size
        runs = self.direct_runs(pages, P, token_start, token_end)
        if runs is not None:
            return self._views(pool, layer, runs), None
        buf = staging(self.nbytes(n)).numpy()
        sections = self._sections(buf, n)

        def scatter() -> None:
            if not self.quantized:
                for part in self.parts:
                    scatter_rows(self.byte_rows(pool, layer, part), sections[(part.name, part.is_scale)], pages, P,
                                 token_start, token_end)
                return
            for c in self.layout.components:
                q = torch.from_numpy(sections[(c.name, False)]).view(torch.float8_e4m3fn).view(n, *c.shape)
                scale = torch.from_numpy(sections[(c.name, True)]).view(torch.float32).view(n, *c.scale_shape)
                values = (q.float() * scale.unsqueeze(-1)).to(self.layout.torch_dtype)
                rows = self.byte_rows(pool, layer, Part(c.name, False, 0))
                scatter_rows(rows, values.reshape(n, -1).view(torch.uint8).numpy(), pages, P, token_start, token_end)

        return [memoryview(buf)], scatter

    def _sections(self, buf: np.ndarray, n: int) -> dict[tuple[str, bool], np.ndarray]:
        """Split a payload buffer [nbytes(n)] uint8 into per-part [n, row_bytes] views, in wire order."""
        out, off = {}, 0
        for part in self.parts:
            out[(part.name, part.is_scale)] = buf[off:off + n * part.row_bytes].reshape(n, part.row_bytes)
            off += n * part.row_bytes
        return out

    def pool_views(self, pool: KVPool, layer: int, pages: Sequence[int], token_start: int,
                   token_end: int) -> list[memoryview]:
        """The rows of [token_start, token_end) as they lie in ``pool``, in payload order (views)."""
        P = pool.page_size
        first, last = _span(P, token_start, token_end)
        breaks = _breaks(pages, first=first, last=last)
        if len(breaks) >= MAX_COPY_RUNS:  # fragmented: gather once per part
            return self._gathered(pool, layer, pages, token_start, token_end)
        return self._views(pool, layer, slot_runs(pages, P, token_start, token_end, breaks))

    # --- shared memory ---------------------------------------------------------------------------
    def copy_layer(self, src: KVPool, dst: KVPool, layer: int, src_pages: Sequence[int] | np.ndarray,
                   dst_pages: Sequence[int] | np.ndarray, token_start: int, token_end: int,
                   want_views: bool = False) -> list[memoryview]:
        """Copy rows of [token_start, token_end) from ``src`` into ``dst`` pages (same dtype, no wire
        conversion); with ``want_views`` returns the source rows as byte views in payload order."""
        P = src.page_size
        first, last = _span(P, token_start, token_end)
        breaks = _breaks(src_pages, dst_pages, first=first, last=last)
        runs = paired_runs(src_pages, dst_pages, P, token_start, token_end, breaks) \
            if len(breaks) < MAX_COPY_RUNS else None
        views: list[np.ndarray] = []
        for part in self.parts:
            s_rows, d_rows = self.byte_rows(src, layer, part), self.byte_rows(dst, layer, part)
            if runs is not None:
                for r in runs:
                    s = s_rows[r.src_slot:r.src_slot + r.num_slots]
                    d_rows[r.dst_slot:r.dst_slot + r.num_slots] = s
                    views.append(s)
            elif want_views:  # fragmented, and the caller checksums the rows in payload order
                pieces = gather_rows(s_rows, src_pages, P, token_start, token_end)
                scatter_rows(d_rows, np.concatenate(pieces) if len(pieces) > 1 else pieces[0], dst_pages, P,
                             token_start, token_end)
                views.extend(pieces)
            else:  # fragmented: whole pages record to record (one numpy gather + scatter), partial ends direct
                copy_pages(s_rows, d_rows, src_pages, dst_pages, P, token_start, token_end)
        return [memoryview(v.reshape(-1)) for v in views] if want_views else []
