"""The start-up of a worker process shared by prefill and decode (the router uses ``freeze_startup_heap`` and
``run`` too): flags, threads, the model contract, serving until SIGTERM/SIGINT. Stdlib only at import time
(the router imports it and must not load torch)."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import time

from common import env, logs

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Move every object alive after a worker's start-up (modules, the model, tokenizer tables, ...) into
    the GC's permanent generation, as vLLM (``freeze_gc_heap`` after warm-up) and SGLang (``freeze_gc``) do.

    A worker holds ~300k long-lived container objects (the default model's, after importing both worker
    modules), so every full collection walks them all on whichever thread triggered it (a scheduler step,
    the KV loop): 170-300 ms per collection measured here, ~0 ms once frozen; the router's ~26k objects
    cost ~20 ms per collection on its event loop. Only cyclic garbage made of
    start-up objects is never reclaimed (refcounting still frees the rest). ``PDSERVE_GC_FREEZE=0``
    disables it. Returns how many objects are frozen."""
    if not env.gc_freeze():
        return 0
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.info("froze the start-up heap: %d objects are out of the garbage collector's reach", n)
    return n


def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: the checkpoint's where this device computes it fast, else float32)")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "fp8_e4m3"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="KV pool pages (at most one of the three sizes)")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES", help="KV pool bytes (8GiB, 512MB, ...)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="fraction of the device's memory for weights, activations and the KV pool (default: 0.9 "
                        "on a GPU; on a CPU at most 4096 pages)")
    p.add_argument("--device", default="auto")
    p.add_argument("--cluster-secret", default=None, help="default: $PDSERVE_CLUSTER_SECRET")
    p.add_argument("--expect-model-hash", default=None, help="refuse to start if the model differs")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default). Co-located workers should split the cores: "
                        "oversubscribed OpenMP threads make small decode ops tens of times slower")
    p.add_argument("--stall-after", type=float, default=60.0,
                   help="seconds a scheduler may go without finishing a step while it has work before the worker "
                        "reports itself unhealthy (the router then drains it)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve the worker's gRPC port over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="on SIGTERM: seconds the requests in flight get to finish (new ones go to other workers)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics of this worker on its own port (0: off, -1: any free port; reported "
                        "as info['metrics_port'] in its status)")
    logs.add_log_args(p)


def start_plan(args: argparse.Namespace, weights_dir: str, role: str):
    """The worker's dtype, KV layout and pool size (``engine.sizing.plan_start``), checked before the model
    is loaded or the pool allocated; a pool that cannot fit ends the process with one line naming the
    numbers."""
    from engine.load import resolve_device  # torch: this module stays stdlib-only at import (the router's)
    from engine.sizing import plan_start, pool_sizing  # lazy: numpy, safetensors, torch
    try:
        return plan_start(weights_dir, args.dtype, args.kv_dtype, resolve_device(args.device), args.page_size,
                          pool_sizing(args.num_pages, args.kv_cache_memory, args.mem_fraction))
    except ValueError as e:
        raise SystemExit(f"pdserve {role} worker: error: {e}") from None


def bind(server, args: argparse.Namespace, role: str) -> int:
    """Bind the worker's gRPC port (TLS with --tls-cert/--tls-key, mutual with --tls-ca); a bad TLS flag
    or a port that cannot be bound ends the process with one line."""
    from protos import tls  # grpc: this module stays stdlib-only at import (the router's)
    try:
        port = tls.bind(server, f"{args.host}:{args.port}", tls.tls_config(args.tls_cert, args.tls_key, args.tls_ca),
                        internal=True)
    except ValueError as e:
        raise SystemExit(f"pdserve {role} worker: error: {e}") from None
    if port == 0:
        raise SystemExit(f"pdserve {role} worker: error: cannot bind {args.host}:{args.port}")
    return port


def apply_threads(n: int) -> None:
    """Process-wide CPU settings of a worker: intra-op threads and the malloc thresholds."""
    import torch  # lazy: torch

    from engine.defaults import tune_malloc  # lazy: engine (the router imports this module)

    tune_malloc()
    if n > 0:
        torch.set_num_threads(n)


async def serve_until_signal(server, on_stop, grace_s: float = 3.0, status=None, info: dict | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain: ``info["draining"] = "1"`` (reported in GetStatus, so the
    router sends new requests elsewhere), wait up to ``grace_s`` while ``status()`` shows requests running
    or queued, stop the server (what is left is cancelled), run ``on_stop``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if info is not None:
        info["draining"] = "1"
    deadline = time.monotonic() + grace_s
    busy = (lambda: (st := status()).running + st.queued) if status is not None else (lambda: 0)
    logger.info("signal received: draining (%d requests running or queued get %gs)", busy(), grace_s)
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # shutdown only: a bounded poll
    if busy():
        logger.warning("grace period of %gs over: cancelling %d requests", grace_s, busy())
    await server.stop(grace=1.0)
    await on_stop()


def run(main_coro) -> None:
    try:
        import uvloop  # lazy: uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay runnable without it
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)
