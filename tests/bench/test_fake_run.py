"""Short real runs over loopback gRPC against an in-process fake of the public API (tests/bench/fake_server.py):
the table, bench.json and bench.png come out, failures are counted by status, never hidden."""
import asyncio
import json

import grpc
import pytest

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.runner import OK, LoadStep, StepRunner
from bench.loadgen.stats import step_stats
from bench.loadgen.sweep import run_bench
from bench.loadgen.workload import make_workload
from cli.main import main as cli_main
from fake_server import FakeBehaviour, FakeServer
from protos.pdserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(180)


def make_cfg(address, tmp_path, **kw) -> BenchConfig:
    base = dict(target=address, input_len=256, output_len=8, cache_hit=0.5, num_prefixes=2, rps=(4.0, 8.0),
                warmup_s=1.0, duration_s=3.0, drain_timeout_s=20.0, out=str(tmp_path / "out"), quiet=True)
    return BenchConfig(**{**base, **kw})


def expected_status(i: int, b: FakeBehaviour) -> str:
    if b.fail_every and i % b.fail_every == b.fail_every - 1:
        return "RESOURCE_EXHAUSTED"
    if b.error_every and i % b.error_every == b.error_every - 1:
        return "finish:error"
    return OK


def test_step_runner_records_every_failure_by_status(tmp_path):
    b = FakeBehaviour(fail_every=3, error_every=5, itl_s=0.002)
    with FakeServer(b) as srv:
        cfg = make_cfg(srv.address, tmp_path, rps=(), concurrency=(3,)).with_defaults()

        async def go():
            async with grpc.aio.insecure_channel(srv.address) as ch:
                runner = StepRunner(generation_pb2_grpc.GenerationStub(ch), make_workload(cfg, 512), cfg)
                return await runner.run(LoadStep("concurrency", 3), warmup_s=0.3, duration_s=1.5)

        sr = asyncio.run(go())
    assert len(sr.records) >= 15
    for r in sr.records:
        assert r.status == expected_status(r.index, b), r
        if r.ok:
            assert r.num_tokens_received == r.completion_tokens == 8 and r.prompt_tokens == 256
    s = step_stats(sr, cfg)
    want = {}
    for r in sr.measured:
        st = expected_status(r.index, b)
        if st != OK:
            want[st] = want.get(st, 0) + 1
    assert s.failures == want and want["RESOURCE_EXHAUSTED"] > 0 and want["finish:error"] > 0
    assert s.num_ok + sum(want.values()) == s.num_measured
    assert s.success_rate == pytest.approx(s.num_ok / s.num_measured)
    assert s.failure_examples["RESOURCE_EXHAUSTED"] == "fake: queue full"


def test_sweep_writes_table_json_png_and_counts_failures(tmp_path):
    b = FakeBehaviour(fail_every=7, ttft_s=0.03, prefill_s_per_token=1e-4, itl_s=0.004)
    with FakeServer(b) as srv:
        cfg = make_cfg(srv.address, tmp_path, slo=Slo(ttft_s=2.0, min_success=0.5), cost_per_hour=2.0)
        result, text = run_bench(cfg, progress=False)
    header = text.splitlines()[1]
    ref = ["Sustained RPS", "Aggregate tok/s/node", "TTFT p50 / p95 ms", "Success rate"]
    cols = [c.strip() for c in header.split("|")]
    assert cols[0] == "Step" and cols[1:5] == ref
    assert "ITL p50 / p95 ms" in cols and "$/Mtok (out)" in cols and "tok/J" not in cols
    assert "Requests" in cols and "Offered RPS" in cols
    # both rates meet the SLO: no knee is claimed, the next range is suggested
    assert "no knee up to rps 8: every step met TTFT p95 <= 2000 ms" in text and "next: --rps 8,16,32,64" in text
    assert "(knee)" not in text and result["knee"] is None and result["verdict"]["status"] == "not-reached"
    assert "RESOURCE_EXHAUSTED x" in text  # failures printed, not hidden
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["config"]["rps"] == [4.0, 8.0] and saved["config"]["input_len"] == 256
    assert saved["resolved"]["vocab_size"] == 512 and saved["server"]["vocab_size"] == 512
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rejected = sum(s["failures"].get("RESOURCE_EXHAUSTED", 0) for s in saved["steps"])
    assert 0 < rejected <= len(srv.log.rejected)
    for s in saved["steps"]:
        assert s["num_measured"] > 5 and s["success_rate"] < 1.0
        assert s["num_ok"] + sum(s["failures"].values()) == s["num_measured"]
        # prefix 128 of 256 tokens, page-aligned: each group's first request misses, then 50% hits
        assert 0.25 < s["cache_hit"] <= 0.5
        assert s["ttft"]["p50"] >= 0.03 and s["tpot"]["p50"] >= 0.004
        assert s["total_tok_s"] > s["output_tok_s"] > 0 and s["cost_per_mtok"] > 0
        assert s["kv_bytes_per_req"] == 256 * b.kv_bytes_per_token
    # every prompt the server saw has exactly the requested length
    assert {len(p) for p in srv.log.prompts.values()} == {256}


def test_every_workload_reports_the_hit_rate_by_tier_from_the_prefill_workers_metrics(tmp_path):
    """Not only agentic runs: a step of the prefill-bound workload scrapes the prefill workers' /metrics around
    it (``prefix_cache_hit_tokens_total{tier}``) and the table gains the Hit by tier column; the device share
    agrees with what the requests reported (``cached_tokens``). Without a metrics port: no column, no figures."""
    for metrics in (True, False):
        with FakeServer(FakeBehaviour(metrics=metrics, itl_s=0.001)) as srv:
            cfg = make_cfg(srv.address, tmp_path / str(metrics), rps=(8.0,))
            result, text = run_bench(cfg, progress=False)
        step = result["steps"][0]
        if not metrics:
            assert "cache_tiers" not in step and "Hit by tier" not in text
            continue
        tiers = step["cache_tiers"]
        assert tiers["source"] == "metrics" and tiers["num_workers"] == 1 and "errors" not in tiers
        assert tiers["query_tokens"] == 256 * len(srv.log.prompts)  # warm-up and drain included: the whole step
        assert 0.25 < tiers["hit_rate"]["device"] <= 0.5 and tiers["hit_rate"]["host"] == 0.0
        assert "Hit by tier" in text.splitlines()[1] and "device " in text


def test_cli_bench_then_compare_saved_runs(tmp_path, capsys):
    with FakeServer(FakeBehaviour(tokens_per_chunk=2)) as srv:
        out = tmp_path / "cli"
        rc = cli_main(["bench", "--target", srv.address, "--workload", "random", "--input-len", "64",
                       "--output-len", "6", "--concurrency", "1,2", "--warmup", "0.5", "--duration", "2",
                       "--out", str(out), "--power-watts", "100", "--slo", "ttft=1s,tpot=50ms"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "conc 1" in text and "conc 2" in text and "tok/J" in text
    saved = json.loads((out / "bench.json").read_text())
    assert all(s["accept_len"] == 2.0 and s["success_rate"] == 1.0 for s in saved["steps"])
    rc = cli_main(["bench", "--from-json", str(out / "bench.json"), "--compare", str(out / "bench.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "compare: cli (this) vs cli (other) (workloads random / random)" in text and "1.00x" in text


def test_api_key_sent_and_rejections_counted(tmp_path, capsys):
    with FakeServer(FakeBehaviour(api_key="sesame")) as srv:
        ok = run_bench(make_cfg(srv.address, tmp_path, rps=(5.0,), duration_s=1.0, api_key="sesame"), False)[0]
        rc = cli_main(["bench", "--target", srv.address, "--rps", "5", "--input-len", "32", "--output-len", "2",
                       "--warmup", "0", "--duration", "1", "--out", str(tmp_path / "bad"), "--quiet"])
    assert ok["steps"][0]["success_rate"] == 1.0
    bad = json.loads((tmp_path / "bad" / "bench.json").read_text())["steps"][0]
    assert rc == 1 and bad["num_ok"] == 0 and set(bad["failures"]) == {"UNAUTHENTICATED"}
    assert "UNAUTHENTICATED x" in capsys.readouterr().out


def test_single_stream_reports_output_speed(tmp_path):
    with FakeServer(FakeBehaviour(ttft_s=0.05, itl_s=0.02)) as srv:
        cfg = make_cfg(srv.address, tmp_path, workload="single-stream", rps=(), input_len=128, output_len=20,
                       cache_hit=None, warmup_s=0.3, duration_s=2.0)
        result, text = run_bench(cfg, progress=False)
    s = result["steps"][0]
    assert s["label"] == "conc 1" and s["num_measured"] >= 2 and s["success_rate"] == 1.0
    assert 15.0 < s["stream_tok_s"]["p50"] <= 51.0  # 1 / 20 ms, less the sleep overshoot of a loaded machine
    assert s["ttft"]["p50"] >= 0.05 and s["e2e"]["p50"] >= 0.05 + 19 * 0.02
    assert s["cache_hit"] == 0.0


def test_trace_replay_against_fake(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 + 0.1 * i, "input_len": 64 + 16 * (i % 3), "output_len": 3, "prefix_group": i % 2}
            for i in range(20)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FakeServer() as srv:
        cfg = make_cfg(srv.address, tmp_path, workload="trace", trace=str(trace), rps=(), duration_s=None,
                       warmup_s=0.45, input_len=None, output_len=None)
        result, _ = run_bench(cfg, progress=False)
        seen = sorted(len(p) for p in srv.log.prompts.values())
    s = result["steps"][0]
    assert s["label"] == "trace x1" and s["num_sent"] == 20 and s["num_measured"] == 15
    assert seen == sorted(r["input_len"] for r in rows)
    assert result["resolved"]["duration_s"] == pytest.approx(1.9 + 1e-3 - 0.45)


@pytest.mark.parametrize("timeouts,status", [(dict(drain_timeout_s=0.5), "DRAIN_TIMEOUT"),
                                             (dict(request_timeout_s=0.5), "DEADLINE_EXCEEDED")])
def test_slow_requests_fail_visibly(tmp_path, timeouts, status):
    with FakeServer(FakeBehaviour(itl_s=1.0)) as srv:
        cfg = make_cfg(srv.address, tmp_path, rps=(), concurrency=(2,), warmup_s=0.0, duration_s=0.3,
                       output_len=30, **timeouts)
        result, text = run_bench(cfg, progress=False)
    s = result["steps"][0]
    assert s["num_measured"] == 2 and s["num_ok"] == 0 and s["failures"] == {status: 2}
    assert s["success_rate"] == 0.0 and f"{status} x2" in text
    assert "knee: none" in text
