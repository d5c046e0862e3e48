"""Transfers between two processes on loopback: exact pages, both transports, streaming overlap."""
from __future__ import annotations

import logging

import pytest
import torch

from kvt_helpers import (SECRET, fragment, make_layout, make_pool, receiver, token_rows, token_values, write_layer)
from kvtransfer import FailReason, KVSender, KVSenderConfig, LayerSend, TransferError, TransportKind

pytestmark = pytest.mark.timeout(120)


def assert_same_rows(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs"


def transfer(prefill, pool, num_tokens: int, **cmd):
    """Reserve on ``pool``, let the prefill process push, return (its report, our TransferResult)."""
    start = pool.allocator.num_used
    with receiver(pool) as h:
        ticket = h.rx.reserve("req-1", num_tokens)
        report = prefill.run(ticket=ticket.to_dict(), **cmd)
        assert report["status"] == "done", report
        result = h.wait("req-1")
    assert report["end_used"] == report["start_used"], "prefill pages leaked"
    rows = token_rows(pool, list(result.page_ids), num_tokens)
    values = token_values(pool, list(result.page_ids), num_tokens)
    pool.allocator.decref(list(result.page_ids))
    assert pool.allocator.num_used == start, "decode pages leaked"
    return report, result, rows, values


@pytest.mark.parametrize("kv_dtype,kind", [("bfloat16", "mla"), ("float32", "mla"), ("fp8_e4m3", "mla"),
                                           ("bfloat16", "gqa")])
def test_tcp_transfer_is_bit_identical(prefill, kv_dtype, kind):
    pool = make_pool(make_layout(kv_dtype, kind), 96)
    fragment(pool, seed=1)  # scattered decode pages: staging + page scatter on receive
    report, result, rows, _ = transfer(prefill, pool, 45, transport="tcp", chunks=[(0, 18), (18, 45)])
    assert result.transport is TransportKind.TCP and report["transport"] == "tcp"
    assert_same_rows(rows, report["rows"])
    assert result.num_bytes == report["num_bytes"] == pool.layout.bytes_per_token_per_layer() * 45 * 3


def test_large_contiguous_transfer_lands_in_place(prefill):
    """Long page runs on both sides: payloads go straight from page memory to page memory."""
    pool = make_pool(make_layout("bfloat16", latent=512, page_size=16), 160)
    report, result, rows, _ = transfer(prefill, pool, 2000, transport="tcp", num_pages=140, chunks=[(0, 1000),
                                                                                                  (1000, 2000)])
    assert_same_rows(rows, report["rows"])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_shm_transfer_is_bit_identical(prefill, kv_dtype):
    pool = make_pool(make_layout(kv_dtype), 96, shm=True)
    fragment(pool, seed=2)
    report, result, rows, _ = transfer(prefill, pool, 45, transport="auto", chunks=[(0, 18), (18, 45)])
    assert result.transport is TransportKind.SHM and report["transport"] == "shm"
    assert_same_rows(rows, report["rows"])


def test_shm_pool_can_be_forced_to_tcp(prefill):
    pool = make_pool(make_layout(), 64, shm=True)
    report, result, rows, _ = transfer(prefill, pool, 30, transport="tcp")
    assert result.transport is TransportKind.TCP
    assert_same_rows(rows, report["rows"])


def test_fp8_on_the_wire_halves_bytes(prefill):
    pool = make_pool(make_layout("bfloat16", latent=256), 64)
    report, result, _, values = transfer(prefill, pool, 40, transport="tcp", wire="fp8_e4m3")
    native = pool.layout.bytes_per_token_per_layer() * 40 * 3
    assert result.num_bytes < 0.55 * native  # 1 byte per value + one fp32 scale per token and component
    for key, want in report["values"].items():
        got = values[key]
        amax = want.abs().amax(dim=-1, keepdim=True)
        # e4m3 keeps 3 mantissa bits (half-ulp error <= 1/16 relative), bf16 storage adds 2^-8
        assert ((got - want).abs() <= want.abs() / 14 + amax / 448 + 1e-6).all(), key


def test_layers_stream_while_later_layers_compute(prefill):
    """The first layer is in decode memory before the prefill has computed the last one."""
    pool = make_pool(make_layout(num_layers=5), 64)
    report, result, rows, _ = transfer(prefill, pool, 40, transport="tcp", layer_delay_s=0.15)
    compute_done = report["compute_done"]  # time.monotonic() is one clock for all processes of a host
    arrived = result.layer_done_at_s
    assert arrived[0] < compute_done[-1], (arrived, compute_done)
    assert all(a >= c for a, c in zip(arrived, compute_done)), "a layer arrived before it was computed?"
    assert list(arrived) == sorted(arrived)
    assert_same_rows(rows, report["rows"])


def test_forced_shm_falls_back_to_tcp_with_a_warning(caplog):
    """In-process: a receiver without a shm pool, and one whose segment vanished."""
    lay = make_layout()
    for shm_pool in (False, True):
        src = make_pool(lay, 32)
        dst = make_pool(lay, 32, shm=shm_pool)
        if shm_pool:
            dst.close()  # unlink the name: the sender's attach fails
        pages = src.allocator.alloc(5, "req")
        for layer in range(lay.num_layers):
            write_layer(src, layer, pages, 0, 20, seed=3)
        with receiver(dst) as h, caplog.at_level(logging.WARNING, logger="kvtransfer"):
            ticket = h.rx.reserve("r", 20)
            sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.SHM))
            for layer in range(lay.num_layers):
                sender.send_layer(ticket, layer, pages, 0, 20)
            assert sender.finish(ticket).result(10).transport is TransportKind.TCP
            res = h.wait("r")
            assert_same_rows(token_rows(dst, list(res.page_ids), 20), token_rows(src, pages, 20))
            sender.close()
        assert any("TCP" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        caplog.clear()


def test_a_batch_multiplexes_one_connection():
    """One forward pass over three requests (two chunks each): one on_layer_done call per layer ships every
    request; a request cancelled by its decode side does not disturb the other two."""
    lay = make_layout(num_layers=4)
    src, dst = make_pool(lay, 64), make_pool(lay, 64)
    fragment(src, seed=5)
    start_src, start_dst = src.allocator.num_used, dst.allocator.num_used
    lengths = {"a": 30, "b": 17, "c": 41}
    pages = {req_id: src.allocator.alloc(src.pages_for(n), req_id) for req_id, n in lengths.items()}
    with receiver(dst) as h:
        tickets = {req_id: h.rx.reserve(req_id, n) for req_id, n in lengths.items()}
        sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.TCP))
        for chunk in range(2):
            sends = []
            for req_id, n in lengths.items():
                ts, te = (0, n // 2) if chunk == 0 else (n // 2, n)
                sends.append(LayerSend(tickets[req_id], pages[req_id], ts, te))
            on_layer_done = sender.on_layer_done(sends)
            for layer in range(lay.num_layers):
                for s in sends:
                    write_layer(src, layer, pages[s.ticket.req_id], s.token_start, s.token_end, seed=7)
                on_layer_done(layer)
                if chunk == 0 and layer == 1:
                    h.rx.cancel("b")
        futures = {req_id: sender.finish(t) for req_id, t in tickets.items() if req_id not in on_layer_done.errors}
        for req_id in ("a", "c"):
            assert futures[req_id].result(10).transport is TransportKind.TCP
            res = h.wait(req_id)
            assert_same_rows(token_rows(dst, list(res.page_ids), lengths[req_id]),
                             token_rows(src, pages[req_id], lengths[req_id]))
            dst.allocator.decref(list(res.page_ids))
        with pytest.raises(TransferError) as exc:
            (futures.get("b") or sender.finish(tickets["b"])).result(10)
        assert exc.value.reason is FailReason.CANCELLED
        assert h.rx.stats().num_connections == 1
        sender.close()
    for p in pages.values():
        src.allocator.decref(p)
    assert src.allocator.num_used == start_src and dst.allocator.num_used == start_dst


@pytest.mark.parametrize("shm", [False, True])
def test_long_request_spans_more_pages_than_one_frame_names(prefill, shm):
    """page_size 1 and 9000 tokens: every layer is split into frames of at most 4096 pages."""
    pool = make_pool(make_layout(page_size=1), 9200, shm=shm)
    fragment(pool, seed=3)
    report, result, rows, _ = transfer(prefill, pool, 9000, transport="auto", num_pages=9100,
                                       chunks=[(0, 5000), (5000, 9000)])
    assert result.transport is (TransportKind.SHM if shm else TransportKind.TCP)
    assert_same_rows(rows, report["rows"])


@pytest.mark.parametrize("cached", [0, 12])
def test_prefill_transfer_sink_opens_the_shm_lease_before_its_first_layer(cached):
    """The prefill worker's ``TransferSink.start`` opens the transfer: over shm the receiver has granted
    the lease (the reservation is under way) before the first chunk's first layer is computed. The KV then
    arrives bit-identical, cached prefix included, and both pools end where they started."""
    from kvtransfer import TransferState
    from prefill.transfer import TransferSink
    lay = make_layout(num_layers=3)
    dst, src = make_pool(lay, 64, shm=True), make_pool(lay, 64)
    d0, s0 = dst.allocator.num_used, src.allocator.num_used
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.AUTO))
    try:
        with receiver(dst) as h:
            ticket = h.rx.reserve("sink", 30)
            pages = src.allocator.alloc(8, "req")
            for layer in range(lay.num_layers if cached else 0):  # the cached prefix is already in the pool
                write_layer(src, layer, pages, 0, cached, seed=5)
            sink = TransferSink(sender, ticket, lay.num_layers, timeout_s=30)
            sink.start(pages, cached)
            if not cached:
                h.wait_until(lambda: h.rx.manager.active()[0].state is TransferState.RECEIVING, timeout_s=10)
                assert src.allocator.num_used == s0 + 8, "nothing pinned before the first layer"
            for layer in range(lay.num_layers):
                write_layer(src, layer, pages, cached, 30, seed=6)
                sink.send(layer, cached, 30)
            assert sink.finish().result(timeout=30).num_bytes > 0
            res = h.wait("sink")
            assert_same_rows(token_rows(dst, list(res.page_ids), 30), token_rows(src, pages, 30))
            assert res.transport is TransportKind.SHM
            dst.allocator.decref(list(res.page_ids))
            src.allocator.decref(pages)
            assert dst.allocator.num_used == d0
    finally:
        sender.close()
    assert src.allocator.num_used == s0
