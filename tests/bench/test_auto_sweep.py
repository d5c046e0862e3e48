"""``--rps auto`` / ``--concurrency auto`` over loopback gRPC against the in-process fake (tests/bench/fake_server.py)
with a capacity (``slots``): the search finds the knee within its resolution, says "no knee" where the server
never breaks, stays inside --max-duration, and never overwrites a previous run's folder."""
import json

import pytest

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.sweep import run_bench
from cli.main import main as cli_main
from fake_server import FakeBehaviour, FakeServer

pytestmark = pytest.mark.timeout(120)


def auto_cfg(address, tmp_path, **kw) -> BenchConfig:
    base = dict(target=address, workload="random", input_len=64, output_len=8, input_range=(64, 64),
                output_range=(8, 8), auto="rps", warmup_s=0.2, duration_s=1.0, drain_timeout_s=10.0,
                out=str(tmp_path / "out"), quiet=True)
    return BenchConfig(**{**base, **kw})


def steps_by_label(result):
    return {s["label"]: s for s in result["steps"]}


def test_concurrency_auto_finds_the_servers_slot_count(tmp_path):
    """3 slots of 0.57 s each: 3 in flight never wait, a 4th waits a whole request (>> the 250 ms SLO), so the
    knee is exactly concurrency 3; then one step past it shows the throughput flat at capacity."""
    b = FakeBehaviour(slots=3, ttft_s=0.01, itl_s=0.08)
    with FakeServer(b) as srv:
        cfg = auto_cfg(srv.address, tmp_path, auto="concurrency", start_rate=2, max_rate=32,
                       slo=Slo(ttft_s=0.25))
        result, text = run_bench(cfg, progress=False)
    assert result["knee"]["label"] == "conc 3" and result["knee"]["first_bad_label"] == "conc 4", text
    steps = steps_by_label(result)
    assert [s["label"] for s in result["steps"]] == ["conc 2", "conc 4", "conc 3", "conc 5"]
    assert result["search"]["phases"] == ["ramp", "ramp", "bisect", "saturate"]
    # Saturated: each slot finishes at most ceil(window / request time) = 2 requests inside the 1 s window.
    assert steps["conc 5"]["sustained_rps"] <= 3 * 2 / 1.0 and not steps["conc 5"]["within_slo"]
    assert "knee: conc 3 - the highest rate with TTFT p95 <= 250 ms" in text and "saturation: at most" in text
    assert "conc 3 (knee)" in text


def test_rps_auto_brackets_the_knee_within_the_resolution(tmp_path):
    """One slot of 0.1 s (capacity 10 req/s): Poisson load queues as it nears capacity, so TTFT crosses the
    400 ms SLO somewhere below ~10 req/s (where exactly is up to the Poisson draw); the search ramps from
    2 req/s, brackets the crossing to 25% and runs a step past it."""
    b = FakeBehaviour(slots=1, ttft_s=0.02, itl_s=0.02)
    with FakeServer(b) as srv:
        cfg = auto_cfg(srv.address, tmp_path, output_len=5, output_range=(5, 5), start_rate=2.0, max_rate=64,
                       resolution="25%", slo=Slo(ttft_s=0.4), seed=2)  # seed 0 draws no arrival in some windows
        result, text = run_bench(cfg, progress=False)
    knee = result["knee"]
    assert knee is not None, text
    good, bad = knee["rate"], knee["first_bad_rate"]
    assert 0 < bad - good <= 0.25 * good + 1e-9, text  # the stated resolution
    for s in result["steps"]:  # good up to the knee (or overruled as noise by a higher passing rate), bad above
        if s["rate"] <= good:
            assert s["within_slo"] or s["label"] in knee["noise"], (s["label"], text)
        else:
            assert not s["within_slo"], (s["label"], text)
    assert good < 10 * 1.5, text  # not far past the capacity
    assert max(s["rate"] for s in result["steps"]) >= 1.5 * good, text  # one step past the knee
    # The most the server can finish in a 1 s window: 10 at capacity, plus one in service at the start.
    assert result["saturation"]["sustained_rps"] <= 10 + 1, text
    assert result["search"]["stopped"] == "resolution"


def test_no_knee_when_the_server_never_breaks(tmp_path):
    with FakeServer(FakeBehaviour()) as srv:
        cfg = auto_cfg(srv.address, tmp_path, start_rate=8.0, max_rate=32.0, duration_s=0.5)
        result, text = run_bench(cfg, progress=False)
    assert [s["label"] for s in result["steps"]] == ["rps 8", "rps 16", "rps 32"], text
    assert result["knee"] is None and result["saturation"] is None
    assert result["verdict"]["status"] == "not-reached" and result["search"]["stopped"] == "max_rate"
    assert "no knee up to rps 32: every step met" in text
    assert "next: --rps auto --start-rate 32 --max-rate 256" in text and "(knee)" not in text


def test_auto_sweep_stops_within_its_time_bound(tmp_path):
    """A server that never breaks and no max rate in reach: only --max-duration ends the search, inside it."""
    with FakeServer(FakeBehaviour()) as srv:
        cfg = auto_cfg(srv.address, tmp_path, start_rate=8.0, max_rate=1e4, warmup_s=0.1, duration_s=0.5,
                       max_duration_s=3.5)
        result, text = run_bench(cfg, progress=False)
    assert result["elapsed_s"] <= 3.5 + 0.25, text
    assert 1 <= len(result["steps"]) <= 3 and all(s["within_slo"] for s in result["steps"]), text
    assert result["search"]["stopped"] == "time" and "(stopped by --max-duration 3.5s)" in text
    assert result["verdict"]["status"] == "not-reached"


def test_max_duration_cuts_the_drain_and_says_so(tmp_path):
    """Requests of ~2.1 s and a 2.5 s bound: the step's drain is cut, its stragglers fail visibly as
    DRAIN_TIMEOUT, the next step is skipped with a warning, and the run ends inside the bound."""
    with FakeServer(FakeBehaviour(itl_s=0.3)) as srv:
        cfg = auto_cfg(srv.address, tmp_path, auto=None, rps=(4.0, 8.0), warmup_s=0.2, duration_s=0.6,
                       max_duration_s=2.5)
        result, text = run_bench(cfg, progress=False)
    assert result["elapsed_s"] <= 2.5 + 0.25, text
    assert [s["label"] for s in result["steps"]] == ["rps 4"]
    assert result["steps"][0]["failures"].get("DRAIN_TIMEOUT", 0) > 0, text
    assert "drain cut to" in text and "--max-duration 2.5s skipped rps 8" in text


def test_out_folder_is_never_overwritten_and_compare_labels_by_folder(tmp_path, capsys):
    with FakeServer(FakeBehaviour()) as srv:
        cfg = auto_cfg(srv.address, tmp_path, auto=None, rps=(5.0,), warmup_s=0.0, duration_s=0.3)
        run_bench(cfg, progress=False)
        first = (tmp_path / "out" / "bench.json").read_bytes()
        _, text = run_bench(cfg, progress=False)
        _, text3 = run_bench(cfg, progress=False)
    assert (tmp_path / "out" / "bench.json").read_bytes() == first
    runs = sorted(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert len(runs) == 2 and all((p / "bench.json").exists() and (p / "bench.png").exists() for p in runs)
    assert f"already holds a run: this one goes to {runs[0]}" in text
    assert str(runs[1]) in text3
    rc = cli_main(["bench", "--from-json", str(runs[0] / "bench.json"), "--compare",
                   str(tmp_path / "out" / "bench.json")])
    out = capsys.readouterr().out
    assert rc == 0 and f"compare: {runs[0].name} vs out " in out
    assert json.loads(first)["steps"][0]["label"] == "rps 5"


def test_reference_workload_scales_to_the_servers_context(tmp_path):
    """--workload reference on a server with a 2048-token context: scale 0.05 (1000 in / 50 out, 60% shared
    prefix), swept with --rps auto; the table leads with the reference table's columns."""
    with FakeServer(FakeBehaviour(max_context=2048, itl_s=0.001)) as srv:
        cfg = BenchConfig(target=srv.address, workload="reference", start_rate=8.0, max_rate=16.0, warmup_s=0.2,
                          duration_s=1.0, out=str(tmp_path / "ref"), quiet=True)
        result, text = run_bench(cfg, progress=False)
        lengths = {len(p) for p in srv.log.prompts.values()}
    c = result["config"]
    assert (c["scale"], c["input_len"], c["output_len"], c["cache_hit"], c["auto"]) == (0.05, 1000, 50, 0.6, "rps")
    assert lengths == {1000} and [s["label"] for s in result["steps"]] == ["rps 8", "rps 16"], text
    header = [h.strip() for h in text.splitlines()[1].split("|")]
    assert header[:6] == ["Step", "Phase", "Sustained RPS", "Aggregate tok/s/node", "TTFT p50 / p95 ms",
                          "Success rate"]
    assert result["steps"][1]["cache_hit"] > 0.3  # 8 prefixes of 600 tokens: resident after the first step
