"""Page-granular KV storage in host memory: the bytes of the prefix cache's host tier (``prefill.host_cache``
indexes them).

One host page (a *slot*) holds everything one page of a ``KVPool`` holds, as one contiguous byte row::

    for each layer of the pool (the main layers, then the MTP layers):
        for each component (latent, rope, index | k, v):  its rows   [page_size, *component.shape], pool dtype
        with fp8 KV, for each component:                   its scales [page_size, *component.scale_shape], fp32

so a slot is ``layout.bytes_per_page()`` bytes and a checksum over the row covers the whole state a prefilled token
leaves behind: MLA latent and rope parts, the DSA indexer keys (and their scales), the MTP layer's KV. Bytes are
copied as they are (no dtype conversion), so a restored page is bit-identical to the page that was saved.

Slots come from a ``PageAllocator`` (owner tags, exact accounting, double frees refused). When the pool is on a
GPU the rows are pinned host memory (as SGLang's host pool is); on a CPU they are plain memory, reserved
up front and touched (made resident) only as slots are first written. Copies are one ``index_select`` /
``index_copy_`` per segment for a batch of pages; a restore runs them on a prefill loader thread
(``prefill.admission``), not yet overlapped with the forward layer by layer.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import xxhash

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool, PageAllocator


class Segment(NamedTuple):
    """One (layer, component, rows or scales) part of a page: bytes ``[offset, offset + num_bytes)`` of a slot."""
    layer: int
    name: str
    scales: bool
    offset: int
    num_bytes: int


def segments(layout: KVLayout) -> list[Segment]:
    """The parts of a page in slot order (module docstring); their sizes add up to ``layout.bytes_per_page()``."""
    elem = torch.empty((), dtype=layout.torch_dtype).element_size()
    out, off = [], 0
    for layer in range(layout.num_layers):
        parts = [(c.name, False, c.numel * elem) for c in layout.components]
        if layout.is_fp8:
            parts += [(c.name, True, max(1, math.prod(c.scale_shape)) * 4) for c in layout.components]
        for name, is_scale, per_token in parts:
            n = per_token * layout.page_size
            out.append(Segment(layer, name, is_scale, off, n))
            off += n
    return out


class HostPagePool:
    """``num_pages`` slots of one pool layout's pages in host memory, and their allocator."""

    def __init__(self, layout: KVLayout, num_pages: int, pin: bool = False) -> None:
        self.layout = layout
        self.layout_hash = layout.layout_hash()
        self.page_bytes = layout.bytes_per_page()
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self.segments = segments(layout)
        if self.segments[-1].offset + self.segments[-1].num_bytes != self.page_bytes:
            raise ValueError(f"page segments do not add up to the layout's {self.page_bytes} bytes per page")
        self.data = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8, pin_memory=pin)
        """``[num_pages, page_bytes]`` one row per slot."""

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def _check(self, pool: KVPool) -> None:
        if pool.layout != self.layout:
            raise ValueError(f"pool layout {pool.layout.to_dict()} != host pool layout {self.layout.to_dict()}")

    @staticmethod
    def _pool_view(pool: KVPool, seg: Segment) -> torch.Tensor:
        """``[num_pages, seg.num_bytes]`` uint8 view of the pool's storage of ``seg`` (buffers are contiguous)."""
        t = (pool.scales if seg.scales else pool.buffers)[seg.layer][seg.name]
        return t.view(torch.uint8).view(t.shape[0], -1)

    def save(self, pool: KVPool, pool_pages: Sequence[int], slots: Sequence[int]) -> None:
        """Copy pool pages ``pool_pages[i]`` (every layer and component) into slot ``slots[i]``."""
        self._check(pool)
        if not len(pool_pages):
            return
        src = torch.as_tensor(list(pool_pages), dtype=torch.long, device=pool.device)
        dst = torch.as_tensor(list(slots), dtype=torch.long)
        for seg in self.segments:
            rows = self._pool_view(pool, seg).index_select(0, src)  # [n, seg bytes] on the pool's device
            self.data.narrow(1, seg.offset, seg.num_bytes).index_copy_(0, dst, rows.to("cpu"))

    def save_rows(self, pool: KVPool, pool_pages: Sequence[int]) -> torch.Tensor:
        """Pool pages ``pool_pages`` as ``[n, page_bytes]`` uint8 rows in slot layout, outside the slots (for the
        disk tier, when the slots have no room)."""
        self._check(pool)
        src = torch.as_tensor(list(pool_pages), dtype=torch.long, device=pool.device)
        out = torch.empty((len(pool_pages), self.page_bytes), dtype=torch.uint8)
        for seg in self.segments:
            out.narrow(1, seg.offset, seg.num_bytes).copy_(self._pool_view(pool, seg).index_select(0, src))
        return out

    def load(self, slots: Sequence[int], pool: KVPool, pool_pages: Sequence[int]) -> None:
        """Copy slot ``slots[i]`` into pool page ``pool_pages[i]`` (every layer and component)."""
        if len(slots):
            self.load_rows(self.data.index_select(0, torch.as_tensor(list(slots), dtype=torch.long)), pool,
                           pool_pages)

    def load_rows(self, rows: torch.Tensor, pool: KVPool, pool_pages: Sequence[int]) -> None:
        """Copy ``rows[i]`` (``[n, page_bytes]`` uint8 in slot layout, e.g. read from the disk tier) into pool page
        ``pool_pages[i]``."""
        self._check(pool)
        if not len(pool_pages):
            return
        if rows.shape != (len(pool_pages), self.page_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} for {len(pool_pages)} pages of "
                             f"{self.page_bytes} bytes")
        dst = torch.as_tensor(list(pool_pages), dtype=torch.long, device=pool.device)
        for seg in self.segments:
            part = rows.narrow(1, seg.offset, seg.num_bytes)
            self._pool_view(pool, seg).index_copy_(0, dst, part.to(pool.device))

    def checksum(self, slot: int, seed: int) -> int:
        """xxh3-64 of the slot's bytes, seeded (a page's block hash and layout hash: the same bytes stored for
        another prefix or another layout do not verify)."""
        return xxhash.xxh3_64_intdigest(self.data[slot].numpy(), seed=seed & (2**64 - 1))

