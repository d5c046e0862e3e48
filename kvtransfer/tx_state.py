"""Send-side state of one KV transfer, shared by the sender (``sender.py``) and its peer connections
(``tx_peer.py``): the per-ticket record, its states and result, and the items a connection's writer queue
carries. Split out of ``tx_peer.py`` so both import it and neither imports the other for its types."""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
from kvtransfer.config import TransportKind
from kvtransfer.errors import TransferError
from kvtransfer.payload import page_array
from kvtransfer.protocol import pack_u32
from kvtransfer.staging import HostStage
from kvtransfer.ticket import TransferTicket


def resolve_future(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """First outcome wins (any thread)."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


class PeerLink(Protocol):
    """What the sender reads and calls on the connection carrying a transfer (``tx_peer.TxPeer``)."""

    ready: bool
    closed: bool
    transport: TransportKind
    queue: asyncio.Queue

    def spawn(self, coro: Any) -> None: ...

    async def send_abort(self, st: OutgoingTransfer) -> None: ...


class SendState(enum.Enum):
    QUEUED = "queued"
    STREAMING = "streaming"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


class SendResult(NamedTuple):
    req_id: str
    num_bytes: int
    """Payload bytes written to the socket (TCP) or copied into the receiver's pages (shm)."""
    transport: TransportKind
    started_at_s: float
    """time.monotonic() of the first ``send_layer``."""
    done_at_s: float
    """time.monotonic() when the receiver's DONE arrived."""


@dataclass(eq=False)
class OutgoingTransfer:
    """Prefill-side record of one ticket (shared by the caller's thread and the loop, under the sender lock)."""

    ticket: TransferTicket
    future: concurrent.futures.Future
    started_at: float = field(default_factory=time.monotonic)
    state: SendState = SendState.QUEUED
    pinned: list[int] = field(default_factory=list)
    pinned_set: set[int] = field(default_factory=set)
    unpinned: bool = False
    error: TransferError | None = None
    finish_queued: bool = False
    num_bytes: int = 0
    transport: TransportKind = TransportKind.TCP
    peer: PeerLink | None = None
    """The connection carrying this transfer once routed (a ``tx_peer.TxPeer``)."""
    lease: asyncio.Future | None = None
    finish_timer: asyncio.TimerHandle | None = None
    page_bytes: bytes = b""
    gen_bytes: bytes = b""
    dst_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    src_head: list[int] = field(default_factory=list)
    """The caller's source pages of the latest ``send_layer`` (from token 0) and, below, as read-only numpy."""
    src_arr: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    opened: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    """Resolves once the receiver would take a write now (shm: the lease is granted; TCP: the connection
    is up), or with the transfer's error. Only ``KVSender.open`` callers look at it."""

    def __post_init__(self) -> None:
        self.future.set_running_or_notify_cancel()  # callers cancel with KVSender.cancel, not future.cancel
        self.page_bytes = pack_u32(self.ticket.page_ids)
        self.gen_bytes = pack_u32(self.ticket.generations)
        self.dst_pages = page_array(self.ticket.page_ids)

    @property
    def failed(self) -> bool:
        return self.state is SendState.FAILED


class LayerItem(NamedTuple):
    send: OutgoingTransfer
    layer: int
    src_pages: np.ndarray
    """Prefill page ids from token 0 (a private copy: the caller may grow its list meanwhile)."""
    token_start: int
    token_end: int
    stage: HostStage | None = None
    """A staged pool's pages of this layer, on their way to host memory (``staging.py``)."""

    def drop(self) -> None:
        """The item will not be written: give its stage back."""
        if self.stage is not None:
            self.stage.release()


class OpenItem(NamedTuple):
    """``KVSender.open``: over shm, ask for the lease before the first layer exists."""

    send: OutgoingTransfer


class FinishItem(NamedTuple):
    send: OutgoingTransfer
    draft: bytes | None = None
    """The speculative draft state (``TransferTicket.draft``), sent in FINISH."""


class AbortItem(NamedTuple):
    send: OutgoingTransfer
