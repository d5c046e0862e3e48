"""Where one KV transfer's time goes: a merged timeline of both processes.

Runs ``bench_kvtransfer``'s prefill side in a spawned process and its decode side here, as the bench
does, with the kvtransfer methods that mark a transfer's phases wrapped to record (start, end) times
(``time.perf_counter``: CLOCK_MONOTONIC, one clock for both processes on Linux). After the warm-up rounds
it prints the last transfer's events in ms from its first ``send_layer``, then a summary: before the first
payload byte moves (validation, pinning, queueing, the shm lease), the payload phase, and after the last
byte (FINISH -> DONE -> the sender's completion).

    .venv/bin/python bench/kvtransfer_timeline.py [--layout default|default-bf16|glm5] [--transport tcp|shm]
        [--checksum xxh3|crc32c|crc32|none] [--rounds 5]

A diagnostic, not a benchmark: the wrappers add a few microseconds per event.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import bench_kvtransfer as bk  # noqa: E402
from engine.defaults import tune_malloc  # noqa: E402
from kvtransfer import ChecksumKind, LoopThread, TransportKind  # noqa: E402
from kvtransfer.frame_writer import FrameWriter  # noqa: E402
from kvtransfer.payload import LayerCodec  # noqa: E402
from kvtransfer.rx_conn import RxConnection  # noqa: E402
from kvtransfer.sender import KVSender  # noqa: E402
from kvtransfer.tx_peer import TxPeer  # noqa: E402

EVENTS: list[tuple[float, str]] = []


def _wrap(cls: type, name: str, tag: str, label=None) -> None:
    """Record ``tag>`` / ``tag<`` around ``cls.name`` (``label(args)`` appends to the tag)."""
    f = getattr(cls, name)

    def mark(args, end: bool) -> None:
        EVENTS.append((time.perf_counter(), f"{tag}{label(args) if label else ''}{'<' if end else '>'}"))

    if inspect.iscoroutinefunction(f):
        @functools.wraps(f)
        async def g(*a, **k):
            mark(a, False)
            try:
                return await f(*a, **k)
            finally:
                mark(a, True)
    else:
        @functools.wraps(f)
        def g(*a, **k):
            mark(a, False)
            try:
                return f(*a, **k)
            finally:
                mark(a, True)
    setattr(cls, name, g)


def instrument_sender() -> None:
    for name in ("send_layer", "_pin", "_enqueue", "complete"):
        _wrap(KVSender, name, "send." + name.lstrip("_"))
    for name in ("_write_layer", "_write_finish"):
        _wrap(TxPeer, name, "send." + name.lstrip("_"))
    _wrap(FrameWriter, "_blocking_send", "send.blocking_send")
    _wrap(LayerCodec, "copy_layer", "send.shm_copy")
    _wrap(LayerCodec, "source_views", "send.source_views")


def instrument_receiver() -> None:
    _wrap(RxConnection, "_dispatch", "recv.", lambda a: a[1].name)
    _wrap(RxConnection, "send", "recv.send ", lambda a: a[1].name)


def prefill_main(conn, layouts: dict, tokens: int) -> None:
    tune_malloc()
    torch.set_num_threads(1)
    instrument_sender()
    p = bk.Prefill(layouts, tokens, "cpu")
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        if cmd[0] == "events":
            conn.send(list(EVENTS))
            EVENTS.clear()
        else:
            conn.send(getattr(p, cmd[0])(*cmd[1:]))
    p.close()


def summary(events: list[tuple[float, str]]) -> str:
    moves = [t for t, n in events if n in ("P send.shm_copy>", "P send.blocking_send>")]
    moved = [t for t, n in events if n in ("P send.shm_copy<", "P send.blocking_send<")]
    ends = [t for t, n in events if n == "P send.complete<"]
    if not moves or not ends:
        return "(no payload or completion events recorded)"
    t0, end = next(t for t, n in events if n == "P send.send_layer>"), ends[-1]
    first, last = min(moves), max(moved)
    return (f"total {1e3 * (end - t0):.2f} ms: before the first payload byte {1e3 * (first - t0):.2f}, payload "
            f"{1e3 * (last - first):.2f}, after the last byte to the sender's completion {1e3 * (end - last):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="default", choices=("default", "default-bf16", "glm5"))
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--checksum", default="xxh3", choices=("xxh3", "crc32c", "crc32", "none"))
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5, help="transfers run; the last one is shown")
    args = ap.parse_args()
    tune_malloc()
    torch.set_num_threads(1)
    instrument_receiver()
    layout = bk.layouts()[args.layout]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, {args.layout: layout.to_dict()}, args.tokens))
    proc.start()
    assert conn.recv() == "ready"
    lt = LoopThread("timeline-rx")
    bench = bk.Bench(conn, lt, args.layout, layout, args.tokens, "cpu", "tcp")
    transport = TransportKind(args.transport)
    checksum = ChecksumKind.NONE if transport is TransportKind.SHM else ChecksumKind(args.checksum)
    try:
        for _ in range(args.rounds):
            conn.send(("events",))
            conn.recv()
            EVENTS.clear()
            sample = bench.kv(args.transport, transport, checksum)
            conn.send(("events",))
            child_events = conn.recv()
        events = sorted([(t, "P " + n) for t, n in child_events] + [(t, "D " + n) for t, n in EVENTS])
        t0 = next(t for t, n in events if n == "P send.send_layer>")
        print(f"{args.layout} layout, {args.transport}, checksum {checksum.value}, {args.tokens} tokens: "
              f"{1e3 * sample.seconds:.2f} ms as the bench times it (P = prefill process, D = decode process)")
        for t, n in events:
            print(f"{1e3 * (t - t0):9.3f}  {n}")
        print(summary(events))
    finally:
        bench.close()
        conn.send(None)
        proc.join(30)
        lt.stop()


if __name__ == "__main__":
    main()
