"""The staged path (device pools, ``kvtransfer/staging.py``) on CPU: ``KVPool(force_staged=True)`` sends and
receives pages through host stages exactly as a GPU pool does, minus the device copies themselves.

Every test ends with every page and every staging buffer back."""
from __future__ import annotations

import threading
import time

import numpy as np
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

from engine.kvcache.pool import KVPool
from kvtransfer import FailReason, KVSender, KVSenderConfig, SendState, TransferError, TransferState
from kvtransfer.config import ChecksumKind, TransportKind, WireDType
from kvtransfer.payload import LayerCodec
from kvtransfer.protocol import TRAILER, FrameType, checksum, pack_u32
from kvtransfer.staging import HostStage, Stager, is_staged

pytestmark = pytest.mark.timeout(120)


def staged_pool(lay, num_pages: int = 64, fragmented: bool = False, seed: int = 0) -> KVPool:
    pool = KVPool(lay, num_pages, force_staged=True)
    if fragmented:
        fragment(pool, seed=seed)
    return pool


def _sender(src: KVPool, **cfg) -> KVSender:
    return KVSender(src, KVSenderConfig(**{"cluster_secret": SECRET, "transport": TransportKind.TCP, **cfg}))


def _no_stage_out(*ends) -> None:
    for end in ends:
        stager = end.stager
        assert stager.buffers.num_outstanding == 0, f"{stager.buffers.num_outstanding} staging buffers not released"


def _send_chunks(sender, src, ticket, pages, chunks, seed: int) -> None:
    for ts, te in chunks:
        for layer in range(src.layout.num_layers):
            write_layer(src, layer, pages, ts, te, seed=seed)
            sender.send_layer(ticket, layer, pages, ts, te)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("big", [False, True])
def test_staged_transfer_is_bit_identical(kv_dtype, fragmented, big):
    """Both ends staged; chunk borders mid-page (the receiver writes back only the frame's tokens of a
    shared page); small pages (gather/scatter through the stage) and large runs (straight into it)."""
    lay = make_layout(kv_dtype, latent=512 if big else 32, page_size=16 if big else 4)
    n = 1500 if big else 45
    src, dst = staged_pool(lay, 128, fragmented, seed=1), staged_pool(lay, 128, fragmented, seed=2)
    d0 = dst.allocator.num_used
    sender = _sender(src)
    try:
        with receiver(dst) as h:
            ticket = h.rx.reserve("r", n)
            pages = src.allocator.alloc(src.pages_for(n), "req")
            _send_chunks(sender, src, ticket, pages, [(0, n // 3 + 1), (n // 3 + 1, n)], seed=3)
            sent = sender.finish(ticket).result(timeout=60)
            res = h.wait("r")
            assert_landed(src, pages, dst, res, n)
            assert sent.num_bytes == lay.bytes_per_token_per_layer() * n * lay.num_layers
            assert src.allocator.num_used == len(pages)  # unpinned
            src.allocator.decref(pages)
            dst.allocator.decref(list(res.page_ids))
            _no_stage_out(sender, h.rx)
            assert 0 < h.rx.stager.buffers.num_allocated < 2 * lay.num_layers * 2  # staged, and buffers are reused
            assert sender.stager.buffers.num_allocated > 0
    finally:
        sender.close()
    assert dst.allocator.num_used == d0 and src.allocator.num_used == 0


def test_staged_sender_to_a_plain_pool_and_back():
    """Only one end staged (a GPU prefill worker, a CPU decode worker and the reverse); fp8 on the wire
    from a staged bf16 pool is quantized from the stage."""
    lay = make_layout("bfloat16")
    for src_staged in (True, False):
        src = staged_pool(lay) if src_staged else make_pool(lay)
        dst = make_pool(lay) if src_staged else staged_pool(lay, fragmented=True)
        for wire in (WireDType.NATIVE, WireDType.FP8_E4M3):
            sender = _sender(src, wire_dtype=wire)
            try:
                with receiver(dst) as h:
                    ticket = h.rx.reserve("r", 30)
                    pages = src.allocator.alloc(8, "req")
                    _send_chunks(sender, src, ticket, pages, [(0, 30)], seed=4)
                    sender.finish(ticket).result(timeout=30)
                    res = h.wait("r")
                    got, want = token_rows(dst, list(res.page_ids), 30), token_rows(src, pages, 30)
                    for k in want:
                        if wire is WireDType.NATIVE:
                            assert torch.equal(got[k], want[k]), k
                        else:  # lossy: compare values
                            g, w = got[k].view(torch.bfloat16).float(), want[k].view(torch.bfloat16).float()
                            assert ((g - w).abs() <= w.abs() / 14 + w.abs().amax() / 448 + 1e-6).all(), k
                    src.allocator.decref(pages)
                    dst.allocator.decref(list(res.page_ids))
                    _no_stage_out(*(e for e in (sender, h.rx) if e.stager is not None))
            finally:
                sender.close()
            assert src.allocator.num_used == 0 and dst.allocator.num_used == 0


def test_staged_sender_into_shm():
    """A staged prefill pool copies into a same-host decode worker's shm pages from its stages."""
    lay = make_layout("fp8_e4m3")
    src, dst = staged_pool(lay, 128, fragmented=True), make_pool(lay, 128, shm=True)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.AUTO))
    try:
        with receiver(dst) as h:
            ticket = h.rx.reserve("r", 37)
            pages = src.allocator.alloc(10, "req")
            _send_chunks(sender, src, ticket, pages, [(0, 9), (9, 37)], seed=5)
            assert sender.finish(ticket).result(timeout=30).transport is TransportKind.SHM
            res = h.wait("r")
            assert_landed(src, pages, dst, res, 37)
            # the first transfer's layers were staged (queued before the connection was up); once it is, layers
            # copy into the shm pages with no stage between (zero staging)
            staged_before = sender.stager.buffers.num_allocated
            for n in (24, 300):  # a few runs: one copy each; > MAX_COPY_RUNS: gathered, then scattered
                fragment(dst, seed=n)
                t2 = h.rx.reserve(f"r{n}", n)
                pages2 = src.allocator.alloc(n // 4, "req2")
                _send_chunks(sender, src, t2, pages2, [(0, n)], seed=6)
                sender.finish(t2).result(timeout=30)
                res2 = h.wait(f"r{n}")
                assert_landed(src, pages2, dst, res2, n)
                src.allocator.decref(pages2)
                dst.allocator.decref(list(res2.page_ids))
            assert sender.stager.buffers.num_allocated == staged_before
            src.allocator.decref(pages)
            dst.allocator.decref(list(res.page_ids))
            _no_stage_out(sender)
    finally:
        sender.close()


# --- failure paths: every stage and page back ----------------------------------------------------

def _fail_case(how: str) -> None:
    lay = make_layout(num_layers=4)
    src, dst = staged_pool(lay, fragmented=True), staged_pool(lay, fragmented=True, seed=3)
    cfg = {"ticket_ttl_s": 0.3} if how == "expire" else {"stall_timeout_s": 0.3} if how == "stall" else {}
    sender = _sender(src)
    try:
        with receiver(dst, **cfg) as h:
            ticket = h.rx.reserve("f", 40)
            pages = src.allocator.alloc(10, "req")
            if how == "expire":
                time.sleep(0.6)  # the ticket's reservation is reaped before the first frame
            if how == "drop":
                sender.inject_drop(1)
            failed = None
            for layer in range(2):  # half the layers, then the failure
                write_layer(src, layer, pages, 0, 40, seed=6)
                try:
                    sender.send_layer(ticket, layer, pages, 0, 40)
                except TransferError as e:
                    assert how in ("expire", "drop"), e
                    failed = e
                    break
            if how == "stall":
                h.wait_until(lambda: not h.rx.manager.active())
            if how == "sender_cancel":
                sender.cancel(ticket)
                want = FailReason.CANCELLED
            elif how == "receiver_cancel":
                h.wait_until(lambda: h.rx.manager.active()[0].received_upto[0] == 40)
                h.rx.cancel("f")  # thread-safe but asynchronous: it runs on the receiver's loop
                # a FINISH that reached the loop first would fail the half-sent transfer as INCOMPLETE (which it
                # is): the cancel must have landed before the sender finishes for CANCELLED to be the verdict
                h.wait_until(lambda: h.rx.poll("f") is TransferState.FAILED)
                want = FailReason.CANCELLED
            elif how == "drop":
                want = FailReason.PEER_DIED
            elif how == "stall":  # the receiver gives up on a transfer that stopped halfway
                want = FailReason.STALLED
            else:
                want = FailReason.EXPIRED
            if how == "expire":  # the sender refuses an expired ticket before it stages anything
                assert failed is not None and failed.reason is want, failed
            else:
                with pytest.raises(TransferError) as exc:
                    sender.finish(ticket).result(timeout=30)
                assert exc.value.reason is want, exc.value
            with pytest.raises(TransferError):
                h.wait("f", 10)
            h.wait_until(lambda: dst.allocator.num_used == 0 and h.rx.stager.buffers.num_outstanding == 0,
                         timeout_s=10)
            deadline = time.monotonic() + 10
            while sender.stager.buffers.num_outstanding and time.monotonic() < deadline:
                time.sleep(0.02)
            _no_stage_out(sender, h.rx)
            src.allocator.decref(pages)
    finally:
        sender.close()
    assert src.allocator.num_used == 0 and dst.allocator.num_used == 0


@pytest.mark.parametrize("how", ["sender_cancel", "receiver_cancel", "drop", "expire", "stall"])
def test_staged_failures_release_every_stage_and_page(how):
    _fail_case(how)


def test_staged_corrupt_payload_releases_its_stage():
    """A payload whose checksum fails never reaches the pages, and its stage is given back."""
    lay = make_layout(num_layers=2)
    dst = staged_pool(lay)
    with receiver(dst) as h:
        ticket = h.rx.reserve("c", 8)
        peer = RawPeer(h.rx.address)
        peer.handshake(lay, ck="crc32")
        payload = bytes(LayerCodec(lay, WireDType.NATIVE).nbytes(8))
        bad = checksum(ChecksumKind.CRC32, [memoryview(payload)]) ^ 1
        peer.frame(FrameType.LAYER, {"rid": "c", "tid": ticket.ticket_id, "l": 0, "ts": 0, "te": 8,
                                     "pg": pack_u32(ticket.page_ids), "gn": pack_u32(ticket.generations), "tr": True},
                   payload + TRAILER.pack(bad))
        assert peer.expect(FrameType.ABORT)["reason"] == FailReason.CORRUPT.value
        peer.close()
        h.wait_until(lambda: dst.allocator.num_used == 0)
        _no_stage_out(h.rx)


# --- units ---------------------------------------------------------------------------------------

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda: NVIDIA or ROCm)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_write_back_touches_only_the_frames_tokens(device):
    """A frame covering part of a page leaves the page's other tokens alone (another frame wrote them); on a
    GPU the copy is asynchronous and ``release`` waits for it."""
    lay = make_layout(page_size=4)
    pool = KVPool(lay, 16, device=device, force_staged=device == "cpu")
    stager = Stager(pool)
    pages = np.array([5, 2, 9], dtype=np.int64)
    before = pool.flat(0, "latent").clone()
    stage = stager.stage_in(0, pages, 3, 9)  # tokens 3 (page 5), 4-7 (page 2), 8 (page 9)
    for t in stage.sections.values():
        t.view(torch.uint8).fill_(0x7F)
    stager.write_back(stage, pages, 3, 9)
    stage.release()
    after = pool.flat(0, "latent")
    changed = sorted(set((after != before).any(dim=-1).nonzero().flatten().tolist()))
    assert changed == sorted([5 * 4 + 3, 8, 9, 10, 11, 9 * 4])
    assert stager.buffers.num_outstanding == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_stage_out_copies_whole_pages_after_the_forward(device):
    """The D2H of a layer sees what the forward wrote on the compute stream before ``send_layer`` (the side
    stream waits for it), and the stage holds the request's pages in order."""
    lay = make_layout(page_size=4)
    pool = KVPool(lay, 16, device=device, force_staged=device == "cpu")
    stager = Stager(pool)
    pages = np.array([7, 3, 11], dtype=np.int64)
    flat = pool.flat(1, "rope")
    values = torch.randn(12, *flat.shape[1:], device=device).to(flat.dtype)
    slots = torch.tensor([p * 4 + i for p in pages.tolist() for i in range(4)], device=device)
    flat.index_copy_(0, slots, values)  # "the forward", queued on the current stream
    stage = stager.stage_out(1, pages, 2, 11)
    stage.wait()
    assert torch.equal(stage.flat(1, "rope").view(torch.uint8), values.cpu().view(torch.uint8))
    stage.release()
    assert stager.buffers.num_outstanding == 0 and stager.buffers.pin == (device == "cuda")


def test_only_device_or_forced_pools_are_staged():
    lay = make_layout()
    assert not is_staged(KVPool(lay, 4)) and is_staged(KVPool(lay, 4, force_staged=True))
    assert not is_staged(make_pool(lay, 4, shm=True))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_device_pools_transfer_bit_identical(kv_dtype):
    """The real thing: both pools on the GPU, pinned stages, copies on a side stream ordered by events."""
    lay = make_layout(kv_dtype, latent=512, page_size=16)
    src, dst = KVPool(lay, 128, device="cuda"), KVPool(lay, 128, device="cuda")
    fragment(dst, seed=7)
    sender = _sender(src)
    try:
        with receiver(dst) as h:
            ticket = h.rx.reserve("g", 1000)
            pages = src.allocator.alloc(src.pages_for(1000), "req")
            host = KVPool(lay, 128)  # what the forward would have written, made on the CPU
            for layer in range(lay.num_layers):
                write_layer(host, layer, pages, 0, 1000, seed=8)
                for name, t in host.buffers[layer].items():
                    src.buffers[layer][name].copy_(t)
                for name, t in (host.scales[layer] if lay.is_fp8 else {}).items():
                    src.scales[layer][name].copy_(t)
            for ts, te in [(0, 333), (333, 1000)]:
                for layer in range(lay.num_layers):
                    sender.send_layer(ticket, layer, pages, ts, te)
            sender.finish(ticket).result(timeout=60)
            res = h.wait("g")
            assert_landed(src, pages, dst, res, 1000)
            assert sender.stager.buffers.pin and h.rx.stager.buffers.pin
            src.allocator.decref(pages)
            dst.allocator.decref(list(res.page_ids))
            _no_stage_out(sender, h.rx)
    finally:
        sender.close()


def test_staged_layers_queued_behind_a_cut_connection_give_their_stages_back(monkeypatch):
    """Layers staged and queued when the connection drops: the writer is held on the first layer's copy (as
    on a GPU whose D2H has not finished), the receiver's end closes, and every queued layer -- dropped from
    the queue, never written -- gives its stage back, as does the one being waited for."""
    lay = make_layout(num_layers=6)
    src, dst = staged_pool(lay, 64), staged_pool(lay, 64)
    gate = threading.Event()
    real_wait = HostStage.wait

    def held_wait(self):
        gate.wait(10)
        real_wait(self)

    monkeypatch.setattr(HostStage, "ready", property(lambda self: False))
    monkeypatch.setattr(HostStage, "wait", held_wait)
    sender = _sender(src)
    try:
        with receiver(dst) as h:
            t = h.rx.reserve("q", 40)
            pages = src.allocator.alloc(10, "req")
            # connected first: a connection closed mid-handshake would be retried, not lost
            assert sender.open(t).result(timeout=10) is None
            for layer in range(lay.num_layers):
                sender.send_layer(t, layer, pages, 0, 40)
            assert sender.stager.buffers.num_outstanding == lay.num_layers
            for conn in list(h.rx.connections):
                h.lt.call(conn.close)
            deadline = time.monotonic() + 10
            while sender.state(t) is not SendState.FAILED and time.monotonic() < deadline:
                time.sleep(0.01)
            gate.set()
            with pytest.raises(TransferError) as exc:
                sender.finish(t).result(timeout=30)
            assert exc.value.reason is FailReason.PEER_DIED, exc.value
            while sender.stager.buffers.num_outstanding and time.monotonic() < deadline:
                time.sleep(0.02)
            h.rx.cancel("q")  # no frame ever arrived: the reservation is not bound to the lost connection
            h.wait_until(lambda: dst.allocator.num_used == 0)
            _no_stage_out(sender, h.rx)
            src.allocator.decref(pages)
    finally:
        gate.set()
        sender.close()
    assert src.allocator.num_used == 0
