"""A real prefill worker whose KV pool is too small for two prompts serves the first one again from its host tier:
the KV shipped to a real decode worker from restored pages decodes the same greedy tokens, and the worker's status,
cache events and /metrics count the host hit. A prefill worker with a disk tier, stopped and started again over the
same directory, serves a prompt of its first life from disk, with the same tokens."""
import os
import urllib.request

import grpc
import pytest

from engine.checkpoint import TINY_GLM5, init_random_model
from procs import Worker
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from test_worker_rpc import MD, SECRET, generate, status


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("host_tier")
    model_dir = str(d / "model")
    init_random_model({**TINY_GLM5, "index_topk": 64}, model_dir, seed=3)
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    common = ["--model", model_dir, "--page-size", "16", "--dtype", "float32"]
    pre = Worker("prefill.server", common + ["--num-pages", "8", "--host-cache-bytes", "1MiB", "--metrics-port", "-1",
                                             "--chunk-size", "32", "--max-batch-tokens", "64"], env, str(d / "p.log"))
    dec = Worker("decode.server", common + ["--num-pages", "64", "--no-speculative"], env, str(d / "d.log"))
    try:
        yield pre.wait_ready(), dec.wait_ready(), common, env, d
    finally:
        pre.stop()
        dec.stop()


def test_a_prompt_evicted_from_the_pool_comes_back_from_host_memory(workers):
    pa, da = workers[:2]
    greedy = generation_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = list(range(2, 102)), list(range(200, 300))  # 7 pages each, 6 of them full: the pool holds 8
    r1, out1, _ = generate(pa, da, "a1", a, greedy)
    generate(pa, da, "b", b, greedy)  # evicts 5 of a's 6 cached pages from the pool into the host tier
    r2, out2, _ = generate(pa, da, "a2", a, greedy)
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 96) and out2 == out1
    st = status(pa, worker_pb2_grpc.PrefillWorkerStub)
    assert st.info["host_cache_hit_tokens"] == "80" and st.info["host_cache_corrupt_pages"] == "0"
    assert int(st.info["host_cache_capacity_pages"]) == (1 << 20) // (16 * 4 * 112 * 4)  # 4 layers x 112 fp32
    with grpc.insecure_channel(pa) as ch:
        snapshot = next(iter(worker_pb2_grpc.PrefillWorkerStub(ch).StreamCacheEvents(
            worker_pb2.CacheEventsRequest(), metadata=MD, timeout=10)))
    assert snapshot.reset and len(snapshot.host_stored) == int(st.info["host_cache_pages"]) >= 5
    with urllib.request.urlopen(f"http://127.0.0.1:{st.info['metrics_port']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'pdserve:prefix_cache_hit_tokens_total{tier="host",worker=' in text
    host_line = next(x for x in text.splitlines() if x.startswith('pdserve:prefix_cache_hit_tokens_total{tier="host"'))
    assert host_line.endswith(" 80.0")
    assert 'pdserve:prefix_cache_bytes{tier="host",worker=' in text


def test_a_restarted_worker_serves_its_first_life_from_its_disk_tier(workers):
    """The only test of a real restart (two worker starts, 7 s on the AVX2 EPYC): the directory's re-index, the
    drained writer on SIGTERM and the flags' wiring; the exactness itself is test_disk_tier_exact's."""
    _, da, common, env, d = workers
    greedy = generation_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    a = list(range(3, 103))  # 6 full pages
    argv = common + ["--num-pages", "8", "--host-cache-bytes", "1MiB", "--host-cache-policy", "write_through",
                     "--disk-cache-dir", str(d / "kv"), "--disk-cache-bytes", "4MiB", "--metrics-port", "-1"]
    first = Worker("prefill.server", argv, env, str(d / "p1.log"))
    try:
        r1, out1, _ = generate(first.wait_ready(), da, "d1", a, greedy)
        generate(first.address, da, "d2", [7] * 20, greedy)  # its admission copies a's pages down (write-through)
    finally:
        first.stop()  # SIGTERM: the disk writer finishes what is queued
    pages = sorted(os.listdir(d / "kv" / os.listdir(d / "kv")[0]))
    assert len([p for p in pages if p.endswith(".kv")]) == 7 and not [p for p in pages if p.endswith(".tmp")]
    again = Worker("prefill.server", argv, env, str(d / "p2.log"))
    try:
        pa = again.wait_ready()
        st = status(pa, worker_pb2_grpc.PrefillWorkerStub)
        assert st.info["disk_cache_indexed_pages"] == "7" and st.info["disk_cache_dir"].startswith(str(d / "kv"))
        r2, out2, _ = generate(pa, da, "d3", a, greedy)
        assert (r1.cached_tokens, r2.cached_tokens) == (0, 96) and out2 == out1
        st = status(pa, worker_pb2_grpc.PrefillWorkerStub)
        assert st.info["disk_cache_hit_tokens"] == "96" and st.info["disk_cache_corrupt_pages"] == "0"
        with grpc.insecure_channel(pa) as ch:
            snapshot = next(iter(worker_pb2_grpc.PrefillWorkerStub(ch).StreamCacheEvents(
                worker_pb2.CacheEventsRequest(), metadata=MD, timeout=10)))
        assert len(snapshot.disk_stored) == 7
        with urllib.request.urlopen(f"http://127.0.0.1:{st.info['metrics_port']}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert any(x.startswith('pdserve:prefix_cache_hit_tokens_total{tier="disk"') and x.endswith(" 96.0")
                   for x in text.splitlines())
        assert 'pdserve:prefix_cache_bytes{tier="disk",worker=' in text
    finally:
        again.stop()
