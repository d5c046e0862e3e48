"""The start-up steps of a worker process, prefill and decode alike, that need torch or grpc: the pool plan,
the bind, the follower ranks, the process's threads. The stdlib-only rest (the heap freeze, serving until a
signal) is ``worker.process``, which the router imports too; the router never imports this module."""
from __future__ import annotations

import logging

import torch

from common import env
from common.reasons import Role
from engine.defaults import tune_malloc
from engine.load import resolve_device
from engine.sizing import plan_start, pool_sizing
from protos import tls
from worker import omp
from worker.config import WorkerConfig
from worker.ranks import FollowerArgs, RankConfig, RankGroup


def start_plan(cfg: WorkerConfig, weights_dir: str, role: Role):
    """The worker's dtype, KV layout and pool size (``engine.sizing.plan_start``), checked before the model
    is loaded or the pool allocated; a pool that cannot fit ends the process with one line naming the
    numbers."""
    try:
        return plan_start(weights_dir, cfg.dtype, cfg.kv_dtype, resolve_device(cfg.device), cfg.page_size,
                          pool_sizing(cfg.num_pages, cfg.kv_cache_memory, cfg.mem_fraction))
    except ValueError as e:
        raise SystemExit(f"pdserve {role} worker: error: {e}") from None


def bind(server, cfg: WorkerConfig, role: Role) -> int:
    """Bind the worker's gRPC port (TLS with --tls-cert/--tls-key, mutual with --tls-ca); a bad TLS flag
    or a port that cannot be bound ends the process with one line."""
    try:
        port = tls.bind(server, f"{cfg.host}:{cfg.port}", tls.tls_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca),
                        internal=True)
    except ValueError as e:
        raise SystemExit(f"pdserve {role} worker: error: {e}") from None
    if port == 0:
        raise SystemExit(f"pdserve {role} worker: error: cannot bind {cfg.host}:{cfg.port}")
    return port


def start_ranks(cfg: WorkerConfig, weights_dir: str, dtype: str, role: Role):
    """With ``--tp`` > 1: spawn and join this worker's follower ranks (``worker.ranks``; call from the main
    thread, before the model is loaded here); None at ``--tp 1``."""
    if cfg.tp == 1:
        return None
    if getattr(cfg, "compile", False):
        raise SystemExit(f"pdserve {role} worker: error: --compile with --tp > 1 is not supported yet")
    try:
        config = RankConfig(tp_size=cfg.tp, moe_parallel=cfg.moe_parallel, timeout_s=cfg.rank_timeout_s,
                            heartbeat_s=min(5.0, cfg.rank_timeout_s / 4), check_outputs=env.rank_check())
    except ValueError as e:
        raise SystemExit(f"pdserve {role} worker: error: {e}") from None
    device = resolve_device(cfg.device)
    ranks = RankGroup(config, device)
    ranks.start(FollowerArgs(weights_dir, dtype, str(device), threads=cfg.threads,
                             log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel())))
    return ranks


def apply_threads(n: int) -> None:
    """Process-wide CPU settings of a worker, called on its event loop: intra-op threads, the malloc thresholds,
    and the loop's own threads kept out of OpenMP teams (``worker.omp.serve_serially``: the scheduler thread's
    team stays the only one)."""
    tune_malloc()
    if n > 0:
        torch.set_num_threads(n)
    omp.serve_serially()  # after the count is set: the loop's threads drop to one, the others keep it
