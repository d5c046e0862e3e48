"""``KVSink`` over ``kvtransfer``: ships a request's KV layer by layer into the decode worker's pages.

Decode-side prefix reuse: when the decode worker already holds the prompt's first ``skip_tokens`` tokens (a whole
number of pages, ``TransferTicket.resident_tokens`` in the reservation), the ticket covers the tokens from there
on and only they ship: prompt token ``t`` is the ticket's token ``t - skip_tokens``, in the same page offset."""
from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kvtransfer import KVSender, TransferError, TransferTicket
from prefill.sink import KVSink, SinkResult, TransferFailed, failed


class TransferSink(KVSink):
    def __init__(self, sender: KVSender, ticket: TransferTicket, num_layers: int, timeout_s: float = 60.0,
                 skip_tokens: int = 0) -> None:
        if skip_tokens % ticket.page_size:
            raise ValueError(f"skip_tokens ({skip_tokens}) must be a multiple of the page size {ticket.page_size}")
        self.sender, self.ticket, self.num_layers, self.timeout_s = sender, ticket, num_layers, timeout_s
        self.skip_tokens = skip_tokens
        """Prompt tokens the decode worker holds already: not shipped."""
        self.error: Exception | None = None
        self.pages: list[int] = []
        self.t0 = 0.0

    def start(self, pages: list[int], cached_len: int) -> None:
        self.pages, self.t0 = pages[self.skip_tokens // self.ticket.page_size:], time.monotonic()
        try:  # over shm the lease round trip now overlaps the first layer's compute
            self.sender.open(self.ticket)
        except (TransferError, ValueError) as e:  # recorded; finish() reports it
            self.error = e
            return
        if cached_len > self.skip_tokens:  # the cached prefix's KV ships first, every layer (MTP included)
            for layer in range(self.num_layers):
                self.send(layer, 0, cached_len)

    def send(self, layer: int, token_start: int, token_end: int) -> None:
        """Ship ``layer``'s KV of prompt tokens [token_start, token_end), less those the decode worker holds."""
        start = max(token_start, self.skip_tokens)
        if self.error is not None or token_end <= start:
            return
        try:
            self.sender.send_layer(self.ticket, layer, self.pages, start - self.skip_tokens,
                                   token_end - self.skip_tokens)
        except (TransferError, ValueError) as e:  # recorded; finish() reports it
            self.error = e

    def finish(self, draft: torch.Tensor | None = None) -> Future[SinkResult]:
        if self.error is not None:
            self.sender.cancel(self.ticket, f"prefill side error: {self.error}")
            return failed(TransferFailed(str(self.error)))
        want = self.ticket.draft
        state = None  # the draft state in the decode worker's dtype, as raw bytes (never pickle)
        if want is not None and draft is not None:
            state = draft.to(getattr(torch, want.dtype)).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        try:
            acked = self.sender.finish(self.ticket, state)
        except (TransferError, ValueError) as e:
            return failed(TransferFailed(str(e)))
        out: Future[SinkResult] = Future()

        def on_acked(f: Future) -> None:  # the sender's I/O thread (or this one, when it resolved already)
            try:
                res = f.result()
            except Exception as e:  # noqa: BLE001 - TransferError, or a cancel: the request fails, never hangs
                out.set_exception(e if isinstance(e, TransferFailed) else TransferFailed(str(e)))
                return
            out.set_result(SinkResult(int(getattr(res, "num_bytes", 0)), time.monotonic() - self.t0))
        acked.add_done_callback(on_acked)
        return out

    def abort(self, reason: str) -> None:
        self.sender.cancel(self.ticket, reason)
