"""A short real run against ``pdserve serve`` (router + 1 prefill + 1 decode worker processes) on a tiny
random model from ``pdserve init-model``: ``run_demo_sweep`` (what ``make demo`` calls, windows shortened)
and a ``pdserve bench`` subprocess that discovers the vocabulary from Admin.GetClusterStatus."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_SERVE = os.path.exists(os.path.join(REPO, "cli", "serve.py"))

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not HAS_SERVE, reason="cli/serve.py (pdserve serve) is not in this "
                                                       "checkout yet; the fake-server runs cover the bench")]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_serve")
    subprocess.run(cli("init-model", "--out", str(d / "model")), cwd=REPO, check=True, capture_output=True,
                   timeout=300)
    log_path = d / "serve.out"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cli("serve", "--model", str(d / "model"), "--port", "0", "--http-port", "0", "--run-dir", str(d / "run")),
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            out = log_path.read_text(errors="replace")
            m = re.search(r"pdserve: listening on (\S+)", out)
            if m:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pdserve serve did not come up (rc {proc.poll()}):\n{out[-4000:]}")
            time.sleep(0.2)
        yield m.group(1), d
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_demo_sweep_against_pdserve_serve(served):
    from bench.loadgen import run_demo_sweep
    address, d = served
    # Shorter windows than the demo's, so higher rates: seed 0 puts 6 and 8 arrivals in the two windows.
    table = run_demo_sweep(address, str(d / "demo"), vocab_size=512, rps=(0.5, 1.0), warmup_s=2.0,
                           duration_s=10.0, drain_timeout_s=180.0)
    result = json.loads((d / "demo" / "bench.json").read_text())
    assert (d / "demo" / "bench.png").stat().st_size > 1000
    assert [s["label"] for s in result["steps"]] == ["rps 0.5", "rps 1"]
    assert result["config"]["input_len"] == 1024 and result["config"]["output_len"] == 32
    assert "Sustained RPS | Aggregate tok/s/node" in table
    for s in result["steps"]:
        assert s["num_measured"] >= 5 and s["success_rate"] == 1.0, (s["failures"], s["failure_examples"])
        assert s["length_mismatches"] == 0  # ignore_eos + max_tokens: exactly 32 tokens each
        assert s["ttft"]["p50"] > 0 and s["kv_bytes_per_req"] > 0
    # The prefill worker's prefix cache hits the shared 60% (page-aligned) once the two prefixes are resident.
    hits = [s["cache_hit"] for s in result["steps"]]
    assert max(hits) > 0.3 and all(h <= 0.6 for h in hits)


def test_cli_bench_discovers_vocab_from_the_cluster(served):
    address, d = served
    out = d / "cli"
    run = subprocess.run(cli("bench", "--target", address, "--workload", "random", "--input-range", "64,256",
                             "--output-len", "8", "--concurrency", "2", "--warmup", "1", "--duration", "5",
                             "--out", str(out), "--quiet"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((out / "bench.json").read_text())
    assert result["resolved"]["vocab_size"] == 512 and result["config"]["vocab_size"] is None
    assert {w["role"] for w in result["server"]["workers"]} == {"prefill", "decode"}
    s = result["steps"][0]
    assert s["label"] == "conc 2" and s["num_ok"] >= 1 and s["success_rate"] == 1.0
    assert "conc 2" in run.stdout


def test_cli_bench_fault_kv_slowloris_every_request_still_succeeds(served):
    """``--fault kv-slowloris@1s``: 80 connections that never authenticate held open to the decode worker's
    KV port (re-opened as the receiver times them out) for the rest of the step; every request succeeds and
    the report says what the attack did."""
    address, d = served
    out = d / "slowloris"
    run = subprocess.run(cli("bench", "--target", address, "--workload", "random", "--input-range", "64,256",
                             "--output-len", "8", "--concurrency", "2", "--warmup", "0", "--duration", "8",
                             "--fault", "kv-slowloris@1s", "--out", str(out), "--quiet"), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((out / "bench.json").read_text())
    s = result["steps"][0]
    assert s["num_ok"] >= 2 and s["success_rate"] == 1.0, (s["failures"], s["failure_examples"])
    fault = result["fault"]
    assert fault["kind"] == "kv-slowloris" and fault["failed"] == 0 and fault["slow_opened"] >= 80, fault
    assert "held 80 slow unauthenticated connections" in run.stdout


def test_decode_workers_serve_mxfp4_by_default(served):
    """``pdserve serve`` without ``--decode-weights``: the decode worker's routed experts are MXFP4 (the model
    quantized once into the cache), the prefill worker's are the checkpoint's own."""
    import grpc
    from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
    address, d = served
    with grpc.insecure_channel(address) as ch:
        st = generation_pb2_grpc.AdminStub(ch).GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=30)
    dec = [w for w in st.workers if w.role == "decode"]
    assert dec and all(w.info["routed_experts"] == "mxfp4" for w in dec), [dict(w.info) for w in dec]
    assert all({"preempted", "preemptions", "spec_fallbacks"} <= set(w.info) for w in dec)
    assert "decode weights: " in (d / "serve.out").read_text() and "quantized" in (d / "serve.out").read_text()


def test_agentic_sessions_against_pdserve_serve(served):
    """Two sessions of three turns on the real cluster: each turn's prompt is the last one + the tokens the
    decode worker returned + a user chunk (the server's own prompt_tokens say so), the second turn onwards
    hits the prefill worker's cache, and the hit rate by tier comes from its /metrics. Decode-side reuse (on by
    default): from the second turn on the decode worker holds the previous turn's state and is shipped only the
    rest, at most a page (16 tokens) past the new user chunk and the last returned token."""
    from bench.loadgen.config import BenchConfig
    from bench.loadgen.sweep import run_bench
    address, d = served
    cfg = BenchConfig(target=address, workload="agentic", sessions=2, turns=3, system_len=96, user_len=24,
                      output_len=4, concurrency=(2,), out=str(d / "agentic"), quiet=True, request_timeout_s=120.0)
    result, text = run_bench(cfg, progress=False)
    s = result["steps"][0]
    a = s["agentic"]
    assert a["sessions_completed"] == 2 and a["turns_ok"] == 6 and s["success_rate"] == 1.0, s["failures"]
    assert [t["prompt_tokens_mean"] for t in a["per_turn"]] == [120, 148, 176]
    assert all(t["cache_hit"] > 0.5 for t in a["per_turn"][1:]) and a["kv_bytes_per_turn"] > 0
    tiers = s["cache_tiers"]
    assert tiers["source"] == "metrics" and tiers["num_workers"] == 1, tiers
    assert tiers["query_tokens"] == sum(120 + 28 * t for t in range(3)) * 2
    assert tiers["hit_rate"]["device"] == pytest.approx(s["cache_hit"])
    assert "Hit by tier" in text
    assert all(t["decode_resident_mean"] >= 96 for t in a["per_turn"][1:]), a["per_turn"]
    assert 0 <= a["beyond_tail_tokens_max"] < 16, a
