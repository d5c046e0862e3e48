"""Factories shared by the kvtransfer tests (and imported by the spawned worker processes)."""
from __future__ import annotations

import contextlib
import random
import socket
import time
from typing import Iterator

import torch

from engine.kvcache.layout import KVComponent, KVLayout
from engine.kvcache.pool import KVPool
from kvtransfer import KVReceiver, KVReceiverConfig, LoopThread, ShmKVPool
from kvtransfer import auth
from kvtransfer.protocol import (PDSERVE_KV_PROTOCOL_VERSION, PREFIX, FrameType, Header, decode_header, decode_prefix,
                                 encode_frame, peer_info)
from kvtransfer.shm import host_id

SECRET = b"test-cluster-secret-0123456789"


def make_layout(kv_dtype: str = "bfloat16", kind: str = "mla", num_layers: int = 3, page_size: int = 4,
                latent: int = 32) -> KVLayout:
    """Tiny layouts; the last layer stands for the MTP layer (just another index in the pool)."""
    if kind == "mla":
        comps = (KVComponent("latent", (latent,)), KVComponent("rope", (8,)), KVComponent("index", (16,)))
        return KVLayout("glm_moe_dsa", num_layers, page_size, kv_dtype, comps)
    comps = (KVComponent("k", (2, 16)), KVComponent("v", (2, 16)))
    return KVLayout("glm4_moe", num_layers, page_size, kv_dtype, comps)


def make_pool(layout: KVLayout, num_pages: int = 64, shm: bool = False) -> KVPool:
    return ShmKVPool(layout, num_pages) if shm else KVPool(layout, num_pages)


def fragment(pool: KVPool, seed: int = 0) -> None:
    """Shuffle the free list so the next allocations get scattered page ids (a long-running pool)."""
    pages = pool.allocator.alloc(pool.allocator.num_free, "fragment")
    random.Random(seed).shuffle(pages)
    pool.allocator.decref(pages)


def write_layer(pool: KVPool, layer: int, pages: list[int], token_start: int, token_end: int, seed: int) -> None:
    """What a forward pass does: store this layer's KV for tokens [token_start, token_end)."""
    g = torch.Generator().manual_seed(seed * 1000 + layer * 7 + token_start)
    P = pool.page_size
    slots = torch.tensor([pages[t // P] * P + t % P for t in range(token_start, token_end)])
    for c in pool.layout.components:
        values = torch.randn((token_end - token_start, *c.shape), generator=g) * 3
        pool.write(layer, c.name, slots, values)


def token_rows(pool: KVPool, pages: list[int], num_tokens: int) -> dict[tuple[int, str, bool], torch.Tensor]:
    """Every (layer, component, is_scale) as raw bytes in token order: equal <=> bit-identical."""
    P = pool.page_size
    slots = torch.tensor([pages[t // P] * P + t % P for t in range(num_tokens)])
    out = {}
    for layer in range(pool.layout.num_layers):
        for c in pool.layout.components:
            out[(layer, c.name, False)] = pool.flat(layer, c.name).view(torch.uint8)[slots].clone()
            if pool.layout.is_fp8:
                out[(layer, c.name, True)] = pool.flat_scale(layer, c.name)[slots].clone()
    return out


def assert_landed(src: KVPool, pages: list[int], dst: KVPool, res, num_tokens: int) -> None:
    """The pages ``res`` (a TransferResult) landed in ``dst`` hold exactly what ``src``'s ``pages`` hold for the
    first ``num_tokens`` tokens: every layer, every part, bit for bit."""
    got, want = token_rows(dst, list(res.page_ids), num_tokens), token_rows(src, pages, num_tokens)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key].cpu(), want[key].cpu()), f"{key} differs"


def token_values(pool: KVPool, pages: list[int], num_tokens: int) -> dict[tuple[int, str], torch.Tensor]:
    P = pool.page_size
    slots = torch.tensor([pages[t // P] * P + t % P for t in range(num_tokens)])
    return {(layer, c.name): pool.read(layer, c.name, slots, torch.float32)
            for layer in range(pool.layout.num_layers) for c in pool.layout.components}


class ReceiverHarness:
    """A ``KVReceiver`` on its own loop thread, driven synchronously by a test."""

    def __init__(self, pool: KVPool, **cfg) -> None:
        self.pool = pool
        self.lt = LoopThread("test-rx")
        self.rx = KVReceiver(pool, KVReceiverConfig(**{"cluster_secret": SECRET, **cfg}))
        self.lt.run(self.rx.start())

    def wait(self, req_id: str, timeout_s: float = 30.0):
        return self.lt.run(self.rx.wait_complete(req_id, timeout_s))

    def wait_until(self, pred, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout_s}s; stats {self.rx.stats()}")
            time.sleep(0.02)

    def close(self) -> None:
        self.lt.run(self.rx.stop(grace_s=0.5))
        self.lt.stop()
        if isinstance(self.pool, ShmKVPool):
            self.pool.close()


@contextlib.contextmanager
def receiver(pool: KVPool, **cfg) -> Iterator[ReceiverHarness]:
    h = ReceiverHarness(pool, **cfg)
    try:
        yield h
    finally:
        h.close()


class RawPeer:
    """A hand-driven sender on a blocking socket: for hostile and corrupt frames."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 5.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)

    def handshake(self, layout: KVLayout, secret: bytes | None = SECRET, wire: str = "native",
                  ck: str | None = None) -> dict:
        """``ck``: the checksum kind to announce (None: announce none; the receiver then assumes the protocol default, crc32)."""
        nonce = auth.new_nonce()
        self.frame(FrameType.HELLO, {"v": PDSERVE_KV_PROTOCOL_VERSION, "n": nonce})
        ch = self.expect(FrameType.CHALLENGE)
        extra = {} if ck is None else {"ck": ck}
        info = peer_info(layout.to_dict(), host_id=host_id(), pid=0, pid_start=0, wire=wire, **extra)  # pid 0: no shm
        self.frame(FrameType.AUTH, {"p": auth.make_proof(secret, auth.Role.SENDER, nonce, ch["n"]), "info": info})
        return self.expect(FrameType.READY)["info"]

    def frame(self, ftype: FrameType, fields: dict, payload: bytes = b"") -> None:
        self.sock.sendall(encode_frame(ftype, fields, len(payload)) + payload)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> Header:
        prefix = decode_prefix(self._exactly(PREFIX.size), 1 << 20, 0)
        return decode_header(self._exactly(prefix.header_len), 0)

    def expect(self, ftype: FrameType) -> dict:
        h = self.read()
        if h.type is not ftype:
            raise AssertionError(f"expected {ftype.name}, got {h.type.name} {h.fields}")
        return h.fields

    def closed_by_peer(self) -> bool:
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionError, socket.timeout):
            return False

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("receiver closed the connection")
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()
