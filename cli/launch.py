"""``pdserve launch / status / stop / scale``: a deployment on a running Ray cluster (``cluster/ray_launcher.py``).

    ray start --head                                   # one node; `ray start --address HEAD:6379` on the others
    pdserve launch --address auto --prefill 2 --decode 1 --model /shared/model
    pdserve status --address auto
    pdserve scale --address auto --prefill 3
    pdserve stop --address auto

On one machine, keep every Ray process and pdserve server on loopback (no traffic on the host's address):

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 pdserve launch --address 127.0.0.1:6379 ...

(``--node-ip-address`` alone is not enough: Ray resolves 127.0.0.1 to the host's address unless that
variable turns on its loopback mode.)
"""
from __future__ import annotations

import argparse
import json
import sys

from cluster.ray_launcher import LaunchError, PlacementError, RayLaunchConfig, launch, status, stop
from cluster.ray_placement import PLACEMENTS
from cluster.ray_scale import scale
from cluster.spec import add_cluster_args, cluster_config_from_args
from protos import rpc


def register(sub) -> None:
    la = sub.add_parser("launch", help="start a router and workers as Ray actors on a running Ray cluster")
    # every flag is a field of RayLaunchConfig: ClusterSpec's (shared with `pdserve serve`) and Ray's own
    add_cluster_args(la, RayLaunchConfig, skip=("model_hash",), choices={"placement": PLACEMENTS})
    la.add_argument("--json", action="store_true", help="print the deployment as one JSON object")
    la.set_defaults(fn=cmd_launch)

    st = sub.add_parser("status", help="show the pdserve actors on a Ray cluster: addresses, nodes, restarts")
    _common(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(fn=cmd_status)

    sp = sub.add_parser("stop", help="stop every pdserve actor and remove its placement groups")
    _common(sp)
    sp.add_argument("--grace-s", type=float, default=10.0, help="seconds each server gets after SIGTERM")
    sp.set_defaults(fn=cmd_stop)

    sc = sub.add_parser("scale", help="change the number of prefill / decode workers of a launched deployment")
    _common(sc)
    sc.add_argument("--prefill", type=int, default=None, help="prefill workers wanted (default: unchanged)")
    sc.add_argument("--decode", type=int, default=None, help="decode workers wanted (default: unchanged)")
    sc.add_argument("--drain-timeout-s", type=float, default=600.0,
                    help="how long a removed worker may finish its requests before it is stopped")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    sc.set_defaults(fn=cmd_scale)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster: auto or HOST:PORT (ray://HOST:PORT untested)")
    p.add_argument("--namespace", default="pdserve", help="Ray namespace of the deployment")


def cmd_launch(args: argparse.Namespace) -> int:
    from cluster.preflight import check_launch  # lazy: numpy, safetensors, torch
    try:
        cfg = cluster_config_from_args(args, RayLaunchConfig, api_key=rpc.api_key_from_args(args))
        check_launch(cfg)  # before Ray is contacted
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    workers = (f"{cfg.decode} decode workers, aggregated (each prefills its own prompts)" if cfg.aggregated
               else f"{cfg.prefill} prefill + {cfg.decode} decode workers")
    print(f"pdserve: launching {workers} on Ray ({cfg.address}, namespace {cfg.namespace})", file=sys.stderr,
          flush=True)
    try:
        st = launch(cfg)
    except (LaunchError, PlacementError, ConnectionError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    _print(st, args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        st = status(args.address, args.namespace)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    _print(st, args.json)
    return 0 if st.router is not None or st.workers else 3


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        names = stop(args.address, args.namespace, args.grace_s)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    print(f"pdserve: stopped {', '.join(names) if names else 'nothing (no pdserve actors)'}; placement groups "
          f"removed")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    try:
        st = scale(args.address, args.namespace, args.prefill, args.decode, args.drain_timeout_s)
    except (LaunchError, PlacementError, ConnectionError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    _print(st, args.json)
    return 0


def _print(st, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"namespace": st.namespace, "router": st.router, "workers": st.workers,
                          "errors": st.errors, "notes": st.notes,
                          "groups": {n: {"state": g.get("state"), "strategy": g.get("strategy"),
                                         "nodes": sorted(set((g.get("bundles_to_node_id") or {}).values()))}
                                     for n, g in st.groups.items()}}))
        return
    if st.router is not None:
        print(f"router      {st.router['address']:<22} node {st.router['node_id'][:8]}  (namespace {st.namespace})")
        if st.router.get("http_address"):
            print(f"router      OpenAI-compatible HTTP on http://{st.router['http_address']}/v1")
    for w in sorted(st.workers, key=lambda w: (w["role"], w["name"])):
        flags = [f for f, on in (("restarted", w["restarted"]), ("draining", w["draining"])) if on]
        print(f"{w['name']:<11} {w['address']:<22} node {w['node_id'][:8]}  pid {w['pid']:<7} {' '.join(flags)}")
    for name, err in sorted(st.errors.items()):
        print(f"{name:<11} {err}")
    for note in st.notes:
        print(f"note: {note}")
    if st.router is None and not st.workers and not st.errors:
        print(f"no pdserve actors in namespace {st.namespace}")
