"""``--fault``: flag parsing and the fault report's arithmetic on synthetic records with known answers;
``kv-slowloris`` against a real KV receiver; ``slow-readers`` against a real router."""
import asyncio
import logging
import os
import sys
import time

import pytest

from bench.loadgen.config import BenchConfig
from bench.loadgen.fault import SLOW_READER_STREAMS, KVSlowloris, fault_stats, format_fault
from bench.loadgen.runner import OK, RequestRecord
from bench.loadgen.sweep import run_sweep_async
from engine.kvcache.layout import KVComponent, KVLayout
from engine.kvcache.pool import KVPool
from kvtransfer import KVReceiver, KVReceiverConfig, LoopThread


def test_fault_flag_parsing():
    assert BenchConfig(rps=(1,), fault="kill-decode@30s").fault_spec() == ("kill-decode", 30.0)
    assert BenchConfig(rps=(1,), fault="kill-prefill@2.5").fault_spec() == ("kill-prefill", 2.5)
    assert BenchConfig(rps=(1,)).fault_spec() is None
    for bad in ("kill-router@3s", "kill-decode", "kill-decode@-1s", "kill-decode@soon"):
        with pytest.raises(ValueError, match="KIND@SECONDS"):
            BenchConfig(rps=(1,), fault=bad)
    assert BenchConfig(rps=(1,), fault="drop-kv@30s").fault_spec() == ("drop-kv", 30.0)
    assert BenchConfig(rps=(1,), fault="kv-slowloris@2s").fault_spec() == ("kv-slowloris", 2.0)


def rec(t_send, chunks, status=OK, failovers=0, retries=0):
    r = RequestRecord(0, 10, len(chunks), t_send, t_send=t_send, t_first=chunks[0] if chunks else None,
                      t_end=chunks[-1] if chunks else t_send + 1, chunk_times=list(chunks),
                      chunk_tokens=[1] * len(chunks), status=status)
    r.failovers, r.retries = failovers, retries
    return r


def test_fault_stats_counts_and_penalties():
    fault = {"kind": "kill-decode", "planned_at_s": 5.0, "at_s": 5.0, "worker": "decode-1", "address": "a:1"}
    records = [
        rec(0.0, [0.1, 0.2, 0.3]),                           # done before the fault: undisturbed, ITL 0.1
        rec(4.0, [4.2, 4.3, 5.8, 5.9], failovers=1),         # in flight, failed over: 1.5 s gap
        rec(4.5, [4.6, 4.7, 5.2, 5.3], failovers=1),         # in flight, failed over: 0.5 s gap
        rec(4.8, [], status="UNAVAILABLE"),                  # in flight, failed
        rec(6.0, [6.4, 6.5], retries=1),                     # prefill retried: TTFT 0.4
        rec(7.0, [7.2, 7.3]),                                # after: undisturbed, TTFT 0.2, ITL 0.1
    ]
    f = fault_stats(fault, records)
    assert (f["in_flight_at_fault"], f["completed"], f["failed_over"], f["retried_prefill"], f["failed"],
            f["failed_in_flight"]) == (3, 5, 2, 1, 1, 1)
    assert f["ttft_p50_s"]["retried"] == pytest.approx(0.4)
    assert f["ttft_p50_s"]["undisturbed"] == pytest.approx(0.15)
    assert f["itl_s"]["failover_gap_max"] == pytest.approx(1.5)
    assert f["itl_s"]["failover_gap_p50"] == pytest.approx(1.0)
    assert f["itl_s"]["undisturbed_p50"] == pytest.approx(0.1)
    text = format_fault(f)
    assert "killed decode-1" in text and "failed over 2" in text and "failed 1 (1 of those in flight)" in text


def test_fault_not_injected_is_reported_not_hidden():
    f = fault_stats({"kind": "kill-decode", "planned_at_s": 3.0, "error": "no healthy decode worker reports a pid"},
                    [])
    assert "not injected: no healthy decode worker" in format_fault(f)


def fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own fd
    return out


def test_kv_slowloris_holds_reopens_and_closes_every_connection():
    """Against a real receiver whose handshake timeout is 0.5 s: the slow connections are opened, closed by
    the receiver, re-opened; ``close()`` leaves no connection on either side."""
    layout = KVLayout("glm4_moe", 2, 4, "bfloat16", (KVComponent("k", (2, 16)), KVComponent("v", (2, 16))))
    lt = LoopThread("test-slowloris-rx")
    rx = KVReceiver(KVPool(layout, 8), KVReceiverConfig(cluster_secret=b"s" * 16, handshake_timeout_s=0.5))
    lt.run(rx.start())
    fds0 = fds()

    async def attack() -> dict:
        holder = KVSlowloris([rx.address], num_per_port=10, reopen_s=0.1)
        holder.start()
        await asyncio.sleep(1.5)
        return await holder.close()

    try:
        done = asyncio.run(attack())
        assert done["slow_opened"] >= 20 and done["slow_closed_by_receiver"] >= 10, done
        deadline = time.monotonic() + 5.0  # the receiver (in this process too) sees the last ones close
        while rx.stats().num_connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.stats().num_connections == 0
        assert fds() == fds0
    finally:
        lt.run(rx.stop(grace_s=0.1))
        lt.stop()
    with pytest.raises(ValueError, match="loopback"):
        KVSlowloris([("192.0.2.1", 1)], 1, 1.0)


def test_kv_slowloris_report():
    fault = {"kind": "kv-slowloris", "planned_at_s": 1.0, "at_s": 1.0, "worker": "decode-0",
             "address": "127.0.0.1:7000"}
    f = fault_stats(fault, [rec(0.5, [1.1, 1.2]), rec(2.0, [2.1, 2.2])])
    f.update(slow_connections_per_port=80, slow_opened=160, slow_closed_by_receiver=80, slow_connect_errors=0)
    text = format_fault(f)
    assert "held 80 slow unauthenticated connections open to the KV port of decode-0" in text
    assert "completed 2" in text and "failed 0" in text and "slow connections opened 160" in text


def test_slow_readers_fault_parses():
    assert BenchConfig(rps=(1,), fault="slow-readers@5s").fault_spec() == ("slow-readers", 5.0)


WRITE_TIMEOUT_S = 2.0
"""The router's stream_write_timeout_s in the slow-readers test."""
SLOTS = 64
"""The router's max_inflight there: a quarter of the attack's streams (``SLOW_READER_STREAMS``)."""


def test_slow_readers_fault_against_a_real_router(tmp_path, caplog):
    """``--fault slow-readers@1`` against a real RouterServer (fake workers): its 256 never-read streams take
    every router slot, so requests are refused for a while; the router gives the slots back after its
    stream_write_timeout_s and the bench's requests are served again; nothing is left in flight."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "router"))
    from router_fakes import VOCAB, FakeCluster

    async def go():
        # a router of 64 slots against the attack's 256 streams: the first 64 take every slot at once, whatever
        # the host's speed (with 256 slots every stream had to be admitted within the write timeout, and a slow,
        # loaded 2-core host held only 132-167 of them at once: the first were ended before the last came in)
        async with FakeCluster(1, 2, stream_write_timeout_s=WRITE_TIMEOUT_S, decode_pages=8192,
                               max_inflight=SLOTS) as fc:
            cfg = BenchConfig(target=fc.router.address, workload="random", input_len=16, output_len=4,
                              rps=(20.0,), warmup_s=0.0, duration_s=WRITE_TIMEOUT_S + 4.0, drain_timeout_s=20.0,
                              vocab_size=VOCAB,
                              out=str(tmp_path / "out"), quiet=True, fault="slow-readers@1").with_defaults()
            peak = 0

            async def watch():  # the router's own count of admitted requests, sampled while the sweep runs
                nonlocal peak
                while True:
                    peak = max(peak, fc.router.core.inflight)
                    await asyncio.sleep(0.005)
            watcher = asyncio.ensure_future(watch())
            try:
                result = await run_sweep_async(cfg, progress=False)
            finally:
                watcher.cancel()
            f = result["fault"]
            assert f["streams"] == SLOW_READER_STREAMS and f["worker"] == "router", f
            # the attack took every slot for a while (whether a bench request then met a full router is timing:
            # a stream the router ended is replaced 20 ms later, and a loaded host lets some requests in)...
            assert peak >= fc.router.core.cfg.max_inflight, peak
            assert f["first_ok_sent_after_s"] is not None and f["first_ok_sent_after_s"] < WRITE_TIMEOUT_S + 2.0, f
            assert "never-read streams" in format_fault(f)
            await fc.wait_for(lambda: fc.router.core.inflight == 0 and
                              not any(w.inflight for w in fc.registry.workers.values()) and
                              all(d.pages_free == d.pages_total for d in fc.decodes), what="everything back")
    asyncio.run(asyncio.wait_for(go(), 120))
    # the router ends a never-read stream without a status (its last write still queued in gRPC's core): no
    # servicer error per stream (256 ExecuteBatchError tracebacks before)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]
