"""Decode side of the data plane: reserve pages, accept pushes into them, hand them over complete.

Typical use in a decode worker (all on the receiver's event loop, except ``reserve`` and
``cancel`` which are thread-safe)::

    receiver = KVReceiver(pool, KVReceiverConfig(host=..., port=...))
    await receiver.start()
    ticket = receiver.reserve(req_id, num_prompt_tokens)   # NO_CAPACITY raises here, at once
    ... send ticket.to_dict() to the prefill worker (router / gRPC) ...
    result = await receiver.wait_complete(req_id, timeout_s=30)  # TransferResult, or TransferError
    ... decode with result.page_ids (now owned by req_id; decref them when the request ends) ...

The receiver owns the write side of the pool: nothing else writes a page while it is
reserved. A reaper enforces ticket expiry, stall and claim timeouts and frees the pages of
failed transfers (after any shm writer is provably done, see ``shm.py``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import socket
import time
from typing import NamedTuple

from engine.kvcache.pool import KVPool
from kvtransfer.admission import ConnectionGate, RateLimitedLog
from kvtransfer.config import KVReceiverConfig
from kvtransfer.errors import FailReason, TransferError
from kvtransfer.framing import tune_socket
from kvtransfer.protocol import peer_info
from kvtransfer.mooncake import MooncakeEngine, MooncakeOffer, offer_for
from kvtransfer.rx_conn import RxConnection
from kvtransfer.shm import ShmKVPool, host_id
from kvtransfer.staging import Stager, is_staged, release_all
from kvtransfer.ticket import Reservation, ReservationManager, TransferResult, TransferState, TransferTicket

log = logging.getLogger(__name__)

CRC_THREADS = 2
"""Threads verifying payload checksums while connections keep receiving."""


class ReceiverStats(NamedTuple):
    num_connections: int
    num_active: int
    """Reservations not yet claimed or failed."""
    num_draining: int
    """Failed reservations whose pages wait for a shm writer to be provably done."""
    num_reserved_pages: int
    num_completed: int
    num_failed: int
    num_rejected_frames: int
    num_unauthenticated: int = 0
    """Connections still in the handshake (``admission.py``)."""
    num_rate_limited: int = 0
    """Connections closed at once: their host opened more than ``unauth_rate_per_s``."""
    num_evicted: int = 0
    """Handshakes closed to make room for a newer one (``max_unauthenticated``)."""


class KVReceiver:
    def __init__(self, pool: KVPool, config: KVReceiverConfig | None = None) -> None:
        self.pool = pool
        self.stager = Stager(pool) if is_staged(pool) else None
        """A device (or ``force_staged``) pool's pages arrive through pinned host stages (``staging.py``)."""
        if self.stager is not None and isinstance(pool, ShmKVPool):
            raise ValueError("a shm-backed pool is host memory already: it cannot be force_staged")
        self.config = config or KVReceiverConfig()
        self.receiver_id = secrets.token_hex(8)
        self.local_info = peer_info(pool.layout.to_dict(), self.config.tp_size, self.config.kv_split,
                                    receiver_id=self.receiver_id, host_id=host_id())
        self.connections: set[RxConnection] = set()
        cfg = self.config
        self.gate: ConnectionGate[RxConnection] = ConnectionGate(cfg.max_connections, cfg.max_unauthenticated,
                                                                 cfg.unauth_rate_per_s, cfg.unauth_burst)
        self.prelog = RateLimitedLog(log, cfg.log_interval_s)
        """Warnings about connections that have not authenticated: one line per kind and interval."""
        self.manager: ReservationManager | None = None  # type: ignore[assignment]
        self.num_completed = 0
        self.num_failed = 0
        self.num_rejected_frames = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._reaper: asyncio.Task | None = None
        self._address: tuple[str, int] | None = None
        self._warned_draining: set[str] = set()
        self.crc_pool = concurrent.futures.ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="kvtransfer-crc")
        self.mooncake: MooncakeEngine | None = None
        self.mooncake_offer: MooncakeOffer | None = None
        """What READY tells senders that ask for Mooncake writes (``config.mooncake_protocol``)."""

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind and listen on the running loop (refuses non-loopback without a secret: see config)."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock, cfg.socket_buffer_bytes)  # accepted sockets inherit the buffer sizes
        sock.bind((cfg.host, cfg.port))
        sock.listen(128)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        self._address = (cfg.ticket_host, port)
        self.manager = ReservationManager(self.pool, host=cfg.ticket_host, port=port, receiver_id=self.receiver_id,
                                          ticket_ttl_s=cfg.ticket_ttl_s, max_reserved_pages=cfg.max_reserved_pages,
                                          draft=cfg.draft)
        self._start_mooncake()
        self._server = await self._loop.create_server(lambda: RxConnection(self).reader, sock=sock)
        self._reaper = self._loop.create_task(self._reap_forever(), name="kvtransfer-reaper")
        log.info("kvtransfer: receiver %s listening on %s:%d", self.receiver_id, cfg.host, port)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let running transfers finish for ``grace_s``, then fail the rest (SHUTDOWN)."""
        if self._server is None:
            return
        self._server.close()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(r.state is TransferState.RECEIVING for r in self.manager.active()):
            await asyncio.sleep(0.02)
        for res in self.manager.active():
            self.fail(res, TransferError(FailReason.SHUTDOWN, "receiver stopped", res.req_id))
        self._reap_draining()
        for conn in list(self.connections):
            conn.close()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        self._server = None
        self.crc_pool.shutdown(wait=False)
        if self.mooncake is not None and not self.manager.draining():
            self.mooncake.close()  # with a writer still draining, its registration outlives us instead
        if self.manager.draining():
            log.warning("kvtransfer: stopped with %d reservations still draining (a shm writer is alive)",
                        len(self.manager.draining()))

    def _start_mooncake(self) -> None:
        """Register the pool with a Mooncake engine when asked to; a failure (library missing, device pool)
        is one WARNING and senders use TCP."""
        protocol = self.config.mooncake_protocol
        if protocol is None:
            return
        if self.stager is not None:
            log.warning("kvtransfer: mooncake not offered: the pool is not host memory (device pools need a GPU "
                        "build of the transfer engine); senders use TCP")
            return
        try:
            self.mooncake = MooncakeEngine(self.config.ticket_host, protocol)
            self.mooncake_offer = offer_for(self.mooncake, self.pool)
        except (OSError, ValueError) as e:
            log.warning("kvtransfer: mooncake not offered (%s); senders use TCP", e)
            if self.mooncake is not None:
                self.mooncake.close()
            self.mooncake = None
            return
        log.info("kvtransfer: mooncake %s writes offered at %s", protocol, self.mooncake.session)

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("KVReceiver.start() has not run")
        return self._address

    # --- decode worker API -------------------------------------------------------------------
    def reserve(self, req_id: str, num_tokens: int) -> TransferTicket:
        """Reserve pages for ``num_tokens`` and issue a ticket. Thread-safe; raises
        ``TransferError(NO_CAPACITY)`` immediately when they do not fit."""
        if self.manager is None:
            raise RuntimeError("KVReceiver.start() has not run")
        return self.manager.reserve(req_id, num_tokens)

    async def wait_complete(self, req_id: str, timeout_s: float) -> TransferResult:
        """Wait until every layer arrived and was verified; the pages then belong to ``req_id``.

        On timeout the transfer is abandoned (pages freed, sender told) and
        ``TransferError(TIMEOUT)`` raised; if the awaiting task is cancelled the transfer is
        cancelled on both sides. Must run on the receiver's loop.
        """
        res = self.manager.get(req_id)
        if res is None:
            raise self.manager.recent_failure(req_id) or TransferError(FailReason.UNKNOWN_REQUEST,
                                                                        "no reservation", req_id)
        if res.state is not TransferState.COMPLETE:
            if res.waiter is None:
                res.waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(res.waiter), timeout_s)
            except asyncio.TimeoutError:
                err = TransferError(FailReason.TIMEOUT, f"not complete within {timeout_s}s", req_id)
                self.fail(res, err)
                raise err from None
            except asyncio.CancelledError:
                self.fail(res, TransferError(FailReason.CANCELLED, "the waiting decode request was cancelled",
                                             req_id))
                raise
        self.num_completed += 1
        return self.manager.claim(res)

    def cancel(self, req_id: str, detail: str = "cancelled by the decode worker") -> None:
        """Abort ``req_id``'s transfer: free its pages, tell the sender. Thread-safe, idempotent."""
        if self._loop is None:
            return
        if self._in_loop():
            self._cancel_now(req_id, detail)
        else:
            self._loop.call_soon_threadsafe(self._cancel_now, req_id, detail)

    def poll(self, req_id: str) -> TransferState | None:
        """Non-blocking state (for a synchronous scheduler); None for an unknown request."""
        res = self.manager.get(req_id) if self.manager else None
        if res is not None:
            return res.state
        return TransferState.FAILED if self.manager and self.manager.recent_failure(req_id) else None

    def stats(self) -> ReceiverStats:
        m = self.manager
        return ReceiverStats(len(self.connections), len(m.active()) if m else 0, len(m.draining()) if m else 0,
                             m.num_reserved_pages if m else 0, self.num_completed, self.num_failed,
                             self.num_rejected_frames, len(self.gate.unauthenticated), self.gate.num_rate_limited,
                             self.gate.num_evicted)

    # --- called by connections and the reaper (loop thread) ----------------------------------
    def fail(self, res: Reservation, err: TransferError, notify: bool = True) -> None:
        """Fail one reservation: stop writing into it, free (or drain) its pages, tell both sides."""
        conn = res.conn
        if conn is not None and conn.current is res:
            conn.reader.discard_current()  # no further byte of the in-flight payload reaches its pages
        release_all(res.stages)  # device copies into the pages end before the pages can be freed
        res.stages.clear()
        if not self.manager.fail(res, err):
            return
        self.num_failed += 1
        if notify and conn is not None and not conn.closed:
            conn.send_abort(res, err)
        if res.waiter is not None and not res.waiter.done():
            res.waiter.set_exception(err)
        log.info("kvtransfer: transfer %s failed: %s", res.req_id, err)

    def complete(self, res: Reservation) -> None:
        self.manager.complete(res)
        if res.waiter is not None and not res.waiter.done():
            res.waiter.set_result(None)

    def layer_received(self, res: Reservation, layer: int, token_end: int, nbytes: int) -> None:
        now = time.monotonic()
        res.received_upto[layer] = max(res.received_upto[layer], token_end)  # checks may finish out of order
        res.num_bytes += nbytes
        res.last_progress = now
        if res.received_upto[layer] == res.ticket.num_tokens and not res.layer_done_at[layer]:
            res.layer_done_at[layer] = now

    def connection_lost(self, conn: RxConnection, exc: Exception | None) -> None:
        for res in self.manager.active():
            if res.conn is conn and res.state in (TransferState.RESERVED, TransferState.RECEIVING):
                why = f"connection from {conn.peer} lost" + (f": {exc}" if exc else "")
                self.fail(res, TransferError(FailReason.PEER_DIED, why, res.req_id), notify=False)
        self._reap_draining()

    # --- internals ---------------------------------------------------------------------------
    def _in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _cancel_now(self, req_id: str, detail: str) -> None:
        res = self.manager.get(req_id)
        if res is not None:
            self.fail(res, TransferError(FailReason.CANCELLED, detail, req_id))

    def _reap_draining(self) -> None:
        for res in self.manager.draining():
            w = res.shm_writer
            if w is None or (w.closed and not w.may_still_write()):
                self.manager.drained(res)
                self._warned_draining.discard(res.ticket.ticket_id)
            elif w.closed and res.ticket.ticket_id not in self._warned_draining:
                self._warned_draining.add(res.ticket.ticket_id)
                log.warning("kvtransfer: %d pages of %s stay reserved until shm writer pid %d exits (it lost its "
                            "connection without acknowledging the abort)", len(res.ticket.page_ids), res.req_id,
                            w.peer_pid)

    async def _reap_forever(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.reap_interval_s)
            try:
                for res, err in self.manager.due(time.monotonic(), cfg.stall_timeout_s, cfg.claim_timeout_s):
                    self.fail(res, err)
                self._reap_draining()
            except Exception:  # the reaper must outlive any single bad record
                log.exception("kvtransfer: reaper iteration failed")
