"""``pdserve serve`` (a local cluster: router + workers) and ``pdserve generate`` (stream one answer)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import grpc

from cli.vocab import parse_ids
from cluster.local import ClusterStartError, LocalCluster, LocalClusterConfig
from cluster.spec import add_cluster_args, cluster_config_from_args
from protos import rpc
from cluster.supervisor import RestartPolicy, Supervisor
from common import flags


class _Shutdown(Exception):
    """Raised in the main thread by SIGTERM/SIGINT so startup and the serve loop unwind through cleanup."""


def register(sub) -> None:
    s = sub.add_parser("serve", help="start a router plus prefill and decode workers on this machine")
    # every flag is a field of LocalClusterConfig: ClusterSpec's (shared with `pdserve launch`) and its own
    add_cluster_args(s, LocalClusterConfig, skip=("stop_margin_s",))
    s.set_defaults(fn=cmd_serve)

    g = sub.add_parser("generate", help="send one request to a running router and stream the answer")
    g.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    g.add_argument("--prompt", default=None, help="prompt text (the server needs a tokenizer)")
    g.add_argument("--token-ids", default=None, help="comma-separated prompt token ids")
    g.add_argument("--api-key", default=None, help="every user sees it in ps: prefer --api-key-file or "
                   "$PDSERVE_API_KEY")
    flags.add_api_key_file_arg(g)
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="dial the router over TLS, trusting this CA bundle (or its self-signed certificate)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's, greedy)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens whose probability reaches this")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the most likely one")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated token ids")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--priority", type=int, default=0, help="request priority (higher first when workers queue)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before the request is abandoned")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    g.set_defaults(fn=cmd_generate)


def _raise_shutdown(signum, frame):
    for s in (signal.SIGTERM, signal.SIGINT):  # the cleanup that follows must not be interrupted in turn
        signal.signal(s, signal.SIG_IGN)
    raise _Shutdown(signal.Signals(signum).name)


def serve_config(args: argparse.Namespace) -> LocalClusterConfig:
    """``pdserve serve`` flags -> ``LocalClusterConfig`` (ValueError / OSError: a bad flag or key file)."""
    return cluster_config_from_args(args, LocalClusterConfig, api_key=rpc.api_key_from_args(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.preflight import check_serve  # lazy: numpy, safetensors, torch
    try:
        cfg = serve_config(args)
        check_serve(cfg)  # everything checkable before a process is spawned
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    old = {s: signal.signal(s, _raise_shutdown) for s in (signal.SIGTERM, signal.SIGINT)}
    rc, cluster = 0, None
    try:
        cluster = LocalCluster(cfg)
        workers = (f"{cfg.decode} decode workers, aggregated (each prefills its own prompts)" if cfg.aggregated
                   else f"{cfg.prefill} prefill + {cfg.decode} decode workers")
        print(f"pdserve: run directory {cluster.run_dir} (logs); starting {workers} for {cluster.model} (decode "
              f"weights: {cluster.decode_weights or 'as in the model'})", flush=True)
        cluster.start()
        print(f"pdserve: listening on {cluster.router_address}", flush=True)
        if cluster.http_address:
            scheme = "https" if cfg.tls_cert else "http"
            print(f"pdserve: OpenAI-compatible HTTP on {scheme}://{cluster.http_address}/v1", flush=True)
        for ch in cluster.children:
            print(f"pdserve:   {ch.name:<10} pid {ch.pid:<7} {ch.address}  log {ch.log_path}", flush=True)
        rc = _watch(cluster)
    except ClusterStartError as e:
        print(f"pdserve: error: {e}", file=sys.stderr, flush=True)
        rc = 1
    except _Shutdown as e:
        print(f"pdserve: {e}: shutting down (requests in flight get {cfg.grace_s:g}s to finish)", flush=True)
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        if cluster is not None:
            cluster.stop(keep_logs=rc != 0)
            if rc != 0 and cluster.cfg.run_dir is None:
                print(f"pdserve: logs kept in {cluster.run_dir}", file=sys.stderr, flush=True)
        print("pdserve: stopped", flush=True)
    return rc


def _watch(cluster) -> int:
    """Serve until a signal: a dead worker is restarted (``cluster.supervisor``; the router routes around it
    meanwhile), a dead router ends it."""
    sup = Supervisor(cluster, RestartPolicy(max_restarts=cluster.cfg.max_restarts))
    while True:
        time.sleep(0.5)
        for event in sup.poll():
            print(f"pdserve: {event}", file=sys.stderr, flush=True)
        if cluster.router.proc.poll() is not None:
            print(f"pdserve: router (pid {cluster.router.pid}) exited with code {cluster.router.proc.returncode}; "
                  f"log tail:\n{cluster.router.log_tail(2000)}", file=sys.stderr, flush=True)
            return 1


def cmd_generate(args: argparse.Namespace) -> int:
    # the router's client: the parser that `pdserve bench` builds loads router.config only (tests/bench/test_config.py)
    from router.client import Completion, GenerationClient
    ids = parse_ids(args.token_ids)
    if (ids is None) == (args.prompt is None):
        raise SystemExit("give exactly one of --prompt and --token-ids")
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              min_p=args.min_p, seed=args.seed, stop=args.stop, stop_token_ids=parse_ids(args.stop_token_ids) or [],
              ignore_eos=args.ignore_eos, priority=args.priority, timeout_s=args.timeout)
    out, t0 = Completion(), time.perf_counter()
    try:
        api_key = rpc.api_key_from_args(args)
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    with GenerationClient(args.target, api_key=api_key, tls_ca=args.tls_ca) as client:
        try:
            for chunk in client.stream(args.prompt, ids, **kw):
                out.add(chunk, t0)
                if args.json:
                    continue
                if args.prompt is not None:  # text in, text out; token ids in, token ids out
                    print(chunk.text, end="", flush=True)
                elif chunk.token_ids:
                    print(" ".join(map(str, chunk.token_ids)), end=" ", flush=True)
        except grpc.RpcError as e:
            print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    u, m = out.usage, out.metrics
    if args.json:
        print(json.dumps({"request_id": out.request_id, "token_ids": out.token_ids, "text": out.text,
                          "finish_reason": out.finish_reason, "prompt_tokens": u.prompt_tokens,
                          "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens,
                          "ttft_s": round(out.ttft_s, 4), "elapsed_s": round(time.perf_counter() - t0, 4),
                          "prefill_worker": m.prefill_worker, "decode_worker": m.decode_worker}))
    else:
        print(f"\n[{out.finish_reason}: {u.completion_tokens} tokens, prompt {u.prompt_tokens} "
              f"({u.cached_tokens} cached), ttft {out.ttft_s * 1000:.1f} ms, "
              f"{m.prefill_worker} -> {m.decode_worker}]", file=sys.stderr)
    return 0
