"""Rank groups: a worker of tensor-parallel size N is N processes, rank 0 in charge.

Rank 0 is the worker process as before (gRPC servicer, scheduler, KV data plane). ``RankGroup.start``
makes it the group's leader::

    rank 0                                   ranks 1..N-1 (python -m worker.follower, children of rank 0)
    spawn followers ───────────────────────> die with rank 0 (PR_SET_PDEATHSIG), join the TP group
    join the TP group (engine.parallel.init_tp_group: 127.0.0.1, gloo on CPU, nccl on cuda)
    load its shard                           load its shard, set ready/<rank> = model hash in the
                                             readiness store (rank 0's, another free port)
    wait_ready: every hash equal, or fail    loop: recv command -> run it on the local model and pool
    serve: every model call is a command ──> the same call, same inputs (ModelProxy)
    close: "exit" command, join children     return

The scheduler holds a ``ModelProxy`` instead of the model: same methods (``forward``, ``mtp_kv``,
``forward_mtp``, ``logits``), each broadcast (``worker.rank_wire``, msgpack + raw tensors, no pickle)
before it runs locally, all under one lock, so every rank sees one ordered stream of commands.

KV pool mutations outside a model call, each mirrored to the followers (every other write to the pool
happens inside a model call, which every rank runs on its own pool):

1. KV landed by the KV receiver (decode; TCP, shared memory, Mooncake and staged transports alike): once
   a transfer is complete and verified, before the request joins a batch, rank 0 broadcasts the request's
   pages (every layer, every component, fp8 scales): ``RankGroup.mirror_pages`` (replicated KV: MLA); or,
   when the ranks split the KV heads (GQA), the KV landed whole in a full-layout landing pool and each rank
   takes its heads into new pages: ``RankGroup.scatter_pages``.
2. ``move_kv`` of speculative decoding (an accepted draft-tree branch moved to its final slots):
   ``ModelProxy.move_kv``, handed to ``SpecDecoder`` as its ``move_kv``.
3. A pool made after start-up (``engine.offline.Engine`` and ``SpecEngine`` build their own): registered
   on its first use (the ``pool`` command makes the same layout and page count on every follower).

Not mutations, so nothing to mirror: the prefill prefix cache shares pages by reference (refcounts, no
copy); page allocation, refcounts and frees are rank 0's bookkeeping (followers are addressed by slot);
decode preemption recomputes through ``prefill_forward`` (model calls); the KV sender only reads (with
split heads it reads a full-layout staging pool that ``RankGroup.gather_pages`` fills from every rank:
``prefill.gather_sink``).

Failure: a follower that exits, or a broadcast that raises (a peer gone, the collective timeout), marks
the group failed: every later call raises ``RankFailure`` at once, ``problem()`` says why (the worker
reports itself unhealthy) and ``on_failure`` runs once (the worker then exits, so its supervisor
restarts all its ranks as a unit). Followers die with rank 0 and leave a collective that times out.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kvcache import KVPool
from engine.kvcache.layout import kv_is_split
from engine.parallel import ParallelConfig, destroy_tp_group, init_tp_group
from worker.rank_pages import (
    full_page_tensors,
    gather_heads,
    gather_stats,
    output_stats,
    page_tensors,
    write_full_pages,
    write_head_slices,
)
from worker.rank_wire import CommandChannel

logger = logging.getLogger(__name__)

MOE_PARALLEL = ("tp", "ep")


class RankFailure(RuntimeError):
    """A rank of this worker died or a collective failed: the worker cannot compute any more."""


@dataclass(frozen=True, slots=True)
class RankConfig:
    tp_size: int = 1
    """Ranks in the worker (tensor-parallel size); 1: no followers, no process group."""
    moe_parallel: str = "tp"
    """Routed experts: ``tp`` splits each expert's intermediate dim, ``ep`` partitions the experts."""
    timeout_s: float = 60.0
    """A collective that waits longer raises (a rank gone silent never hangs the others forever)."""
    heartbeat_s: float = 5.0
    """An idle rank 0 pings its followers this often (they wait at most ``timeout_s`` for a command)."""
    start_timeout_s: float = 600.0
    """Followers must have joined and loaded the model within this."""
    check_outputs: bool = False
    """After every model call the ranks compare their logits (``$PDSERVE_RANK_CHECK``): every rank must hold
    the same full-vocab logits, so a rank whose KV missed a mirrored write is caught at its first read."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp size must be >= 1, got {self.tp_size}")
        if self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe parallel mode {self.moe_parallel!r} not in {MOE_PARALLEL}")
        if not 0 < self.heartbeat_s < self.timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < timeout_s ({self.timeout_s})")


@dataclass(frozen=True, slots=True)
class FollowerArgs:
    """What a follower needs to load the same model as rank 0 (its ``worker.follower`` command line)."""
    model_dir: str
    dtype: str
    device: str
    moe_impl: str = "auto"
    threads: int = 0
    log_level: str = "INFO"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def batch_tensors(batch: ForwardBatch) -> tuple[dict, dict[str, torch.Tensor]]:
    """``batch`` as (msgpack meta, tensors) for a follower to rebuild it (``batch_from``)."""
    meta = {"q_lens": batch.q_lens, "kv_lens": batch.kv_lens, "max_kv_len": batch.max_kv_len,
            "cached_lens": batch.cached_lens, "on_layer_done": batch.on_layer_done is not None,
            "trees": [t is not None for t in batch.tree_masks]}
    tensors = {k: getattr(batch, k) for k in BATCH_TENSORS}
    tensors.update({f"tree{i}": t for i, t in enumerate(batch.tree_masks) if t is not None})
    tensors["mask"] = batch._mask  # built and edited by its maker (the draft proposer's sibling visibility)
    return meta, tensors


BATCH_TENSORS = ("input_ids", "positions", "out_slots", "kv_slots", "q_index", "q_valid", "logits_index")


def batch_from(meta: dict, tensors: dict[str, torch.Tensor]) -> ForwardBatch:
    """Inverse of ``batch_tensors``. A batch that had a per-layer hook on rank 0 gets a no-op one, so every
    rank takes the same code path (the hook decides between the eager and the compiled stack)."""
    return ForwardBatch(**{k: tensors[k] for k in BATCH_TENSORS}, q_lens=meta["q_lens"], kv_lens=meta["kv_lens"],
                        max_kv_len=meta["max_kv_len"], cached_lens=meta["cached_lens"],
                        tree_masks=[tensors[f"tree{i}"] if has else None for i, has in enumerate(meta["trees"])],
                        on_layer_done=(lambda layer: None) if meta["on_layer_done"] else None, _mask=tensors.get("mask"))


class RankGroup:
    """Rank 0's side of a worker's rank group (see the module docstring). Thread-safe."""

    def __init__(self, config: RankConfig, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # nccl binds each rank to one indexed device: rank 0's
            device = torch.device("cuda", 0)
        self.config, self.device = config, device
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._chan = CommandChannel(device)
        self._pools: dict[int, tuple[int, KVPool]] = {}
        self._problem = ""
        self._closing = False
        self._last_send = time.monotonic()
        self._store: dist.TCPStore | None = None
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        self.kv_split = False
        """Each rank's pool holds a slice of every token's KV (GQA heads split by the engine), so rank 0's pages
        are not the whole KV: received pages cannot be mirrored and the KV plane says so in its handshake."""
        self.on_failure: Callable[[str], None] | None = None
        """Called once, from the thread that saw it, with the reason (the worker arranges its exit)."""

    @property
    def size(self) -> int:
        return self.config.tp_size

    @property
    def parallel(self) -> ParallelConfig:
        """Rank 0's share of the model (``engine.load.load_model(..., parallel=)``)."""
        return ParallelConfig(self.config.tp_size, 0, self.config.moe_parallel)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- start-up ------------------------------------------------------------------------------
    def start(self, fargs: FollowerArgs) -> None:
        """Spawn ranks 1..N-1 and join the group as rank 0 (call from the main thread: the followers'
        parent-death signal follows the thread that spawned them)."""
        c = self.config
        port, store_port = free_port(), free_port()
        self._store = dist.TCPStore("127.0.0.1", store_port, c.tp_size, is_master=True,
                                    timeout=timedelta(seconds=c.start_timeout_s), wait_for_workers=False)
        for rank in range(1, c.tp_size):
            cmd = [sys.executable, "-m", "worker.follower", "--rank", str(rank), "--world-size", str(c.tp_size),
                   "--master-port", str(port), "--store-port", str(store_port), "--parent-pid", str(os.getpid()),
                   "--model", fargs.model_dir,
                   "--dtype", fargs.dtype, "--device", fargs.device, "--moe-impl", fargs.moe_impl,
                   "--moe-parallel", c.moe_parallel, "--timeout-s", repr(c.timeout_s),
                   "--threads", str(fargs.threads), "--log-level", fargs.log_level]
            self._procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        logger.info("rank group: started followers %s (tp %d, moe %s)", self.pids, c.tp_size, c.moe_parallel)
        init_tp_group(self.parallel, port, backend_for(self.device), c.timeout_s, device=self.device)

    def wait_ready(self, model_hash: str, cfg: ModelConfig) -> None:
        """Wait until every follower has loaded its shard; raise ``RankFailure`` when one exited first, did
        not make it within ``start_timeout_s``, or loaded a model whose hash differs from rank 0's."""
        self.kv_split = kv_is_split(cfg)
        deadline = time.monotonic() + self.config.start_timeout_s
        for rank, proc in enumerate(self._procs, start=1):
            key = f"ready/{rank}"
            while not self._store.check([key]):
                if proc.poll() is not None:
                    raise RankFailure(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode} "
                                      f"during start-up")
                if time.monotonic() > deadline:
                    raise RankFailure(f"rank {rank} not ready within {self.config.start_timeout_s:g}s")
                time.sleep(0.05)  # start-up only: a bounded poll
            theirs = self._store.get(key).decode()
            if theirs != model_hash:
                raise RankFailure(f"rank {rank} loaded model hash {theirs}, rank 0 has {model_hash}: the ranks "
                                  f"of one worker must load the same model")
        self._monitor = threading.Thread(target=self._watch, name="rank-monitor", daemon=True)
        self._monitor.start()
        logger.info("rank group: %d ranks ready", self.size)

    # -- commands ------------------------------------------------------------------------------
    def problem(self) -> str:
        """Why this worker cannot compute (a rank died, a collective failed), or ""."""
        return self._problem

    def call(self, op: str, meta: dict, tensors: dict, pool: KVPool | None, local: Callable[[], object],
             logits_of: Callable[[object], torch.Tensor] | None = None):
        """Broadcast one command, then run ``local()`` here (under the group lock: one ordered stream).
        With ``check_outputs`` and ``logits_of``, the ranks then compare their logits (``output_stats``)."""
        check = self.config.check_outputs and logits_of is not None
        with self._lock:
            if self._problem:
                raise RankFailure(self._problem)
            try:  # the channel and the comparison are collectives only: any failure there is the group's
                if pool is not None:
                    meta = {**meta, "pool": self._pool_handle(pool)}
                self._chan.send(op, {**meta, "check": check}, tensors)
                self._last_send = time.monotonic()
            except Exception as e:
                self._fail(f"rank group broadcast failed in {op!r}: {e}")
                raise RankFailure(self._problem) from e
            try:
                out = local()
            except Exception as e:
                if self._lost(e):  # a collective inside the model call failed: a rank is gone
                    self._fail(f"rank group failed in {op!r}: {e}")
                    raise RankFailure(self._problem) from e
                raise  # the call's own error (rank 0 and the followers raised alike)
            if check:
                try:
                    stats = gather_stats(output_stats(logits_of(out)), self.size, self.device)
                except Exception as e:
                    self._fail(f"rank group output check failed in {op!r}: {e}")
                    raise RankFailure(self._problem) from e
                self._compare(op, stats)
            return out

    def _lost(self, e: Exception) -> bool:
        """Whether ``e`` means a rank is gone: a distributed error, a transport error of the backend, or a
        follower that has exited."""
        text = str(e)
        return (isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text
                or any(p.poll() is not None for p in self._procs))

    def _compare(self, op: str, stats: list[torch.Tensor]) -> None:
        mine = stats[0]
        for rank, theirs in enumerate(stats):
            if not torch.allclose(theirs.cpu(), mine.cpu(), rtol=1e-5, atol=1e-6):
                self._fail(f"rank {rank} diverged from rank 0 in {op!r}: logits fingerprint "
                           f"{theirs.tolist()} != {mine.tolist()}")
                raise RankFailure(self._problem)

    def mirror_pages(self, pool: KVPool, page_ids) -> None:
        """Copy rank 0's bytes of ``page_ids`` (every layer) to every follower's pool (KV that landed here)."""
        if self.kv_split:
            raise ValueError("rank 0 holds only its slice of each token's KV: received pages cannot be mirrored")
        if not len(page_ids):
            return
        idx = torch.as_tensor(list(page_ids), dtype=torch.long, device=pool.device)
        self.call("write_pages", {}, {"pages": idx, **page_tensors(pool, idx)}, pool, lambda: None)

    def scatter_pages(self, landing: KVPool, src_ids, pool: KVPool, dst_ids) -> None:
        """KV that landed whole (every head, ``landing``'s full layout) goes to each rank's heads: pages
        ``src_ids`` of ``landing`` -> pages ``dst_ids`` of every rank's pool (GQA heads split by rank)."""
        src = torch.as_tensor(list(src_ids), dtype=torch.long, device=landing.device)
        dst = torch.as_tensor(list(dst_ids), dtype=torch.long, device=pool.device)
        full = full_page_tensors(landing, src)
        self.call("scatter_pages", {}, {"pages": dst, **full}, pool,
                  lambda: write_head_slices(pool, dst, full, self.parallel))

    def gather_pages(self, pool: KVPool, page_ids, staging: KVPool, staging_ids) -> None:
        """Every rank's heads of ``page_ids`` (its pool) -> pages ``staging_ids`` of the full-layout ``staging``
        pool on rank 0 (split KV leaving a prefill worker whole)."""
        src = torch.as_tensor(list(page_ids), dtype=torch.long, device=pool.device)
        dst = torch.as_tensor(list(staging_ids), dtype=torch.long, device=staging.device)
        self.call("gather_pages", {}, {"pages": src}, pool,
                  lambda: write_full_pages(staging, dst, gather_heads(pool, src, self.size, root=True)))

    def _pool_handle(self, pool: KVPool) -> int:
        """This pool's id on the followers, announcing it first when it is new (under the lock)."""
        got = self._pools.get(id(pool))
        if got is not None and got[1] is pool:
            return got[0]
        handle = len(self._pools)
        self._chan.send("pool", {"handle": handle, "layout": pool.layout.to_dict(), "num_pages": pool.num_pages})
        self._pools[id(pool)] = (handle, pool)  # holds the pool: an id is never reused for another one
        return handle

    # -- failure and shutdown ------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if self._problem or self._closing:
            return
        self._problem = reason
        logger.error("rank group failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _watch(self) -> None:
        """Notice a follower that exits, and keep idle followers' waits under the collective timeout."""
        while not self._stop.wait(0.2):
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None and not self._closing:
                    self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
            if self._problem or self._closing:
                continue
            if time.monotonic() - self._last_send > self.config.heartbeat_s and self._lock.acquire(blocking=False):
                try:
                    if not self._problem:
                        self.call("ping", {}, {}, None, lambda: None)
                except RankFailure:
                    pass  # recorded by call
                finally:
                    self._lock.release()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (an ``exit`` command, or a kill when the group is broken) and join them."""
        self._closing = True
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
        if self._procs and not self._problem:
            try:
                with self._lock:
                    self._chan.send("exit")
            except Exception as e:  # noqa: BLE001 - shutting down: whatever broke, the followers are killed below
                logger.warning("rank group: exit command failed (%s): killing the followers", e)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()) if not self._problem else 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        destroy_tp_group()
        logger.info("rank group: every rank joined")
