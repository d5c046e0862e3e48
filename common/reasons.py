"""Why a request ended, which role a worker plays, why a request was aborted: each named once.

Every one is a ``StrEnum`` whose values are the strings that cross the wire (``GenerateResponse.finish_reason``,
``WorkerStatus.role``, abort messages): members compare equal to those strings and go into proto string fields
as they are, so peers and clients see exactly the strings they saw before.
"""
from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why a request ended (a running request's reason is the empty string)."""
    STOP = "stop"
    """An EOS or stop token, or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached (or the context is full)."""
    ABORT = "abort"
    """Cancelled by the client, a deadline, or a shutdown (``AbortReason``)."""
    ERROR = "error"
    """The cluster could not serve it (the message says why)."""


class Role(enum.StrEnum):
    """What a worker does in the cluster."""
    PREFILL = "prefill"
    DECODE = "decode"


class AbortReason(enum.StrEnum):
    """Why a scheduler aborts a request (its finish reason is ``FinishReason.ABORT``; the value is the message
    its caller sees)."""
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"
    DEADLINE = "deadline exceeded"
    CLIENT_CANCELLED = "cancelled by the client"
    """A prefill worker's caller (the router) cancelled its ``Prefill`` call."""
    STREAM_CLOSED = "stream closed by the client"
    """A decode worker's ``Decode`` stream ended before the request did."""
    ROUTER = "aborted by the router"
    """The router's ``Abort`` call."""
    INTERNAL = "internal error"
    """A scheduler step raised: the requests it was running end."""
