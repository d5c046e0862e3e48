"""What the Ray launcher asks every worker and router process to run (pure: no Ray)."""
import dataclasses

from cluster.ray_launcher import RayLaunchConfig, _router_args, _worker_args


def spec(**kw) -> dict:
    cfg = RayLaunchConfig(model="/m", resources_per_worker='{"CPU": 3, "GPU": 1}', speculative="off", num_pages=64,
                          **kw)
    return {**dataclasses.asdict(cfg), "model_hash": "abc123", "secret": "s", "notes": []}


def test_worker_args_carry_the_model_hash_threads_and_no_secret():
    args = _worker_args(spec(), "decode", "decode-2")
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--expect-model-hash"] == "abc123" and flags["--worker-id"] == "decode-2"
    assert flags["--threads"] == "3"  # the CPUs of its bundle
    assert flags["--speculative"] == "off" and flags["--kv-port"] == "0" and flags["--num-pages"] == "64"
    assert "--host" not in flags  # the actor adds its node's IP
    assert "s" not in args  # the secret goes through the environment only
    assert flags["--stall-after"] == "60.0" and args[-1] == "--shm"  # shared-memory pool for same-node prefill
    assert flags["--metrics-port"] == "-1"  # /metrics on a free port, reported in the worker status
    pre = _worker_args(spec(threads=1, stall_after_s=9), "prefill", "prefill-0")
    assert "--kv-port" not in pre and "--shm" not in pre
    assert dict(zip(pre[::2], pre[1::2]))["--threads"] == "1" and dict(zip(pre[::2], pre[1::2]))["--stall-after"] == "9"
    assert "--shm" not in _worker_args(spec(no_shm=True), "decode", "decode-0")


def test_router_args():
    args = _router_args(spec(port=0, http_port=-1, api_key="k", routing="round_robin", max_failovers=0))
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "0", "--http-port": "-1", "--routing": "round_robin", "--model": "/m",
                     "--startup-timeout-s": "300.0", "--max-failovers": "0", "--decode-stall-timeout-s": "30.0",
                     "--log-level": "INFO", "--log-format": "text"}
    assert "k" not in args  # the API key goes through the router's environment only


def test_decode_weights_reach_decode_workers_only():
    dec = _worker_args(spec(decode_weights="/q"), "decode", "decode-0")
    assert dict(zip(dec[::2], dec[1::2]))["--quantized-model"] == "/q"
    assert "--quantized-model" not in _worker_args(spec(decode_weights="/q"), "prefill", "prefill-0")
    assert "--quantized-model" not in _worker_args(spec(), "decode", "decode-0")


def test_no_spec_fallback_from_the_launch_command_line_reaches_decode_workers_only():
    from cli.main import build_parser
    from common.flags import config_from_args
    cfg = config_from_args(build_parser().parse_args(["launch", "--model", "/m", "--no-spec-fallback"]),
                           cls=RayLaunchConfig)
    assert cfg.no_spec_fallback
    s = {**dataclasses.asdict(cfg), "model_hash": "abc123", "secret": "s", "notes": []}
    assert "--no-spec-fallback" in _worker_args(s, "decode", "decode-0")
    assert "--no-spec-fallback" not in _worker_args(s, "prefill", "prefill-0")
    assert "--no-spec-fallback" not in _worker_args(spec(), "decode", "decode-0")


def test_router_args_parse_with_the_router_the_actor_runs():
    """The router actor runs ``python -m router.discovery`` with ``_router_args``: every flag must exist there."""
    from router.discovery import build_parser
    args = build_parser().parse_args(_router_args(spec(port=0, http_port=-1, log_format="json")))
    assert (args.http_port, args.log_format, args.log_level) == (-1, "json", "INFO")
