"""One cluster description (``cluster.spec.ClusterSpec``) behind ``pdserve serve`` and ``pdserve launch``
(issue 46): every option of one is an option of the other and a key of both ``--config`` files, the router's
options come from ``RouterConfig`` itself, and both launchers hand the processes the same command lines
(pure: nothing is started)."""
import argparse
import dataclasses

import pytest
import yaml

from cli import vocab
from cli.main import build_parser
from cluster.local import LocalClusterConfig
from cluster.ray_launcher import RayLaunchConfig
from cluster.spec import ROUTER_OPTIONS, ROUTER_OWNED, ClusterSpec, WorkerSlot, cluster_config_from_args
from common.flags import comma_list
from kvtransfer.config import TransportConfig
from router.__main__ import build_parser as router_parser
from router.config import RouterConfig, config_from_args
from router.discovery import build_parser as discovery_parser

NOT_OPTIONS = {"-h", "--help", "-v", "--verbose", "--config"}
DIFFERENT_DEFAULTS = {"--decode-weights": ("mxfp4", "model")}
"""serve's and launch's defaults where they differ, and why: launch's must be a path every node can read (serve
quantizes the model once on this host)."""
OWN_DESTS = {"--run-dir", "--log-dir"}
"""Flags both take that set each launcher's own field: where the logs go (serve: one run directory, default a
new temporary one; launch: a directory on each node)."""


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"serve": sub.choices["serve"], "launch": sub.choices["launch"], "sub": sub}


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for o, a in p._option_string_actions.items() if o not in NOT_OPTIONS}


def sample(action: argparse.Action):
    """A value ``action`` accepts, as a YAML value, and what it parses to."""
    if action.nargs == 0:
        return True, action.const
    if action.choices:
        value = list(action.choices)[-1]
    elif action.type is int:
        value = 3
    elif action.type is float:
        value = 2.5
    elif action.type is comma_list:
        return ["a", "b"], ("a", "b")
    else:
        value = "x"
    return value, action.type(value) if action.type else value


def test_every_option_of_serve_is_an_option_of_launch_and_a_config_key_of_both(commands, tmp_path):
    serve, launch, sub = commands["serve"], commands["launch"], commands["sub"]
    missing = sorted(set(options(serve)) - set(options(launch)))
    assert not missing, f"pdserve serve options that pdserve launch lacks: {missing}"
    path = tmp_path / "c.yaml"
    for flag, action in sorted(options(serve).items()):
        value, parsed = sample(action)
        other = options(launch)[flag]
        assert parsed == sample(other)[1] and (action.dest == other.dest or flag in OWN_DESTS), flag
        path.write_text(yaml.safe_dump({flag.removeprefix("--"): value}))
        for cmd in ("serve", "launch"):
            args = sub.choices[cmd].parse_args(vocab.config_argv([cmd, "--config", str(path)], sub)[1:])
            assert getattr(args, options(sub.choices[cmd])[flag].dest) == parsed, (cmd, flag)


def test_serve_and_launch_share_their_defaults(commands):
    serve, launch = options(commands["serve"]), options(commands["launch"])
    differ = {f: (a.default, launch[f].default) for f, a in serve.items()
              if a.dest == launch[f].dest and a.default != launch[f].default}
    assert differ == DIFFERENT_DEFAULTS
    assert serve["--http-port"].default == launch["--http-port"].default == 8000  # vLLM's port
    # launch adds Ray's own options only (and --json)
    launch_only = {f for f in options(commands["launch"]) if f not in serve}
    ray_fields = {f.name for f in dataclasses.fields(RayLaunchConfig)} - {f.name for f in dataclasses.fields(ClusterSpec)}
    assert launch_only == {"--" + n.replace("_", "-") for n in ray_fields - {"model_hash", "log_dir"}} | {"--json"}


def test_the_same_flags_make_the_same_cluster_for_both_launchers(commands):
    argv = ["--model", "/m", "--prefill", "0", "--decode", "3", "--kv-transport", "mooncake", "--max-inflight", "9",
            "--grace-s", "5", "--decode-weights", "model", "--compile", "--no-speculative", "--http-port", "0"]
    got = {}
    for cmd, cls in (("serve", LocalClusterConfig), ("launch", RayLaunchConfig)):
        args = commands[cmd].parse_args(argv)
        vocab.resolve_vocabulary(args, cmd)
        cfg = cluster_config_from_args(args, cls)
        got[cmd] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ClusterSpec)}
    assert got["serve"] == got["launch"]
    spec = ClusterSpec(**got["serve"])
    assert spec.aggregated and spec.router.max_inflight == 9 and spec.transport.kv_transport == "mooncake"
    assert spec.speculation is None and spec.compile_decode


def non_default(f: dataclasses.Field):
    """A value of router field ``f`` other than its default that ``RouterConfig`` accepts."""
    special = {"routing": "round_robin", "host": "127.0.0.2", "host_hit_weight": 0.5,  # a weight is at most 1
               "disk_hit_weight": 0.25}
    if f.name in special:
        return special[f.name]
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, (int, float)):
        return f.default + 1
    return "glm"


@pytest.mark.parametrize("name", ROUTER_OPTIONS)
def test_every_router_option_is_a_flag_of_both_commands_and_reaches_the_router(name, commands):
    """Generated from ``RouterConfig``: a field added there (e.g. --max-queued) needs no edit here or in the
    launchers to be a flag of serve and launch, a --config key and a flag of the router process."""
    flag = "--" + name.replace("_", "-")
    f = next(f for f in dataclasses.fields(RouterConfig) if f.name == name)
    value = non_default(f)
    for cmd in ("serve", "launch"):
        assert flag in options(commands[cmd]), (cmd, flag)
    spec = ClusterSpec(model="/m", router=RouterConfig(**{name: value}))
    for parser in (router_parser(), discovery_parser()):  # what serve and launch run
        router = config_from_args(parser.parse_args(spec.router_argv()))
        assert getattr(router, name) == value


def test_the_launcher_owns_the_rest_of_the_router_config():
    own = {f.name for f in dataclasses.fields(ClusterSpec)}
    assert not own & set(ROUTER_OPTIONS) and not own & {f.name for f in dataclasses.fields(TransportConfig)}
    assert set(ROUTER_OWNED) | set(ROUTER_OPTIONS) == {f.name for f in dataclasses.fields(RouterConfig)}
    spec = ClusterSpec(model="/m", startup_timeout_s=50, grace_s=4, api_key="k-secret", prefill=0)
    router = config_from_args(router_parser().parse_args(spec.router_argv()))
    assert (router.model, router.startup_timeout_s, router.grace_s, router.aggregated) == ("/m", 50, 4, True)
    assert router.api_key is None  # the key goes through the router's environment, never argv


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_transport_reaches_both_worker_kinds_only_when_asked(role):
    slot = WorkerSlot(f"{role}-0", threads=2)
    assert "--kv-transport" not in ClusterSpec().worker_argv(role, slot)  # auto: the workers' default
    argv = ClusterSpec(transport=TransportConfig("mooncake", "rdma")).worker_argv(role, slot)
    assert argv[argv.index("--kv-transport") + 1:argv.index("--kv-transport") + 4] == \
        ["mooncake", "--mooncake-protocol", "rdma"]
