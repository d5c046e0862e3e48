"""Where a prefill's KV goes: the contract between the prefill scheduler and ``kvtransfer``.

The scheduler calls, for each request, in this order and from its own thread::

    start(pages, cached_len)            once, before the first chunk (ship the cached prefix)
    send(layer, token_start, token_end) after each layer of each chunk (rows are in ``pages``)
    finish(draft) -> SinkResult         after the last chunk and the MTP pass (``draft``: its draft state, or
                                        None without an MTP layer); blocks until acked
    abort(reason)                       instead of finish on any failure or cancellation

A sink must never block ``send`` for long (it queues); ``finish`` raises ``TransferFailed``
when the transfer did not complete, and then the request fails (its pages are freed).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class TransferFailed(RuntimeError):
    pass


class SinkResult(NamedTuple):
    num_bytes: int
    elapsed_s: float


class KVSink(ABC):
    @abstractmethod
    def start(self, pages: list[int], cached_len: int) -> None: ...

    @abstractmethod
    def send(self, layer: int, token_start: int, token_end: int) -> None: ...

    @abstractmethod
    def finish(self, draft: torch.Tensor | None = None) -> SinkResult: ...

    @abstractmethod
    def abort(self, reason: str) -> None: ...


class LocalSink(KVSink):
    """No transfer: the KV stays in this worker's pool (local prefill, tests)."""

    def start(self, pages: list[int], cached_len: int) -> None:
        self.pages = pages

    def send(self, layer: int, token_start: int, token_end: int) -> None:
        pass

    def finish(self, draft: torch.Tensor | None = None) -> SinkResult:
        self.draft = draft
        return SinkResult(0, 0.0)

    def abort(self, reason: str) -> None:
        pass
