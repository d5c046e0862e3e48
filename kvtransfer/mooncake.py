"""Mooncake's transfer engine as a one-sided KV transport (``pip install pdserve[mooncake]``).

Mooncake (kvcache-ai; SGLang's default PD backend) writes from registered local memory into a remote
process's registered memory, over RDMA or TCP. Here both pools register every page tensor with one
engine per process, in P2P handshake mode (no metadata server: a peer is named ``host:rpc_port``)::

    receiver  start(): engine.initialize(host, "P2PHANDSHAKE", protocol), register every pool tensor;
              READY to a sender that asked for it carries {session, protocol, num_pages, [(addr, bytes)]}
    sender    registers its own pool once; per layer frame: one batch_transfer_sync_write of every
              contiguous run (both sides' page runs, every component), then SHM_LAYER on the control
              connection (the lease protocol of ``transport.py``: HMAC handshake, page / generation
              checks, checksum, expiry, abort and peer death stay pdserve's)

What it does not do: device pools (the non-CUDA wheel registers host memory only; a staged or device
pool falls back to TCP with a warning), and authenticate the engine's own port -- anyone who reaches it
can write registered memory, as with any RDMA deployment: keep it on the cluster's private network.

The package needs the system's ``libibverbs1`` (Debian/Ubuntu: ``apt-get install libibverbs1
librdmacm1``) even for TCP; without it the import fails and ``available()`` says why.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool
from kvtransfer.config import TransportKind
from kvtransfer.payload import _breaks, _span, paired_runs
from kvtransfer.transport import KVTransport

try:  # optional dependency (the [mooncake] extra) and its system library
    from mooncake.engine import TransferEngine
    IMPORT_ERROR: str | None = None
except ImportError as e:  # also OSError-like failures of the shared library surface as ImportError
    TransferEngine = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
MAX_RUNS_PER_BATCH = 4096
"""Writes per ``batch_transfer_sync_write`` call (a frame of fragmented pages can hold thousands)."""


def available() -> str | None:
    """None when the engine can be used, else why not (one line, for logs and test skips)."""
    if IMPORT_ERROR is None:
        return None
    hint = " (install the system library: apt-get install libibverbs1 librdmacm1)" if "ibverbs" in IMPORT_ERROR \
        or "rdmacm" in IMPORT_ERROR else " (pip install 'pdserve[mooncake]')"
    return f"mooncake transfer engine unavailable: {IMPORT_ERROR}{hint}"


class MooncakeError(OSError):
    """The engine refused an operation (its return code)."""


def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    """Every storage tensor of a pool, in (layer, component, data then scale) order (both sides agree)."""
    out = []
    for layer in range(pool.layout.num_layers):
        for c in pool.layout.components:
            out.append(pool.buffers[layer][c.name])
            if pool.layout.is_fp8:
                out.append(pool.scales[layer][c.name])
    return out


class MooncakeEngine:
    """One process's transfer engine with its registered pool memory."""

    def __init__(self, host: str, protocol: str) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
        why = available()
        if why is not None:
            raise MooncakeError(why)
        self.protocol = protocol
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise MooncakeError(f"mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        """How peers name this engine (``host:rpc_port``)."""
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                ptr = t.data_ptr()
                if ptr in self._registered:
                    continue
                rc = self.engine.register_memory(ptr, t.nbytes)
                if rc != 0:
                    raise MooncakeError(f"mooncake register_memory({t.nbytes} bytes) returned {rc}")
                self._registered[ptr] = t.nbytes

    def write(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        for i in range(0, len(srcs), MAX_RUNS_PER_BATCH):
            j = i + MAX_RUNS_PER_BATCH
            rc = self.engine.batch_transfer_sync_write(session, srcs[i:j], dsts[i:j], lengths[i:j])
            if rc != 0:
                raise MooncakeError(f"mooncake write of {sum(lengths[i:j])} bytes to {session} returned {rc}")

    def close(self) -> None:
        with self._lock:
            for ptr in self._registered:
                self.engine.unregister_memory(ptr)
            self._registered.clear()


class MooncakeOffer(NamedTuple):
    """What a receiver tells a sender in READY (``"mc"``): where and how to write its pages."""

    session: str
    protocol: str
    num_pages: int
    regions: list[tuple[int, int]]
    """(address, bytes) of each pool tensor, in ``pool_tensors`` order."""

    def to_dict(self) -> dict[str, Any]:
        return {"s": self.session, "p": self.protocol, "np": self.num_pages, "r": [list(r) for r in self.regions]}

    @classmethod
    def from_dict(cls, d: Any) -> MooncakeOffer:
        if type(d) is not dict:
            raise ValueError("mooncake offer is not a map")
        regions = [(int(a), int(n)) for a, n in d["r"]]
        return cls(str(d["s"]), str(d["p"]), int(d["np"]), regions)


def offer_for(engine: MooncakeEngine, pool: KVPool) -> MooncakeOffer:
    tensors = pool_tensors(pool)
    engine.register(tensors)
    return MooncakeOffer(engine.session, engine.protocol, pool.num_pages, [(t.data_ptr(), t.nbytes) for t in tensors])


class MooncakeTransport(KVTransport):
    """The sender's side: the receiver's pages as (address, row bytes) geometry, written with the engine."""

    kind = TransportKind.MOONCAKE
    one_sided = True

    def __init__(self, layout: KVLayout, engine: MooncakeEngine, src: KVPool, offer: MooncakeOffer) -> None:
        super().__init__(layout)
        src_tensors = pool_tensors(src)
        if len(offer.regions) != len(src_tensors):
            raise ValueError(f"receiver registered {len(offer.regions)} tensors, the layout has {len(src_tensors)}")
        self.row_bytes = []
        for t, (_, nbytes) in zip(src_tensors, offer.regions):
            row = t.nbytes // (t.shape[0] * t.shape[1])
            if nbytes != row * offer.num_pages * layout.page_size:
                raise ValueError(f"receiver region of {nbytes} bytes does not hold {offer.num_pages} pages")
            self.row_bytes.append(row)
        engine.register(src_tensors)
        self.engine, self.offer = engine, offer
        self.src_ptrs = [t.data_ptr() for t in src_tensors]
        self.per_layer = len(src_tensors) // layout.num_layers

    def write_layer(self, src: KVPool, layer: int, src_pages: Sequence[int] | np.ndarray,
                    dst_pages: Sequence[int] | np.ndarray, token_start: int, token_end: int,
                    want_views: bool) -> list[memoryview]:
        P = self.codec.layout.page_size
        first, last = _span(P, token_start, token_end)
        dst = np.asarray(dst_pages[first:last])
        if len(dst) and (dst.min() < 0 or dst.max() >= self.offer.num_pages):
            raise ValueError(f"destination pages outside the receiver's {self.offer.num_pages}")
        runs = paired_runs(src_pages, dst_pages, P, token_start, token_end,
                           _breaks(src_pages, dst_pages, first=first, last=last))
        srcs, dsts, lengths = [], [], []
        base = layer * self.per_layer
        for k in range(base, base + self.per_layer):
            row, s0, d0 = self.row_bytes[k], self.src_ptrs[k], self.offer.regions[k][0]
            for r in runs:
                srcs.append(s0 + r.src_slot * row)
                dsts.append(d0 + r.dst_slot * row)
                lengths.append(r.num_slots * row)
        self.engine.write(self.offer.session, srcs, dsts, lengths)
        return self.codec.pool_views(src, layer, src_pages, token_start, token_end) if want_views else []
