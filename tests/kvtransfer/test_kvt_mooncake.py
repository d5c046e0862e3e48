"""The Mooncake transport over loopback TCP passes the transfer and failure tests TCP and shm pass: exact pages,
peer SIGKILL, aborts from either side mid-transfer, expiry and stalls, a cut connection; every page back."""
from __future__ import annotations

import logging
import time

import pytest
import torch
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

from kvtransfer import (
    FailReason,
    KVSender,
    KVSenderConfig,
    TransferError,
    TransferState,
    TransportKind,
    auth,
    mooncake,
)
from kvtransfer.protocol import (
    PDSERVE_KV_PROTOCOL_VERSION,
    FrameType,
    pack_u32,
    pages_digest,
    peer_info,
)

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(mooncake.available() is not None, reason=str(mooncake.available()))]

MC = {"mooncake_protocol": "tcp"}


def expect_failure(h, req_id: str, reason: FailReason) -> None:
    with pytest.raises(TransferError) as exc:
        h.wait(req_id, 30)
    assert exc.value.reason is reason, exc.value


def prefill_failed(report: dict, reason: FailReason) -> None:
    assert report["status"] == "error" and report["reason"] == reason.value, report
    assert report["end_used"] == report["start_used"], "prefill pages leaked"


def all_back(h, pool, start: int) -> None:
    h.wait_until(lambda: pool.allocator.num_used == start and h.rx.stats().num_draining == 0, timeout_s=15)


@pytest.mark.parametrize("kv_dtype,kind", [("bfloat16", "mla"), ("fp8_e4m3", "mla"), ("bfloat16", "gqa")])
def test_mooncake_transfer_is_bit_identical(prefill, kv_dtype, kind):
    pool = make_pool(make_layout(kv_dtype, kind), 96)
    fragment(pool, seed=1)  # scattered pages on both sides: one write per run and component
    start = pool.allocator.num_used
    with receiver(pool, **MC) as h:
        ticket = h.rx.reserve("req-1", 45)
        report = prefill.run(ticket=ticket.to_dict(), transport="mooncake", chunks=[(0, 18), (18, 45)])
        assert report["status"] == "done" and report["transport"] == "mooncake", report
        res = h.wait("req-1")
        assert res.transport is TransportKind.MOONCAKE
        rows = token_rows(pool, list(res.page_ids), 45)
        assert rows.keys() == report["rows"].keys()
        assert all(torch.equal(rows[k], report["rows"][k]) for k in rows)
        assert res.num_bytes == report["num_bytes"] == pool.layout.bytes_per_token_per_layer() * 45 * 3
        pool.allocator.decref(list(res.page_ids))
    assert report["end_used"] == report["start_used"] and pool.allocator.num_used == start


def test_large_contiguous_mooncake_transfer():
    lay = make_layout("bfloat16", latent=512, page_size=16)
    src, dst = make_pool(lay, 160), make_pool(lay, 160)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.MOONCAKE))
    try:
        with receiver(dst, **MC) as h:
            t = h.rx.reserve("big", 2000)
            pages = src.allocator.alloc(125, "req")
            for ts, te in [(0, 1000), (1000, 2000)]:
                for layer in range(lay.num_layers):
                    write_layer(src, layer, pages, ts, te, seed=2)
                    sender.send_layer(t, layer, pages, ts, te)
            assert sender.finish(t).result(60).transport is TransportKind.MOONCAKE
            res = h.wait("big")
            assert_landed(src, pages, dst, res, 2000)
            dst.allocator.decref(list(res.page_ids))
            src.allocator.decref(pages)
    finally:
        sender.close()
    assert src.allocator.num_used == 0 and dst.allocator.num_used == 0


def test_sender_sigkilled_mid_transfer(spawn_prefill):
    """The writer process dies holding a lease: the pages are freed once its pid is provably gone."""
    pool = make_pool(make_layout(num_layers=4), 64)
    start = pool.allocator.num_used
    worker = spawn_prefill()
    with receiver(pool, **MC) as h:
        ticket = h.rx.reserve("doomed", 40)
        worker.submit(ticket=ticket.to_dict(), transport="mooncake", hang_after=2)
        assert worker.result()["status"] == "hanging"
        h.wait_until(lambda: h.rx.poll("doomed") is TransferState.RECEIVING)
        assert h.rx.manager.active()[0].transport is TransportKind.MOONCAKE
        worker.kill()
        expect_failure(h, "doomed", FailReason.PEER_DIED)
        all_back(h, pool, start)


def test_prefill_side_abort_mid_transfer(prefill):
    pool = make_pool(make_layout(), 64)
    start = pool.allocator.num_used
    with receiver(pool, **MC) as h:
        ticket = h.rx.reserve("c", 30)
        prefill_failed(prefill.run(ticket=ticket.to_dict(), transport="mooncake", cancel_after=1),
                       FailReason.CANCELLED)
        expect_failure(h, "c", FailReason.CANCELLED)
        all_back(h, pool, start)


def test_decode_side_abort_mid_transfer(prefill):
    """The receiver aborts a leased transfer: the sender stops writing and acknowledges, then the pages go."""
    pool = make_pool(make_layout(num_layers=4), 64)
    start = pool.allocator.num_used
    with receiver(pool, **MC) as h:
        ticket = h.rx.reserve("c", 30)
        prefill.submit(ticket=ticket.to_dict(), transport="mooncake", layer_delay_s=0.15)
        h.wait_until(lambda: h.rx.poll("c") is TransferState.RECEIVING)
        h.rx.cancel("c")
        prefill_failed(prefill.result(), FailReason.CANCELLED)
        expect_failure(h, "c", FailReason.CANCELLED)
        all_back(h, pool, start)


def test_stalled_and_expired_transfers_are_freed(prefill):
    pool = make_pool(make_layout(num_layers=4), 64)
    start = pool.allocator.num_used
    # the ticket's TTL outlasts a sender's Mooncake set-up (a stalled transfer must be leased before it can
    # stall: at 0.5 s the TTL sometimes expired the ticket first); the stall timeout stays short
    with receiver(pool, stall_timeout_s=0.5, ticket_ttl_s=3.0, **MC) as h:
        stalled = h.rx.reserve("s", 30)
        prefill_failed(prefill.run(ticket=stalled.to_dict(), transport="mooncake", stall_after=1),
                       FailReason.STALLED)
        expect_failure(h, "s", FailReason.STALLED)
        h.rx.reserve("e", 30)  # never written
        expect_failure(h, "e", FailReason.EXPIRED)
        all_back(h, pool, start)


def test_cut_connection_frees_every_page_and_the_retry_goes_through():
    lay = make_layout(num_layers=4)
    src, dst = make_pool(lay, 64), make_pool(lay, 64)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.MOONCAKE))
    try:
        with receiver(dst, **MC) as h:
            cut = h.rx.reserve("cut", 40)
            pages = src.allocator.alloc(10, "req")
            sender.inject_drop(1)
            for layer in range(lay.num_layers):
                write_layer(src, layer, pages, 0, 40, seed=1)
                try:
                    sender.send_layer(cut, layer, pages, 0, 40)
                except TransferError:
                    break
            with pytest.raises(TransferError) as exc:
                sender.finish(cut).result(timeout=30)
            assert exc.value.reason is FailReason.PEER_DIED, exc.value
            expect_failure(h, "cut", FailReason.PEER_DIED)
            all_back(h, dst, 0)  # the sender reconnected to release its lease (its process lives on)
            retry = h.rx.reserve("retry", 40)
            for layer in range(lay.num_layers):
                sender.send_layer(retry, layer, pages, 0, 40)
            assert sender.finish(retry).result(30).transport is TransportKind.MOONCAKE
            res = h.wait("retry")
            assert_landed(src, pages, dst, res, 40)
            dst.allocator.decref(list(res.page_ids))
            src.allocator.decref(pages)
    finally:
        sender.close()
    assert src.allocator.num_used == 0 and dst.allocator.num_used == 0


def test_receiver_without_mooncake_falls_back_to_tcp(caplog):
    lay = make_layout()
    src, dst = make_pool(lay, 32), make_pool(lay, 32)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.MOONCAKE))
    try:
        with receiver(dst) as h, caplog.at_level(logging.WARNING, logger="kvtransfer"):
            t = h.rx.reserve("r", 20)
            pages = src.allocator.alloc(5, "req")
            for layer in range(lay.num_layers):
                write_layer(src, layer, pages, 0, 20, seed=3)
                sender.send_layer(t, layer, pages, 0, 20)
            assert sender.finish(t).result(30).transport is TransportKind.TCP
            res = h.wait("r")
            assert_landed(src, pages, dst, res, 20)
            dst.allocator.decref(list(res.page_ids))
            src.allocator.decref(pages)
        assert any("mooncake" in r.getMessage() and "TCP" in r.getMessage() for r in caplog.records)
    finally:
        sender.close()


def test_one_sided_frames_need_an_offer():
    """A sender that did not ask for Mooncake (or shm) cannot open a one-sided lease."""
    pool = make_pool(make_layout(), 16)
    with receiver(pool, **MC) as h:
        t = h.rx.reserve("x", 8)
        peer = RawPeer(h.rx.address)
        info = peer.handshake(pool.layout)
        assert info["mc"] is None  # not asked for: not offered
        peer.frame(FrameType.SHM_OPEN, {"rid": "x", "tid": t.ticket_id,
                                        "dg": pages_digest(pack_u32(t.page_ids), pack_u32(t.generations))})
        assert peer.expect(FrameType.ABORT)["reason"] == FailReason.BAD_FRAME.value
        peer.close()
        h.wait_until(lambda: pool.allocator.num_used == 0)


def test_a_lost_remote_writer_keeps_its_pages_for_the_grace_period():
    """A Mooncake writer on another host (its pid cannot be checked here) loses its connection holding a
    lease: the pages stay reserved for ``remote_writer_grace_s`` (a write may still be in flight), then go."""
    pool = make_pool(make_layout(), 16)
    with receiver(pool, remote_writer_grace_s=1.0, **MC) as h:
        t = h.rx.reserve("w", 8)
        peer = RawPeer(h.rx.address)
        nonce = auth.new_nonce()
        peer.frame(FrameType.HELLO, {"v": PDSERVE_KV_PROTOCOL_VERSION, "n": nonce})
        ch = peer.expect(FrameType.CHALLENGE)
        info = peer_info(pool.layout.to_dict(), host_id="elsewhere", pid=1 << 30, pid_start=1, wire="native",
                         ck="xxh3", mc=True)  # a pid that runs nowhere here: another host's process
        peer.frame(FrameType.AUTH, {"p": auth.make_proof(SECRET, auth.Role.SENDER, nonce, ch["n"]), "info": info})
        assert peer.expect(FrameType.READY)["info"]["mc"]["s"] == h.rx.mooncake.session
        peer.frame(FrameType.SHM_OPEN, {"rid": "w", "tid": t.ticket_id,
                                        "dg": pages_digest(pack_u32(t.page_ids), pack_u32(t.generations))})
        peer.expect(FrameType.SHM_OPENED)
        peer.close()
        expect_failure(h, "w", FailReason.PEER_DIED)
        lost = time.monotonic()
        h.wait_until(lambda: pool.allocator.num_used == 0, timeout_s=10)
        assert time.monotonic() - lost >= 0.8, "freed before the grace period"
        assert h.rx.stats().num_draining == 0
