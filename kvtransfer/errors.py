"""The one exception the data plane raises to its callers, and why it was raised.

Every failure a prefill or decode worker can observe ends in ``TransferError`` with a
``FailReason``: callers branch on the enum, never on message text. The reason travels on
the wire as its string value (ABORT and ERROR frames), so both sides of a failed
transfer report the same cause.
"""
from __future__ import annotations

import enum


class FailReason(enum.Enum):
    """Why a transfer (or a connection) failed. Values are the wire spelling."""

    NO_CAPACITY = "no_capacity"
    """Admission control: the decode pool cannot reserve the pages (nothing was allocated)."""
    AUTH_FAILED = "auth_failed"
    """The peer did not prove it holds the cluster secret (or we could not prove it to the peer)."""
    INCOMPATIBLE = "incompatible"
    """Layout handshake: model, layers, page size, KV dtype, head dims or versions differ."""
    TIMEOUT = "timeout"
    """A wait ran past its deadline (connect, handshake, send, finish, wait_complete)."""
    STALLED = "stalled"
    """The transfer made no progress for ``stall_timeout_s``."""
    EXPIRED = "expired"
    """The ticket was not used before its expiry."""
    PEER_DIED = "peer_died"
    """The connection to the peer was lost (or refused) before the transfer completed."""
    CORRUPT = "corrupt"
    """A payload checksum did not match."""
    STALE_PAGE = "stale_page"
    """A frame named pages or generation counters the reservation does not hold (freed, reused)."""
    UNKNOWN_REQUEST = "unknown_request"
    """A frame named a request the receiver has no reservation for."""
    BAD_FRAME = "bad_frame"
    """A frame was malformed, out of bounds, out of order or oversized."""
    INCOMPLETE = "incomplete"
    """FINISH arrived before every layer of every token was received."""
    CANCELLED = "cancelled"
    """One side cancelled the request; the other side is told."""
    SHUTDOWN = "shutdown"
    """The local sender or receiver was stopped."""
    BUSY = "busy"
    """The receiver's connection limits are full for now (see ``admission.py``); senders retry with backoff."""
    INTERNAL = "internal"
    """A bug in kvtransfer (the log has the traceback); the transfer was failed rather than left hanging."""

    @classmethod
    def from_wire(cls, value: object) -> "FailReason":
        """Parse a reason from a peer; anything unknown reads as ``BAD_FRAME``."""
        try:
            return cls(value)
        except ValueError:
            return cls.BAD_FRAME


class TransferError(RuntimeError):
    """A transfer (or the connection carrying it) failed; ``reason`` says why."""

    def __init__(self, reason: FailReason, detail: str = "", req_id: str | None = None) -> None:
        where = f" [req {req_id}]" if req_id else ""
        super().__init__(f"{reason.value}{where}: {detail}" if detail else f"{reason.value}{where}")
        self.reason = reason
        self.detail = detail
        self.req_id = req_id

    def for_request(self, req_id: str) -> "TransferError":
        """The same failure, attributed to one request (connection errors fail many)."""
        return TransferError(self.reason, self.detail, req_id)


class ProtocolError(Exception):
    """A frame failed validation; the receiver rejects it (internal: becomes a ``TransferError``)."""

    def __init__(self, reason: FailReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
