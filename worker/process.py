"""The process side of a worker shared by prefill and decode (the router uses ``freeze_startup_heap`` and
``run`` too): the heap freeze, rank failure, serving until SIGTERM/SIGINT (the flags: ``worker.config``).
Stdlib only at import time (the router imports it and must not load torch); the start-up steps that need
torch or grpc (the pool plan, the bind, the ranks, threads) are ``worker.boot``'s."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time

from common import env

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


def exit_on_rank_failure(ranks, delay_s: float, not_serving=None) -> None:
    """When a rank of this worker fails: it reports unhealthy in its status (``ranks.problem()``) and, with
    ``not_serving`` (a coroutine function), NOT_SERVING on the gRPC health service; ``delay_s`` later it drains
    and exits (SIGTERM to itself), so its supervisor restarts every rank as a unit."""
    loop = asyncio.get_running_loop()

    def failed(reason: str) -> None:  # from any thread
        logger.error("a rank of this worker failed (%s): exiting in %gs", reason, delay_s)
        if not_serving is not None:
            asyncio.run_coroutine_threadsafe(not_serving(), loop)
        loop.call_soon_threadsafe(loop.call_later, delay_s, os.kill, os.getpid(), signal.SIGTERM)
    ranks.on_failure = failed
    if ranks.problem():  # failed before this was set
        failed(ranks.problem())


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
