"""The speculative draft state travels in FINISH (issue 24): bit-identical, checksummed, and a pair of
workers whose speculative configs disagree fails the transfer with a clear error, every page back."""
from __future__ import annotations

import os
import zlib

import pytest
from test_kvt_failures import _layer_frame

from kvt_helpers import SECRET, RawPeer, make_layout, make_pool, receiver, write_layer
from kvtransfer import FailReason, KVSender, KVSenderConfig, TransferError, TransportKind
from kvtransfer.config import ChecksumKind, DraftLayout, WireDType
from kvtransfer.payload import LayerCodec
from kvtransfer.protocol import FrameType
from kvtransfer.ticket import TransferTicket

pytestmark = pytest.mark.timeout(120)
DRAFT = DraftLayout(hidden_size=96, dtype="bfloat16")


def push(sender, src, ticket, num_tokens, draft):
    """Every layer of ``num_tokens`` tokens from fresh source pages, then FINISH with ``draft``."""
    lay = src.layout
    pages = src.allocator.alloc(src.pages_for(num_tokens), "req")
    try:
        for layer in range(lay.num_layers):
            write_layer(src, layer, pages, 0, num_tokens, seed=layer)
            sender.send_layer(ticket, layer, pages, 0, num_tokens)
        return sender.finish(ticket, draft).result(30)
    finally:
        src.allocator.decref(pages)


@pytest.mark.parametrize("transport,checksum", [(TransportKind.TCP, ChecksumKind.XXH3),
                                                (TransportKind.AUTO, ChecksumKind.CRC32C),
                                                (TransportKind.TCP, ChecksumKind.NONE)])
def test_draft_state_arrives_with_the_kv(transport, checksum):
    lay = make_layout(num_layers=3)
    dst, src = make_pool(lay, 64, shm=transport is TransportKind.AUTO), make_pool(lay, 64)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=transport, checksum=checksum))
    draft = os.urandom(DRAFT.num_bytes)
    try:
        with receiver(dst, draft=DRAFT, require_checksum=checksum is not ChecksumKind.NONE) as h:
            ticket = h.rx.reserve("d", 21)
            assert TransferTicket.from_dict(ticket.to_dict()).draft == DRAFT  # travels with the ticket
            push(sender, src, ticket, 21, draft)
            res = h.wait("d")
            assert res.draft == draft
            dst.allocator.decref(list(res.page_ids))
            assert dst.allocator.num_used == 0
    finally:
        sender.close()
    assert src.allocator.num_used == 0


def test_speculating_decode_and_a_prefill_without_draft_state_fail_clearly():
    """The decode worker speculates (its tickets ask for a draft state); this prefill worker has none (no MTP
    layer) or one of another size: the sender refuses at FINISH and the receiver frees the pages."""
    lay = make_layout(num_layers=3)
    dst, src = make_pool(lay, 64), make_pool(lay, 64)
    sender = KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.TCP))
    try:
        with receiver(dst, draft=DRAFT) as h:
            for i, draft in enumerate((None, b"\0" * (DRAFT.num_bytes - 2))):
                ticket = h.rx.reserve(f"x{i}", 10)
                with pytest.raises(TransferError, match="draft state") as e:
                    push(sender, src, ticket, 10, draft)
                assert e.value.reason is FailReason.INCOMPATIBLE
                with pytest.raises(TransferError):
                    h.wait(f"x{i}", 10)
            h.wait_until(lambda: dst.allocator.num_used == 0, 10)
        with receiver(dst) as h:  # and the other way round: a draft state nobody asked for
            ticket = h.rx.reserve("y", 10)
            with pytest.raises(TransferError, match="no draft state"):
                push(sender, src, ticket, 10, b"\0" * 8)
            h.wait_until(lambda: dst.allocator.num_used == 0, 10)
    finally:
        sender.close()
    assert src.allocator.num_used == 0


@pytest.mark.parametrize("dh,dc,reason", [(None, None, "INCOMPLETE"), (b"\1" * 192, 12345, "CORRUPT"),
                                          (b"\1" * 190, None, "INCOMPLETE")])
def test_receiver_checks_the_draft_state_of_a_raw_finish(dh, dc, reason):
    """A FINISH that lacks the asked-for draft state, has the wrong size or a bad checksum fails the
    reservation (its pages freed), never completes it."""
    lay = make_layout(num_layers=2, page_size=4)
    dst = make_pool(lay, 32)
    with receiver(dst, draft=DRAFT) as h:
        ticket = h.rx.reserve("raw", 8)
        peer = RawPeer(h.rx.address)
        peer.handshake(lay)
        codec = LayerCodec(lay, WireDType.NATIVE)
        for layer in range(lay.num_layers):
            payload = os.urandom(codec.nbytes(8))
            peer.frame(FrameType.LAYER, *_layer_frame(ticket, layer, 0, 8, payload, zlib.crc32(payload)))
        peer.frame(FrameType.FINISH, {"rid": "raw", "tid": ticket.ticket_id, "nt": 8, "dh": dh, "dc": dc})
        assert peer.expect(FrameType.ABORT)["reason"] == FailReason[reason].value
        with pytest.raises(TransferError):
            h.wait("raw", 10)
        h.wait_until(lambda: dst.allocator.num_used == 0, 10)
        peer.close()
