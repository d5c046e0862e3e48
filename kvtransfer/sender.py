# over 400 lines: the sender's public API and the bookkeeping of every outgoing transfer.
"""Prefill side of the data plane: push each layer's KV to the decode worker as soon as it exists.

The prefill loop is synchronous; ``KVSender`` runs its connections on its own event loop
thread (``LoopThread``, uvloop when installed) plus one blocking send thread per receiver,
so ``send_layer`` only validates, pins the source pages and enqueues (blocking only when
``max_pending_frames`` are already queued: backpressure). The loop thread gathers frame
k+1 while the send thread checksums and writes frame k piece by piece (the checksum trails
the payload); shm copies run on the loop thread. Hooking it into a forward pass::

    sender = KVSender(pool, KVSenderConfig())
    ticket = TransferTicket.from_dict(ticket_dict)       # issued by the decode worker
    sender.open(ticket)                                  # optional, before the forward: the shm lease early
    on_layer_done = sender.on_layer_done([LayerSend(ticket, src_pages=req.page_ids, token_start=c0, token_end=c1)])
    prefill_forward(model, pool, chunks, on_layer_done=on_layer_done)  # engine.batch.OnLayerDone: each layer
                                                         # ships right after its KV is written, MTP layer included
    fut = sender.finish(ticket)                          # after the last chunk; Future[SendResult]
    fut.result(timeout)                                  # or poll sender.state(ticket)

Source pages are pinned (``incref``) from the first ``send_layer`` until the transfer ends,
so the prefill worker may free its own reference at any time; they are unpinned exactly
once whether the transfer completes, fails or is cancelled.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.kvcache.pool import KVPool, PageError
from kvtransfer.admission import RateLimitedLog
from kvtransfer.config import KVSenderConfig, TransportKind
from kvtransfer.errors import FailReason, TransferError
from kvtransfer.loop import LoopThread
from kvtransfer.mooncake import MooncakeEngine
from kvtransfer.payload import page_array
from kvtransfer.staging import Stager, is_staged
from kvtransfer.ticket import TOMBSTONES, TransferTicket
from kvtransfer.tx_peer import TxPeer
from kvtransfer.tx_state import (AbortItem, FinishItem, LayerItem, OpenItem, OutgoingTransfer, SendResult, SendState,
                                 resolve_future)

log = logging.getLogger(__name__)

RETRY_LOG_INTERVAL_S = 10.0
"""Retried connects to one receiver log at most one line per this many seconds."""


@dataclass(frozen=True, slots=True)
class LayerSend:
    """One request's share of a forward pass."""

    ticket: TransferTicket
    src_pages: Sequence[int]
    """The request's prefill pages from token 0 (page i holds tokens [i * page_size, (i + 1) * page_size))."""
    token_start: int
    token_end: int
    """The tokens this forward pass computed (a prefill chunk)."""


class LayerSends:
    """A batch's ``LayerSend``s as its ``engine.batch.OnLayerDone``: calling it with a layer index ships that
    layer for every request of the batch; one request's failure does not stop the others (it is recorded in
    ``errors`` and its later layers are skipped)."""

    def __init__(self, sender: "KVSender", sends: Sequence[LayerSend]) -> None:
        self.sender = sender
        self.sends = tuple(sends)
        self.errors: dict[str, TransferError] = {}

    def __call__(self, layer: int) -> None:
        for s in self.sends:
            if s.ticket.req_id in self.errors:
                continue
            try:
                self.sender.send_layer(s.ticket, layer, s.src_pages, s.token_start, s.token_end)
            except TransferError as e:
                self.errors[s.ticket.req_id] = e


SHUTDOWN_SETUP_WAIT_S = 3.0
"""A closing sender waits this long (beyond the 1 s flush) for connections still being set up to carry their
queued ABORTs (``TxPeer.flush``); ``close`` bounds its shutdown at ``grace_s + 5`` s."""


class KVSender:
    def __init__(self, pool: KVPool, config: KVSenderConfig | None = None) -> None:
        self.pool = pool
        self.stager = Stager(pool) if is_staged(pool) else None
        """A device (or ``force_staged``) pool's pages leave through pinned host stages (``staging.py``)."""
        self.config = config or KVSenderConfig()
        self._lt = LoopThread("kvtransfer-sender")
        self._lock = threading.Lock()
        self._sends: dict[str, OutgoingTransfer] = {}
        self._ended: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        """Futures of finished transfers (bounded): late calls get the outcome, not a fresh start."""
        self._peers: dict[tuple[str, int], TxPeer] = {}
        self._slots = threading.Semaphore(self.config.max_pending_frames)
        self._closed = False
        self.drops_armed = 0
        """Fault injection: transfers still to have their connection cut (``inject_drop``)."""
        self.drops_fired = 0
        self._orphans: dict[tuple[str, int], dict[str, tuple[str, str]]] = {}
        """Per receiver: shm leases whose connection was lost before the receiver heard we stopped
        writing (ticket id -> (req id, receiver id)); released on the next connection (loop thread)."""
        self._release_tries: dict[tuple[str, int], int] = {}
        self.retry_log = RateLimitedLog(logging.getLogger("kvtransfer.tx_peer"), RETRY_LOG_INTERVAL_S)
        """Retried connects (a busy receiver): one line per receiver and interval."""
        self._mooncake: MooncakeEngine | None = None

    # --- prefill worker API (any thread) -----------------------------------------------------
    def open(self, ticket: TransferTicket) -> concurrent.futures.Future:
        """Announce a transfer before its first layer is computed (optional; the first ``send_layer`` does
        it otherwise): connect to the receiver if needed and, over shm, ask for the lease now, so its round
        trip overlaps the forward instead of delaying the first copy. Nothing is pinned. Once opened, the
        transfer ends like any other: ``finish`` or ``cancel`` (a lease held by a transfer that never
        finishes is released by the receiver's stall timeout, or by ``cancel``).

        Returns a Future that resolves once the receiver would take a write now (shm: lease granted; TCP:
        connection up) or raises the transfer's ``TransferError``; nobody has to wait for it. Opening a
        transfer already under way (or over) changes nothing and returns that transfer's."""
        self._check_ticket(ticket)
        tid = ticket.ticket_id
        with self._lock:
            if tid in self._ended:
                done: concurrent.futures.Future = concurrent.futures.Future()
                resolve_future(done, None, self._ended[tid].exception())
                return done
            st = self._sends.get(tid)
            if st is not None:
                return st.opened
            st = self._new_transfer(ticket, "before the transfer opened")
        self._lt.call(self._enqueue, OpenItem(st))
        return st.opened

    def send_layer(self, ticket: TransferTicket, layer: int, src_pages: Sequence[int], token_start: int,
                   token_end: int) -> None:
        """Queue ``layer``'s rows for tokens [token_start, token_end) (already written to ``src_pages``).

        Returns at once unless the queue is full. Raises ``ValueError`` for bad arguments and
        ``TransferError`` when this transfer already failed (its reason) or cannot start.
        """
        self._validate(ticket, layer, src_pages, token_start, token_end)
        need = -(-token_end // self.pool.page_size)
        st, src_arr = self._pin(ticket, src_pages, token_start // self.pool.page_size, need)
        if not self._slots.acquire(timeout=self.config.enqueue_timeout_s):
            err = TransferError(FailReason.TIMEOUT, f"send queue full for enqueue_timeout_s="
                                f"{self.config.enqueue_timeout_s}", ticket.req_id)
            self._lt.call(self._abort, ticket, err)
            raise err
        stage = None
        if self.stager is not None and not self._copies_direct(st):
            # the D2H starts now, while earlier layers are still on the wire
            try:
                stage = self.stager.stage_out(layer, src_arr, token_start, token_end)
            except BaseException:
                self.release_slot()
                raise
        self._lt.call(self._enqueue, LayerItem(st, layer, src_arr, token_start, token_end, stage))

    def finish(self, ticket: TransferTicket, draft: bytes | None = None) -> concurrent.futures.Future:
        """All layers of all tokens were queued: ask the receiver to verify and complete. ``draft``: the
        speculative draft state the ticket asks for (``ticket.draft``: exactly its ``num_bytes``), else None.

        Returns a Future resolving to ``SendResult`` or raising ``TransferError``; it resolves
        within ``finish_timeout_s`` of FINISH being written. A draft state that does not match the ticket's
        fails the transfer (INCOMPATIBLE): the decode worker would otherwise speculate on garbage.
        """
        want = ticket.draft
        if (want is None) != (draft is None) or (want is not None and len(draft) != want.num_bytes):  # type: ignore[arg-type]
            err = TransferError(FailReason.INCOMPATIBLE, (
                f"the decode worker asks for a draft state of {want.hidden_size} {want.dtype} values "
                f"({want.num_bytes} bytes: it speculates with an MTP layer) but this prefill worker "
                + ("has none (no MTP layer?)" if draft is None else f"has {len(draft)} bytes (another model?)")
            ) if want is not None else "the ticket asks for no draft state but one was given", ticket.req_id)
            self._lt.call(self._abort, ticket, err)
            raise err
        with self._lock:
            if ticket.ticket_id in self._ended:
                return self._ended[ticket.ticket_id]
            st = self._sends.get(ticket.ticket_id)
            if st is None:
                raise ValueError(f"finish({ticket.req_id!r}) before any send_layer")
            if st.finish_queued or st.error is not None:
                return st.future
            st.finish_queued = True
        self._lt.call(self._enqueue, FinishItem(st, draft))
        return st.future

    def cancel(self, ticket: TransferTicket, detail: str = "cancelled by the prefill worker") -> None:
        """Stop sending, unpin the source pages and tell the receiver to free its pages."""
        self._lt.call(self._abort, ticket, TransferError(FailReason.CANCELLED, detail, ticket.req_id))

    def state(self, ticket: TransferTicket) -> SendState | None:
        with self._lock:
            st = self._sends.get(ticket.ticket_id)
            if st is not None:
                return st.state
            if ticket.ticket_id in self._ended:
                return SendState.FAILED if self._ended[ticket.ticket_id].exception() else SendState.DONE
            return None

    def inject_drop(self, count: int = 1) -> int:
        """Fault injection (``pdserve bench --fault drop-kv``): cut the connection of each of the next
        ``count`` transfers right after its first frame, as a failed network would (no ABORT; every
        transfer on that connection fails and the receiver frees their pages). Returns the faults pending."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            self.drops_armed += count
            return self.drops_armed

    def take_drop(self) -> bool:
        """Loop thread: True (and one fault consumed) when an armed drop should fire now."""
        with self._lock:
            if self.drops_armed <= 0:
                return False
            self.drops_armed -= 1
            self.drops_fired += 1
            return True

    def on_layer_done(self, sends: Sequence[LayerSend]) -> LayerSends:
        """The batch's ``OnLayerDone`` (pass it as ``prefill_forward``'s ``on_layer_done``)."""
        return LayerSends(self, sends)

    def close(self, grace_s: float = 5.0) -> None:
        """Let finishing transfers complete for ``grace_s``, fail the rest (SHUTDOWN), stop the loop."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            futs = [st.future for st in self._sends.values() if st.finish_queued]
        concurrent.futures.wait(futs, timeout=grace_s)
        try:
            self._lt.run(self._shutdown(), timeout_s=grace_s + 5.0)
        finally:
            self._lt.stop()
            if self._mooncake is not None:
                self._mooncake.close()

    def _copies_direct(self, st: OutgoingTransfer) -> bool:
        """Caller thread: a staged pool's layer skips the host stage when the connection to its receiver is up
        and copies into the receiver's shm pages: the device copy lands in them directly (zero staging,
        ``ShmTransport``). A racy read of loop-thread state, on purpose: a wrong guess only costs a stage
        (``TxPeer._restaged`` stages a layer whose connection turns out not to be shm)."""
        peer = st.peer or self._peers.get(st.ticket.address)
        return peer is not None and peer.ready and not peer.closed and peer.transport is TransportKind.SHM

    def mooncake_engine(self, host: str) -> MooncakeEngine:
        """Loop thread: this sender's Mooncake engine (one per process, made on first use, bound to the local
        address of the first connection that wants it); raises ``OSError`` when it cannot start."""
        if self._mooncake is None:
            self._mooncake = MooncakeEngine(host, self.config.mooncake_protocol)
        return self._mooncake

    # --- internals (caller thread) -----------------------------------------------------------
    def _check_ticket(self, ticket: TransferTicket) -> None:
        if self._closed:
            raise TransferError(FailReason.SHUTDOWN, "sender closed", ticket.req_id)
        lay = self.pool.layout
        if ticket.layout.page_size != lay.page_size or ticket.layout.num_layers != lay.num_layers:
            raise TransferError(FailReason.INCOMPATIBLE, f"ticket layout (page_size {ticket.layout.page_size}, "
                                f"{ticket.layout.num_layers} layers) != ours ({lay.page_size}, {lay.num_layers})",
                                ticket.req_id)

    def _validate(self, ticket: TransferTicket, layer: int, src_pages: Sequence[int], ts: int, te: int) -> None:
        self._check_ticket(ticket)
        lay = self.pool.layout
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer {layer} outside [0, {lay.num_layers})")
        if not 0 <= ts < te <= ticket.num_tokens:
            raise ValueError(f"tokens [{ts}, {te}) outside the ticket's [0, {ticket.num_tokens})")
        if len(src_pages) * lay.page_size < te:
            raise ValueError(f"{len(src_pages)} source pages cannot hold {te} tokens")

    def _pin(self, ticket: TransferTicket, src_pages: Sequence[int], first: int,
             need: int) -> tuple[OutgoingTransfer, np.ndarray]:
        """Pin the pages of ``src_pages[first:need]`` not pinned yet; returns the transfer and a private,
        read-only copy of ``src_pages[:need]`` as numpy (made once, while the caller passes the same pages:
        the layers of a chunk share it; converting 1250 page ids costs ~50 us)."""
        tid = ticket.ticket_id
        with self._lock:
            if tid in self._ended:
                raise self._ended[tid].exception() or ValueError(f"transfer of {ticket.req_id!r} already completed")
            st = self._sends.get(tid)
            if st is None:
                st = self._new_transfer(ticket, "before the first layer")
            if st.error is not None:
                raise st.error
            if st.finish_queued:
                raise ValueError(f"send_layer({ticket.req_id!r}) after finish()")
            try:
                head = list(src_pages[:need])
                if head != st.src_head:  # a C-level compare of the lists
                    arr = page_array(head)
                    arr.flags.writeable = False
                    st.src_head, st.src_arr = head, arr
                span = head[first:]
                if not st.pinned_set:  # the first layer: every page is new (no per-page set lookups)
                    new, new_ids = span, st.src_arr[first:]
                else:  # issuperset: the common case of a later layer of the same chunk, one C-level pass
                    new = [] if st.pinned_set.issuperset(span) else [p for p in span if p not in st.pinned_set]
                    new_ids = new
                if new:
                    self.pool.allocator.incref(new_ids)
            except (PageError, TypeError, ValueError, OverflowError) as e:  # not pages of ours / not integers
                raise ValueError(f"source pages of {ticket.req_id!r}: {e}") from None
            if new:
                st.pinned.extend(new)
                st.pinned_set.update(new)
            return st, st.src_arr

    def _new_transfer(self, ticket: TransferTicket, when: str) -> OutgoingTransfer:
        """Under the lock: the record of a transfer that starts now (its ticket must not have expired)."""
        if time.time() > ticket.expires_at_s:
            raise TransferError(FailReason.EXPIRED, f"ticket expired {when}", ticket.req_id)
        st = self._sends[ticket.ticket_id] = OutgoingTransfer(ticket, concurrent.futures.Future())
        return st

    # --- internals (loop thread; also called by TxPeer) --------------------------------------
    def _route(self, st: OutgoingTransfer) -> TxPeer:
        peer = self._peers.get(st.ticket.address)
        if peer is None or peer.closed:
            peer = self._peers[st.ticket.address] = TxPeer(self, st.ticket.address)
        st.peer = peer
        peer.sends[st.ticket.ticket_id] = st
        return peer

    def _enqueue(self, item: LayerItem | FinishItem | OpenItem) -> None:
        st = item.send
        if st.failed:
            if isinstance(item, LayerItem):
                item.drop()
                self.release_slot()
            return
        peer = st.peer if st.peer is not None and not st.peer.closed else self._route(st)
        peer.queue.put_nowait(item)

    def _abort(self, ticket: TransferTicket, err: TransferError) -> None:
        with self._lock:
            st = self._sends.get(ticket.ticket_id)
            if st is None:
                if ticket.ticket_id in self._ended:
                    return
                st = self._sends[ticket.ticket_id] = OutgoingTransfer(ticket, concurrent.futures.Future())
        if st.peer is None:
            self._route(st)  # never sent anything: connect just to tell the receiver
        self.fail(st, err, notify=True)

    def fail(self, st: OutgoingTransfer, err: TransferError, notify: bool = True) -> None:
        """First failure wins: unpin, resolve the future, and (``notify``) send ABORT to the receiver."""
        with self._lock:
            if st.state in (SendState.DONE, SendState.FAILED):
                return
            st.state, st.error = SendState.FAILED, err
            self._unpin(st)
        if st.finish_timer is not None:
            st.finish_timer.cancel()
        if st.lease is not None and not st.lease.done():
            st.lease.set_exception(err)
            st.lease.exception()  # retrieved here: the copy loop may no longer be waiting for it
        st.future.set_exception(err)
        resolve_future(st.opened, error=err)
        self._retire(st)
        peer = st.peer
        if notify and peer is not None and not peer.closed:
            if peer.ready:
                peer.spawn(peer.send_abort(st))
            else:
                peer.queue.put_nowait(AbortItem(st))
        log.info("kvtransfer: send of %s failed: %s", st.ticket.req_id, err)

    def complete(self, st: OutgoingTransfer, num_bytes_received: int) -> None:
        with self._lock:
            if st.state in (SendState.DONE, SendState.FAILED):
                return
            st.state = SendState.DONE
            self._unpin(st)
        if st.finish_timer is not None:
            st.finish_timer.cancel()
        st.future.set_result(SendResult(st.ticket.req_id, st.num_bytes, st.transport, st.started_at,
                                        time.monotonic()))
        resolve_future(st.opened, None)
        self._retire(st)

    def _unpin(self, st: OutgoingTransfer) -> None:
        """Under the lock: the source pages go back to the prefill pool exactly once."""
        if not st.unpinned:
            st.unpinned = True
            if st.pinned:  # the chunk's numpy ids when they are the pinned pages (the usual case): no conversion
                self.pool.allocator.decref(st.src_arr if st.pinned == st.src_head else st.pinned)

    def _retire(self, st: OutgoingTransfer) -> None:
        """Forget a finished transfer but remember its (resolved) future for late calls."""
        with self._lock:
            self._sends.pop(st.ticket.ticket_id, None)
            self._ended[st.ticket.ticket_id] = st.future
            while len(self._ended) > TOMBSTONES:
                self._ended.popitem(last=False)

    def finish_timed_out(self, st: OutgoingTransfer) -> None:
        self.fail(st, TransferError(FailReason.TIMEOUT, f"no DONE within finish_timeout_s="
                                    f"{self.config.finish_timeout_s}", st.ticket.req_id))

    def release_slot(self) -> None:
        self._slots.release()

    def peer_closed(self, peer: TxPeer, orphans: dict[str, tuple[str, str]]) -> None:
        """Loop thread: ``peer``'s connection is gone, leaving ``orphans`` (shm leases it never released).
        Their pages stay reserved at the receiver until it hears we stopped writing (every copy runs on
        this thread, so we have): reconnect soon to say so."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        if orphans:
            self._orphans.setdefault(peer.address, {}).update(orphans)
        if self._orphans.get(peer.address) and not self._closed:
            tries = self._release_tries.get(peer.address, 0)
            if tries >= self.config.release_retries:
                log.warning("kvtransfer: gave up telling %s:%d that %d shm transfers stopped (%d reconnects "
                            "failed); it frees those pages when this process exits", peer.address[0],
                            peer.address[1], len(self._orphans.pop(peer.address)), tries)
                self._release_tries.pop(peer.address, None)
                return
            self._release_tries[peer.address] = tries + 1
            delay = self.config.release_backoff_s * 2 ** tries
            peer.loop.call_later(delay, self._reconnect, peer.address)

    def _reconnect(self, address: tuple[str, int]) -> None:
        if self._closed or not self._orphans.get(address):
            return
        if address not in self._peers:
            self._peers[address] = TxPeer(self, address)

    def take_orphans(self, address: tuple[str, int], receiver_id: str) -> list[tuple[str, str]]:
        """Loop thread, on a new connection's handshake: the (req id, ticket id) pairs to release there
        (leases of an earlier instance of that receiver died with it and are dropped)."""
        self._release_tries.pop(address, None)
        orphans = self._orphans.pop(address, {})
        return [(req_id, tid) for tid, (req_id, rx) in orphans.items() if rx == receiver_id]

    async def _shutdown(self) -> None:
        with self._lock:
            pending = list(self._sends.values())
        for st in pending:
            self.fail(st, TransferError(FailReason.SHUTDOWN, "sender closed", st.ticket.req_id))
        # let the ABORTs just spawned go out first, on connections still being set up too (all at once: one
        # shared bound, under ``close``'s own)
        peers = list(self._peers.values())
        await asyncio.gather(*(p.flush(timeout_s=1.0, setup_s=SHUTDOWN_SETUP_WAIT_S) for p in peers))
        for peer in peers:
            await peer.aclose()
