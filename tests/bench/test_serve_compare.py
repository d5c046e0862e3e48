"""``bench.serve_compare``: one workload against several server configurations in one run. The orchestration
against in-process fakes of the public API (tests/bench/fake_server.py) in place of ``pdserve serve``: each
configuration's server gets the common flags and its own ({dir}: a scratch directory of its own), is benched with
the same workload, and the combined table has every configuration's figures and their ratios to the first."""
import contextlib
import json
import os

import pytest

from bench.loadgen.report import format_configs
from bench.serve_compare import main, parse_configs, run
from fake_server import FakeBehaviour, FakeServer

pytestmark = pytest.mark.timeout(120)
BENCH = ["--input-len", "64", "--output-len", "4", "--cache-hit", "0.5", "--num-prefixes", "2", "--rps", "8",
         "--warmup", "0.5", "--duration", "2", "--drain-timeout", "10", "--quiet"]


def test_parse_configs():
    assert parse_configs(["off=--host-cache-bytes 0", "l2=", "l2+l3=--disk-cache-dir '{dir}/a b'"]) == [
        ("off", ["--host-cache-bytes", "0"]), ("l2", []), ("l2+l3", ["--disk-cache-dir", "{dir}/a b"])]
    for bad in (["noequals"], ["=x"], ["a/b=x"], ["a=1", "a=2"], []):
        with pytest.raises(ValueError):
            parse_configs(bad)


def test_each_configuration_is_served_benched_and_compared(tmp_path):
    seen = []

    @contextlib.contextmanager
    def fake_serve(flags):
        seen.append(flags)
        slow = "--slow" in flags  # the second configuration answers later: its TTFT ratio is > 1
        with FakeServer(FakeBehaviour(metrics=True, ttft_s=0.05 if slow else 0.005, itl_s=0.001)) as srv:
            yield srv.address

    configs = parse_configs(["fast=", "slow=--slow --disk-cache-dir {dir}/disk"])
    lines = []
    results = run(configs, ["--num-pages", "64"], BENCH, str(tmp_path / "out"), serve_fn=fake_serve, echo=lines.append)
    assert seen[0] == ["--num-pages", "64"] and seen[1][:3] == ["--num-pages", "64", "--slow"]
    scratch = seen[1][-1]
    assert seen[1][-2] == "--disk-cache-dir" and scratch.endswith("/disk") and "serve-compare-slow-" in scratch
    assert not os.path.exists(os.path.dirname(scratch))  # the scratch directory is gone with its server
    assert list(results) == ["fast", "slow"] and lines[0].startswith("== fast: pdserve serve --num-pages 64")
    for name in results:
        saved = json.loads((tmp_path / "out" / name / "bench.json").read_text())
        assert saved["config"]["target"] == results[name]["config"]["target"] and saved["steps"][0]["num_ok"] > 0
    text = format_configs(results)
    header = text.splitlines()[1]
    assert [c.strip() for c in header.split("|")] == ["Step", "Metric", "fast", "slow", "slow/fast"]
    ttft = next(line for line in text.splitlines() if "TTFT p50 ms" in line)
    assert float(ttft.split("|")[-1].strip().rstrip("x")) > 2  # 50 ms against 5 ms
    assert "Hit by tier" in text and "device " in text and "knee: fast" in text


def test_target_and_out_belong_to_the_runner(tmp_path, capsys):
    assert main(["--config", "a=", "--", "--target", "127.0.0.1:1"]) == 2
    assert "--target and --out are set per configuration" in capsys.readouterr().err
    assert main(["--config", "bad name=x"]) == 2
