"""Mid-stream failover with real processes: ``pdserve serve`` with 1 prefill + 3 decode workers serving the
shipped default model (trained GLM-5 architecture) in fp32; a decode worker is killed with SIGKILL while 24
streams are running. Every stream must finish with exactly the greedy tokens transformers' ``generate``
gives (no token duplicated or missing across the failover), and the survivors must hold no pages.

The trained model, not a random one: after a failover the streamed tokens are re-prefilled in one
forward instead of decoded one by one, which rounds differently (within 1e-4, see
tests/engine/test_paged.py); a random model's near-tied logits turn that into a different argmax
(seen at token 59 of 64), a trained model's margins do not.
"""
import asyncio
import os
import signal

import grpc
import pytest
import torch

from engine.defaults import SHIPPED_DEFAULT
from router.client import AsyncGenerationClient, Completion, GenerationClient
from serve_helpers import ServeProcess, pages_all_free, pid_alive
from shared_helpers import wait_until

NUM_TOKENS = 64
STALL_S = 2.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("failover")
    sp = ServeProcess(["--model", SHIPPED_DEFAULT, "--prefill", "1", "--decode", "3", "--port", "0",
                       "--dtype", "float32", "--decode-weights", "model", "--num-pages", "400", "--local-prefill-below", "0",
                       "--no-speculative", "--decode-stall-timeout", str(STALL_S), "--fault-injection",
                       "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        yield sp
    finally:
        sp.stop()


def hf_greedy(prompts, n):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_DEFAULT, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def run_streams_and(sp, prompts, fault) -> tuple[list[Completion], str, float]:
    """Concurrent slow-reading streams; once all are decoding, ``fault(pid)`` hits the busiest decode
    worker. Returns the completions, the victim and the seconds from the fault to the last finish."""
    import time
    progress = [0] * len(prompts)

    async def one(c: AsyncGenerationClient, i: int) -> Completion:
        out = Completion()
        async for chunk in c.stream(token_ids=prompts[i], max_tokens=NUM_TOKENS, ignore_eos=True):
            out.add(chunk, 0.0)
            progress[i] = len(out.token_ids)
            await asyncio.sleep(0.01)  # a slow reader: the streams stay open long enough to be cut
        return out

    async def run():
        async with AsyncGenerationClient(sp.address, timeout_s=120) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(len(prompts))]
            # The fault lands once every stream has its first token (prefilled, KV on the decode worker: a
            # fault during a transfer would be a prefill retry, not a failover) on the busiest decode
            # worker. With 24 streams spread over 3 decode workers its batch is still ~8 then.
            while min(progress) < 1:
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.002)
            st = await c.cluster_status()
            busy = max((w for w in st.workers if w.role == "decode"), key=lambda w: w.running)
            assert busy.running > 0 and min(progress) < NUM_TOKENS, "streams ended before the fault"
            fault(sp.children[busy.worker_id])
            t0 = time.monotonic()
            outs = list(await asyncio.gather(*tasks))
            return outs, busy.worker_id, time.monotonic() - t0

    return asyncio.run(run())


def check_outputs(prompts, outs, expected, victim):
    failed_over = [o for o in outs if o.metrics.failovers]
    assert failed_over, "no stream was on the faulty worker"
    for i, (o, ref) in enumerate(zip(outs, expected)):
        assert o.finish_reason == "length" and o.token_ids == ref, (i, o.metrics, o.token_ids, ref)
        assert o.usage.prompt_tokens == len(prompts[i]) and o.usage.completion_tokens == NUM_TOKENS
    for o in failed_over:
        assert o.metrics.decode_worker != victim and o.metrics.failovers == 1


PROMPTS = [[(11 * i + 3 * j) % 1500 + 2 for j in range(20 + 7 * i)] for i in range(8)]
STREAMS = PROMPTS * 3
"""The streams of the stall / kill tests: 24, so that spread over the 3 decode workers each one still
decodes a batch of about 8 (the victim's streams must still be running when the fault lands)."""


@pytest.fixture(scope="module")
def expected():
    return hf_greedy(PROMPTS, NUM_TOKENS)


def prefill_status(client):
    return next(w for w in client.cluster_status().workers if w.role == "prefill")


def test_dropped_kv_connection_is_retried_and_completes(served, expected):
    """The prefill worker cuts its KV connection mid-transfer (Admin.InjectFault drop-kv, a real socket
    shutdown with no ABORT): the router retries on a fresh reservation over a fresh connection, the
    client gets exactly transformers' greedy tokens with metrics.retries == 1, and no page stays reserved
    anywhere (the lost shm lease is released by the sender's reconnect, not by its process exiting)."""
    from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
    with GenerationClient(served.address, timeout_s=120) as c:
        fired = int(prefill_status(c).info["kv_drops_fired"])
        with grpc.insecure_channel(served.address) as ch:
            r = generation_pb2_grpc.AdminStub(ch).InjectFault(generation_pb2.InjectFaultRequest(kind="drop-kv"),
                                                              timeout=10)
        assert r.worker_id == "prefill-0" and r.armed == 1
        out = c.generate(token_ids=PROMPTS[7], max_tokens=NUM_TOKENS, ignore_eos=True)
        assert out.token_ids == expected[7] and out.finish_reason == "length"
        assert out.metrics.retries == 1 and out.metrics.failovers == 0, out.metrics
        st = prefill_status(c)
        assert (st.info["kv_drops_armed"], int(st.info["kv_drops_fired"])) == ("0", fired + 1)
        wait_until(lambda: pages_all_free(c), timeout_s=20, what="pages back on every worker after the drop")


def test_bench_fault_drop_kv_reports_the_retries(served, tmp_path):
    """``pdserve bench --fault drop-kv@2s`` (the real CLI): the dropped transfer's request is retried,
    nothing fails, and the report says so."""
    fault, out = run_bench(served, tmp_path, "drop-kv@2s", duration_s=5)
    assert "error" not in fault, fault
    assert fault["worker"] == "prefill-0" and fault["retried_prefill"] >= 1 and fault["failed"] == 0, fault
    assert "armed a KV connection drop on prefill-0" in out
    with GenerationClient(served.address, timeout_s=60) as c:
        wait_until(lambda: pages_all_free(c), timeout_s=20, what="pages back on every worker after the bench")


def run_bench(served, tmp_path, fault: str, duration_s: float, concurrency: int = 4):
    """One ``pdserve bench --fault`` run as a subprocess; returns bench.json's fault report and stdout."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "--target", served.address, "--workload",
                          "random", "--input-len", "64", "--output-len", "64", "--concurrency", str(concurrency),
                          "--duration", str(duration_s), "--warmup", "0", "--fault", fault, "--out", str(tmp_path),
                          "--quiet"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.load(open(tmp_path / "bench.json"))["fault"], out.stdout


def test_stalled_decode_worker_fails_over_within_the_stall_timeout(served, expected):
    """SIGSTOP (alive, connected, silent): its streams fail over after --decode-stall-timeout; after
    SIGCONT the stalled worker frees the abandoned requests' pages and rejoins."""
    stopped = []

    def stall(pid):
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
    try:
        outs, victim, took = run_streams_and(served, STREAMS, stall)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    check_outputs(STREAMS, outs, expected * 3, victim)
    assert took < STALL_S + 20, took
    with GenerationClient(served.address, timeout_s=60) as c:
        wait_until(lambda: pages_all_free(c), timeout_s=30, what="pages back on every worker, the stalled one too")


def test_decode_worker_killed_mid_stream_every_stream_completes(served, expected):
    outs, victim, _ = run_streams_and(served, STREAMS, lambda pid: os.kill(pid, signal.SIGKILL))
    assert not pid_alive(served.children[victim])
    check_outputs(STREAMS, outs, expected * 3, victim)
    with GenerationClient(served.address, timeout_s=60) as c:
        wait_until(lambda: pages_all_free(c, skip=victim), timeout_s=20, what="pages back on the surviving workers")
        again = c.generate(token_ids=PROMPTS[0], max_tokens=8, ignore_eos=True)  # survivors keep serving
        assert again.token_ids == expected[0][:8]


def test_bench_fault_kill_decode_reports_the_failover(served, tmp_path):
    """``pdserve bench --fault kill-decode@3s`` (a subprocess, the real CLI) against the same cluster:
    the busiest surviving decode worker dies, nothing fails, the report counts the failovers (and the
    prefill retries of requests whose KV was on its way to it)."""
    # 8 at once: spread over the 3 decode workers, the victim still holds a few mid-stream when it dies
    fault, out = run_bench(served, tmp_path, "kill-decode@3s", duration_s=8, concurrency=8)
    assert "error" not in fault, fault
    assert not pid_alive(served.children[fault["worker"]])
    # its requests fail over, or, those still receiving their KV when it died, retry their prefill elsewhere
    assert fault["in_flight_at_fault"] >= 1 and fault["failed"] == 0, fault
    assert fault["failed_over"] + fault["retried_prefill"] >= 1, fault
    if fault["failed_over"]:
        assert fault["itl_s"]["failover_gap_max"] > fault["itl_s"]["undisturbed_p50"]
    assert "fault kill-decode at" in out and "failed over" in out
