"""What ``pdserve serve`` asks each local worker process to run (pure: nothing is started)."""
import argparse

from cli.main import build_parser
from common.flags import config_from_args
from decode.config import DecodeWorkerConfig
from decode.server import build_parser as decode_parser
from cli.serve import serve_config
from cluster.local import LocalCluster
from kvtransfer.config import add_transport_args, receiver_mooncake_protocol


def worker_cmds(tmp_path, *flags: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--decode-weights", "model", "--run-dir",
                                      str(tmp_path / "run"), *flags])
    cluster = LocalCluster(serve_config(args))
    return {role: cluster._worker_cmd(role, 0) for role in ("prefill", "decode")}


def test_no_spec_fallback_reaches_the_decode_worker_only(tmp_path):
    cmds = worker_cmds(tmp_path, "--no-spec-fallback", "--speculative", "3/1/4")
    assert "--no-spec-fallback" in cmds["decode"] and "--no-spec-fallback" not in cmds["prefill"]
    dec = cmds["decode"]
    assert dec[dec.index("--speculative") + 1] == "3/1/4"
    assert "--no-spec-fallback" not in worker_cmds(tmp_path)["decode"]  # the adaptive fallback stays the default


def test_the_api_key_reaches_the_router_through_its_environment_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "k-0123456789")
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--decode-weights", "model", "--run-dir",
                                      str(tmp_path / "run")])
    cluster = LocalCluster(serve_config(args))
    assert cluster.cfg.api_key == "k-0123456789"
    assert not any("k-0123456789" in a for a in cluster._router_cmd() + cluster._worker_cmd("decode", 0))
    assert "PDSERVE_API_KEY" not in cluster.env  # the workers' environment


def test_kv_transport_reaches_both_workers_and_both_parse_it(tmp_path):
    cmds = worker_cmds(tmp_path, "--kv-transport", "mooncake", "--mooncake-protocol", "rdma")
    for role in ("prefill", "decode"):
        cmd = cmds[role]
        assert cmd[cmd.index("--kv-transport") + 1] == "mooncake"
        assert cmd[cmd.index("--mooncake-protocol") + 1] == "rdma"
    p = argparse.ArgumentParser()
    add_transport_args(p)
    assert receiver_mooncake_protocol(p.parse_args(["--kv-transport", "mooncake", "--mooncake-protocol", "rdma"])) \
        == "rdma"
    assert receiver_mooncake_protocol(p.parse_args([])) is None
    assert "--kv-transport" not in worker_cmds(tmp_path)["prefill"]  # auto: the workers' default, not passed


def test_prefill_0_is_aggregated_all_cores_to_the_decode_workers(tmp_path, monkeypatch):
    """``--prefill 0``: no prefill worker, the router started aggregated (no --prefill list), the cores split
    between the decode workers alone (their own prefill forwards on at least that share, decode steps on
    ``--threads-per-worker`` when given), the prefill chunk passed on; ``--prefill 1`` unchanged."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)

    def cluster(*flags):
        args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--decode-weights", "model",
                                          "--run-dir", str(tmp_path / "run"), *flags])
        return LocalCluster(serve_config(args))

    def threads(cmd):
        return int(cmd[cmd.index("--threads") + 1])
    agg = cluster("--prefill", "0", "--decode", "2", "--prefill-chunk", "512")
    assert agg.cfg.aggregated and threads(agg._worker_cmd("decode", 0)) == 4  # 8 // 2
    dec = agg._worker_cmd("decode", 0)
    assert dec[dec.index("--prefill-chunk") + 1] == "512"
    router = agg._router_cmd()
    assert "--aggregated" in router and "--prefill" not in router
    assert int(dec[dec.index("--prefill-threads") + 1]) == 4
    hybrid = cluster("--prefill", "0", "--decode", "2", "--threads-per-worker", "1")._worker_cmd("decode", 0)
    assert threads(hybrid) == 1 and hybrid[hybrid.index("--prefill-threads") + 1] == "4"  # decode 1, prefill 4
    disagg = cluster("--prefill", "1", "--decode", "2")
    assert not disagg.cfg.aggregated and threads(disagg._worker_cmd("decode", 0)) == 2  # 8 // 3
    assert threads(disagg._worker_cmd("prefill", 0)) == 2  # 8 // 3: prefill workers keep their share
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    small = cluster("--prefill", "0")._worker_cmd("decode", 0)  # 2 cores: decode and its prefill on both
    assert threads(small) == 2 and small[small.index("--prefill-threads") + 1] == "2"
    assert threads(cluster("--prefill", "0", "--threads-per-worker", "2")._worker_cmd("decode", 0)) == 2
    router = disagg._router_cmd()
    assert "--aggregated" not in router and "--prefill" in router


def test_decode_prefix_cache_off_reaches_the_decode_worker_only_and_it_parses_it(tmp_path):
    dec = worker_cmds(tmp_path, "--decode-prefix-cache", "off")["decode"]
    assert dec[dec.index("--prefix-cache") + 1] == "off"
    assert "--prefix-cache" not in worker_cmds(tmp_path)["decode"]  # on: the workers' own default
    assert "--prefix-cache" not in worker_cmds(tmp_path, "--decode-prefix-cache", "off")["prefill"]
    args = decode_parser().parse_args(["--prefix-cache", "off"])
    assert config_from_args(args, DecodeWorkerConfig).prefix_cache == "off"
    assert config_from_args(decode_parser().parse_args([]), DecodeWorkerConfig).prefix_cache == "on"
