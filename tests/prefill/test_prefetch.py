"""Prefetch at arrival (``prefill.admission``): a prefix in the host or disk tier loads on a loader thread from the
moment the request is submitted; the scheduler runs other requests meanwhile, never reads a file itself, and a late,
corrupt or missing page is recomputed with the same output as a cold prefill; cancels, deadlines and a shutdown
during a load leave no pool page, disk pin, file descriptor or loader thread behind. The disk reads are held on a
gate (an Event) so that the orderings are proved by what has happened, not by timings. The tiny GLM-5 with its MTP
layer (``test_host_tier_exact``'s checks of the restored state)."""
import dataclasses
import os
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import prefill.disk_cache as dc
from engine.kvcache import KVLayout, KVPool
from engine.kvcache.pool import PoolExhausted
from engine.kvcache.page_file import PageFile
from engine.load import load_model
from prefill.disk_cache import DiskCache
from prefill.admission import Admitted
from prefill.host_cache import HostCache
from engine.kvcache.radix import prefix_block_hashes
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, RequestAborted
from prefill.server import PrefillServicer
from prefill.tier_index import LoadTimes
from protos.pdserve.v1 import generation_pb2
from worker.metrics import Histogram, WorkerCollector
from test_disk_tier_exact import to_disk
import test_host_tier_exact as host_exact
from test_host_tier_exact import PAGE, assert_no_page_leaked, assert_same_state, pool_bytes, prompt
from test_prefill_scheduler import CaptureSink, run_all, task


logits_seen = host_exact.logits_seen


@pytest.fixture(scope="module")
def tiny(tiny_glm5_dir):
    model, cfg = load_model(tiny_glm5_dir, "float32", "cpu")
    return model, cfg


def make_sched(tiny, directory=None, num_pages=64, host_pages=8, disk_pages=32, **kw):
    """Chunks of 96 tokens by default: a 100-token prompt restored from page 6 on runs the cold prefill's last chunk
    (bit-identical logits need the same chunk boundaries)."""
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, PAGE, "float32"), num_pages)
    host = None
    if directory is not None:
        host = HostCache(pool, host_pages)
        file_bytes = PageFile(host.store.layout_hash, PAGE, host.store.page_bytes).file_bytes
        host.lower = DiskCache(str(directory), disk_pages * file_bytes, host.store, pool)
    return PrefillScheduler(model, pool, PrefillConfig(**{"chunk_size": 96, "max_batch_tokens": 192, **kw}),
                            host_cache=host)


class Gate:
    """Holds the disk tier's page reads (``PageFile.read``) until opened; records each read's thread and page."""

    def __init__(self, disk: DiskCache, hold_from: int = 0) -> None:
        self.open, self.reads, self.waiting = threading.Event(), [], threading.Event()
        real, self.hold_from = disk.format.read, hold_from

        def read(path, h, expect, out):
            self.reads.append((threading.current_thread().name, h))
            if len(self.reads) > self.hold_from:
                self.waiting.set()
                assert self.open.wait(60), "the test never opened the gate"
            return real(path, h, expect, out)
        disk.format.read = read


def prefill_alone(sched, ids, name, logits_seen):
    res, sink, before = {}, CaptureSink(sched.pool), len(logits_seen)
    run_all(sched, [task(name, ids, res, sink=sink)])
    assert isinstance(res[name], PrefillResult) and len(logits_seen) == before + 1
    return res[name], sink, logits_seen[-1], pool_bytes(sched.pool, sink.pages[:len(ids) // PAGE])


def step_until(sched, done, timeout_s=60.0):
    until = time.monotonic() + timeout_s
    while not done() and time.monotonic() < until:
        if not sched.step():
            time.sleep(0.002)
    assert done()


def test_slow_disk_does_not_hold_up_another_request(tiny, tmp_path, logits_seen):
    """A's prefix is on disk and its reads are held; B (no cached prefix) arrives after A and finishes first, on a
    scheduler that never reads a file; once the reads go on, A restores its whole prefix (its state is checked
    against a cold prefill's in the test below and in test_disk_tier_exact, both through the same prefetch)."""
    ids, other = prompt(tiny[1], 100, seed=7), prompt(tiny[1], 70, seed=3)
    sched = make_sched(tiny, tmp_path, load_timeout_s=600)
    prefill_alone(sched, ids, "a0", logits_seen)
    to_disk(sched)
    disk = sched.host.lower
    gate = Gate(disk)
    res, sink = {}, CaptureSink(sched.pool)
    sched.add(task("a", ids, res, sink=sink))  # the loader starts reading A's pages now, at arrival
    assert gate.waiting.wait(30)
    sched.add(task("b", other, res))
    step_until(sched, lambda: "b" in res)
    assert isinstance(res["b"], PrefillResult) and "a" not in res and sched.num_queued == 1
    assert {name for name, _ in gate.reads} == {"prefill-loader_0"} and threading.current_thread().name not in \
        {name for name, _ in gate.reads}
    gate.open.set()
    step_until(sched, lambda: "a" in res)
    assert isinstance(res["a"], PrefillResult) and res["a"].cached_tokens == 96 and disk.hit_tokens == 96
    assert disk.load_times.count == 1 and disk.late_pages == 0
    sched.stop()
    assert_no_page_leaked(sched)
    sched.host.close()


def test_late_then_corrupt_page_mid_prefetch_is_recomputed(tiny, tmp_path, logits_seen, monkeypatch):
    """Pages load one at a time; the third one's read is held. Late: the request goes on past the load timeout with
    the two loaded. Corrupt (the same prompt again): the third page's file is damaged while its read waits. Either
    way pages 2.. are recomputed, counted, and the output is a cold prefill's."""
    monkeypatch.setattr(dc, "BATCH_BYTES", 1)  # one page a batch: pages 0-1 are in the pool while 2 is read
    ids, chunks = prompt(tiny[1], 100, seed=8), {"chunk_size": 32, "max_batch_tokens": 64}  # cold and warm: 32, 64, 96
    cold = prefill_alone(make_sched(tiny, **chunks), ids, "cold", logits_seen)
    sched = make_sched(tiny, tmp_path, load_timeout_s=0.2, **chunks)
    prefill_alone(sched, ids, "a0", logits_seen)
    disk = sched.host.lower
    real_read = disk.format.read
    for fault in ("late", "corrupt"):
        to_disk(sched)
        disk.format.read = real_read
        gate = Gate(disk, hold_from=2)
        res, sink = {}, CaptureSink(sched.pool)
        computed = sched.tokens_done
        sched.add(task(fault, ids, res, sink=sink))
        assert gate.waiting.wait(30)
        if fault == "corrupt":
            sched.config = dataclasses.replace(sched.config, load_timeout_s=600)
            with open(os.path.join(disk.dir, f"{prefix_block_hashes(ids, PAGE)[2]:016x}.kv"), "r+b") as f:
                f.seek(disk.file_bytes // 2)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0x01]))
            gate.open.set()
        step_until(sched, lambda: fault in res)  # noqa: B023 - called at once
        gate.open.set()
        warm = (res[fault], sink, logits_seen[-1], pool_bytes(sched.pool, sink.pages[:len(ids) // PAGE]))
        assert warm[0].cached_tokens == 32 and sched.tokens_done - computed == 68  # pages 0-1 loaded, 2.. recomputed
        assert_same_state(warm, cold)
        step_until(sched, lambda: not sched.admission.num_loading)  # the late load's read ends; it frees nothing
    counters = PrefillServicer.counters(SimpleNamespace(sched=sched, kv_transfers=0, kv_bytes=0, kv_seconds=0.0))
    assert disk.late_pages == 4 and disk.corrupt_pages == 1
    assert counters["prefix_cache_late_pages"][0].values == {"host": 0, "disk": 4}
    assert counters["prefix_cache_recomputed_pages"][0].values == {"host": 0, "disk": 1}
    hist = counters["prefix_cache_load_seconds"][0]
    assert hist.label == "tier" and hist.values["disk"][0][-1] == ("+Inf", 2) and hist.values["host"][0][-1][1] == 0
    assert hist.values["disk"][1] == disk.load_times.sum_s > 0
    sched.stop()
    assert_no_page_leaked(sched)
    assert not any(e.pins for e in disk._entries.values())
    sched.host.close()


def test_cancels_deadlines_and_shutdown_during_prefetch_leak_nothing(tiny, tmp_path, logits_seen):
    """Sessions whose prefixes are on disk arrive while the reads are held: some cancelled, one past its deadline,
    the rest left loading when the scheduler stops (the gate opens a moment later). Then no pool page, host slot,
    disk pin, file descriptor or loader thread is left."""
    fds = len(os.listdir("/proc/self/fd"))
    sched = make_sched(tiny, tmp_path, num_pages=64, host_pages=4, disk_pages=32, load_timeout_s=600)
    sessions = [prompt(tiny[1], 50, seed=30 + s) for s in range(4)]  # 3 full pages each
    for i, ids in enumerate(sessions):
        prefill_alone(sched, ids, f"first{i}", logits_seen)
    to_disk(sched)
    disk = sched.host.lower
    gate = Gate(disk)
    res = {}
    for i, ids in enumerate(sessions):
        sched.add(task(f"r{i}", ids + [7, 8, 9], res, deadline=time.monotonic() + 0.3 if i == 2 else None))
    assert gate.waiting.wait(30)
    assert sched.abort("r0") and sched.abort("r1")
    time.sleep(0.35)
    sched.step()  # reaps r2 (deadline)
    assert isinstance(res["r0"], RequestAborted) and isinstance(res["r2"], RequestAborted)
    assert sched.admission.num_loading >= 1
    threading.Timer(0.3, gate.open.set).start()
    sched.stop()  # r3 is still queued and loading: the loads end, then every page they held is back
    assert len(res) == 4 and all(isinstance(r, RequestAborted) for r in res.values())
    assert sched.admission.num_loading == 0 and sched.admission.num_prefetch_pages == 0
    assert_no_page_leaked(sched)
    assert not any(e.pins for e in disk._entries.values())
    assert not [t for t in threading.enumerate() if t.name.startswith("prefill-loader")]
    sched.host.close()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_without_prefetch_the_scheduler_loads_at_admission(tiny, tmp_path, logits_seen):
    """``PrefillConfig(prefetch=False)``, the behaviour measured against: no loader thread, the disk pages are read
    by the thread that admits the request."""
    sched = make_sched(tiny, tmp_path, prefetch=False)
    ids = prompt(tiny[1], 50, seed=5)
    prefill_alone(sched, ids, "a0", logits_seen)
    to_disk(sched)
    gate = Gate(sched.host.lower)
    gate.open.set()
    assert prefill_alone(sched, ids, "a", logits_seen)[0].cached_tokens == 48
    assert {name for name, _ in gate.reads} == {threading.current_thread().name} and len(gate.reads) == 3
    assert sched.admission._loader is None and sched.admission.num_prefetch_pages == 0
    sched.stop()
    assert_no_page_leaked(sched)
    sched.host.close()


def test_load_latency_histogram_renders_per_tier():
    times = LoadTimes()
    for s in (0.0004, 0.003, 0.003, 20.0):
        times.observe(s)
    assert times.count == 4 and times.buckets()[0] == ("0.0005", 1) and times.buckets()[-1] == ("+Inf", 4)
    status = generation_pb2.WorkerStatus(worker_id="prefill-0")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(lambda: status, lambda: {"prefix_cache_load_seconds": (
        Histogram("tier", {"disk": (times.buckets(), times.sum_s)}), "load seconds")}))
    text = generate_latest(registry).decode()
    assert 'pdserve:prefix_cache_load_seconds_bucket{le="0.005",tier="disk",worker="prefill-0"} 3.0' in text
    assert 'pdserve:prefix_cache_load_seconds_count{tier="disk",worker="prefill-0"} 4.0' in text


def test_a_prefetch_given_back_and_a_refused_admission_count_the_query_once(tiny, tmp_path, logits_seen):
    """The radix cache's hit / query counters (the hit rate ``pdserve:prefix_cache_*`` reports) take each request's
    query once: a finished prefetch given back (``reclaim``, to make room for the head of the queue) looks its prefix
    up again at admission, and an admission refused for room is tried again; neither counts it a second time."""
    ids = prompt(tiny[1], 100, seed=7)
    sched = make_sched(tiny, tmp_path, num_pages=16, load_timeout_s=600)
    prefill_alone(sched, ids, "a0", logits_seen)
    to_disk(sched)
    adm, cache = sched.admission, sched.cache
    q0, h0 = cache.query_tokens, cache.hit_tokens
    t = task("a", ids, {})
    adm._prefetch_now(t, lambda: True)  # what the loader thread runs at arrival (here: on this thread)
    assert t.prefetch is not None and t.prefetch.done and cache.query_tokens == q0 + len(ids)
    with adm.lock:
        assert adm.reclaim([t]) == (True, False) and t.prefetch is None
        hog = adm._alloc(adm.pool.allocator.num_free - 2, "hog")  # too few pages left for its prefix
        with pytest.raises(PoolExhausted):
            adm.admit(t)
        adm.pool.allocator.decref(hog)
        until = time.monotonic() + 60
        while adm.admit(t) is not Admitted.RUNNING and time.monotonic() < until:  # the load runs on the loader
            adm.lock.wait(0.01)
    assert t.num_cached == 96 and cache.query_tokens == q0 + len(ids) and cache.hit_tokens == h0  # disk hits only
    with adm.lock:
        adm.release(t)
    sched.stop()
    assert_no_page_leaked(sched)
    sched.host.close()
