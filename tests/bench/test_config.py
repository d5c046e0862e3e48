"""BenchConfig validation, SLO parsing, generated flags; the bench stays a pure gRPC client (no torch)."""
import argparse
import ast
import os
import subprocess
import sys

import pytest

from bench.loadgen.config import BenchConfig, Slo, add_config_args, config_from_args, parse_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(argv))


def test_slo_parse():
    assert Slo.parse("ttft=5s,tpot=50ms") == Slo(ttft_s=5.0, tpot_s=0.05)
    assert Slo.parse("ttft=250ms, e2e=30, success=0.9") == Slo(ttft_s=0.25, e2e_s=30.0, min_success=0.9)
    assert parse_seconds("1.5e-3s") == pytest.approx(0.0015)
    for bad in ("ttft", "itl=5ms", "ttft=fast", "ttft=-1s", "success=2"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_flags_generated_from_fields():
    cfg = parse(["--target", "10.0.0.1:9000", "--rps", "0.5,1,1.5,2", "--input-len", "4000", "--output-len", "200",
                 "--cache-hit", "0.6", "--num-prefixes", "4", "--duration", "30", "--warmup", "5", "--out", "o",
                 "--api-key", "k", "--seed", "3", "--slo", "ttft=5s,tpot=50ms", "--nodes", "2",
                 "--cost-per-hour", "2.5", "--power-watts", "700", "--text-prompts"])
    assert cfg.rps == (0.5, 1.0, 1.5, 2.0) and cfg.duration_s == 30.0 and cfg.warmup_s == 5.0
    assert cfg.slo == Slo(ttft_s=5.0, tpot_s=0.05) and cfg.text_prompts and cfg.nodes == 2
    assert (cfg.input_len, cfg.output_len, cfg.cache_hit, cfg.num_prefixes, cfg.seed) == (4000, 200, 0.6, 4, 3)
    assert parse([]) == BenchConfig()  # unset flags keep the dataclass defaults


@pytest.mark.parametrize("kw,match", [
    (dict(rps=(1.0,), concurrency=(2,)), "not both"),
    (dict(rps=(0.0,)), "rates must be > 0"),
    (dict(cache_hit=1.0), "cache_hit"),
    (dict(target="nohost"), "HOST:PORT"),
    (dict(workload="trace"), "needs --trace"),
    (dict(workload="bogus"), "workload"),
    (dict(vocab_size=2), "vocab_size"),
    (dict(input_range=(5, 3)), "input_range"),
])
def test_invalid_configs_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kw)


def test_with_defaults_requires_a_load_shape():
    with pytest.raises(ValueError, match=r"--rps LIST\|auto or --concurrency LIST\|auto"):
        BenchConfig().with_defaults()
    with pytest.raises(ValueError, match="one request at a time"):
        BenchConfig(workload="single-stream", rps=(1.0,)).with_defaults()
    assert BenchConfig(rps=(1.0,)).with_defaults().duration_s == 60.0


def test_help_lists_every_flag(capsys):
    p = argparse.ArgumentParser()
    add_config_args(p)
    p.print_help()  # field docs with '%' ("10%") must not break argparse's %-formatting
    text = capsys.readouterr().out
    assert "--rps LIST" in text and "--resolution" in text and "(10%)" in text and "--max-duration" in text


def test_rps_auto_flags():
    cfg = parse(["--rps", "auto", "--resolution", "0.25", "--start-rate", "1", "--max-rate", "8",
                 "--max-duration", "90"])
    assert (cfg.auto, cfg.rps, cfg.start_rate, cfg.max_rate, cfg.max_duration_s) == ("rps", (), 1.0, 8.0, 90.0)
    assert cfg.resolution_for(4.0) == 0.25 and BenchConfig().resolution_for(4.0) == pytest.approx(0.4)
    conc = parse(["--concurrency", "auto"]).with_defaults()
    assert conc.auto == "concurrency" and conc.max_duration_s == 1200.0  # auto sweeps are always bounded
    assert BenchConfig(rps=(1.0,)).with_defaults().max_duration_s is None
    with pytest.raises(SystemExit):  # 'auto' only where a rate list goes
        parse(["--input-range", "auto"])


@pytest.mark.parametrize("kw,match", [
    (dict(auto="rps", rps=(1.0,)), "drop the rate list"),
    (dict(auto="tokens"), "auto must be one of"),
    (dict(resolution="ten"), "resolution must be"),
    (dict(resolution="-5%"), "resolution must be"),
    (dict(start_rate=4.0, max_rate=2.0), "above max_rate"),
    (dict(max_duration_s=0.0), "max_duration_s must be > 0"),
])
def test_invalid_auto_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kw)


def test_reference_workload_scales_the_reference_shape():
    cfg = BenchConfig(workload="reference", scale=0.1).with_defaults()
    assert (cfg.input_len, cfg.output_len, cfg.cache_hit, cfg.auto) == (2000, 100, 0.6, "rps")
    # Without --scale the server's context decides: the largest listed scale whose 21000 x scale fits.
    unresolved = BenchConfig(workload="reference").with_defaults()
    assert unresolved.input_len is None
    assert unresolved.with_scale(4096) == cfg
    assert unresolved.with_scale(None).input_len == 20_000 and unresolved.with_scale(32768).scale == 1.0
    assert BenchConfig(workload="reference", rps=(0.5, 1.0), input_len=4000).with_defaults().output_len == 200


def test_api_key_not_written_to_json():
    out = BenchConfig(api_key="secret", rps=(1.0,)).with_defaults().to_json()
    assert "api_key" not in out and "secret" not in repr(out)
    assert out["rps"] == [1.0] and out["slo"]["ttft_s"] == 5.0


def _imports(path):
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_bench_is_a_pure_grpc_client():
    """No torch, engine or worker imports anywhere in the load generator or its CLI (it runs off-cluster)."""
    files = [os.path.join(ROOT, "cli", "bench.py")]
    for dirpath, _, names in os.walk(os.path.join(ROOT, "bench", "loadgen")):
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    bad = [f"{os.path.relpath(f, ROOT)} imports {m}" for f in files for m in _imports(f)
           if m in {"torch", "engine", "prefill", "decode", "kvtransfer", "router"}]
    assert not bad, bad
    # the whole CLI's parser (serve's and launch's flags included) may read the router's option declarations
    # (router.config: dataclasses, no grpc server, no torch), nothing else of the router, and no torch or engine
    code = ("import sys; from cli.main import build_parser; build_parser(); import bench.loadgen; "
            "from bench.loadgen import sweep; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'engine', 'prefill', 'decode') or (m.startswith('router.') and m != 'router.config')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_openai_backend_needs_a_base_url_and_no_admin_fault():
    with pytest.raises(ValueError, match="--base-url"):
        BenchConfig(backend="openai")
    with pytest.raises(ValueError, match="--fault needs the pdserve backend"):
        BenchConfig(backend="openai", base_url="http://127.0.0.1:8000/v1", fault="drop-kv@1")
    with pytest.raises(ValueError, match="backend must be one of"):
        BenchConfig(backend="vllm")
    assert BenchConfig(backend="openai", base_url="http://h:1/v1", model="m").to_json()["backend"] == "openai"
