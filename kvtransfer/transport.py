"""How a sender's layer payloads reach a receiver's pages: one interface, three implementations.

================  =========================================================================================
``TcpTransport``  two-sided: the payload travels in LAYER frames on the control connection itself (the
                  codec, ``payload.py``, reads it straight out of the pages where runs are long)
``ShmTransport``  one-sided: the sender copies into the receiver's pages in /dev/shm (``shm.py``)
``MooncakeTransport`` (``mooncake.py``)  one-sided: Mooncake's transfer engine writes into the receiver's
                  registered pages, over TCP or RDMA
================  =========================================================================================

The control connection is pdserve's for all three: the HMAC handshake, the page / generation checks and
the failure protocol. One-sided transports share its lease frames: SHM_OPEN asks for a write lease on a
reservation (pages and generations digested), SHM_LAYER says "layer l, tokens [ts, te) are written" (with
their checksum), FINISH / ABORT / ABORT_ACK end the lease. The receiver frees a leased reservation's pages
only after the writer acknowledged an abort, finished, or is provably gone: a one-sided writer never
writes into a page that was freed (sglang #24527, vllm #56104). Expiry, stall and claim timeouts, peer
death and generation counters therefore work the same whichever transport moves the bytes.

A transport is chosen per connection at the handshake (``TxPeer``): the receiver's READY offers what it
can take (a shm segment on the same host, a Mooncake session), the sender's ``KVSenderConfig.transport``
picks, and anything that cannot be set up falls back to TCP with one warning.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import torch

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool
from kvtransfer.config import TransportKind, WireDType
from kvtransfer.payload import (
    MAX_COPY_RUNS,
    LayerCodec,
    _breaks,
    paired_runs,
    scatter_rows,
)
from kvtransfer.shm import ShmAttachment
from kvtransfer.staging import is_staged


class KVTransport(abc.ABC):
    """Moves one sender's layer rows to one receiver. ``write_layer`` runs on the connection's send thread,
    one call at a time and in frame order; it must not touch the destination once the transfer failed (the
    caller checks before each call), and it raises ``OSError`` when the receiver cannot be written (the
    connection then fails every transfer it carries)."""

    kind: TransportKind
    one_sided: bool
    """True: ``write_layer`` puts the rows into the receiver's pages itself (lease frames on the control
    connection); False: the rows travel as LAYER payloads (``payload_views``)."""

    def __init__(self, layout: KVLayout, wire: WireDType = WireDType.NATIVE) -> None:
        self.codec = LayerCodec(layout, wire if not self.one_sided else WireDType.NATIVE)

    def payload_views(self, src: KVPool, layer: int, src_pages: np.ndarray, token_start: int,
                      token_end: int) -> list[memoryview]:
        """Two-sided: the LAYER payload of [token_start, token_end), in wire order."""
        raise NotImplementedError(f"{self.kind.value} writes one-sided")

    def write_layer(self, src: KVPool, layer: int, src_pages: Sequence[int] | np.ndarray,
                    dst_pages: Sequence[int] | np.ndarray, token_start: int, token_end: int,
                    want_views: bool) -> list[memoryview]:
        """One-sided: write the rows of [token_start, token_end) into the receiver's ``dst_pages``; with
        ``want_views`` return the source rows as byte views in payload order (for the checksum)."""
        raise NotImplementedError(f"{self.kind.value} sends payloads in frames")

    def close(self) -> None:  # noqa: B027 - a hook: transports without resources keep the no-op
        """Release what the transport holds (mappings, registrations)."""


class TcpTransport(KVTransport):
    kind = TransportKind.TCP
    one_sided = False

    def payload_views(self, src: KVPool, layer: int, src_pages: np.ndarray, token_start: int,
                      token_end: int) -> list[memoryview]:
        return self.codec.source_views(src, layer, src_pages, token_start, token_end)


class ShmTransport(KVTransport):
    kind = TransportKind.SHM
    one_sided = True

    def __init__(self, layout: KVLayout, attachment: ShmAttachment) -> None:
        super().__init__(layout)
        self.attachment = attachment

    def write_layer(self, src: KVPool, layer: int, src_pages: Sequence[int] | np.ndarray,
                    dst_pages: Sequence[int] | np.ndarray, token_start: int, token_end: int,
                    want_views: bool) -> list[memoryview]:
        if is_staged(src):  # a device pool: its copies land in the shm pages directly, no host stage between
            self._copy_from_device(src, layer, src_pages, dst_pages, token_start, token_end)
            return self.codec.pool_views(self.attachment, layer, dst_pages,  # type: ignore[arg-type]
                                         token_start, token_end) if want_views else []
        return self.codec.copy_layer(src, self.attachment, layer, src_pages, dst_pages,  # type: ignore[arg-type]
                                     token_start, token_end, want_views=want_views)

    def _copy_from_device(self, src: KVPool, layer: int, src_pages: Sequence[int] | np.ndarray,
                          dst_pages: Sequence[int] | np.ndarray, token_start: int, token_end: int) -> None:
        """One ``copy_`` per run contiguous on both sides (device -> the mapped shm rows; on the calling
        thread's current stream, after the forward that wrote the layer); fragmented pages are gathered on the
        device in token order, copied once, and scattered page by page on the host."""
        P = self.codec.layout.page_size
        first, last = token_start // P, -(-token_end // P)
        breaks = _breaks(src_pages, dst_pages, first=first, last=last)
        for part in self.codec.parts:
            s_rows = LayerCodec.rows(src, layer, part)
            d_rows = LayerCodec.rows(self.attachment, layer, part)  # type: ignore[arg-type]
            if len(breaks) < MAX_COPY_RUNS:
                for r in paired_runs(src_pages, dst_pages, P, token_start, token_end, breaks):
                    d_rows[r.dst_slot:r.dst_slot + r.num_slots].copy_(s_rows[r.src_slot:r.src_slot + r.num_slots])
                continue
            t = np.arange(token_start, token_end, dtype=np.int64)
            slots = torch.from_numpy(np.asarray(src_pages, dtype=np.int64)[t // P] * P + t % P).to(s_rows.device)
            rows = s_rows.index_select(0, slots).cpu().numpy()  # [n, row_bytes] in token order
            scatter_rows(self.codec.byte_rows(self.attachment, layer, part), rows,  # type: ignore[arg-type]
                         dst_pages, P, token_start, token_end)
