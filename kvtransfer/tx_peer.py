# over 400 lines: one connection's handshake, transport choice, request writer and reader, which share its socket and send states; the send-state types live in tx_state.py, the frame writer in frame_writer.py.
"""The prefill side's connection to one receiver: handshake, transport choice, request writer and reader.

One ``TxPeer`` per receiver address multiplexes every request going there. Handshake,
reader and writer run on the sender's loop thread; the writer task drains one FIFO queue of
requests' items and turns them into frames, which its ``FrameWriter`` puts on the socket whole,
in order (``frame_writer.py``), so the frames of a request go out in the order ``send_layer``
was called and never interleave. Sending state per request (``SendState``)::

    QUEUED --first frame written--> STREAMING --FINISH written--> FINISHING --DONE--> DONE
       \\____________________________________________________________________/
         ABORT from the receiver, cancel, connection lost, timeout --> FAILED (source pages unpinned)
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from typing import Any, Protocol

import numpy as np
from engine.kvcache.pool import KVPool
from kvtransfer import auth
from kvtransfer.admission import RateLimitedLog
from kvtransfer.config import ChecksumKind, KVSenderConfig, TransportKind
from kvtransfer.errors import FailReason, ProtocolError, TransferError
from kvtransfer.frame_writer import FrameWriter
from kvtransfer.framing import read_frame, send_frame, tune_socket
from kvtransfer.payload import LayerCodec
from kvtransfer.protocol import (MAX_HEADER_BYTES, MAX_PAGES_PER_FRAME, PDSERVE_KV_PROTOCOL_VERSION, TRAILER,
                                 FrameType, check_compatible, checksum, encode_frame, pages_digest, peer_info)
from kvtransfer.mooncake import MooncakeEngine, MooncakeOffer, MooncakeTransport
from kvtransfer.shm import ShmAttachment, host_id, process_start_time
from kvtransfer.staging import is_staged
from kvtransfer.transport import KVTransport, ShmTransport, TcpTransport
from kvtransfer.tx_state import AbortItem, LayerItem, OpenItem, OutgoingTransfer, SendState, resolve_future

log = logging.getLogger(__name__)

RETRYABLE = frozenset({FailReason.BUSY, FailReason.TIMEOUT})
FLUSH_POLL_S = 0.005
"""How often a closing sender looks whether a connection's queued items went out (``TxPeer.flush``)."""
"""Receiver refusals (ERROR frames) worth another connect: its limits, a handshake it timed out."""

class SenderOwner(Protocol):
    """What a peer connection reads and calls on the sender that owns it (``kvtransfer.sender.KVSender``):
    a small contract instead of importing the owner back."""

    config: KVSenderConfig
    pool: KVPool
    retry_log: RateLimitedLog

    def fail(self, st: OutgoingTransfer, err: TransferError, notify: bool = True) -> None: ...

    def complete(self, st: OutgoingTransfer, num_bytes_received: int) -> None: ...

    def finish_timed_out(self, st: OutgoingTransfer) -> None: ...

    def release_slot(self) -> None: ...

    def peer_closed(self, peer: TxPeer, orphans: dict[str, tuple[str, str]]) -> None: ...

    def take_drop(self) -> bool: ...

    def mooncake_engine(self, host: str) -> MooncakeEngine: ...

    def take_orphans(self, address: tuple[str, int], receiver_id: str) -> list[tuple[str, str]]: ...


class TxPeer:
    def __init__(self, sender: SenderOwner, address: tuple[str, int]) -> None:
        self.sender = sender
        self.cfg = sender.config
        self.address = address
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sends: dict[str, OutgoingTransfer] = {}
        self.sock: socket.socket | None = None
        self.ready = False
        self.closed = False
        self.receiver_id = ""
        self.transport = TransportKind.TCP
        self.link: KVTransport = TcpTransport(sender.pool.layout, self.cfg.wire_dtype)
        """How payloads reach the receiver (``transport.py``), chosen at the handshake."""
        self.codec = self.link.codec
        self.writer: FrameWriter | None = None
        """Writes this connection's frames (``frame_writer.py``), made once the handshake is done."""
        self._reader: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.task = self.loop.create_task(self._run(), name=f"kvtransfer-peer-{address[0]}:{address[1]}")

    # --- connection ---------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._connect_retrying()
        except TransferError as err:
            self.fail(err)
            return
        except (OSError, asyncio.TimeoutError, ProtocolError) as e:
            self.fail(self._conn_error(e, "connecting to"))
            return
        self._reader = self.loop.create_task(self._read_forever())
        try:
            await self._release_orphans()
            await self._write_forever()
        except Exception as e:  # a bug must fail the transfers loudly, not leave them hanging
            log.exception("kvtransfer: writer for %s:%d crashed", *self.address)
            self.fail(TransferError(FailReason.INTERNAL, f"sender writer crashed: {type(e).__name__}: {e}"))

    def _conn_error(self, e: BaseException, doing: str) -> TransferError:
        where = f"{doing} receiver {self.address[0]}:{self.address[1]}"
        if isinstance(e, asyncio.TimeoutError):
            return TransferError(FailReason.TIMEOUT, f"{where} timed out")
        if isinstance(e, ProtocolError):
            return TransferError(e.reason, f"{where}: {e.detail}")
        return TransferError(FailReason.PEER_DIED, f"{where}: {type(e).__name__}: {e}")

    async def _connect_retrying(self) -> None:
        """Connect; a connection the receiver accepted and then refused (ERROR busy or timeout, or a reset /
        EOF from a receiver whose limits are full, see ``admission.py``) is retried with exponential backoff
        while some transfer queued here can still use it: until the latest ticket expiry, at most
        ``connect_retry_s``. Nothing listening (ECONNREFUSED: the worker is gone), a connect timeout, a wrong
        secret or layout are final, so the caller fails over at once."""
        cfg = self.cfg
        give_up_mono = time.monotonic() + cfg.connect_retry_s
        delay = cfg.connect_backoff_s
        for attempt in itertools.count(1):
            try:
                return await self._connect()
            except TransferError as e:
                if e.reason not in RETRYABLE:
                    raise
                err: BaseException = e
            except ConnectionRefusedError:
                raise
            except ConnectionError as e:
                err = e
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            expiry = max((st.ticket.expires_at_s for st in self.sends.values()), default=float("inf"))
            left = min(give_up_mono - time.monotonic(), expiry - time.time())
            if self.closed or left < delay:
                raise err
            self.sender.retry_log.warning(f"{self.address}", "kvtransfer: connecting to %s:%d failed (attempt %d: "
                                          "%s); retrying in %.2fs", self.address[0], self.address[1], attempt, err,
                                          delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, cfg.connect_backoff_max_s)

    async def _connect(self) -> None:
        cfg, loop = self.cfg, self.loop
        family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
        sock = self.sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        tune_socket(sock, cfg.socket_buffer_bytes)  # before connect: the window scale is fixed at SYN
        await asyncio.wait_for(loop.sock_connect(sock, self.address), cfg.connect_timeout_s)
        await asyncio.wait_for(self._handshake(), cfg.handshake_timeout_s)

    async def _expect(self, ftype: FrameType) -> dict[str, Any]:
        h = await read_frame(self.loop, self.sock, MAX_HEADER_BYTES)  # type: ignore[arg-type]
        if h.type is FrameType.ERROR:
            raise TransferError(FailReason.from_wire(h.fields["reason"]), f"receiver {self.address[0]}:"
                                f"{self.address[1]} refused us: {h.fields['detail']}")
        if h.type is not ftype:
            raise ProtocolError(FailReason.BAD_FRAME, f"expected {ftype.name}, got {h.type.name}")
        return h.fields

    async def _handshake(self) -> None:
        secret, loop, sock = self.cfg.cluster_secret, self.loop, self.sock
        nonce = auth.new_nonce()
        await send_frame(loop, sock, FrameType.HELLO, {"v": PDSERVE_KV_PROTOCOL_VERSION, "n": nonce})
        ch = await self._expect(FrameType.CHALLENGE)
        if not auth.check_proof(secret, auth.Role.RECEIVER, nonce, ch["n"], ch["p"]):
            raise TransferError(FailReason.AUTH_FAILED, f"receiver {self.address[0]}:{self.address[1]} could not "
                                "prove it holds our cluster secret")
        local = peer_info(self.sender.pool.layout.to_dict(), self.cfg.tp_size, self.cfg.kv_split, host_id=host_id(),
                          pid=os.getpid(),
                          pid_start=process_start_time(os.getpid()) or 0, wire=self.cfg.wire_dtype.value,
                          ck=self.cfg.checksum.value, sck=self.cfg.shm_checksum.value,
                          mc=self.cfg.transport is TransportKind.MOONCAKE)
        await send_frame(loop, sock, FrameType.AUTH,
                         {"p": auth.make_proof(secret, auth.Role.SENDER, nonce, ch["n"]), "info": local})
        info = (await self._expect(FrameType.READY))["info"]
        check_compatible(local, info)
        self.receiver_id = str(info.get("receiver_id"))
        self._choose_transport(info)
        self.writer = FrameWriter(loop, sock, self.cfg.send_timeout_s)
        self.ready = True

    def _choose_transport(self, info: dict[str, Any]) -> None:
        want, shm = self.cfg.transport, info.get("shm")
        if want is TransportKind.TCP:
            return
        if want is TransportKind.MOONCAKE:
            return self._choose_mooncake(info.get("mc"))
        if type(shm) is not dict:
            if want is TransportKind.SHM:
                log.warning("kvtransfer: shm forced but receiver %s:%d offers none (pool not shm-backed or "
                            "not the same host); using TCP", *self.address)
            return
        if want is TransportKind.AUTO and info.get("host_id") != host_id():
            return
        try:
            attachment = ShmAttachment(str(shm.get("name")), bytes(shm.get("nonce") or b""),
                                       self.sender.pool.layout, int(shm.get("num_pages") or 0))
        except (OSError, ValueError, TypeError) as e:
            log.warning("kvtransfer: shm setup with receiver %s:%d failed (%s); falling back to TCP",
                        self.address[0], self.address[1], e)
            return
        self.link, self.transport = ShmTransport(self.sender.pool.layout, attachment), TransportKind.SHM

    def _choose_mooncake(self, offer: Any) -> None:
        why = None
        if offer is None:
            why = "the receiver offers none (started without mooncake_protocol, or a device pool)"
        elif is_staged(self.sender.pool):
            why = "this pool is not host memory (a device or staged pool)"
        else:
            try:
                engine = self.sender.mooncake_engine(self.sock.getsockname()[0])  # type: ignore[union-attr]
                self.link = MooncakeTransport(self.sender.pool.layout, engine, self.sender.pool,
                                              MooncakeOffer.from_dict(offer))
            except (OSError, ValueError, TypeError, KeyError) as e:
                why = str(e)
        if why is not None:
            log.warning("kvtransfer: mooncake to receiver %s:%d unavailable (%s); using TCP", *self.address, why)
            return
        self.transport = TransportKind.MOONCAKE

    def fail(self, err: TransferError) -> None:
        """The connection is gone: fail everything routed through it and close."""
        if self.closed:
            return
        self.closed = True
        self.ready = False
        orphans = {tid: (st.ticket.req_id, st.ticket.receiver_id) for tid, st in self.sends.items()
                   if st.lease is not None and st.state is not SendState.DONE}
        self.sender.peer_closed(self, orphans)
        for st in list(self.sends.values()):
            self.sender.fail(st, err.for_request(st.ticket.req_id), notify=False)
        self.sends.clear()
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, LayerItem):
                item.drop()
                self.sender.release_slot()
            if item is not None:
                self.sender.fail(item.send, err.for_request(item.send.ticket.req_id), notify=False)
        self.queue.put_nowait(None)  # wake the writer so it exits
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader and a send thread blocked on it
            except OSError:
                pass
            reader, sock = self._reader, self.sock
            if reader is not None and not reader.done() and reader is not asyncio.current_task():
                reader.add_done_callback(lambda _: sock.close())  # the loop must unregister the fd first
            else:
                self.loop.call_soon(sock.close)
        if self.writer is not None:
            self.writer.close()
        log.info("kvtransfer: connection to %s:%d closed: %s", self.address[0], self.address[1], err)

    # --- writing -----------------------------------------------------------------------------
    async def _send(self, *bufs: bytes | memoryview, payload: tuple[memoryview, ...] = (),
                    kind: ChecksumKind = ChecksumKind.NONE) -> None:
        """One whole frame through the writer (``FrameWriter.send``)."""
        if self.closed or self.writer is None:
            raise ConnectionError("connection closed")
        await self.writer.send(*bufs, payload=payload, kind=kind)

    async def _release_orphans(self) -> None:
        """Tell the receiver that shm transfers whose connection was lost get no more writes from us
        (the ABORT_ACK a live connection would have sent): it frees their pages now."""
        for req_id, tid in self.sender.take_orphans(self.address, self.receiver_id):
            await self._send(encode_frame(FrameType.ABORT_ACK, {"rid": req_id, "tid": tid}))
            log.info("kvtransfer: released the shm lease of %s at %s:%d after a lost connection", req_id, *self.address)

    async def _write_forever(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            st = item.send
            try:
                if isinstance(item, AbortItem):
                    await self.send_abort(st)
                elif st.failed:
                    pass
                elif st.ticket.receiver_id != self.receiver_id:
                    self.sender.fail(st, TransferError(FailReason.UNKNOWN_REQUEST, "ticket was issued by another "
                                                       "receiver instance (restarted?)", st.ticket.req_id), False)
                elif isinstance(item, LayerItem):
                    item = self._restaged(item)
                    await self._write_layer(item)
                elif isinstance(item, OpenItem):
                    if self.link.one_sided and st.lease is None:
                        await self._request_lease(st)
                    if st.lease is None:
                        resolve_future(st.opened, None)
                else:
                    await self._write_finish(st, item.draft)
            except (OSError, asyncio.TimeoutError) as e:
                self.fail(self._conn_error(e, "writing to"))
                return
            finally:
                if isinstance(item, LayerItem):
                    self._release_after_writes(item)
                    self.sender.release_slot()

    def _chunks(self, codec: LayerCodec, ts: int, te: int) -> list[tuple[int, int]]:
        page = self.sender.pool.page_size
        step = max(1, min(self.cfg.max_frame_bytes // codec.bytes_per_token, (MAX_PAGES_PER_FRAME - 1) * page))
        return [(a, min(te, a + step)) for a in range(ts, te, step)]

    def _span_fields(self, st: OutgoingTransfer, layer: int, a: int, b: int) -> dict[str, Any]:
        span = st.ticket.page_span(a, b)
        return {"rid": st.ticket.req_id, "tid": st.ticket.ticket_id, "l": layer, "ts": a, "te": b,
                "pg": st.page_bytes[4 * span.start:4 * span.stop], "gn": st.gen_bytes[4 * span.start:4 * span.stop]}

    def _release_after_writes(self, item: LayerItem) -> None:
        """Give a layer's stage back once the send thread is past every frame queued so far (one FIFO
        thread: the last write done means all of them are), or now when none is queued."""
        if item.stage is None:
            return
        if self.writer is not None:
            self.writer.after_writes(item.drop)
        else:
            item.drop()

    async def _source(self, item: LayerItem) -> tuple[Any, np.ndarray]:
        """The pool to read ``item`` from and its pages: the sender's pool, or the item's host stage once
        its device copy has finished (waited for off the loop)."""
        if item.stage is None:
            return self.sender.pool, item.src_pages  # host memory, or a staged pool copying into shm pages
        if not item.stage.ready:
            await self.loop.run_in_executor(None, item.stage.wait)
        return item.stage, item.stage.page_map

    def _restaged(self, item: LayerItem) -> LayerItem:
        """A staged pool's layer queued unstaged (for direct copies into shm pages, ``KVSender._copies_direct``)
        that this connection must send some other way: stage it now."""
        stager = self.sender.stager
        if item.stage is not None or stager is None or self.link.kind is TransportKind.SHM:
            return item
        return item._replace(stage=stager.stage_out(item.layer, item.src_pages, item.token_start, item.token_end))

    async def _write_layer(self, item: LayerItem) -> None:
        st = item.send
        if self.link.one_sided:
            return await self._copy_layer_shm(item)
        pool, src_pages = await self._source(item)
        for a, b in self._chunks(self.codec, item.token_start, item.token_end):
            if st.failed:
                return
            views = self.link.payload_views(pool, item.layer, src_pages, a, b)
            nbytes, kind = self.codec.nbytes(b - a), self.cfg.checksum
            trailer = kind is not ChecksumKind.NONE
            header = encode_frame(FrameType.LAYER, {**self._span_fields(st, item.layer, a, b), "tr": trailer},
                                  nbytes + (TRAILER.size if trailer else 0))
            st.state = SendState.STREAMING
            await self._send(header, payload=tuple(views), kind=kind)
            await self._maybe_cut(st)
            st.num_bytes += nbytes

    async def _copy_layer_shm(self, item: LayerItem) -> None:
        st = item.send
        if st.lease is None:
            await self._request_lease(st)
        try:
            await asyncio.shield(st.lease)  # type: ignore[arg-type]
        except (TransferError, asyncio.CancelledError):
            return  # refused, timed out or aborted: st already failed
        pool, src_pages = await self._source(item)
        link, kind = self.link, self._one_sided_checksum()
        for a, b in self._chunks(link.codec, item.token_start, item.token_end):
            if st.failed:  # checked before every copy: after an ABORT we never touch the pages again
                return
            want = kind is not ChecksumKind.NONE
            if link.kind is TransportKind.SHM:  # a memory copy: on the loop thread, as before
                views = link.write_layer(pool, item.layer, src_pages, st.dst_pages, a, b, want)
            else:  # a network write: on the send thread, in order with the frames
                views = await self.writer.run_in_order(link.write_layer, pool, item.layer,  # type: ignore[union-attr]
                                                       src_pages, st.dst_pages, a, b, want)
            crc = checksum(kind, views)
            st.state = SendState.STREAMING
            await self._maybe_cut(st)
            st.num_bytes += link.codec.nbytes(b - a)
            await self._send(encode_frame(FrameType.SHM_LAYER, {**self._span_fields(st, item.layer, a, b), "crc": crc}))

    def _one_sided_checksum(self) -> ChecksumKind:
        """shm copies never leave this host's memory (``shm_checksum``, off by default); Mooncake writes
        cross a network, so they are checked like TCP payloads (``checksum``)."""
        return self.cfg.checksum if self.transport is TransportKind.MOONCAKE else self.cfg.shm_checksum

    async def _request_lease(self, st: OutgoingTransfer) -> None:
        """Send SHM_OPEN; the reader resolves ``st.lease`` on SHM_OPENED (or fails ``st``). Sent by the first
        layer or, earlier, by ``KVSender.open``, so that the round trip overlaps the first layer's compute."""
        st.transport = self.transport
        st.lease = self.loop.create_future()
        self.loop.call_later(self.cfg.handshake_timeout_s, self._lease_timed_out, st)
        await self._send(encode_frame(FrameType.SHM_OPEN, {"rid": st.ticket.req_id, "tid": st.ticket.ticket_id,
                                                           "dg": pages_digest(st.page_bytes, st.gen_bytes)}))

    def _lease_timed_out(self, st: OutgoingTransfer) -> None:
        if st.lease is not None and not st.lease.done():
            self.sender.fail(st, TransferError(FailReason.TIMEOUT, "shm lease not granted within "
                                               f"{self.cfg.handshake_timeout_s}s", st.ticket.req_id))

    async def _maybe_cut(self, st: OutgoingTransfer) -> None:
        """Fault injection: on a transfer's first frame, with a drop armed, shut the socket down under
        both our reader and writer, no ABORT sent: they (and the receiver) find out as from a real
        network failure, and every transfer on this connection takes its failure path. Frames already
        queued are written first, so the receiver has this transfer on the connection when it drops."""
        if st.num_bytes or not self.sender.take_drop():
            return
        await self.writer.drain()  # type: ignore[union-attr]  # made by the handshake, before any transfer
        log.warning("kvtransfer: fault injection: dropping the connection to %s:%d during %s", self.address[0],
                    self.address[1], st.ticket.req_id)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        except OSError:
            pass

    async def _write_finish(self, st: OutgoingTransfer, draft: bytes | None) -> None:
        crc = None if draft is None else checksum(self.cfg.checksum, [memoryview(draft)])
        await self._send(encode_frame(FrameType.FINISH, {"rid": st.ticket.req_id, "tid": st.ticket.ticket_id,
                                                         "nt": st.ticket.num_tokens, "dh": draft, "dc": crc}))
        if not st.failed:
            st.state = SendState.FINISHING
            st.finish_timer = self.loop.call_later(self.cfg.finish_timeout_s, self.sender.finish_timed_out, st)

    async def send_abort(self, st: OutgoingTransfer) -> None:
        err = st.error or TransferError(FailReason.CANCELLED)
        if self.ready and not self.closed:
            await self._send(encode_frame(FrameType.ABORT, {"rid": st.ticket.req_id, "tid": st.ticket.ticket_id,
                                                            "reason": err.reason.value, "detail": err.detail[:1000]}))
        self.sends.pop(st.ticket.ticket_id, None)

    def spawn(self, coro: Any) -> None:
        """Run a small write (ABORT, ABORT_ACK) as a tracked task; a failure closes the connection."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(self._conn_error(task.exception(), "writing to"))  # type: ignore[arg-type]

    async def flush(self, timeout_s: float, setup_s: float = 0.0) -> None:
        """Wait at most ``timeout_s`` for the small writes in flight (ABORT, ABORT_ACK). A connection still being
        set up gets up to ``setup_s`` more: its queue holds what was routed to it meanwhile, the ABORT of a
        transfer cancelled before the handshake finished included, and closing it then would drop that ABORT
        (the receiver would hold the reservation until its ticket expired; seen in CI as a Mooncake test whose
        set-up outlasted the sender's 1 s shutdown grace)."""
        end = self.loop.time() + timeout_s + (0.0 if self.ready else setup_s)
        while not self.closed and not self.queue.empty() and self.loop.time() < end:
            await asyncio.sleep(FLUSH_POLL_S)
        pending = [*self._tasks, *(self.writer.pending if self.writer is not None else ())]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, end - self.loop.time()))

    async def aclose(self) -> None:
        """Close the connection and wait for our tasks (sender shutdown)."""
        self.fail(TransferError(FailReason.SHUTDOWN, "sender closed"))
        me = asyncio.current_task()
        tasks = [t for t in (self.task, self._reader, *self._tasks) if t is not None and t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- reading -----------------------------------------------------------------------------
    async def _read_forever(self) -> None:
        try:
            while True:
                h = await read_frame(self.loop, self.sock, MAX_HEADER_BYTES)  # type: ignore[arg-type]
                self._on_frame(h.type, h.fields)
        except asyncio.CancelledError:
            raise
        except (OSError, ConnectionError, ProtocolError) as e:
            self.fail(self._conn_error(e, "reading from"))
        except TransferError as e:
            self.fail(e)

    def _on_frame(self, ftype: FrameType, f: dict[str, Any]) -> None:
        if ftype is FrameType.ERROR:
            raise TransferError(FailReason.from_wire(f["reason"]), f"receiver closed the connection: {f['detail']}")
        st = self.sends.get(f.get("tid", ""))
        if st is None:
            return  # a late reply for a transfer we already gave up
        if ftype is FrameType.DONE:
            self.sender.complete(st, f["nb"])
            self.sends.pop(st.ticket.ticket_id, None)
        elif ftype is FrameType.SHM_OPENED:
            if st.lease is not None and not st.lease.done():
                st.lease.set_result(None)
                resolve_future(st.opened, None)
        elif ftype is FrameType.ABORT:
            err = TransferError(FailReason.from_wire(f["reason"]), f"receiver aborted: {f['detail']}",
                                st.ticket.req_id)
            leased = st.lease is not None
            self.sender.fail(st, err, notify=False)
            if leased:  # we are between copies (this runs on the loop thread): promise no more writes
                self.spawn(self._send(encode_frame(FrameType.ABORT_ACK, {"rid": st.ticket.req_id,
                                                                       "tid": st.ticket.ticket_id})))
            self.sends.pop(st.ticket.ticket_id, None)
        else:
            raise ProtocolError(FailReason.BAD_FRAME, f"unexpected {ftype.name} from receiver")
