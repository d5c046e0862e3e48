"""Unit tests of the pieces: config, frames, auth, tickets, reservations, payload mapping, shm pool."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from engine.kvcache.pool import KVPool
from kvt_helpers import SECRET, make_layout, make_pool
from kvtransfer import (FailReason, KVReceiverConfig, KVSenderConfig, ShmKVPool, TransferError, TransferState,
                        TransferTicket)
from kvtransfer import auth
from common.env import CLUSTER_SECRET as SECRET_ENV
from kvtransfer.config import WireDType
from kvtransfer.errors import ProtocolError
from kvtransfer.payload import LayerCodec, gather_rows, paired_runs, scatter_rows, slot_runs
from kvtransfer.protocol import (MAX_HEADER_BYTES, MAX_REQ_ID_LEN, FrameType, check_compatible, decode_header,
                                 decode_prefix, encode_frame, peer_info)
from kvtransfer.shm import ShmAttachment, pid_alive, process_start_time
from kvtransfer.ticket import ReservationManager

pytestmark = pytest.mark.timeout(60)


# --- config -------------------------------------------------------------------------------------

def test_non_loopback_bind_needs_a_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="without a cluster secret"):
        KVReceiverConfig(host="0.0.0.0")
    KVReceiverConfig(host="127.0.0.1")
    KVReceiverConfig(host="::1")
    KVReceiverConfig(host="0.0.0.0", cluster_secret=SECRET)
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-123")
    assert KVReceiverConfig(host="0.0.0.0").cluster_secret == b"from-the-environment-123"
    assert KVSenderConfig().cluster_secret == b"from-the-environment-123"
    with pytest.raises(ValueError, match="at least"):
        KVSenderConfig(cluster_secret=b"short")


# --- frames -------------------------------------------------------------------------------------

def test_frame_roundtrip_and_schema():
    fin = {"rid": "r", "tid": "t", "nt": 5, "dh": None, "dc": None}
    raw = encode_frame(FrameType.FINISH, fin)
    prefix = decode_prefix(raw[:16], MAX_HEADER_BYTES, 0)
    h = decode_header(raw[16:16 + prefix.header_len], 0)
    assert h.type is FrameType.FINISH and h.fields == fin
    bad = [({"rid": "r", "tid": "t"}, "fields"), ({**fin, "nt": -1}, "bounds"),
           ({**fin, "nt": "5"}, "bounds"), ({**fin, "rid": ""}, "bounds"),
           ({**fin, "x": 1}, "fields"), ({**fin, "dh": "text"}, "bounds"), ({**fin, "dh": bytes(48 * 1024 + 1)}, "bounds"),
           ({**fin, "dc": -1}, "bounds")]
    for fields, what in bad:
        raw = encode_frame(FrameType.FINISH, fields)
        with pytest.raises(ProtocolError, match=what):
            decode_header(raw[16:], 0)
    with pytest.raises(ProtocolError, match="carry no payload"):
        decode_header(encode_frame(FrameType.FINISH, fin)[16:], 10)
    with pytest.raises(ProtocolError, match="magic"):
        decode_prefix(b"XXXX" + raw[4:16], MAX_HEADER_BYTES, 0)
    with pytest.raises(ProtocolError, match="payload_len"):
        decode_prefix(encode_frame(FrameType.LAYER, {}, 1 << 40)[:16], MAX_HEADER_BYTES, 1 << 20)


def test_handshake_compatibility_lists_every_difference():
    a = peer_info(make_layout().to_dict())
    check_compatible(a, peer_info(make_layout().to_dict()))
    b = peer_info(make_layout("float32", page_size=8).to_dict())
    b["pdserve"] = "9.9.9"
    with pytest.raises(TransferError) as exc:
        check_compatible(a, b)
    assert exc.value.reason is FailReason.INCOMPATIBLE
    for word in ("pdserve", "page_size", "kv_dtype"):
        assert word in exc.value.detail


def test_hmac_proofs_are_bound_to_role_nonces_and_secret():
    s, r = auth.new_nonce(), auth.new_nonce()
    p = auth.make_proof(SECRET, auth.Role.SENDER, s, r)
    assert auth.check_proof(SECRET, auth.Role.SENDER, s, r, p)
    assert not auth.check_proof(SECRET, auth.Role.RECEIVER, s, r, p)  # no reflection
    assert not auth.check_proof(SECRET, auth.Role.SENDER, r, s, p)
    assert not auth.check_proof(b"another-secret-of-some-length", auth.Role.SENDER, s, r, p)
    assert not auth.check_proof(None, auth.Role.SENDER, s, r, p)


# --- tickets and reservations -------------------------------------------------------------------

def make_manager(num_pages: int = 16, **kw) -> tuple[KVPool, ReservationManager]:
    pool = make_pool(make_layout(), num_pages)
    return pool, ReservationManager(pool, host="127.0.0.1", port=1, receiver_id="rx", ticket_ttl_s=kw.pop("ttl", 60),
                                    **kw)


def test_ticket_roundtrip_and_validation():
    _, m = make_manager()
    t = m.reserve("req", 10)
    assert TransferTicket.from_dict(t.to_dict()) == t
    assert t.page_span(3, 9) == slice(0, 3)
    assert list(t.page_ids) == sorted(t.page_ids)
    with pytest.raises(ValueError):
        TransferTicket.from_dict({**t.to_dict(), "page_ids": [1]})
    with pytest.raises(ValueError):
        TransferTicket.from_dict({"req_id": "x"})


def test_a_refused_reservation_holds_no_page(monkeypatch):
    """Issue 25: an id over the data plane's limit used to be refused by TransferTicket *after* the pages
    were allocated, and they never came back."""
    pool, m = make_manager()
    for req_id in ("x" * (MAX_REQ_ID_LEN + 1), ""):
        with pytest.raises(ValueError, match="request id"):
            m.reserve(req_id, 10)
    m.reserve("a", 10)
    with pytest.raises(ValueError, match="already holds"):
        m.reserve("a", 10)
    assert pool.allocator.owners() == {"kvtransfer:a": 3} and m.num_reserved_pages == 3
    # any error after the allocation gives the pages back
    monkeypatch.setattr(pool.allocator, "generations", lambda pages: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        m.reserve("b", 10)
    assert pool.allocator.owners() == {"kvtransfer:a": 3} and m.num_reserved_pages == 3 and m.get("b") is None


def test_reservations_free_exactly_once_and_hand_over_on_claim():
    pool, m = make_manager()
    t = m.reserve("a", 10)
    res = m.get("a")
    assert pool.allocator.owners() == {"kvtransfer:a": 3} and m.num_reserved_pages == 3
    err = TransferError(FailReason.CANCELLED)
    assert m.fail(res, err) and not m.fail(res, err)
    assert pool.allocator.num_used == 0 and m.num_reserved_pages == 0 and res.state is TransferState.FAILED
    assert m.recent_failure("a") is err
    with pytest.raises(ProtocolError) as exc:
        m.lookup("a", t.ticket_id)
    assert exc.value.reason is FailReason.CANCELLED
    t2 = m.reserve("a", 10)
    res2 = m.get("a")
    with pytest.raises(ProtocolError) as exc:
        m.lookup("a", "forged")
    assert exc.value.reason is FailReason.STALE_PAGE
    res2.received_upto = [10] * 3
    m.complete(res2)
    result = m.claim(res2)
    assert result.page_ids == t2.page_ids and pool.allocator.owners() == {"a": 3} and m.num_reserved_pages == 0
    assert not m.fail(res2, err), "a claimed reservation belongs to the decode request"


def test_reaper_decisions():
    pool, m = make_manager(ttl=0.01)
    m.reserve("idle", 4)
    m.reserve("slow", 4)
    m.get("slow").state = TransferState.RECEIVING
    time.sleep(0.02)
    due = {res.req_id: err.reason for res, err in m.due(time.monotonic(), stall_timeout_s=0.001,
                                                         claim_timeout_s=60)}
    assert due == {"idle": FailReason.EXPIRED, "slow": FailReason.STALLED}


def test_shm_writer_keeps_pages_until_drained():
    pool, m = make_manager()
    m.reserve("s", 8)
    res = m.get("s")
    res.shm_writer = object()
    m.fail(res, TransferError(FailReason.PEER_DIED))
    assert res.state is TransferState.DRAINING and pool.allocator.num_used == 2
    m.drained(res)
    assert res.state is TransferState.FAILED and pool.allocator.num_used == 0


# --- payload mapping ----------------------------------------------------------------------------

def test_runs_follow_page_adjacency():
    pages = [5, 6, 7, 2, 3]
    assert slot_runs(pages, 4, 2, 19) == [(22, 10), (8, 7)]
    assert paired_runs(pages, [1, 2, 3, 4, 9], 4, 2, 19) == [(22, 6, 10), (8, 16, 4), (12, 36, 3)]
    assert slot_runs(pages, 4, 5, 6) == [(25, 1)]


@pytest.mark.parametrize("ts,te", [(0, 40), (3, 40), (0, 37), (5, 7), (4, 8), (13, 29)])
def test_gather_scatter_roundtrip(ts, te):
    rows = torch.randint(0, 255, (64, 12), dtype=torch.uint8)
    pages = random.Random(ts * 100 + te).sample(range(16), 10)
    slots = torch.tensor([pages[t // 4] * 4 + t % 4 for t in range(ts, te)])
    got = torch.from_numpy(np.concatenate(gather_rows(rows.numpy(), pages, 4, ts, te)))
    assert torch.equal(got, rows[slots])
    new = torch.randint(0, 255, (te - ts, 12), dtype=torch.uint8)
    before = rows.clone()
    scatter_rows(rows.numpy(), new.numpy(), pages, 4, ts, te)
    assert torch.equal(rows[slots], new)
    mask = torch.ones(64, dtype=torch.bool)
    mask[slots] = False
    assert torch.equal(rows[mask], before[mask]), "scatter touched other slots"


def test_codec_sizes():
    lay = make_layout("bfloat16", latent=32)
    assert LayerCodec(lay, WireDType.NATIVE).bytes_per_token == lay.bytes_per_token_per_layer()
    assert LayerCodec(lay, WireDType.FP8_E4M3).bytes_per_token == (32 + 8 + 16) + 3 * 4
    fp8 = make_layout("fp8_e4m3")
    assert LayerCodec(fp8, WireDType.FP8_E4M3).bytes_per_token == fp8.bytes_per_token_per_layer()


# --- shared memory pool -------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_shm_pool_matches_kvpool_and_is_shared(kv_dtype):
    lay = make_layout(kv_dtype)
    ref, pool = KVPool(lay, 8), ShmKVPool(lay, 8)
    try:
        assert set(vars(ref)) <= set(vars(pool)), "KVPool grew attributes ShmKVPool does not set"
        for layer in range(lay.num_layers):
            for name, t in ref.buffers[layer].items():
                assert pool.buffers[layer][name].shape == t.shape and pool.buffers[layer][name].dtype == t.dtype
                if lay.is_fp8:
                    assert torch.equal(pool.scales[layer][name], ref.scales[layer][name])
        peer = ShmAttachment(pool.segment_name, pool.nonce, lay, 8)
        peer.flat(1, "rope")[5].view(torch.uint8).fill_(7)
        assert (pool.flat(1, "rope")[5].view(torch.uint8) == 7).all()
        with pytest.raises(ValueError, match="header"):
            ShmAttachment(pool.segment_name, b"\0" * 16, lay, 8)
        with pytest.raises(ValueError, match="refusing"):
            ShmAttachment("../etc/passwd", pool.nonce, lay, 8)
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{pool.segment_name}")


def test_pid_liveness_defeats_pid_reuse():
    start = process_start_time(os.getpid())
    assert start is not None and pid_alive(os.getpid(), start)
    assert not pid_alive(os.getpid(), start + 1)
    assert not pid_alive(2**22 + 12345, 0)


def test_shm_pool_refuses_a_segment_that_does_not_fit(monkeypatch, caplog):
    """tmpfs creates an oversized segment fine and SIGBUSes on first touch: refuse it up front (ENOSPC),
    leaving nothing in /dev/shm, and the decode worker falls back to a private pool, saying so."""
    import errno
    from types import SimpleNamespace

    from decode.startup import make_pool as decode_pool
    from kvtransfer import shm
    before = set(os.listdir(shm.SHM_DIR))
    monkeypatch.setattr(shm.os, "statvfs", lambda path: SimpleNamespace(f_bavail=16, f_frsize=4096))
    with pytest.raises(OSError) as exc:
        ShmKVPool(make_layout(), 64)
    assert exc.value.errno == errno.ENOSPC and "shm-size" in str(exc.value)
    assert set(os.listdir(shm.SHM_DIR)) == before
    pool = decode_pool(make_layout(), 64, shm=True)
    assert type(pool) is KVPool and "shared memory failed" in caplog.text


def test_kv_sockets_keep_alive():
    """A peer host that disappears without a FIN is found by TCP keepalive (idle connections too)."""
    import socket

    from kvtransfer.framing import KEEPALIVE_IDLE_S, tune_socket
    with socket.socket() as s:
        tune_socket(s, 0)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S


def test_checksums_match_their_published_check_values():
    """CRC-32C and CRC-32 of "123456789" are the standard check values (RFC 3720 B.4, ISO-HDLC), XXH3-64 of
    the empty input is xxHash's published 0x2D06800538D394C2; every kind chains over split views like one
    pass, which is what lets the receiver hash each piece as it lands."""
    from kvtransfer.config import ChecksumKind
    from kvtransfer.protocol import checksum
    data = memoryview(b"123456789")
    assert checksum(ChecksumKind.CRC32C, [data]) == 0xE3069283
    assert checksum(ChecksumKind.CRC32, [data]) == 0xCBF43926
    assert checksum(ChecksumKind.XXH3, [memoryview(b"")]) == 0x2D06800538D394C2
    big = memoryview(os.urandom(5000))  # past XXH3's 240-byte short-input path and its 1 KiB stripes
    for kind in (ChecksumKind.XXH3, ChecksumKind.CRC32C, ChecksumKind.CRC32):
        assert checksum(kind, [data[:4], data[4:7], data[7:]]) == checksum(kind, [data])
        assert checksum(kind, [big[:1], big[1:1500], big[1500:4097], big[4097:]]) == checksum(kind, [big])
    assert checksum(ChecksumKind.NONE, [data]) is None


@pytest.mark.parametrize("src_kind,dst_kind", [("run", "run"), ("run", "scattered"), ("scattered", "run"),
                                               ("scattered", "scattered")])
@pytest.mark.parametrize("span", [(0, 64), (5, 61), (3, 7), (16, 48)])
def test_copy_pages_puts_every_token_row_in_its_slot(src_kind, dst_kind, span):
    """The shm copy of fragmented pages (records gathered or scattered in one pass where one side is a
    run) against the definition: token t's row goes from src slot pages[t // P] * P + t % P to the same
    token's dst slot, and nothing else in dst changes."""
    from kvtransfer.payload import copy_pages
    P, n_pages, width = 4, 40, 6
    rng = random.Random(hash((src_kind, dst_kind, span)) & 0xFFFF)

    def pages(kind):
        return list(range(7, 7 + 16)) if kind == "run" else rng.sample(range(n_pages), 16)
    sp, dp = pages(src_kind), pages(dst_kind)
    src = torch.randint(0, 255, (n_pages * P, width), dtype=torch.uint8)
    dst = torch.randint(0, 255, (n_pages * P, width), dtype=torch.uint8)
    want = dst.clone()
    for t in range(*span):
        want[dp[t // P] * P + t % P] = src[sp[t // P] * P + t % P]
    copy_pages(src.numpy(), dst.numpy(), sp, dp, P, *span)
    assert torch.equal(dst, want)


def test_segments_of_killed_workers_are_reaped_and_no_others(tmp_path, monkeypatch):
    """SIGKILL skips a pool's finalizer and leaves its /dev/shm segment behind: the next pool created
    on the host removes those of dead pids in our pid namespace, never a live one's or another
    namespace's."""
    import subprocess
    import sys

    from kvtransfer import shm
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    ns = shm._pid_ns()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead = int(dead)
    names = {"dead": f"pdserve-kv-{ns:x}-{dead:x}-00000001", "alive": f"pdserve-kv-{ns:x}-{os.getpid():x}-00000002",
             "other_ns": f"pdserve-kv-{ns + 1:x}-{dead:x}-00000003", "old_name": f"pdserve-kv-{dead:x}-00000004",
             "unrelated": "something-else"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    pool = ShmKVPool(make_layout(), 4)
    try:
        left = set(os.listdir(tmp_path))
        assert names["dead"] not in left
        assert {names[k] for k in ("alive", "other_ns", "old_name", "unrelated")} <= left
        assert pool.segment_name in left and shm.NAME_RE.match(pool.segment_name)
    finally:
        pool.close()


def test_payload_reads_wake_on_a_low_water_mark():
    """While a payload is due the receiving socket wakes the loop only once min(rest of the payload,
    RCVLOWAT_MAX_BYTES) bytes are queued (fewer, larger reads); between frames any byte wakes it, so
    a header or the end of a payload is never left waiting."""
    import socket

    from kvtransfer.framing import RCVLOWAT_MAX_BYTES, FrameReader, PayloadSink
    if not hasattr(socket, "SO_RCVLOWAT"):
        pytest.skip("no SO_RCVLOWAT on this platform")
    n = RCVLOWAT_MAX_BYTES + 1000
    payload, dst, done = os.urandom(n), bytearray(n), []

    class Handler:
        max_header, max_payload = MAX_HEADER_BYTES, 1 << 30

        def on_connected(self, transport):
            pass

        def on_frame(self, header, payload_len):
            assert header.type is FrameType.LAYER and payload_len == n
            return PayloadSink([memoryview(dst)], lambda: done.append(True))

    with socket.socket() as sock:
        class Transport:
            def get_extra_info(self, key):
                return sock if key == "socket" else None

        lowat = lambda: sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)  # noqa: E731
        reader = FrameReader(Handler())
        reader.connection_made(Transport())
        assert lowat() == 1
        frame = encode_frame(FrameType.LAYER, {"rid": "r", "tid": "t", "l": 0, "ts": 0, "te": 1, "pg": b"\0" * 4,
                                               "gn": b"\0" * 4, "tr": False}, n) + payload[:100]

        def deliver(data: bytes) -> None:  # what the event loop does with each recv_into
            while data:
                buf = reader.get_buffer(-1)
                k = min(len(buf), len(data))
                buf[:k] = data[:k]
                reader.buffer_updated(k)
                data = data[k:]

        deliver(frame)  # header + the payload's first 100 bytes
        assert lowat() == RCVLOWAT_MAX_BYTES
        deliver(payload[100:n - 500])
        assert lowat() == 500  # only 500 bytes are still due: wake for exactly those
        deliver(payload[n - 500:])
        assert done and bytes(dst) == payload and lowat() == 1


def test_hashed_payload_reads_are_capped_and_hashed_in_order():
    """A checksummed payload offers the socket at most HASHED_READ_BYTES per read (so each read is hashed
    while it is still in L2), every byte is hashed once and in order whatever the read sizes, the trailer
    is not hashed, and a payload without a checksum offers whole views."""
    from kvtransfer.config import ChecksumKind
    from kvtransfer.framing import HASHED_READ_BYTES, PayloadSink
    from kvtransfer.protocol import checksum, new_digest
    n = 2 * HASHED_READ_BYTES + 12345
    data = os.urandom(n)
    a, b = bytearray(n - 1000), bytearray(1000)
    tail = memoryview(bytearray(8))
    sink = PayloadSink([memoryview(a), memoryview(b)], lambda: None, new_digest(ChecksumKind.XXH3), tail)
    wire = data + b"TRAILER!"
    sizes = []
    while not sink.done:
        view = sink.current()
        sizes.append(view.nbytes)
        k = min(view.nbytes, 300_000 if len(sizes) % 2 else view.nbytes)  # partial and full reads
        view[:k] = wire[n + 8 - sink.remaining:n + 8 - sink.remaining + k]
        sink.advance(k)
    assert max(sizes) == HASHED_READ_BYTES
    assert bytes(a) + bytes(b) == data and bytes(tail) == b"TRAILER!"
    assert sink.digest.intdigest() == checksum(ChecksumKind.XXH3, [memoryview(data)])
    plain = PayloadSink([memoryview(bytearray(n))], lambda: None)
    assert plain.current().nbytes == n
