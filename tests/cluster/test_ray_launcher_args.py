"""What the Ray launcher asks every worker and router process to run (pure: no Ray)."""
from cli.main import build_parser
from cluster.ray_launcher import Deployment, RayLaunchConfig
from cluster.spec import cluster_config_from_args
from router.config import RouterConfig


def deployment(**kw) -> Deployment:
    cfg = RayLaunchConfig(model="/m", resources_per_worker='{"CPU": 3, "GPU": 1}', speculative="off", num_pages=64,
                          **kw)
    return Deployment(cfg.resolved("/m", None), "abc123", "s")


def as_dict(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs (switches map to "")."""
    out, i = {}, 0
    while i < len(args):
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        out[args[i]] = args[i + 1] if has_value else ""
        i += 2 if has_value else 1
    return out


def test_worker_args_carry_the_model_hash_threads_and_no_secret():
    args = deployment().worker_args("decode", "decode-2")
    flags = as_dict(args)
    assert flags["--expect-model-hash"] == "abc123" and flags["--worker-id"] == "decode-2"
    assert flags["--threads"] == "3" and flags["--prefill-threads"] == "3"  # the CPUs of its bundle
    assert flags["--no-speculative"] == "" and flags["--kv-port"] == "0" and flags["--num-pages"] == "64"
    assert "--host" not in flags  # the actor adds its node's IP
    assert "s" not in args  # the secret goes through the environment only
    assert flags["--stall-after"] == "60.0" and "--shm" in flags  # shared-memory pool for same-node prefill
    assert flags["--metrics-port"] == "-1"  # /metrics on a free port, reported in the worker status
    assert (flags["--grace-s"], flags["--prefill-chunk"]) == ("30.0", "2048")
    pre = as_dict(deployment(threads_per_worker=1, stall_after_s=9).worker_args("prefill", "prefill-0"))
    assert "--kv-port" not in pre and "--shm" not in pre and "--prefill-chunk" not in pre
    assert pre["--threads"] == "1" and pre["--stall-after"] == "9"
    assert "--shm" not in deployment(no_shm=True).worker_args("decode", "decode-0")


def test_router_args():
    args = deployment(api_key="k", router=RouterConfig(port=0, http_port=-1, routing="round_robin",
                                                       max_failovers=0)).cfg.router_argv()
    flags = as_dict(args)
    assert {k: flags[k] for k in ("--host", "--port", "--http-port", "--routing", "--model", "--startup-timeout-s",
                                  "--max-failovers", "--decode-stall-timeout-s", "--log-level", "--log-format",
                                  "--grace-s", "--max-inflight", "--request-timeout-s")} == \
        {"--host": "127.0.0.1", "--port": "0", "--http-port": "-1", "--routing": "round_robin", "--model": "/m",
         "--startup-timeout-s": "300.0", "--max-failovers": "0", "--decode-stall-timeout-s": "30.0",
         "--log-level": "INFO", "--log-format": "text", "--grace-s": "30.0", "--max-inflight": "256",
         "--request-timeout-s": "600.0"}
    assert "k" not in args  # the API key goes through the router's environment only
    assert "--aggregated" not in args and "--fault-injection" not in args


def test_decode_weights_reach_decode_workers_only():
    dep = Deployment(RayLaunchConfig(model="/m").resolved("/m", "/q"), "abc123", "s")
    assert as_dict(dep.worker_args("decode", "decode-0"))["--quantized-model"] == "/q"
    assert "--quantized-model" not in dep.worker_args("prefill", "prefill-0")
    assert "--quantized-model" not in deployment().worker_args("decode", "decode-0")


def launch_deployment(*flags: str) -> Deployment:
    cfg = cluster_config_from_args(build_parser().parse_args(["launch", "--model", "/m", *flags]), RayLaunchConfig)
    return Deployment(cfg.resolved("/m", None), "abc123", "s")


def test_no_spec_fallback_from_the_launch_command_line_reaches_decode_workers_only():
    dep = launch_deployment("--no-spec-fallback")
    assert dep.cfg.no_spec_fallback
    assert "--no-spec-fallback" in dep.worker_args("decode", "decode-0")
    assert "--no-spec-fallback" not in dep.worker_args("prefill", "prefill-0")
    assert "--no-spec-fallback" not in deployment().worker_args("decode", "decode-0")


def test_decode_prefix_cache_off_from_the_launch_command_line_reaches_decode_workers_only():
    dep = launch_deployment("--decode-prefix-cache", "off")
    args = dep.worker_args("decode", "decode-0")
    assert args[args.index("--prefix-cache") + 1] == "off"
    assert "--prefix-cache" not in dep.worker_args("prefill", "prefill-0")
    assert "--prefix-cache" not in deployment().worker_args("decode", "decode-0")


def test_prefill_0_launches_aggregated():
    """``launch --prefill 0``: no prefill workers, the router started ``--aggregated``, the decode workers'
    own prefill chunked as asked (as ``pdserve serve --prefill 0``)."""
    dep = launch_deployment("--prefill", "0", "--decode", "2", "--prefill-chunk", "512")
    assert dep.cfg.aggregated and (dep.cfg.prefill, dep.cfg.decode) == (0, 2)
    assert "--aggregated" in dep.cfg.router_argv()
    assert as_dict(dep.worker_args("decode", "decode-1"))["--prefill-chunk"] == "512"


def test_the_options_launch_lacked_reach_the_servers():
    """Issue 46: Mooncake, the router's limits and timeouts, fault injection, the grace period."""
    dep = launch_deployment("--kv-transport", "mooncake", "--mooncake-protocol", "rdma", "--max-inflight", "7",
                            "--request-timeout-s", "30", "--served-model-name", "glm", "--local-prefill-below", "64",
                            "--decode-stall-timeout", "9", "--grace-s", "4", "--startup-timeout", "50",
                            "--fault-injection")
    router = as_dict(dep.cfg.router_argv())
    assert (router["--max-inflight"], router["--request-timeout-s"], router["--served-model-name"]) == \
        ("7", "30.0", "glm")
    assert (router["--local-prefill-below"], router["--decode-stall-timeout-s"], router["--grace-s"]) == \
        ("64", "9.0", "4.0")
    assert router["--startup-timeout-s"] == "50.0" and "--fault-injection" in router
    for role in ("prefill", "decode"):
        w = as_dict(dep.worker_args(role, f"{role}-0"))
        assert (w["--kv-transport"], w["--mooncake-protocol"], w["--grace-s"]) == ("mooncake", "rdma", "4.0")
    assert "--fault-injection" in dep.worker_args("prefill", "prefill-0")
    assert "--fault-injection" not in dep.worker_args("decode", "decode-0")


def test_router_args_parse_with_the_router_the_actor_runs():
    """The router actor runs ``python -m router.discovery`` with ``router_argv``: every flag must exist there."""
    from router.discovery import build_parser as discovery_parser
    dep = deployment(log_format="json", router=RouterConfig(port=0, http_port=-1, served_model_name="glm"))
    args = discovery_parser().parse_args(dep.cfg.router_argv())
    assert (args.http_port, args.log_format, args.log_level, args.served_model_name) == (-1, "json", "INFO", "glm")
    agg = launch_deployment("--prefill", "0", "--fault-injection")
    args = discovery_parser().parse_args(agg.cfg.router_argv())
    assert args.aggregated and args.fault_injection and args.startup_timeout_s == 300.0
