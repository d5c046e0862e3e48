"""The workers' flags come from their config dataclasses (``common.flags``): every flag the local and Ray
launchers pass parses with the role's parser, and every flag has help text (pure: nothing is started)."""
import os

import pytest

from cli.main import build_parser as cli_parser
from cli.serve import serve_config
from cluster.local import LocalCluster
from cluster.ray_launcher import Deployment, RayLaunchConfig
from common.flags import config_from_args
from decode.server import DecodeWorkerConfig
from decode.server import build_parser as decode_parser
from kvtransfer.config import TransportConfig
from prefill.config import PrefillConfig, PrefillWorkerConfig
from prefill.server import build_parser as prefill_parser

PARSERS = {"prefill": (prefill_parser, PrefillWorkerConfig), "decode": (decode_parser, DecodeWorkerConfig)}


def parse(role: str, argv: list[str]):
    """The role's worker configs from ``argv`` (argparse exits on a flag it does not know)."""
    build, cls = PARSERS[role]
    args = build().parse_args(argv)
    return config_from_args(args, cls), config_from_args(args, TransportConfig), args


def local_cmds(tmp_path, *flags: str) -> dict[str, list[str]]:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")  # read as PEM by the config check only
    args = cli_parser().parse_args(["serve", "--model", str(tmp_path), "--decode-weights", "model", "--run-dir",
                                    str(tmp_path / "run"), *flags])
    cluster = LocalCluster(serve_config(args))
    if "--compile" in flags:
        cluster.decode_weights = "/q"  # as resolved from an MX format (no model here to quantize)
    return {role: cluster._worker_cmd(role, 0) for role in PARSERS}


def test_every_flag_of_pdserve_serve_parses_with_the_workers(tmp_path):
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"),
           "--tls-ca", str(tmp_path / "ca.pem")]
    for flags in ([], ["--kv-dtype", "fp8_e4m3", "--num-pages", "64", "--no-spec-fallback", "--compile",
                       "--fault-injection", "--kv-transport", "mooncake", "--mooncake-protocol", "rdma",
                       "--log-format", "json", "--speculative", "3/1/4", "--host-cache-bytes", "64M",
                       "--host-cache-policy", "write_through", "--disk-cache-dir", str(tmp_path / "kv"),
                       "--disk-cache-bytes", "2G", "--load-timeout-s", "0.5", *tls],
                  ["--kv-cache-memory", "1GiB", "--mem-fraction", "0.5", "--no-speculative", "--no-shm"]):
        for role, cmd in local_cmds(tmp_path, *flags).items():
            assert cmd[1:3] == ["-m", f"{role}.server"]
            wcfg, transport, args = parse(role, cmd[3:])
            assert wcfg.worker_id == f"{role}-0" and wcfg.metrics_port == -1 and wcfg.host == "127.0.0.1"
            if "--kv-transport" in flags:
                assert (transport.kv_transport, transport.mooncake_protocol) == ("mooncake", "rdma")
                assert (wcfg.kv_dtype, wcfg.num_pages, args.log_format) == ("fp8_e4m3", 64, "json")
                assert wcfg.tls_ca.endswith("ca.pem")
                if role == "decode":
                    assert (wcfg.no_spec_fallback, wcfg.compile, wcfg.speculative) == (True, True, "3/1/4")
                    assert wcfg.quantized_model == "/q" and wcfg.shm
                else:
                    assert wcfg.fault_injection
                    assert (wcfg.host_cache_bytes, wcfg.host_cache_policy) == ("64M", "write_through")
                    assert (wcfg.disk_cache_dir, wcfg.disk_cache_bytes) == (str(tmp_path / "kv" / "prefill-0"), "2G")
                    assert wcfg.load_timeout_s == 0.5
            elif role == "prefill":
                assert (wcfg.host_cache_bytes, wcfg.host_cache_policy) == ("auto", "write_back")
                assert wcfg.load_timeout_s == PrefillConfig().load_timeout_s  # one default, the scheduler's
                assert (wcfg.disk_cache_dir, wcfg.disk_cache_bytes) == (None, "auto")
            if "--no-speculative" in flags:
                assert (wcfg.kv_cache_memory, wcfg.mem_fraction) == ("1GiB", 0.25)  # the fraction split by 2 workers
                assert role == "prefill" or (wcfg.no_speculative and not wcfg.shm)


def ray_deployment(tmp_path, **kw) -> Deployment:
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")  # read as PEM by the config check only
    tls = {k: str(tmp_path / f) for k, f in (("tls_cert", "c.pem"), ("tls_key", "k.pem"), ("tls_ca", "ca.pem"))}
    decode_weights = kw.pop("decode_weights", None)
    cfg = RayLaunchConfig(model="/m", resources_per_worker='{"CPU": 3}', **tls, **kw)
    return Deployment(cfg.resolved("/m", decode_weights), "abc123", "s")


@pytest.mark.parametrize("kw", [
    {},
    {"kv_dtype": "bfloat16", "num_pages": 64, "compile_decode": True, "no_spec_fallback": True,
     "decode_weights": "/q", "speculative": "off", "log_format": "json"},
    {"kv_cache_memory": "512MB", "mem_fraction": 0.4, "no_shm": True, "host_cache_bytes": "0"},
    {"disk_cache_dir": "kv", "disk_cache_bytes": "40G"},
])
def test_every_flag_of_the_ray_launcher_parses_with_the_workers(kw, tmp_path):
    for role in PARSERS:
        argv = ray_deployment(tmp_path, **kw).worker_args(role, f"{role}-1")
        wcfg, _, args = parse(role, argv + ["--host", "10.0.0.1"])  # the actor adds its node's IP
        assert (wcfg.expect_model_hash, wcfg.threads, wcfg.worker_id) == ("abc123", 3, f"{role}-1")
        assert (wcfg.tls_cert, wcfg.host, args.log_format) == (str(tmp_path / "c.pem"), "10.0.0.1",
                                                               kw.get("log_format", "text"))
        assert wcfg.num_pages == kw.get("num_pages") and wcfg.mem_fraction == kw.get("mem_fraction")
        if role == "decode":
            assert wcfg.compile == kw.get("compile_decode", False) and wcfg.shm == (not kw.get("no_shm"))
            assert wcfg.quantized_model == kw.get("decode_weights")
        else:
            assert wcfg.host_cache_bytes == kw.get("host_cache_bytes", "auto")
            assert wcfg.disk_cache_bytes == kw.get("disk_cache_bytes", "auto")
            assert wcfg.disk_cache_dir == (os.path.abspath(f"kv/{role}-1") if "disk_cache_dir" in kw else None)


@pytest.mark.parametrize("role", list(PARSERS))
def test_every_worker_flag_has_help_and_the_defaults_are_the_configs(role):
    build, cls = PARSERS[role]
    p = build()
    for action in p._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help text"
    wcfg, transport, args = parse(role, [])
    assert wcfg == cls() and transport == TransportConfig()
    assert (args.log_level, args.log_format) == ("INFO", "text")
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float64"])  # choices still checked
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-transport", "carrier-pigeon"])


def test_a_negative_load_timeout_is_refused_by_the_worker_and_by_serve():
    with pytest.raises(ValueError, match="--load-timeout-s must be >= 0"):
        PrefillWorkerConfig(load_timeout_s=-1.0)
    with pytest.raises(ValueError, match="load_timeout_s must be >= 0"):
        serve_config(cli_parser().parse_args(["serve", "--load-timeout-s", "-1"]))
