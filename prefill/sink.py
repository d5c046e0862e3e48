"""Where a prefill's KV goes: the contract between the prefill scheduler and ``kvtransfer``.

The scheduler calls, for each request, in this order and from its own thread::

    start(pages, cached_len)            once, before the first chunk (ship the cached prefix)
    send(layer, token_start, token_end) after each layer of each chunk (rows are in ``pages``)
    finish(draft) -> Future[SinkResult] after the last chunk and the MTP pass (``draft``: its draft state, or
                                        None without an MTP layer); returns at once
    abort(reason)                       instead of finish on any failure or cancellation, or after it (the
                                        request was cancelled or its transfer outlived ``timeout_s``)

A sink must never block ``send`` for long (it queues). ``finish``'s future resolves once the receiver has
acknowledged the KV, on whichever thread learns it (the transfer's I/O thread; at once for a local sink), or fails
with ``TransferFailed``, and then the request fails (its pages are freed). The scheduler answers the request from
that callback: no thread waits on a transfer. ``abort`` after ``finish`` must fail the future (a cancelled
transfer resolves: nothing is left waiting).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import NamedTuple

import torch


class TransferFailed(RuntimeError):
    pass


class SinkResult(NamedTuple):
    num_bytes: int
    elapsed_s: float


def resolved(result: SinkResult) -> Future[SinkResult]:
    """A ``finish`` future that has resolved already (a sink with nothing to wait for)."""
    fut: Future[SinkResult] = Future()
    fut.set_result(result)
    return fut


def failed(exc: BaseException) -> Future[SinkResult]:
    fut: Future[SinkResult] = Future()
    fut.set_exception(exc)
    return fut


class KVSink(ABC):
    timeout_s: float | None = None
    """After ``finish``, the scheduler aborts a transfer not acknowledged within this many seconds (None: never)."""

    @abstractmethod
    def start(self, pages: list[int], cached_len: int) -> None: ...

    @abstractmethod
    def send(self, layer: int, token_start: int, token_end: int) -> None: ...

    @abstractmethod
    def finish(self, draft: torch.Tensor | None = None) -> Future[SinkResult]: ...

    @abstractmethod
    def abort(self, reason: str) -> None: ...


class LocalSink(KVSink):
    """No transfer: the KV stays in this worker's pool (local prefill, tests)."""

    def start(self, pages: list[int], cached_len: int) -> None:
        self.pages = pages

    def send(self, layer: int, token_start: int, token_end: int) -> None:
        pass

    def finish(self, draft: torch.Tensor | None = None) -> Future[SinkResult]:
        self.draft = draft
        return resolved(SinkResult(0, 0.0))

    def abort(self, reason: str) -> None:
        pass
