"""Entry points of the worker processes the kvtransfer tests spawn (multiprocessing 'spawn').

``prefill_worker`` is a simulated prefill worker: for each command it builds a pool,
"computes" each layer of each chunk (writes random KV, optionally sleeping), ships it with
``KVSender`` through its per-layer ``on_layer_done`` exactly as a forward pass would, and reports what
happened: status and reason, timestamps, the source rows, and its pool accounting.
``receiver_worker`` is a decode worker holding one reservation, to be killed or stopped.
"""
from __future__ import annotations

import errno
import logging
import os
import time
import traceback

import torch

from engine.kvcache.layout import KVLayout
from kvtransfer import (ChecksumKind, KVReceiver, KVReceiverConfig, KVSender, KVSenderConfig, LayerSend, LoopThread,
                        SendState, TransferError, TransferTicket, TransportKind, WireDType)
from kvt_helpers import SECRET, fragment, make_pool, token_rows, token_values, write_layer


def prefill_worker(conn) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            conn.send(run_prefill(conn, **cmd))
        except Exception as e:  # report instead of dying: the test prints it
            conn.send({"status": "crash", "error": repr(e), "traceback": traceback.format_exc()})


def _wait_failed(sender: KVSender, ticket: TransferTicket, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sender.state(ticket) is not SendState.FAILED and time.monotonic() < deadline:
        time.sleep(0.02)


def run_prefill(conn, ticket: dict, secret: bytes | None = SECRET, transport: str = "auto", wire: str = "native",
                checksum: str = "xxh3", chunks: list | None = None, layer_delay_s: float = 0.0,
                stall_after: int | None = None, cancel_after: int | None = None, hang_after: int | None = None,
                layout: dict | None = None, seed: int = 0, num_pages: int = 96, finish_timeout_s: float = 10.0,
                send_timeout_s: float = 10.0) -> dict:
    """One request through a simulated prefill; ``*_after`` = number of layer sends before the event."""
    tk = TransferTicket.from_dict(ticket)
    lay = KVLayout.from_dict(layout) if layout else tk.layout
    pool = make_pool(lay, num_pages)
    fragment(pool, seed)
    start_used = pool.allocator.num_used
    pages = pool.allocator.alloc(pool.pages_for(tk.num_tokens), "prefill-req")
    cfg = KVSenderConfig(cluster_secret=secret, transport=TransportKind(transport), wire_dtype=WireDType(wire),
                         checksum=ChecksumKind(checksum), finish_timeout_s=finish_timeout_s,
                         send_timeout_s=send_timeout_s)
    sender = KVSender(pool, cfg)
    out: dict = {"compute_done": [], "status": "done"}
    sent = 0
    try:
        for ts, te in chunks or [(0, tk.num_tokens)]:
            on_layer_done = sender.on_layer_done([LayerSend(tk, pages, ts, te)])
            for layer in range(lay.num_layers):
                time.sleep(layer_delay_s)  # the layer's compute
                write_layer(pool, layer, pages, ts, te, seed)
                out["compute_done"].append(time.monotonic())
                on_layer_done(layer)
                if on_layer_done.errors:
                    raise on_layer_done.errors[tk.req_id]
                sent += 1
                if sent == hang_after:
                    conn.send({"status": "hanging"})
                    time.sleep(3600)  # killed by the test
                if sent == stall_after:
                    _wait_failed(sender, tk, 30.0)  # we stall; the receiver must give up on us
                    raise sender.finish(tk).exception()
                if sent == cancel_after:
                    sender.cancel(tk)
                    _wait_failed(sender, tk, 10.0)
                    raise sender.finish(tk).exception()
        res = sender.finish(tk).result(finish_timeout_s + 5)
        out["transport"] = res.transport.value
        out["num_bytes"] = res.num_bytes
    except TransferError as e:
        out.update(status="error", reason=e.reason.value, detail=e.detail)
    out["rows"] = token_rows(pool, pages, tk.num_tokens)
    out["values"] = token_values(pool, pages, tk.num_tokens)
    pool.allocator.decref(pages)  # the prefill request ends; only the sender's pins could keep pages now
    sender.close(grace_s=1.0)
    out["start_used"], out["end_used"] = start_used, pool.allocator.num_used
    return out


def receiver_worker(conn, layout: dict, num_tokens: int, shm: bool) -> None:
    """Decode worker with one reservation; sends its ticket, then waits to be killed or stopped."""
    torch.set_num_threads(1)
    pool = make_pool(KVLayout.from_dict(layout), 64, shm=shm)
    lt = LoopThread("rx-worker")
    rx = KVReceiver(pool, KVReceiverConfig(cluster_secret=SECRET))
    lt.run(rx.start())
    conn.send(rx.reserve("victim", num_tokens).to_dict())
    conn.recv()


def fill_after_create_worker(conn, shm_dir: str, layout: dict, num_pages: int) -> None:
    """Create a shm pool in ``shm_dir`` (a small tmpfs), fill that tmpfs to the last byte, then write every
    byte of the pool, as decode steps and prefill copies would. A pool whose segment was not reserved at
    creation dies here with SIGBUS."""
    from kvtransfer import shm
    shm.SHM_DIR = shm_dir
    pool = make_pool(KVLayout.from_dict(layout), num_pages, shm=True)
    fd = os.open(f"{shm_dir}/filler", os.O_CREAT | os.O_WRONLY, 0o600)
    chunk = b"\xff" * 4096
    try:
        while os.write(fd, chunk) > 0:
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC, e  # the tmpfs is full now
    finally:
        os.close(fd)
    conn.send("full")
    for per_layer in pool.buffers:
        for t in per_layer.values():
            t.view(-1).view(torch.uint8).fill_(7)
    conn.send(int(sum(int(t.view(torch.uint8).sum() // 7) for per_layer in pool.buffers
                      for t in per_layer.values())))
    pool.close()
