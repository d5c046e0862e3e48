# over 400 lines: one receiving connection: handshake, every frame handler and the checksum offload share its state.
"""One sender's connection on the decode side: handshake, then frame validation and placement.

Connection states (``ConnState``)::

    HELLO --HELLO ok--> AUTH --proof + layout ok--> READY --lost/closed--> CLOSED
      \\________________ bad frame, wrong secret, incompatible, timeout ____/  (ERROR frame, close)

Before READY a peer may send only small payload-free frames (``PREAUTH_MAX_HEADER_BYTES``).
In READY every request frame is checked in this order, and the first failed check decides
what happens:

1. the request and ticket exist (else the frame alone is rejected: ABORT back to the
   sender, no reservation touched -- this is the "frame for a freed page" path);
2. the reservation is bound to this connection (the first frame binds it);
3. layer, token range (in order per layer), page ids and generation counters match the
   reservation, the payload size matches the layout, a checksum is present when required;
   on the first frame and again at FINISH the allocator itself must agree that every page
   is still ours at the reserved generation -- else the *reservation* fails and is freed;
4. after the payload arrived, its checksum (a TCP payload's is computed piece by piece as it
   lands and compared with the trailer that ends the payload; a large shm copy's on a CRC
   thread, overlapping the next frame, and FINISH waits for those) -- else the reservation
   fails (CORRUPT).

A payload is written only into pages of the reservation it names, and only while that
reservation is RECEIVING: if it fails mid-payload the rest is discarded, and staged
payloads are scattered into the pages only after their checksum passed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from engine.kvcache.pool import KVPool, PageError
from kvtransfer import auth
from kvtransfer.admission import ConnectionGate, RateLimitedLog
from kvtransfer.config import ChecksumKind, KVReceiverConfig, TransportKind, WireDType
from kvtransfer.errors import FailReason, ProtocolError, TransferError
from kvtransfer.framing import FrameReader, PayloadSink, tune_socket
from kvtransfer.payload import LayerCodec
from kvtransfer.protocol import (MAX_HEADER_BYTES, PDSERVE_KV_PROTOCOL_VERSION, PREAUTH_MAX_HEADER_BYTES,
                                 TRAILER, FrameType, Header, check_compatible, checksum, encode_frame,
                                 new_digest, pages_digest)
from kvtransfer.shm import ShmKVPool, pid_alive
from kvtransfer.mooncake import MooncakeOffer
from kvtransfer.staging import Stager, release_all
from kvtransfer.ticket import Reservation, ReservationManager, TransferState

log = logging.getLogger(__name__)

OFFLOAD_CRC_BYTES = 256 * 1024
"""shm copies at least this large are checksummed on a CRC thread while the next frame arrives."""


class ConnState(enum.Enum):
    HELLO = "hello"
    AUTH = "auth"
    READY = "ready"
    CLOSED = "closed"


class ReceiverOwner(Protocol):
    """What a connection reads and calls on the receiver that owns it (``kvtransfer.receiver.KVReceiver``):
    a small contract instead of importing the owner back."""

    config: KVReceiverConfig
    pool: KVPool
    stager: Stager | None
    manager: ReservationManager
    gate: ConnectionGate
    prelog: RateLimitedLog
    connections: set
    local_info: dict[str, Any]
    crc_pool: concurrent.futures.ThreadPoolExecutor
    mooncake_offer: MooncakeOffer | None
    num_rejected_frames: int

    def fail(self, res: Reservation, err: TransferError, notify: bool = True) -> None: ...

    def complete(self, res: Reservation) -> None: ...

    def layer_received(self, res: Reservation, layer: int, token_end: int, nbytes: int) -> None: ...

    def connection_lost(self, conn: RxConnection, exc: Exception | None) -> None: ...


class RxConnection:
    def __init__(self, rx: ReceiverOwner) -> None:
        self.rx = rx
        self.cfg = rx.config
        self.state = ConnState.HELLO
        self.reader = FrameReader(self)
        self.max_header = PREAUTH_MAX_HEADER_BYTES
        self.max_payload = 0
        self.peer = "?"
        self.sender_nonce = b""
        self.receiver_nonce = auth.new_nonce()
        self.codec: LayerCodec | None = None
        self.shm_codec = LayerCodec(rx.pool.layout, WireDType.NATIVE)
        self.shm_ok = False
        self.mc_ok = False
        """This connection's sender asked for, and was offered, Mooncake writes (its lease frames are then
        Mooncake's, not shm's)."""
        self.peer_local = False
        """The sender runs on this host, in our pid namespace: its liveness can be checked (``pid_alive``)."""
        self.closed_at = 0.0
        self.peer_pid = -1
        self.ck, self.sck = ChecksumKind.CRC32, ChecksumKind.NONE
        """Checksum kinds the sender announced (TCP payloads, shm copies)."""
        self.peer_start = -1
        self.current: Reservation | None = None
        """The reservation whose payload is arriving right now."""
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._verifying = 0
        self._deferred_finish: dict[str, Any] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def closed(self) -> bool:
        return self.state is ConnState.CLOSED

    # --- FrameHandler ------------------------------------------------------------------------
    def on_connected(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock, self.cfg.socket_buffer_bytes)
        admitted, victim = self.rx.gate.admit(self, peer[0] if peer else "?")
        if not admitted:
            self.rx.prelog.warning("rate", "kvtransfer: refusing a connection from %s: more than %s new "
                                   "connections per second from that host (unauth_rate_per_s)", self.peer,
                                   self.cfg.unauth_rate_per_s)
            self.state = ConnState.CLOSED
            transport.write(encode_frame(FrameType.ERROR, {"reason": FailReason.BUSY.value,
                                                           "detail": "too many new connections from your host"}))
            transport.close()
            return
        self.rx.connections.add(self)
        if victim is not None:
            victim.close(FailReason.BUSY, f"{self.cfg.max_unauthenticated} connections in the handshake "
                         "(max_unauthenticated): closed the oldest to make room")
        self._timer = asyncio.get_running_loop().call_later(self.cfg.handshake_timeout_s, self._handshake_timeout)

    def on_lost(self, exc: Exception | None) -> None:
        was_open = self.state is not ConnState.CLOSED
        self.state = ConnState.CLOSED
        self.closed_at = time.monotonic()
        if self._timer is not None:
            self._timer.cancel()
        self.rx.gate.remove(self)
        if was_open or self in self.rx.connections:
            self.rx.connections.discard(self)
            self.rx.connection_lost(self, exc)
        self._staging = torch.empty(0, dtype=torch.uint8)  # may be MBs: not held until the cyclic collector runs

    def on_bad_header(self, err: ProtocolError, payload_len: int) -> bool:
        if self.state is not ConnState.READY:
            return False
        self.rx.num_rejected_frames += 1
        log.warning("kvtransfer: rejected frame from %s: %s", self.peer, err)
        return True

    def on_fatal(self, err: ProtocolError) -> None:
        self.rx.num_rejected_frames += 1
        self._warn_closing(err.reason, str(err))
        self.send(FrameType.ERROR, {"reason": err.reason.value, "detail": err.detail})

    def on_frame(self, header: Header, payload_len: int) -> PayloadSink | None:
        if self.state is ConnState.HELLO:
            self._on_hello(header)
            return None
        if self.state is ConnState.AUTH:
            self._on_auth(header)
            return None
        return self._dispatch(header.type, header.fields, payload_len)

    def _dispatch(self, ftype: FrameType, f: dict[str, Any], payload_len: int) -> PayloadSink | None:
        handler = self._handlers.get(ftype)
        if handler is None:
            self.rx.num_rejected_frames += 1
            log.warning("kvtransfer: unexpected %s frame from %s", ftype.name, self.peer)
            return PayloadSink.trash(payload_len) if payload_len else None
        try:
            return handler(self, f, payload_len)
        except ProtocolError as err:  # the frame names no reservation of ours: reject only the frame
            self.rx.num_rejected_frames += 1
            log.info("kvtransfer: rejected %s for %s from %s: %s", ftype.name, f.get("rid"), self.peer, err)
            if ftype is not FrameType.ABORT:
                self.send(FrameType.ABORT, {"rid": f["rid"], "tid": f["tid"], "reason": err.reason.value,
                                            "detail": err.detail})
            return PayloadSink.trash(payload_len) if payload_len else None

    # --- output ------------------------------------------------------------------------------
    def send(self, ftype: FrameType, fields: dict[str, Any]) -> None:
        t = self.reader.transport
        if t is not None and not t.is_closing():
            t.write(encode_frame(ftype, fields))

    def send_abort(self, res: Reservation, err: TransferError) -> None:
        self.send(FrameType.ABORT, {"rid": res.req_id, "tid": res.ticket.ticket_id, "reason": err.reason.value,
                                    "detail": err.detail[:1000]})

    def close(self, reason: FailReason | None = None, detail: str = "") -> None:
        if reason is not None:
            self._warn_closing(reason, f"{reason.value}: {detail}")
            self.send(FrameType.ERROR, {"reason": reason.value, "detail": detail[:1000]})
        self.reader.close()

    def _warn_closing(self, reason: FailReason, why: str) -> None:
        """Authenticated peers get a line each; handshakes (anyone can open those) one line per interval."""
        if self.state is ConnState.READY:
            log.warning("kvtransfer: closing connection from %s: %s", self.peer, why)
        else:
            self.rx.prelog.warning(f"handshake-{reason.value}", "kvtransfer: closing connection from %s before it "
                                   "authenticated: %s", self.peer, why)

    def _handshake_timeout(self) -> None:
        if self.state in (ConnState.HELLO, ConnState.AUTH):
            self.close(FailReason.TIMEOUT, f"no handshake within {self.cfg.handshake_timeout_s}s")

    # --- handshake ---------------------------------------------------------------------------
    def _on_hello(self, h: Header) -> None:
        if h.type is not FrameType.HELLO:
            return self.close(FailReason.BAD_FRAME, f"expected HELLO, got {h.type.name}")
        if h.fields["v"] != PDSERVE_KV_PROTOCOL_VERSION:
            return self.close(FailReason.INCOMPATIBLE, f"protocol version {h.fields['v']} != receiver's "
                              f"{PDSERVE_KV_PROTOCOL_VERSION}")
        self.sender_nonce = h.fields["n"]
        proof = auth.make_proof(self.cfg.cluster_secret, auth.Role.RECEIVER, self.sender_nonce, self.receiver_nonce)
        self.send(FrameType.CHALLENGE, {"n": self.receiver_nonce, "p": proof})
        self.state = ConnState.AUTH

    def _on_auth(self, h: Header) -> None:
        if h.type is not FrameType.AUTH:
            return self.close(FailReason.BAD_FRAME, f"expected AUTH, got {h.type.name}")
        if not auth.check_proof(self.cfg.cluster_secret, auth.Role.SENDER, self.sender_nonce, self.receiver_nonce,
                                h.fields["p"]):
            return self.close(FailReason.AUTH_FAILED, "the sender's proof does not match this receiver's cluster "
                              "secret")
        info = h.fields["info"]
        try:
            check_compatible(self.rx.local_info, info)
            wire = WireDType(info.get("wire"))
            # the sender's checksum kinds for TCP payloads and shm copies; a sender that omits them gets the
            # protocol's defaults, crc32 and none (pdserve's own senders always announce both)
            self.ck, self.sck = ChecksumKind(info.get("ck", "crc32")), ChecksumKind(info.get("sck", "none"))
            pid, start = info.get("pid"), info.get("pid_start")
            if type(pid) is not int or type(start) is not int:
                raise ValueError("pid")
        except TransferError as e:
            return self.close(FailReason.INCOMPATIBLE, e.detail)
        except ValueError as e:
            return self.close(FailReason.BAD_FRAME, f"bad AUTH info field: {e}")
        if not self.rx.gate.authenticate(self):
            return self.close(FailReason.BUSY, f"{self.cfg.max_connections} authenticated connections open "
                              "(max_connections)")
        self.codec = LayerCodec(self.rx.pool.layout, wire)
        self.peer_pid, self.peer_start = pid, start
        # shm only when we can later tell whether the writer process is still alive (same host + pid ns)
        pool = self.rx.pool
        self.peer_local = pid_alive(pid, start)
        offer = self.rx.mooncake_offer
        self.mc_ok = offer is not None and info.get("mc") is True
        self.shm_ok = isinstance(pool, ShmKVPool) and self.cfg.offer_shm and self.peer_local and not self.mc_ok
        shm = ({"name": pool.segment_name, "nonce": pool.nonce, "num_pages": pool.num_pages}
               if self.shm_ok else None)
        self.state = ConnState.READY
        self.max_header, self.max_payload = MAX_HEADER_BYTES, self.cfg.max_frame_bytes
        if self._timer is not None:
            self._timer.cancel()
        mc = offer.to_dict() if self.mc_ok else None  # type: ignore[union-attr]
        self.send(FrameType.READY, {"info": {**self.rx.local_info, "shm": shm, "mc": mc}})
        log.info("kvtransfer: %s authenticated (wire %s, shm %s)", self.peer, wire.value, self.shm_ok)

    # --- request frames ----------------------------------------------------------------------
    def _owned(self, f: dict[str, Any]) -> Reservation:
        res = self.rx.manager.lookup(f["rid"], f["tid"])
        if res.conn is not None and res.conn is not self:
            raise ProtocolError(FailReason.BAD_FRAME, "request is bound to another connection")
        return res

    def _check_span(self, res: Reservation, f: dict[str, Any]) -> None:
        t = res.ticket
        layer, ts, te = f["l"], f["ts"], f["te"]
        if layer >= t.layout.num_layers:
            raise ProtocolError(FailReason.BAD_FRAME, f"layer {layer} >= num_layers {t.layout.num_layers}")
        if not 0 <= ts < te <= t.num_tokens:
            raise ProtocolError(FailReason.BAD_FRAME, f"tokens [{ts}, {te}) outside [0, {t.num_tokens})")
        if ts != res.queued_upto[layer]:
            raise ProtocolError(FailReason.BAD_FRAME, f"layer {layer}: expected token {res.queued_upto[layer]}, "
                                f"got {ts} (frames of a layer must arrive in order)")
        span = t.page_span(ts, te)
        if f["pg"] != res.page_bytes[4 * span.start:4 * span.stop] or \
                f["gn"] != res.gen_bytes[4 * span.start:4 * span.stop]:
            raise ProtocolError(FailReason.STALE_PAGE, f"pages/generations for tokens [{ts}, {te}) do not match "
                                "the reservation")
        if res.conn is None:  # first frame: the pool itself must still agree (again before COMPLETE)
            self._check_pool(res)

    def _check_pool(self, res: Reservation) -> None:
        """The allocator still has every page at the reserved generation (guards against a page of
        ours being freed behind our back; frames are checked against the reservation's copy)."""
        try:
            self.rx.pool.allocator.check(res.page_arr, np.frombuffer(res.gen_bytes, dtype="<u4"))
        except PageError as e:
            raise ProtocolError(FailReason.STALE_PAGE, str(e)) from None

    def _start(self, res: Reservation) -> None:
        res.conn = self
        res.last_progress = time.monotonic()
        if res.state is TransferState.RESERVED:
            res.state = TransferState.RECEIVING

    def _fail_res(self, res: Reservation, err: ProtocolError, payload_len: int = 0) -> PayloadSink | None:
        self.rx.num_rejected_frames += 1
        if res.conn is None:
            res.conn = self  # so the ABORT goes back to whoever sent the bad frame
        self.rx.fail(res, TransferError(err.reason, err.detail, res.req_id))
        return PayloadSink.trash(payload_len) if payload_len else None

    def _on_layer(self, f: dict[str, Any], payload_len: int) -> PayloadSink | None:
        res = self._owned(f)
        try:
            if res.shm_writer is not None:
                raise ProtocolError(FailReason.BAD_FRAME, "TCP layer frame for a request leased over shm")
            self._check_span(res, f)
            trailer = TRAILER.size if f["tr"] else 0
            need = self.codec.nbytes(f["te"] - f["ts"]) + trailer  # type: ignore[union-attr]
            if payload_len != need:
                raise ProtocolError(FailReason.BAD_FRAME, f"payload {payload_len} bytes, layout needs {need}")
            if not trailer and self.cfg.require_checksum:
                raise ProtocolError(FailReason.BAD_FRAME, "payload without checksum (require_checksum=True)")
            if trailer and self.ck is ChecksumKind.NONE:
                raise ProtocolError(FailReason.BAD_FRAME, "checksum trailer, but the handshake announced none")
        except ProtocolError as err:
            return self._fail_res(res, err, payload_len)
        self._start(res)
        res.queued_upto[f["l"]] = f["te"]
        views, finalize = self._sink(res, f["l"], f["ts"], f["te"])
        self.current = res
        if not trailer:
            return PayloadSink(views, lambda: self._verify(res, f, views, finalize, payload_len, None))
        # the checksum runs over each piece as it lands (cache-hot), not over the whole payload afterwards
        digest, tail = new_digest(self.ck), memoryview(bytearray(trailer))
        return PayloadSink(views, lambda: self._verify(res, f, views, finalize, payload_len - trailer,
                                                       TRAILER.unpack(tail)[0], crc=digest.intdigest()),
                           digest, tail)

    def _sink(self, res: Reservation, layer: int, ts: int,
              te: int) -> tuple[list[memoryview], Callable[[], None] | None]:
        """Where a LAYER payload goes and what runs once it is verified: the pool's pages (a CPU pool), or a
        host stage that is then copied into the pages (a staged pool, ``staging.py``)."""
        stager, codec = self.rx.stager, self.codec
        assert codec is not None  # set at AUTH, before any LAYER frame is dispatched
        if stager is None:
            return codec.sink_views(self.rx.pool, layer, res.page_arr, ts, te, self._stage)
        stage = stager.stage_in(layer, res.page_arr, ts, te)
        res.stages.append(stage)  # released by FINISH or by the reservation's failure, whichever comes
        views, scatter = codec.sink_views(stage, layer, stage.page_map, ts, te, self._stage)  # type: ignore[arg-type]

        def write_back() -> None:
            if scatter is not None:
                scatter()
            stager.write_back(stage, res.page_arr, ts, te)
            done = [s for s in res.stages if s.ready]  # give back the stages whose copies have finished
            for s in done:
                s.release()
            res.stages[:] = [s for s in res.stages if s.buf is not None]

        return views, write_back

    def _on_shm_open(self, f: dict[str, Any], payload_len: int) -> None:
        res = self._owned(f)
        try:
            if not (self.shm_ok or self.mc_ok):
                raise ProtocolError(FailReason.BAD_FRAME, "no one-sided transport (shm, mooncake) was offered on "
                                    "this connection")
            if res.state is not TransferState.RESERVED:
                raise ProtocolError(FailReason.BAD_FRAME, f"shm lease requested in state {res.state.value}")
            if f["dg"] != pages_digest(res.page_bytes, res.gen_bytes):
                raise ProtocolError(FailReason.STALE_PAGE, "shm lease pages/generations do not match the reservation")
            self._check_pool(res)
        except ProtocolError as err:
            return self._fail_res(res, err)
        self._start(res)
        res.shm_writer = self
        res.transport = TransportKind.MOONCAKE if self.mc_ok else TransportKind.SHM
        self.send(FrameType.SHM_OPENED, {"rid": res.req_id, "tid": res.ticket.ticket_id})

    def _on_shm_layer(self, f: dict[str, Any], payload_len: int) -> None:
        res = self._owned(f)
        try:
            if res.shm_writer is not self:
                raise ProtocolError(FailReason.BAD_FRAME, "shm layer frame without a shm lease")
            self._check_span(res, f)
        except ProtocolError as err:
            return self._fail_res(res, err)
        res.queued_upto[f["l"]] = f["te"]
        views = [] if f["crc"] is None else self.shm_codec.pool_views(self.rx.pool, f["l"], res.page_arr, f["ts"],
                                                                      f["te"])
        kind = self.ck if self.mc_ok else self.sck  # Mooncake writes crossed a network: checked like TCP
        self._verify(res, f, views, None, self.shm_codec.nbytes(f["te"] - f["ts"]), f["crc"], kind)

    def _verify(self, res: Reservation, f: dict[str, Any], views: list[memoryview],
                finalize: Callable[[], None] | None, nbytes: int, expected: int | None,
                kind: ChecksumKind | None = None, crc: int | None = None) -> None:
        """The payload is in place: check it against the checksum the sender sent (``expected``; None: it
        sent none), then account it.

        TCP payloads arrive with their checksum already computed piece by piece (``crc``). Other large
        payloads (shm copies) are checksummed on the receiver's CRC threads while this connection
        keeps receiving (every kind releases the GIL). A FINISH waits until every pending check
        has passed.
        """
        self.current = None
        if res.state is not TransferState.RECEIVING:
            return  # failed while the bytes arrived: they went to the discard buffer
        if expected is None:
            return self._accept(res, f, finalize, nbytes, True)
        kind = kind or self.ck
        if kind is ChecksumKind.NONE:  # a checksum the sender said it would not send
            return self._accept(res, f, finalize, nbytes, False)
        if crc is not None:
            return self._accept(res, f, finalize, nbytes, crc == expected)
        if nbytes < OFFLOAD_CRC_BYTES:  # (only shm copies get here: a TCP payload always brings ``crc``)
            return self._accept(res, f, finalize, nbytes, checksum(kind, views) == expected)
        self._verifying += 1
        fut = asyncio.get_running_loop().run_in_executor(self.rx.crc_pool, checksum, kind, views)
        fut.add_done_callback(lambda fu: self._verified(
            res, f, nbytes, not fu.cancelled() and fu.exception() is None and fu.result() == expected))

    def _verified(self, res: Reservation, f: dict[str, Any], nbytes: int, ok: bool) -> None:
        """A CRC thread's verdict on a payload written straight into the pages (an shm copy)."""
        self._verifying -= 1
        self._accept(res, f, None, nbytes, ok)
        if self._verifying == 0 and self._deferred_finish is not None:
            deferred, self._deferred_finish = self._deferred_finish, None
            if not self.closed:
                self._dispatch(FrameType.FINISH, deferred, 0)
                self.reader.resume()

    def _accept(self, res: Reservation, f: dict[str, Any], finalize: Callable[[], None] | None, nbytes: int,
                ok: bool) -> None:
        if res.state is not TransferState.RECEIVING:
            return
        if not ok:
            self.rx.num_rejected_frames += 1
            self.rx.fail(res, TransferError(FailReason.CORRUPT, f"layer {f['l']} tokens [{f['ts']}, {f['te']}): "
                                            "payload checksum mismatch", res.req_id))
            return
        if finalize is not None:
            finalize()  # staging -> pages; safe: the reservation is still RECEIVING and we are on its loop
        self.rx.layer_received(res, f["l"], f["te"], nbytes)

    def _on_finish(self, f: dict[str, Any], payload_len: int) -> None:
        if self._verifying:  # checksums still running: decide once they are all in
            self._deferred_finish = f
            self.reader.pause()
            return
        res = self._owned(f)
        try:
            self._check_pool(res)
        except ProtocolError as err:
            return self._fail_res(res, err)
        if res.state is not TransferState.RECEIVING or f["nt"] != res.ticket.num_tokens or not res.all_received:
            missing = [f"layer {i}: {n}/{res.ticket.num_tokens}" for i, n in enumerate(res.received_upto)
                       if n != res.ticket.num_tokens]
            return self._fail_res(res, ProtocolError(FailReason.INCOMPLETE, "FINISH before all tokens arrived: "
                                                     + ", ".join(missing[:8])))
        try:
            res.draft = self._draft_state(res, f["dh"], f["dc"])
        except ProtocolError as err:
            return self._fail_res(res, err)
        release_all(res.stages)  # a staged pool: every device copy into the pages has finished
        res.stages.clear()
        self.rx.complete(res)
        self.send(FrameType.DONE, {"rid": res.req_id, "tid": res.ticket.ticket_id, "nb": res.num_bytes})

    def _draft_state(self, res: Reservation, draft: bytes | None, crc: int | None) -> bytes | None:
        """FINISH's draft state, checked against what the ticket asked for and against its checksum."""
        want = res.ticket.draft
        if want is None:
            if draft is not None:
                raise ProtocolError(FailReason.BAD_FRAME, "FINISH carries a draft state the ticket did not ask for")
            return None
        if draft is None or len(draft) != want.num_bytes:
            raise ProtocolError(FailReason.INCOMPLETE, f"FINISH without the draft state the ticket asks for "
                                f"({want.hidden_size} {want.dtype} values; got "
                                f"{'none' if draft is None else f'{len(draft)} bytes'}): the prefill worker "
                                "computes no MTP draft state (no MTP layer, or a mismatched model)")
        if crc is None:
            if self.ck is not ChecksumKind.NONE or self.cfg.require_checksum:
                raise ProtocolError(FailReason.BAD_FRAME, "draft state without its checksum")
        elif self.ck is ChecksumKind.NONE or checksum(self.ck, [memoryview(draft)]) != crc:
            self.rx.num_rejected_frames += 1
            raise ProtocolError(FailReason.CORRUPT, "draft state checksum mismatch")
        return draft

    def _on_abort(self, f: dict[str, Any], payload_len: int) -> None:
        """The sender gave up; it has stopped writing (for shm, its ABORT releases the lease)."""
        res = self.rx.manager.find_draining(f["tid"])
        if res is not None and res.shm_writer is self:
            self.rx.manager.drained(res)
            return
        res = self._owned(f)
        if res.shm_writer is self:
            res.shm_writer = None
        reason = FailReason.from_wire(f["reason"])
        self.rx.fail(res, TransferError(reason, f"sender aborted: {f['detail']}", res.req_id), notify=False)

    def _on_abort_ack(self, f: dict[str, Any], payload_len: int) -> None:
        res = self.rx.manager.find_draining(f["tid"])
        if res is not None and self._speaks_for(res.shm_writer):
            self.rx.manager.drained(res)

    def _speaks_for(self, writer: "RxConnection | None") -> bool:
        """This connection may release ``writer``'s shm lease: it is that connection, or a later one from
        the same live process (same host, pid and start time) after that one was lost."""
        if writer is self:
            return True
        return (writer is not None and writer.closed and (self.shm_ok or self.mc_ok) and self.peer_pid > 0
                and (writer.peer_pid, writer.peer_start) == (self.peer_pid, self.peer_start))

    def may_still_write(self) -> bool:
        """A closed connection's one-sided writer might still write our pages: its process is alive (same
        host), or (another host) ``remote_writer_grace_s`` has not passed since the connection was lost."""
        if self.peer_local:
            return pid_alive(self.peer_pid, self.peer_start)
        return time.monotonic() - self.closed_at < self.cfg.remote_writer_grace_s

    def _stage(self, nbytes: int) -> torch.Tensor:
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    _handlers: dict[FrameType, Callable[..., PayloadSink | None]] = {
        FrameType.LAYER: _on_layer,
        FrameType.SHM_OPEN: _on_shm_open,
        FrameType.SHM_LAYER: _on_shm_layer,
        FrameType.FINISH: _on_finish,
        FrameType.ABORT: _on_abort,
        FrameType.ABORT_ACK: _on_abort_ack,
    }
