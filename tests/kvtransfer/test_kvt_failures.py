"""Every failure ends in the right ``FailReason`` on both sides, with the pools back where they started."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import threading
import time
import zlib

import pytest
import torch

import kvt_workers
from kvt_helpers import (
    SECRET,
    RawPeer,
    assert_landed,
    fragment,
    make_layout,
    make_pool,
    receiver,
    token_rows,
    write_layer,
)
from kvtransfer import FailReason, KVSender, KVSenderConfig, SendState, TransferError, TransferState, TransferTicket
from kvtransfer.config import ChecksumKind, TransportKind, WireDType
from kvtransfer.payload import LayerCodec
from kvtransfer.protocol import TRAILER, FrameType, checksum, pack_u32

pytestmark = pytest.mark.timeout(120)


def expect_failure(h, req_id: str, reason: FailReason, timeout_s: float = 30.0) -> TransferError:
    with pytest.raises(TransferError) as exc:
        h.wait(req_id, timeout_s)
    assert exc.value.reason is reason, exc.value
    return exc.value


def prefill_failed(report: dict, reason: FailReason) -> None:
    assert report["status"] == "error" and report["reason"] == reason.value, report
    assert report["end_used"] == report["start_used"], "prefill pages leaked"


# --- peer death and stalls ----------------------------------------------------------------------

@pytest.mark.parametrize("shm", [False, True])
def test_sender_killed_mid_transfer(spawn_prefill, shm):
    pool = make_pool(make_layout(num_layers=4), 64, shm=shm)
    start = pool.allocator.num_used
    worker = spawn_prefill()
    with receiver(pool) as h:
        ticket = h.rx.reserve("doomed", 40)
        worker.submit(ticket=ticket.to_dict(), transport="auto", hang_after=2)
        assert worker.result()["status"] == "hanging"
        h.wait_until(lambda: h.rx.poll("doomed") is TransferState.RECEIVING)
        worker.kill()
        expect_failure(h, "doomed", FailReason.PEER_DIED)
        # shm: the pages are freed only once the writer process is provably gone (reaper checks its pid)
        h.wait_until(lambda: pool.allocator.num_used == start)
        assert h.rx.stats().num_draining == 0


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_receiver_killed_or_stalled_mid_transfer(how):
    lay = make_layout(num_layers=4)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=kvt_workers.receiver_worker, args=(child, lay.to_dict(), 40, False), daemon=True)
    proc.start()
    try:
        assert conn.poll(60)
        ticket = TransferTicket.from_dict(conn.recv())
        src = make_pool(lay, 32)
        start = src.allocator.num_used
        pages = src.allocator.alloc(10, "req")
        sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, finish_timeout_s=1.0, send_timeout_s=1.0))
        write_layer(src, 0, pages, 0, 40, seed=0)
        sender.send_layer(ticket, 0, pages, 0, 40)
        deadline = time.monotonic() + 10
        while sender.state(ticket) is not SendState.STREAMING and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "kill":
            proc.join(10)
        for layer in range(1, lay.num_layers):
            write_layer(src, layer, pages, 0, 40, seed=0)
            try:
                sender.send_layer(ticket, layer, pages, 0, 40)
            except TransferError as e:  # the loss may already be known
                assert e.reason is FailReason.PEER_DIED
        with pytest.raises(TransferError) as exc:
            sender.finish(ticket).result(15)
        assert exc.value.reason is (FailReason.PEER_DIED if how == "kill" else FailReason.TIMEOUT), exc.value
        src.allocator.decref(pages)
        assert src.allocator.num_used == start, "pinned prefill pages leaked"
        sender.close(grace_s=0.5)
    finally:
        proc.kill()
        proc.join(10)


def test_stalled_sender_is_given_up(prefill):
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    with receiver(pool, stall_timeout_s=0.5) as h:
        ticket = h.rx.reserve("slow", 30)
        prefill.submit(ticket=ticket.to_dict(), transport="tcp", stall_after=1)
        expect_failure(h, "slow", FailReason.STALLED)
        prefill_failed(prefill.result(), FailReason.STALLED)
        assert pool.allocator.num_used == start


def test_unused_ticket_expires_and_wait_times_out(prefill):
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    with receiver(pool, ticket_ttl_s=0.3) as h:
        h.rx.reserve("never", 10)
        expect_failure(h, "never", FailReason.EXPIRED)
        assert pool.allocator.num_used == start
        h.rx.reserve("impatient", 10)
        expect_failure(h, "impatient", FailReason.TIMEOUT, timeout_s=0.05)
        assert pool.allocator.num_used == start


# --- bad frames ---------------------------------------------------------------------------------

def _layer_frame(ticket, layer: int, ts: int, te: int, payload: bytes, crc: int | None,
                 gens=None) -> tuple[dict, bytes]:
    """A LAYER header and its wire payload (``payload``, then ``crc`` as the trailer unless None)."""
    span = ticket.page_span(ts, te)
    fields = {"rid": ticket.req_id, "tid": ticket.ticket_id, "l": layer, "ts": ts, "te": te,
              "pg": pack_u32(ticket.page_ids[span]), "gn": pack_u32((gens or ticket.generations)[span]),
              "tr": crc is not None}
    return fields, payload if crc is None else payload + TRAILER.pack(crc)


@pytest.mark.parametrize("ck", [None, "crc32", "crc32c", "xxh3"])
def test_corrupt_payload_fails_only_its_request(prefill, ck):
    """Whichever checksum the sender announced (none announced: the protocol default, crc32), a payload
    that does not match it fails its request alone."""
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    with receiver(pool) as h:
        bad = h.rx.reserve("bad", 20)
        good = h.rx.reserve("good", 20)
        peer = RawPeer(h.rx.address)
        peer.handshake(pool.layout, ck=ck)
        payload = os.urandom(LayerCodec(pool.layout, WireDType.NATIVE).nbytes(20))
        crc = checksum(ChecksumKind(ck or "crc32"), [memoryview(payload)])
        assert crc != checksum(ChecksumKind("crc32c" if ck != "crc32c" else "crc32"), [memoryview(payload)])
        peer.frame(FrameType.LAYER, *_layer_frame(bad, 0, 0, 20, payload, crc ^ 1))
        abort = peer.expect(FrameType.ABORT)
        assert abort["rid"] == "bad" and abort["reason"] == FailReason.CORRUPT.value
        expect_failure(h, "bad", FailReason.CORRUPT)
        assert all((pool.buffers[0][c.name][list(good.page_ids)] == 0).all() for c in pool.layout.components)
        report = prefill.run(ticket=good.to_dict(), transport="tcp")
        res = h.wait("good")
        assert all(torch.equal(a, b) for a, b in zip(token_rows(pool, list(res.page_ids), 20).values(),
                                                     report["rows"].values()))
        pool.allocator.decref(list(res.page_ids))
        peer.close()
    assert pool.allocator.num_used == start


def test_checksum_trailer_on_a_connection_that_announced_none_is_refused():
    """A sender that announced no checksum but sends a trailer (or a wrong length for one) fails that
    request as a bad frame; nothing is written into its pages."""
    pool = make_pool(make_layout(), 16)
    with receiver(pool) as h:
        t = h.rx.reserve("odd", 20)
        peer = RawPeer(h.rx.address)
        peer.handshake(pool.layout, ck="none")
        payload = os.urandom(LayerCodec(pool.layout, WireDType.NATIVE).nbytes(20))
        peer.frame(FrameType.LAYER, *_layer_frame(t, 0, 0, 20, payload, 5))
        abort = peer.expect(FrameType.ABORT)
        assert abort["reason"] == FailReason.BAD_FRAME.value and "announced none" in abort["detail"]
        expect_failure(h, "odd", FailReason.BAD_FRAME)
        assert all((pool.buffers[0][c.name] == 0).all() for c in pool.layout.components), "a page was written"
        peer.close()
    assert pool.allocator.num_used == 0


def test_large_payloads_are_verified_before_finish():
    """330 KB payloads, checksummed piece by piece as they land (several reads each): a good stream
    completes, one bad layer among good ones fails the request."""
    lay = make_layout(latent=4096)  # 8 KiB per token per layer: 40 tokens = 330 KB frames
    pool = make_pool(lay, 32)
    codec = LayerCodec(lay, WireDType.NATIVE)
    with receiver(pool) as h:
        for bad_layer in (None, 1):
            ticket = h.rx.reserve(f"big-{bad_layer}", 40)
            peer = RawPeer(h.rx.address)
            peer.handshake(lay)
            payloads = [os.urandom(codec.nbytes(40)) for _ in range(lay.num_layers)]
            for layer, payload in enumerate(payloads):
                crc = zlib.crc32(payload) ^ (layer == bad_layer)
                peer.frame(FrameType.LAYER, *_layer_frame(ticket, layer, 0, 40, payload, crc))
            peer.frame(FrameType.FINISH, {"rid": ticket.req_id, "tid": ticket.ticket_id, "nt": 40, "dh": None,
                                          "dc": None})
            if bad_layer is None:
                assert peer.expect(FrameType.DONE)["nb"] == sum(map(len, payloads))
                res = h.wait(ticket.req_id)
                rows = token_rows(pool, list(res.page_ids), 40)
                got = b"".join(rows[(0, c.name, False)].numpy().tobytes() for c in lay.components)
                assert got == payloads[0]
                pool.allocator.decref(list(res.page_ids))
            else:
                assert peer.expect(FrameType.ABORT)["reason"] == FailReason.CORRUPT.value
                expect_failure(h, ticket.req_id, FailReason.CORRUPT)
            peer.close()
    assert pool.allocator.num_used == 0


def test_frame_for_a_freed_and_reused_page_is_refused(prefill):
    pool = make_pool(make_layout(), 16)
    start = pool.allocator.num_used
    with receiver(pool) as h:
        old = h.rx.reserve("old", 20)
        h.rx.cancel("old")
        h.wait_until(lambda: pool.allocator.num_used == start)
        new = h.rx.reserve("new", 20)  # same pages, bumped generations
        assert set(new.page_ids) == set(old.page_ids) and new.generations != old.generations
        prefill_failed(prefill.run(ticket=old.to_dict(), transport="tcp"), FailReason.CANCELLED)
        # a forged frame naming the new ticket with the old generation counters: refused before any write
        peer = RawPeer(h.rx.address)
        peer.handshake(pool.layout)
        payload = b"\x01" * LayerCodec(pool.layout, WireDType.NATIVE).nbytes(20)
        peer.frame(FrameType.LAYER, *_layer_frame(new, 0, 0, 20, payload, zlib.crc32(payload), old.generations))
        assert peer.expect(FrameType.ABORT)["reason"] == FailReason.STALE_PAGE.value
        expect_failure(h, "new", FailReason.STALE_PAGE)
        assert all((pool.buffers[0][c.name] == 0).all() for c in pool.layout.components), "a page was written"
        peer.close()
        again = h.rx.reserve("new", 20)
        report = prefill.run(ticket=again.to_dict(), transport="tcp")
        assert report["status"] == "done"
        pool.allocator.decref(list(h.wait("new").page_ids))
    assert pool.allocator.num_used == start


# --- handshake ----------------------------------------------------------------------------------

def test_wrong_secret_is_refused_by_both_sides(prefill):
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    with receiver(pool, ticket_ttl_s=1.0) as h:
        ticket = h.rx.reserve("r", 20)
        prefill_failed(prefill.run(ticket=ticket.to_dict(), secret=b"not-the-cluster-secret!!"), FailReason.AUTH_FAILED)
        # a peer that skips checking our proof and answers with a wrong one is refused by the receiver
        peer = RawPeer(h.rx.address)
        with pytest.raises(AssertionError, match="ERROR"):
            peer.handshake(pool.layout, secret=b"also-not-the-cluster-secret")
        assert peer.closed_by_peer()
        expect_failure(h, "r", FailReason.EXPIRED)
    assert pool.allocator.num_used == start


@pytest.mark.parametrize("change", [dict(latent=64), dict(kv_dtype="float32"), dict(num_layers=4)])
def test_incompatible_layout_is_refused(prefill, change):
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    theirs = make_layout(**change)
    with receiver(pool, ticket_ttl_s=1.0) as h:
        ticket = h.rx.reserve("r", 20)
        report = prefill.run(ticket=ticket.to_dict(), layout=theirs.to_dict())
        prefill_failed(report, FailReason.INCOMPATIBLE)
        assert any(k in report["detail"] for k in ("components", "kv_dtype", "layers")), report["detail"]
        expect_failure(h, "r", FailReason.EXPIRED)
    assert pool.allocator.num_used == start


def test_protocol_version_mismatch_is_refused():
    pool = make_pool(make_layout(), 8)
    with receiver(pool) as h:
        peer = RawPeer(h.rx.address)
        peer.frame(FrameType.HELLO, {"v": 999, "n": b"\0" * 32})
        err = peer.expect(FrameType.ERROR)
        assert err["reason"] == FailReason.INCOMPATIBLE.value and "999" in err["detail"]


# --- cancellation and admission -----------------------------------------------------------------

def test_decode_side_cancel_reaches_the_sender(prefill):
    pool = make_pool(make_layout(num_layers=4), 64)
    start = pool.allocator.num_used
    with receiver(pool) as h:
        ticket = h.rx.reserve("c", 30)
        prefill.submit(ticket=ticket.to_dict(), transport="tcp", layer_delay_s=0.15)
        h.wait_until(lambda: h.rx.poll("c") is TransferState.RECEIVING)
        h.rx.cancel("c")
        prefill_failed(prefill.result(), FailReason.CANCELLED)
        expect_failure(h, "c", FailReason.CANCELLED)
    assert pool.allocator.num_used == start


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_prefill_side_cancel_reaches_the_receiver(prefill, transport):
    pool = make_pool(make_layout(), 64, shm=transport == "auto")
    start = pool.allocator.num_used
    with receiver(pool) as h:
        ticket = h.rx.reserve("c", 30)
        prefill_failed(prefill.run(ticket=ticket.to_dict(), transport=transport, cancel_after=1), FailReason.CANCELLED)
        expect_failure(h, "c", FailReason.CANCELLED)
        h.wait_until(lambda: pool.allocator.num_used == start)


def test_admission_control_refuses_at_once():
    pool = make_pool(make_layout(), 8)
    fragment(pool)
    start = pool.allocator.num_used
    with receiver(pool, max_reserved_pages=6) as h:
        with pytest.raises(TransferError) as exc:
            h.rx.reserve("huge", 8 * 4 + 1)
        assert exc.value.reason is FailReason.NO_CAPACITY
        h.rx.reserve("a", 20)  # 5 pages
        with pytest.raises(TransferError) as exc:
            h.rx.reserve("b", 8)  # 2 more pages would pass the cap of 6
        assert exc.value.reason is FailReason.NO_CAPACITY and "max_reserved_pages" in str(exc.value)
        with pytest.raises(ValueError):
            h.rx.reserve("a", 4)
        h.rx.cancel("a")
        h.wait_until(lambda: pool.allocator.num_used == start)


# --- injected connection drop (pdserve bench --fault drop-kv) -----------------------------------

def _pools_and_sender(lay, shm: bool, **sender_cfg) -> tuple:
    """A decode pool (in shared memory with ``shm``), a prefill pool, and a sender that takes shm when it can."""
    dst, src = make_pool(lay, 64, shm=shm), make_pool(lay, 64)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.AUTO if shm
                                          else TransportKind.TCP, **sender_cfg))
    return dst, src, sender


def _send_all(sender: KVSender, src, ticket, pages: list[int], n: int, seed: int) -> None:
    for layer in range(src.layout.num_layers):
        write_layer(src, layer, pages, 0, n, seed=seed)
        try:
            sender.send_layer(ticket, layer, pages, 0, n)
        except TransferError:  # the loss may already be known: finish() reports it
            return


def _deliver(sender: KVSender, h, src, dst, ticket, name: str, pages: list[int], n: int, seed: int, shm: bool) -> None:
    """Send ``n`` tokens of every layer, finish: the transfer goes through on the expected transport, bit
    identical; the received pages are released again."""
    _send_all(sender, src, ticket, pages, n, seed=seed)
    sent = sender.finish(ticket).result(timeout=30)
    assert sent.transport is (TransportKind.SHM if shm else TransportKind.TCP)
    res = h.wait(name)
    assert_landed(src, pages, dst, res, n)
    dst.allocator.decref(list(res.page_ids))


@pytest.mark.parametrize("shm", [False, True])
def test_dropped_connection_fails_its_transfers_frees_every_page_and_the_next_one_goes_through(shm):
    """``KVSender.inject_drop`` cuts the connection after a transfer's first frame, no ABORT sent. Both
    sides fail it as PEER_DIED; the receiver frees its pages at once, also over shm, where a lost writer
    would otherwise keep them until its process exits: the sender reconnects to release the lease. The
    next transfer to that receiver (a retry) takes a fresh connection and arrives bit-identical."""
    lay = make_layout(num_layers=4)
    dst, src, sender = _pools_and_sender(lay, shm)
    d0, s0 = dst.allocator.num_used, src.allocator.num_used
    try:
        with receiver(dst) as h:
            cut = h.rx.reserve("cut", 40)
            pages = src.allocator.alloc(10, "req")
            assert sender.inject_drop(1) == 1
            _send_all(sender, src, cut, pages, 40, seed=1)
            with pytest.raises(TransferError) as exc:
                sender.finish(cut).result(timeout=30)
            assert exc.value.reason is FailReason.PEER_DIED, exc.value
            expect_failure(h, "cut", FailReason.PEER_DIED)
            assert (sender.drops_armed, sender.drops_fired) == (0, 1)
            h.wait_until(lambda: dst.allocator.num_used == d0 and h.rx.stats().num_draining == 0, timeout_s=10)

            retry = h.rx.reserve("cut.retry1", 40)
            _deliver(sender, h, src, dst, retry, "cut.retry1", pages, 40, seed=2, shm=shm)
            src.allocator.decref(pages)
            assert dst.allocator.num_used == d0
    finally:
        sender.close()
    assert src.allocator.num_used == s0, "source pages still pinned"


def test_inject_drop_needs_a_positive_count():
    sender = KVSender(make_pool(make_layout(), 8), KVSenderConfig(cluster_secret=SECRET))
    try:
        with pytest.raises(ValueError, match="count"):
            sender.inject_drop(0)
    finally:
        sender.close()


# --- KVSender.open: the transfer (and over shm its lease) before the first layer ----------------

@pytest.mark.parametrize("shm", [False, True])
def test_open_before_the_first_layer_then_a_full_transfer(shm):
    """``open`` pins nothing; over shm the receiver grants the lease before any layer is computed. The
    transfer then goes through bit-identical and every page comes back; a second ``open`` is a no-op."""
    lay = make_layout(num_layers=3)
    dst, src, sender = _pools_and_sender(lay, shm)
    d0 = dst.allocator.num_used
    try:
        with receiver(dst) as h:
            t = h.rx.reserve("o", 30)
            pages = src.allocator.alloc(8, "req")
            s0 = src.allocator.num_used
            opened = sender.open(t)
            assert sender.open(t) is opened
            assert opened.result(timeout=10) is None
            if shm:  # the lease is granted: the reservation is under way before any layer exists
                assert h.rx.manager.active()[0].state is TransferState.RECEIVING
            assert src.allocator.num_used == s0 and sender.state(t) is SendState.QUEUED  # nothing pinned yet
            _deliver(sender, h, src, dst, t, "o", pages, 30, seed=3, shm=shm)
            assert sender.open(t).result(timeout=0) is None  # over: still a no-op
            src.allocator.decref(pages)
            assert dst.allocator.num_used == d0 and src.allocator.num_used == s0 - 8
    finally:
        sender.close()


@pytest.mark.parametrize("shm", [False, True])
def test_opened_transfer_cancelled_before_any_layer_frees_both_sides(shm):
    lay = make_layout()
    dst, src, sender = _pools_and_sender(lay, shm)
    d0, s0 = dst.allocator.num_used, src.allocator.num_used
    try:
        with receiver(dst) as h:
            t = h.rx.reserve("oc", 30)
            opened = sender.open(t)
            opened.result(timeout=10)
            sender.cancel(t, "client went away")
            expect_failure(h, "oc", FailReason.CANCELLED)
            h.wait_until(lambda: dst.allocator.num_used == d0 and h.rx.stats().num_draining == 0)
            assert sender.state(t) is SendState.FAILED
            with pytest.raises(TransferError):
                sender.open(t).result(timeout=0)
            with pytest.raises(TransferError) as exc:
                sender.send_layer(t, 0, src.allocator.alloc(8, "late"), 0, 30)
            assert exc.value.reason is FailReason.CANCELLED
    finally:
        sender.close()
    assert src.allocator.num_used == s0 + 8, "only the test's own late pages are held"


def test_opened_transfer_that_never_sends_a_layer_is_reaped_as_stalled():
    """A prefill that opens and then never ships (hung, crashed without cancelling) holds the shm lease
    only until the receiver's stall timeout: the receiver frees its pages and tells the sender."""
    lay = make_layout()
    dst, src, sender = _pools_and_sender(lay, shm=True)
    d0 = dst.allocator.num_used
    try:
        with receiver(dst, stall_timeout_s=0.5) as h:
            t = h.rx.reserve("os", 30)
            sender.open(t).result(timeout=10)
            expect_failure(h, "os", FailReason.STALLED)
            h.wait_until(lambda: dst.allocator.num_used == d0 and h.rx.stats().num_draining == 0)
            h.wait_until(lambda: sender.state(t) is SendState.FAILED)
    finally:
        sender.close()


def test_shm_lease_not_granted_in_time_fails_the_opened_transfer_and_frees_the_pages():
    """The lease wait is timed from SHM_OPEN, also when nothing else is waiting for it (an opened
    transfer). The receiver is made unresponsive by blocking its event loop."""
    lay = make_layout()
    dst, src, sender = _pools_and_sender(lay, shm=True, handshake_timeout_s=0.3)
    d0 = dst.allocator.num_used
    try:
        with receiver(dst) as h:
            warm, t = h.rx.reserve("warm", 4), h.rx.reserve("ol", 30)
            pages = src.allocator.alloc(8, "req")
            _send_all(sender, src, warm, pages, 4, seed=4)  # connection up, shm negotiated
            sender.finish(warm).result(timeout=30)
            dst.allocator.decref(list(h.wait("warm").page_ids))
            # the receiver hears nothing until the sender has given up (a gate, not a fixed sleep: on a loaded
            # host a 1.5 s sleep could end before the starved sender even asked for the lease)
            blocked, gate = threading.Event(), threading.Event()
            h.lt.call(lambda: (blocked.set(), gate.wait(30)))
            assert blocked.wait(10)
            try:
                t0 = time.monotonic()
                with pytest.raises(TransferError) as exc:
                    sender.open(t).result(timeout=1.2)
                assert exc.value.reason is FailReason.TIMEOUT and "shm lease" in str(exc.value)
                assert time.monotonic() - t0 < 1.2
                with pytest.raises(TransferError) as exc:
                    sender.send_layer(t, 0, pages, 0, 30)
                assert exc.value.reason is FailReason.TIMEOUT and "shm lease" in str(exc.value)
            finally:
                gate.set()
            expect_failure(h, "ol", FailReason.TIMEOUT)
            h.wait_until(lambda: dst.allocator.num_used == d0 and h.rx.stats().num_draining == 0)
            src.allocator.decref(pages)
    finally:
        sender.close()


def test_open_rejects_an_incompatible_or_expired_ticket():
    src = make_pool(make_layout(num_layers=3), 16)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET))
    try:
        with receiver(make_pool(make_layout(num_layers=4), 16)) as h:
            with pytest.raises(TransferError) as exc:
                sender.open(h.rx.reserve("x", 8))
            assert exc.value.reason is FailReason.INCOMPATIBLE
        with receiver(make_pool(make_layout(num_layers=3), 16), ticket_ttl_s=0.05) as h:
            t = h.rx.reserve("y", 8)
            time.sleep(0.1)
            with pytest.raises(TransferError) as exc:
                sender.open(t)
            assert exc.value.reason is FailReason.EXPIRED
    finally:
        sender.close()


def test_split_kv_heads_refused_in_the_handshake_with_both_layouts_named():
    """A tensor-parallel worker whose ranks each hold a slice of every token's KV (GQA heads) cannot ship or take
    KV through rank 0 alone: the handshake refuses it (INCOMPATIBLE, both sides' TP layouts named) instead of
    moving half the heads; replicated KV (MLA) at any TP size passes, and the receiver holds nothing after."""
    src = make_pool(make_layout(num_layers=3), 16)
    split = KVSender(src, KVSenderConfig(cluster_secret=SECRET, tp_size=2, kv_split=True))
    replicated = KVSender(src, KVSenderConfig(cluster_secret=SECRET, tp_size=2))
    try:
        with receiver(make_pool(make_layout(num_layers=3), 16)) as h:
            with pytest.raises(TransferError) as exc:
                split.open(h.rx.reserve("x", 8)).result(timeout=5)
            assert exc.value.reason is FailReason.INCOMPATIBLE
            assert "local 1 rank(s), peer 2 rank(s) with split KV heads" in exc.value.detail  # the receiver's words
            t = h.rx.reserve("y", 8)
            replicated.open(t).result(timeout=5)
            replicated.cancel(t, "done")
            for req in ("x", "y"):  # what the router does after a failed or finished prefill
                h.rx.cancel(req, "done")
            h.wait_until(lambda: h.rx.pool.allocator.num_used == 0)
        with receiver(make_pool(make_layout(num_layers=3), 16), tp_size=2, kv_split=True) as h:
            with pytest.raises(TransferError) as exc:
                replicated.open(h.rx.reserve("z", 8)).result(timeout=5)
            assert exc.value.reason is FailReason.INCOMPATIBLE
            assert "local 2 rank(s) with split KV heads, peer 2 rank(s)" in exc.value.detail
    finally:
        split.close()
        replicated.close()


def test_a_cancel_during_connection_setup_reaches_the_receiver_when_the_sender_closes(monkeypatch):
    """A transfer cancelled while its connection is still being set up (its ABORT waits in the connection's queue)
    and the sender closed right after: the ABORT still goes out once the handshake completes, so the receiver
    frees the reservation at once (CANCELLED) instead of holding it until its ticket expires. Before, the close
    dropped the queued ABORT (the Mooncake CI flake: its set-up outlasted the sender's 1 s shutdown flush)."""
    from kvtransfer.tx_peer import TxPeer
    real = TxPeer._handshake

    async def slow_handshake(self):
        await asyncio.sleep(1.5)  # longer than the 1 s flush of a closing sender
        return await real(self)
    monkeypatch.setattr(TxPeer, "_handshake", slow_handshake)
    lay = make_layout(num_layers=2)
    src, dst = make_pool(lay, 64), make_pool(lay, 64)
    with receiver(dst, ticket_ttl_s=60.0) as h:
        start = dst.allocator.num_used
        ticket = h.rx.reserve("early", 30)
        sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET))
        pages = src.allocator.alloc(src.pages_for(30), "req")
        write_layer(src, 0, pages, 0, 30, seed=1)
        sender.send_layer(ticket, 0, pages, 0, 30)
        sender.cancel(ticket)
        t0 = time.monotonic()
        sender.close(grace_s=1.0)
        expect_failure(h, "early", FailReason.CANCELLED, timeout_s=10.0)
        assert time.monotonic() - t0 < 10.0
        h.wait_until(lambda: dst.allocator.num_used == start)
        src.allocator.decref(pages)
        assert src.allocator.num_used == 0
