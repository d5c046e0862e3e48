"""``GatherSink``: the KV sink of a tensor-parallel prefill worker whose ranks each hold a slice of every
token's KV (GQA heads split by rank, ``worker.ranks``).

Rank 0's pages alone hold only its heads, so nothing ships while the chunks run (``send`` is a no-op); at
``finish`` every rank's heads of the request's pages are gathered on rank 0 into pages of a full-layout
staging pool, the inner sink (``TransferSink`` over a sender on that pool) ships them whole, and the staging
pages are freed once the receiver has acknowledged them. The decode side sees an ordinary full-layout transfer.
Cost: no transfer/compute overlap, one gather per layer and component, staging pages while a transfer runs.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from engine.kvcache import KVPool, PoolExhausted
from prefill.sink import KVSink, SinkResult, TransferFailed, failed

GatherPages = Callable[[list[int], list[int]], None]
"""``(pages of the worker's pool, pages of the staging pool)``: gather every rank's heads into the staging pages."""


class GatherSink(KVSink):
    def __init__(self, inner: KVSink, gather: GatherPages, staging: KVPool, num_layers: int, num_tokens: int,
                 owner: str, skip_tokens: int = 0) -> None:
        self.inner, self.gather, self.staging = inner, gather, staging
        self.num_layers, self.num_tokens, self.owner = num_layers, num_tokens, owner
        self.skip_pages = skip_tokens // staging.page_size
        """Pages of the prompt the decode worker holds already (decode-side reuse): neither gathered nor shipped;
        ``num_tokens`` counts the tokens after them."""
        self.pages: list[int] = []

    @property
    def timeout_s(self) -> float | None:  # type: ignore[override]
        return self.inner.timeout_s

    def start(self, pages: list[int], cached_len: int) -> None:
        self.pages = pages

    def send(self, layer: int, token_start: int, token_end: int) -> None:
        pass  # rank 0's pages hold its heads only: everything ships whole at finish

    def finish(self, draft: torch.Tensor | None = None) -> Future[SinkResult]:
        need = self.staging.pages_for(self.num_tokens)
        try:
            staged = self.staging.allocator.alloc(need, self.owner)
        except PoolExhausted as e:
            self.inner.abort(f"no staging pages: {e}")
            return failed(TransferFailed(f"no staging pages to gather the KV heads in: {e}"))
        try:
            self.gather(self.pages[self.skip_pages:self.skip_pages + need], staged)
            self.inner.start(staged, 0)
            for layer in range(self.num_layers):
                self.inner.send(layer, 0, self.num_tokens)
            acked = self.inner.finish(draft)
        except Exception:
            self.inner.abort("gathering the KV heads failed")
            self.staging.allocator.decref(staged)
            raise
        # the staging pages are the transfer's source: freed once the receiver has them (or the transfer failed)
        acked.add_done_callback(lambda _: self.staging.allocator.decref(staged))
        return acked

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)
