"""Transfer tickets and the decode side's reservations (admission control + exact page accounting).

A decode worker reserves pages *before* prefill starts (``ReservationManager.reserve``): if
the pool cannot hold the request the caller learns it at once (``NO_CAPACITY``), nothing
is allocated. The ``TransferTicket`` it returns travels (router, gRPC) to the prefill
worker and names everything a frame must match: request, ticket id, receiver instance,
page ids and their generation counters.

Lifecycle of a reservation (``TransferState``)::

    RESERVED --first accepted frame--> RECEIVING --FINISH, all layers verified--> COMPLETE
       |                                   |                                      |
       |            expiry (ticket_ttl_s), stall (stall_timeout_s), cancel,       | wait_complete
       |            bad frame, checksum, peer death, wait timeout                 v
       +-----------------------------------+----> FAILED (pages freed)          CLAIMED
                                           |                                (pages now owned
                                           +----> DRAINING --shm writer acked  by the request)
                                                  or died--> FAILED (pages freed)

Pages are freed exactly once (``_free_pages`` guards it) and never while a shm writer may
still touch them: a failed reservation with an outstanding shm lease waits in DRAINING.
Every page a reservation holds carries the owner tag ``kvtransfer:<req_id>``.
"""
from __future__ import annotations

import enum
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from engine.kvcache.layout import KVLayout
from engine.kvcache.pool import KVPool, PoolExhausted
from kvtransfer.config import DraftLayout, TransportKind
from kvtransfer.errors import FailReason, ProtocolError, TransferError
from kvtransfer.payload import page_array
from kvtransfer.protocol import MAX_DRAFT_BYTES, MAX_REQ_ID_LEN, pack_u32

TOMBSTONES = 4096
"""How many finished ticket ids keep their fate, so late frames get the real reason."""


class TransferState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    COMPLETE = "complete"
    CLAIMED = "claimed"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferTicket:
    """What the prefill side needs to push one request's KV into reserved decode pages."""

    req_id: str
    ticket_id: str
    """Random per reservation: a re-reserved ``req_id`` gets a new one, old frames are refused."""
    host: str
    port: int
    receiver_id: str
    """Random per receiver instance: a restarted receiver refuses tickets of its predecessor."""
    num_tokens: int
    page_ids: tuple[int, ...]
    """Decode pool pages; token t lives in page_ids[t // page_size] at offset t % page_size."""
    generations: tuple[int, ...]
    """Generation counter of each page at reservation time (bumped when a page is freed)."""
    layout: KVLayout
    expires_at_s: float
    """Unix time after which the receiver frees the reservation if no frame arrived."""
    draft: DraftLayout | None = None
    """The speculative draft state the decode worker wants in FINISH; None: KV only."""

    def __post_init__(self) -> None:
        if self.draft is not None and self.draft.num_bytes > MAX_DRAFT_BYTES:
            raise ValueError(f"a draft state of {self.draft.num_bytes} bytes exceeds the protocol's "
                             f"{MAX_DRAFT_BYTES}")
        if not 0 < len(self.req_id) <= MAX_REQ_ID_LEN:
            raise ValueError(f"req_id must be 1..{MAX_REQ_ID_LEN} chars, got {len(self.req_id)}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        need = -(-self.num_tokens // self.layout.page_size)
        if len(self.page_ids) != need or len(self.generations) != need:
            raise ValueError(f"{self.num_tokens} tokens need {need} pages, ticket has {len(self.page_ids)} "
                             f"pages and {len(self.generations)} generations")

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def page_span(self, token_start: int, token_end: int) -> slice:
        """Indices into ``page_ids`` of the pages holding tokens [token_start, token_end)."""
        return slice(token_start // self.page_size, -(-token_end // self.page_size))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack / protobuf Struct / JSON)."""
        return {"req_id": self.req_id, "ticket_id": self.ticket_id, "host": self.host, "port": self.port,
                "receiver_id": self.receiver_id, "num_tokens": self.num_tokens, "page_ids": list(self.page_ids),
                "generations": list(self.generations), "layout": self.layout.to_dict(),
                "expires_at_s": self.expires_at_s, "draft": None if self.draft is None else self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransferTicket":
        try:
            return cls(req_id=str(d["req_id"]), ticket_id=str(d["ticket_id"]), host=str(d["host"]),
                       port=int(d["port"]), receiver_id=str(d["receiver_id"]), num_tokens=int(d["num_tokens"]),
                       page_ids=tuple(int(p) for p in d["page_ids"]),
                       generations=tuple(int(g) for g in d["generations"]),
                       layout=KVLayout.from_dict(d["layout"]), expires_at_s=float(d["expires_at_s"]),
                       draft=DraftLayout.from_dict(d.get("draft")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed ticket dict: {e!r}") from None


class TransferResult(NamedTuple):
    """A complete, verified transfer, handed to the decode request by ``wait_complete``."""

    req_id: str
    page_ids: tuple[int, ...]
    """Now owned by the decode request (owner tag ``req_id``): it frees them with ``decref``."""
    num_tokens: int
    num_bytes: int
    """Payload bytes received (TCP) or copied in by the sender (shm)."""
    transport: TransportKind
    reserved_at_s: float
    """time.monotonic() of the reservation (same clock as the two fields below)."""
    completed_at_s: float
    layer_done_at_s: tuple[float, ...]
    """time.monotonic() at which each layer's last token arrived."""
    draft: bytes | None = None
    """The draft state the ticket asked for (``DraftLayout``: raw values, verified), else None."""


@dataclass(slots=True, eq=False)
class Reservation:
    """Mutable decode-side record of one ticket. Touched only on the receiver's loop thread,
    except for creation under the manager's lock."""

    ticket: TransferTicket
    reserved_at: float
    deadline: float
    """Monotonic: RESERVED past this is EXPIRED."""
    page_bytes: bytes
    gen_bytes: bytes
    page_arr: np.ndarray
    """``ticket.page_ids`` as int64 numpy, for the payload helpers."""
    state: TransferState = TransferState.RESERVED
    last_progress: float = 0.0
    received_upto: list[int] = field(default_factory=list)
    """Per layer: tokens [0, received_upto[l]) have arrived and been verified."""
    queued_upto: list[int] = field(default_factory=list)
    """Per layer: frames up to this token were accepted (their checksums may still be running)."""
    layer_done_at: list[float] = field(default_factory=list)
    conn: Any = None
    """The connection the first frame came on; other connections may not write this request."""
    shm_writer: Any = None
    """The connection holding a shm write lease (a remote process may write the pages)."""
    transport: TransportKind = TransportKind.TCP
    num_bytes: int = 0
    completed_at: float = 0.0
    draft: bytes | None = None
    """The verified draft state from FINISH (when the ticket asked for one)."""
    error: TransferError | None = None
    waiter: Any = None
    """asyncio.Future resolved when the reservation completes or fails (set by the receiver)."""
    pages_freed: bool = False
    stages: list[Any] = field(default_factory=list)
    """Host stages of a staged pool whose device copy into the pages may still run (``staging.py``)."""

    @property
    def req_id(self) -> str:
        return self.ticket.req_id

    @property
    def all_received(self) -> bool:
        return all(n == self.ticket.num_tokens for n in self.received_upto)

    def result(self) -> TransferResult:
        return TransferResult(self.req_id, self.ticket.page_ids, self.ticket.num_tokens, self.num_bytes,
                              self.transport, self.reserved_at, self.completed_at, tuple(self.layer_done_at),
                              self.draft)


class ReservationManager:
    """Owns every decode page reserved for incoming transfers; frees each exactly once."""

    def __init__(self, pool: KVPool, *, host: str, port: int, receiver_id: str, ticket_ttl_s: float,
                 max_reserved_pages: int | None = None, draft: DraftLayout | None = None) -> None:
        self.pool = pool
        self.host, self.port, self.receiver_id = host, port, receiver_id
        self.ticket_ttl_s = ticket_ttl_s
        self.max_reserved_pages = max_reserved_pages
        self.draft = draft
        """The draft state every ticket asks for (``KVReceiverConfig.draft``)."""
        self._active: dict[str, Reservation] = {}
        self._draining: dict[str, Reservation] = {}
        self._tombstones: OrderedDict[str, FailReason] = OrderedDict()
        self._failures: OrderedDict[str, TransferError] = OrderedDict()
        self._reserved_pages = 0
        self._lock = threading.Lock()

    # --- admission -------------------------------------------------------------------------------
    def reserve(self, req_id: str, num_tokens: int) -> TransferTicket:
        """Allocate the pages ``num_tokens`` need and issue a ticket. Thread-safe.

        Raises ``TransferError(NO_CAPACITY)`` at once when the pool (or ``max_reserved_pages``)
        cannot hold them, ``ValueError`` for a bad request or a ``req_id`` already reserved. Every
        check runs before the allocation, and any error after it frees the pages again: a refused
        reservation never holds a page.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not 0 < len(req_id) <= MAX_REQ_ID_LEN:
            raise ValueError(f"request id must be 1..{MAX_REQ_ID_LEN} characters, got {len(req_id)}")
        n = self.pool.pages_for(num_tokens)
        with self._lock:
            if req_id in self._active:
                raise ValueError(f"request {req_id!r} already holds a reservation")
            if self.max_reserved_pages is not None and self._reserved_pages + n > self.max_reserved_pages:
                raise TransferError(FailReason.NO_CAPACITY, f"{n} pages requested, {self._reserved_pages} of "
                                    f"max_reserved_pages={self.max_reserved_pages} already reserved", req_id)
            try:
                # ascending ids: the allocator hands out a freed range in reverse, sorting restores
                # contiguous runs so payloads can be received straight into the pages
                pages = sorted(self.pool.allocator.alloc(n, owner=f"kvtransfer:{req_id}"))
            except PoolExhausted as e:
                raise TransferError(FailReason.NO_CAPACITY, str(e), req_id) from None
            try:
                res = self._new_reservation(req_id, num_tokens, pages)
            except BaseException:
                self.pool.allocator.decref(pages)
                raise
            self._failures.pop(req_id, None)
            self._active[req_id] = res
            self._reserved_pages += n
            return res.ticket

    def _new_reservation(self, req_id: str, num_tokens: int, pages: list[int]) -> Reservation:
        gens = self.pool.allocator.generations(pages)
        now = time.monotonic()
        ticket = TransferTicket(req_id=req_id, ticket_id=secrets.token_hex(16), host=self.host, port=self.port,
                                receiver_id=self.receiver_id, num_tokens=num_tokens, page_ids=tuple(pages),
                                generations=tuple(gens), layout=self.pool.layout,
                                expires_at_s=time.time() + self.ticket_ttl_s, draft=self.draft)
        layers = self.pool.layout.num_layers
        return Reservation(ticket=ticket, reserved_at=now, deadline=now + self.ticket_ttl_s,
                           page_bytes=pack_u32(pages), gen_bytes=pack_u32(gens), page_arr=page_array(pages),
                           last_progress=now, received_upto=[0] * layers, queued_upto=[0] * layers,
                           layer_done_at=[0.0] * layers)

    # --- lookups ---------------------------------------------------------------------------------
    def get(self, req_id: str) -> Reservation | None:
        return self._active.get(req_id)

    def recent_failure(self, req_id: str) -> TransferError | None:
        """The error a recently failed reservation of ``req_id`` ended with."""
        return self._failures.get(req_id)

    def find_draining(self, tid: str) -> Reservation | None:
        return self._draining.get(tid)

    def draining(self) -> list[Reservation]:
        return list(self._draining.values())

    def active(self) -> list[Reservation]:
        return list(self._active.values())

    @property
    def num_reserved_pages(self) -> int:
        """Pages held by reservations not yet claimed (including DRAINING ones)."""
        return self._reserved_pages

    def lookup(self, req_id: str, tid: str) -> Reservation:
        """The reservation a frame names, or ``ProtocolError`` saying why there is none."""
        res = self._active.get(req_id)
        if res is not None and res.ticket.ticket_id == tid:
            return res
        fate = self._tombstones.get(tid)
        if fate is not None:
            raise ProtocolError(fate, f"ticket {tid} already ended ({fate.value})")
        if res is not None:
            raise ProtocolError(FailReason.STALE_PAGE, f"ticket {tid} is not the current reservation of {req_id!r}")
        raise ProtocolError(FailReason.UNKNOWN_REQUEST, f"no reservation for request {req_id!r}")

    # --- transitions -----------------------------------------------------------------------------
    def fail(self, res: Reservation, err: TransferError) -> bool:
        """First failure wins. Frees the pages now, or moves to DRAINING while a shm lease is out."""
        with self._lock:
            if res.state not in (TransferState.RESERVED, TransferState.RECEIVING, TransferState.COMPLETE):
                return False
            res.error = err
            if self._active.get(res.req_id) is res:
                del self._active[res.req_id]
            self._tombstone(res.ticket.ticket_id, err.reason)
            self._failures[res.req_id] = err
            while len(self._failures) > TOMBSTONES:
                self._failures.popitem(last=False)
            if res.shm_writer is not None:
                res.state = TransferState.DRAINING
                self._draining[res.ticket.ticket_id] = res
            else:
                res.state = TransferState.FAILED
                self._free_pages(res)
            return True

    def drained(self, res: Reservation) -> None:
        """The shm writer acknowledged the abort or is gone: the pages can be freed now."""
        with self._lock:
            res.shm_writer = None
            if res.state is TransferState.DRAINING:
                del self._draining[res.ticket.ticket_id]
                res.state = TransferState.FAILED
                self._free_pages(res)

    def complete(self, res: Reservation) -> None:
        res.state = TransferState.COMPLETE
        res.shm_writer = None  # FINISH is the sender's promise that it is done writing
        res.completed_at = time.monotonic()

    def claim(self, res: Reservation) -> TransferResult:
        """Hand a COMPLETE reservation's pages to the decode request (owner tag = req_id)."""
        with self._lock:
            if res.state is not TransferState.COMPLETE:
                raise ValueError(f"request {res.req_id!r} is {res.state.value}, not complete")
            res.state = TransferState.CLAIMED
            del self._active[res.req_id]
            self._tombstone(res.ticket.ticket_id, FailReason.UNKNOWN_REQUEST)
            self._reserved_pages -= len(res.ticket.page_ids)
            self.pool.allocator.set_owner(res.ticket.page_ids, res.req_id)
            return res.result()

    def due(self, now: float, stall_timeout_s: float,
            claim_timeout_s: float) -> list[tuple[Reservation, TransferError]]:
        """Reservations the reaper must fail: expired, stalled, or completed but never claimed."""
        out = []
        for res in list(self._active.values()):
            if res.state is TransferState.RESERVED and now > res.deadline:
                out.append((res, TransferError(FailReason.EXPIRED, f"no frame within ticket_ttl_s="
                                               f"{self.ticket_ttl_s}", res.req_id)))
            elif res.state is TransferState.RECEIVING and now - res.last_progress > stall_timeout_s:
                out.append((res, TransferError(FailReason.STALLED, f"no progress for stall_timeout_s="
                                               f"{stall_timeout_s}", res.req_id)))
            elif res.state is TransferState.COMPLETE and now - res.completed_at > claim_timeout_s:
                out.append((res, TransferError(FailReason.TIMEOUT, f"complete but not claimed within "
                                               f"claim_timeout_s={claim_timeout_s}", res.req_id)))
        return out

    def _free_pages(self, res: Reservation) -> None:
        if res.pages_freed:
            return
        res.pages_freed = True
        self._reserved_pages -= len(res.ticket.page_ids)
        self.pool.allocator.decref(res.page_arr)

    def _tombstone(self, tid: str, reason: FailReason) -> None:
        self._tombstones[tid] = reason
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
