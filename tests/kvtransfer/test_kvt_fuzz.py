"""A hostile peer sends malformed, truncated and oversized frames: each is rejected, the receiver
stays healthy (pool accounting intact) and the next good transfer is bit-identical."""
from __future__ import annotations

import socket
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvt_helpers import SECRET, RawPeer, ReceiverHarness, make_layout, make_pool, token_rows, write_layer
from kvtransfer import KVSender, KVSenderConfig, TransferState, TransportKind
from kvtransfer.protocol import MAGIC, PREFIX, FrameType, pack_u32

pytestmark = pytest.mark.timeout(120)

LAYOUT = make_layout()


class World:
    def __init__(self) -> None:
        self.pool = make_pool(LAYOUT, 64)
        self.h = ReceiverHarness(self.pool, handshake_timeout_s=1.0)
        self.src = make_pool(LAYOUT, 16)
        self.src_pages = self.src.allocator.alloc(5, "src")
        for layer in range(LAYOUT.num_layers):
            write_layer(self.src, layer, self.src_pages, 0, 20, seed=9)
        self.sender = KVSender(self.src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.TCP))
        self.start_used = self.pool.allocator.num_used
        self.n = 0

    def good_transfer(self) -> None:
        self.n += 1
        ticket = self.h.rx.reserve(f"good-{self.n}", 20)
        for layer in range(LAYOUT.num_layers):
            self.sender.send_layer(ticket, layer, self.src_pages, 0, 20)
        self.sender.finish(ticket).result(10)
        res = self.h.wait(ticket.req_id)
        got = token_rows(self.pool, list(res.page_ids), 20)
        want = token_rows(self.src, self.src_pages, 20)
        assert all(torch.equal(got[k], want[k]) for k in want)
        self.pool.allocator.decref(list(res.page_ids))

    def close(self) -> None:
        self.sender.close(grace_s=0.5)
        self.h.close()


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20)


@st.composite
def hostile_layer_fields(draw, ticket):
    """LAYER headers close to valid: right or wrong ids, ranges, page lists, checksums."""
    span = ticket.page_span(0, 20)
    return {"rid": draw(st.sampled_from([ticket.req_id, "nope", ""])),
            "tid": draw(st.sampled_from([ticket.ticket_id, "0" * 32])),
            "l": draw(st.integers(-1, 70000)), "ts": draw(st.integers(-1, 30)), "te": draw(st.integers(-1, 2**33)),
            "pg": draw(st.sampled_from([pack_u32(ticket.page_ids[span]), b"\0\0\0", b"", pack_u32([63] * 5)])),
            "gn": draw(st.sampled_from([pack_u32(ticket.generations[span]), pack_u32([7] * 5)])),
            "tr": draw(st.booleans() | st.none() | st.integers(0, 1))}


def _frame(header: bytes, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, len(header), payload_len) + header


@st.composite
def attacks(draw, ticket):
    kind = draw(st.sampled_from(["bytes", "prefix", "msgpack", "layer", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=2048))
    if kind == "prefix":  # sane or absurd lengths, then whatever
        magic = draw(st.sampled_from([MAGIC, b"PDKX"]))
        return struct.pack("!4sIQ", magic, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**64 - 1))) + \
            draw(st.binary(max_size=256))
    if kind == "msgpack":
        obj = draw(st.dictionaries(st.sampled_from(["t", "rid", "tid", "l", "ts", "te", "pg", "gn", "tr", "crc", "x"]),
                                   msgpack_values, max_size=9))
        if draw(st.booleans()):
            obj["t"] = draw(st.sampled_from([int(t) for t in FrameType] + [0, 99]))
        header = msgpack.packb(obj, use_bin_type=True)
        payload = draw(st.binary(max_size=512))
        return _frame(header, len(payload)) + payload
    fields = draw(hostile_layer_fields(ticket))
    header = msgpack.packb({"t": int(FrameType.LAYER), **fields}, use_bin_type=True)
    declared = draw(st.integers(0, 4096))
    payload = draw(st.binary(min_size=declared, max_size=declared))
    if kind == "truncated":
        return _frame(header, declared + draw(st.integers(1, 1000))) + payload
    return _frame(header, declared) + payload


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data(), authenticate=st.booleans())
def test_hostile_frames_leave_the_receiver_healthy(world, data, authenticate):
    world.n += 1
    target = world.h.rx.reserve(f"target-{world.n}", 20)
    try:
        attack = data.draw(attacks(target))
        peer = RawPeer(world.h.rx.address, timeout_s=2.0)
        try:
            if authenticate:
                peer.handshake(LAYOUT)
            peer.send(attack)
        except (ConnectionError, socket.timeout):
            pass  # the receiver may hang up on us mid-attack: that is a rejection too
        finally:
            peer.close()
    finally:
        world.h.rx.cancel(target.req_id)
        world.h.wait_until(lambda: world.h.rx.poll(target.req_id) in (None, TransferState.FAILED))
    world.h.wait_until(lambda: world.pool.allocator.num_used == world.start_used)
    world.good_transfer()
    world.h.wait_until(lambda: world.h.rx.stats().num_connections <= 1)  # hostile connections are gone
    assert world.pool.allocator.num_used == world.start_used
