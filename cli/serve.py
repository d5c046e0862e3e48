"""``pdserve serve`` (a local cluster: router + workers) and ``pdserve generate`` (stream one answer)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from cli.main import _parse_ids
from cluster.supervisor import RestartPolicy, Supervisor
from common import flags


class _Shutdown(Exception):
    """Raised in the main thread by SIGTERM/SIGINT so startup and the serve loop unwind through cleanup."""


def register(sub) -> None:
    s = sub.add_parser("serve", help="start a router plus prefill and decode workers on this machine")
    s.add_argument("--model", default=None, help="model directory (default: the shipped default model)")
    s.add_argument("--prefill", type=int, default=1,
                   help="prefill worker processes; 0: aggregated (no prefill workers: each decode worker prefills "
                        "every prompt itself, chunked, on all the cores; for a small machine or a single node)")
    s.add_argument("--decode", type=int, default=1, help="decode worker processes")
    s.add_argument("--dp", type=int, default=None,
                   help="data-parallel size: identical workers per role (--prefill K --decode K at once; TP4 x DP2 "
                        "is --decode-tp 4 --decode 2)")
    s.add_argument("--prefill-tp", type=int, default=1, help="rank processes (tensor-parallel size) per prefill worker")
    s.add_argument("--decode-tp", type=int, default=1, help="rank processes (tensor-parallel size) per decode worker")
    s.add_argument("--moe-parallel", default="tp", choices=["tp", "ep"],
                   help="with a tp > 1: split each routed expert's intermediate dim (tp) or partition the experts (ep)")
    s.add_argument("--host", default="127.0.0.1", help="router bind address")
    s.add_argument("--port", type=int, default=50051, help="router port (0: any free port)")
    s.add_argument("--http-port", type=int, default=flags.DEFAULT_HTTP_PORT,
                   help="OpenAI-compatible HTTP port of the router (/v1/completions, /v1/chat/completions, /metrics; "
                        "0: off, -1: any free port)")
    s.add_argument("--served-model-name", default="",
                   help="the model name HTTP clients send (default: the model directory's last component)")
    s.add_argument("--log-level", default="INFO", help="log level of the router and the workers")
    s.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="router and worker logs as text lines or one JSON object per line")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: the checkpoint's where the device computes it fast, else float32)")
    s.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "fp8_e4m3"], help="KV cache dtype (default: the compute dtype; alias --kv-cache-dtype)")
    s.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    s.add_argument("--num-pages", type=int, default=None, help="KV pages per worker (default: sized from memory)")
    s.add_argument("--kv-cache-memory", default=None, metavar="BYTES", help="KV pool bytes per worker (8GiB, 512MB)")
    s.add_argument("--mem-fraction", type=float, default=None,
                   help="fraction of this host's (or GPU's) memory for all workers together (weights, activations, "
                        "KV pools), split equally (default: 0.9 on a GPU; on a CPU at most 4096 pages per worker)")
    s.add_argument("--speculative", default="5/1/6", help="MTP speculation STEPS/TOPK/DRAFT_TOKENS")
    s.add_argument("--no-speculative", action="store_true", help="no MTP speculation (same as --speculative off)")
    s.add_argument("--no-spec-fallback", action="store_true",
                   help="decode workers keep speculating for every request, even when its drafts are rarely "
                        "accepted (default: such a request switches to plain decoding)")
    s.add_argument("--compile", action="store_true",
                   help="decode workers run decode / verify steps through compiled graphs (torch.compile, warmed up "
                        "at start: a few minutes the first time on 2 CPU cores, far less once inductor's disk "
                        "cache holds them)")
    s.add_argument("--decode-weights", default="mxfp4",
                   help="decode workers' routed experts: mxfp4 (default) / mxfp6_e2m3 / mxfp6_e3m2 / mxfp8 (the model "
                        "quantized once, cached), 'model' (the checkpoint as is), or a quantized copy's directory")
    s.add_argument("--api-key", default=None, help="require 'authorization: Bearer KEY' on the public port (every "
                   "user sees it in ps: prefer --api-key-file or $PDSERVE_API_KEY)")
    flags.add_api_key_file_arg(s)
    s.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the router's gRPC and HTTP ports and the workers' gRPC ports over TLS with this "
                        "certificate (the KV data plane stays HMAC-authenticated: see protos/tls.py)")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    s.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle for mutual TLS between the router and the workers (default: trust --tls-cert)")
    s.add_argument("--routing", default="cache_aware", choices=["cache_aware", "round_robin", "least_load", "random"], help="router prefill policy")
    s.add_argument("--local-prefill-below", type=int, default=0,
                   help="prefill prompts shorter than this on the decode worker (0: always disaggregate)")
    s.add_argument("--prefill-chunk", type=int, default=2048,
                   help="decode workers' own prefill (--prefill 0, --local-prefill-below): prompt tokens per step; a "
                        "longer prompt continues over the next steps while the running requests keep decoding")
    s.add_argument("--max-inflight", type=int, default=256,
                   help="router: requests in flight at once (more get RESOURCE_EXHAUSTED)")
    s.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="router: the longest a request may take (a client's shorter deadline wins)")
    s.add_argument("--max-failovers", type=int, default=2,
                   help="times a request may resume on another decode worker after its own died mid-stream")
    s.add_argument("--decode-stall-timeout", type=float, default=30.0,
                   help="seconds a decode stream may stay silent before its requests fail over")
    s.add_argument("--stall-after", type=float, default=60.0,
                   help="a worker whose scheduler has work and finished no step for this long reports itself "
                        "unhealthy (the router drains it)")
    s.add_argument("--no-shm", action="store_true",
                   help="ship KV over TCP even though all workers share this host (default: shared memory)")
    s.add_argument("--kv-transport", choices=["auto", "tcp", "shm", "mooncake"], default="auto",
                   help="how prefill workers ship KV: auto (shm on this host, else tcp), tcp, shm, or mooncake "
                        "(Mooncake's transfer engine: pip install 'pdserve[mooncake]'; falls back to tcp)")
    s.add_argument("--mooncake-protocol", choices=["tcp", "rdma"], default="tcp",
                   help="with --kv-transport mooncake: the transfer engine's protocol")
    s.add_argument("--fault-injection", action="store_true",
                   help="let `pdserve bench --fault drop-kv@S` inject faults (router + prefill workers)")
    s.add_argument("--threads-per-worker", type=int, default=0, help="0: split the cores between the workers")
    s.add_argument("--run-dir", default=None, help="where worker logs go (default: a new temporary directory)")
    s.add_argument("--startup-timeout", type=float, default=300.0, help="seconds every process may take to start")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="times a worker that dies is restarted on its old address (backoff 1 s, doubling up to 30 s)")
    s.add_argument("--grace-s", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: stop admitting, give the requests in flight this long to finish, then "
                        "end the rest with UNAVAILABLE")
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


def serve_config(args: argparse.Namespace):
    """``pdserve serve`` flags -> ``LocalClusterConfig`` (ValueError / OSError: a bad flag or key file)."""
    from cluster.local import LocalClusterConfig  # lazy: grpc, grpc_health, grpc_reflection
    from protos import rpc  # lazy: grpc, grpc_health, grpc_reflection
    api_key = rpc.api_key_from_args(args)
    return LocalClusterConfig(
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, moe_parallel=args.moe_parallel,
        model=args.model, num_prefill=args.prefill, num_decode=args.decode, host=args.host, port=args.port,
        http_port=args.http_port, served_model_name=args.served_model_name, log_level=args.log_level,
        log_format=args.log_format,
        dtype=args.dtype, kv_dtype=args.kv_dtype, page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory, mem_fraction=args.mem_fraction,
        speculative=None if args.no_speculative else args.speculative, spec_fallback=not args.no_spec_fallback,
        decode_weights=args.decode_weights,
        compile_decode=args.compile,
        api_key=api_key, routing=args.routing, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        local_prefill_below=args.local_prefill_below, prefill_chunk=args.prefill_chunk, max_failovers=args.max_failovers,
        max_inflight=args.max_inflight, request_timeout_s=args.request_timeout_s,
        decode_stall_timeout_s=args.decode_stall_timeout, fault_injection=args.fault_injection, shm=not args.no_shm,
        stall_after_s=args.stall_after,
        threads_per_worker=args.threads_per_worker,
        run_dir=args.run_dir, startup_timeout_s=args.startup_timeout, grace_s=args.grace_s,
        max_restarts=args.max_restarts,
        extra_worker_args=() if args.kv_transport == "auto" else
        ("--kv-transport", args.kv_transport, "--mooncake-protocol", args.mooncake_protocol))


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.local import ClusterStartError, LocalCluster  # lazy: grpc, grpc_health, grpc_reflection
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
        workers = (f"{cfg.num_decode} decode workers, aggregated (each prefills its own prompts)" if cfg.aggregated
                   else f"{cfg.num_prefill} prefill + {cfg.num_decode} decode workers")
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
    import grpc  # lazy: grpc

    from protos import rpc  # lazy: grpc, grpc_health, grpc_reflection
    from router.client import Completion, GenerationClient  # lazy: google, grpc, grpc_health, grpc_reflection
    ids = _parse_ids(args.token_ids)
    if (ids is None) == (args.prompt is None):
        raise SystemExit("give exactly one of --prompt and --token-ids")
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              min_p=args.min_p, seed=args.seed, stop=args.stop, stop_token_ids=_parse_ids(args.stop_token_ids) or [],
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
