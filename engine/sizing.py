"""A worker's start-up plan, made from config.json and the checkpoint headers before anything is loaded or
allocated: the compute dtype (``--dtype auto``), the KV layout and how many pages fit (``engine.memory``).
A plan that cannot fit raises ``PoolSizeError`` with the numbers, so a worker asked for too much never
starts the allocation the out-of-memory killer would end."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.headers import checkpoint_tensors, weights_bytes
from engine.kvcache.layout import KVLayout
from engine.loader import detect_mtp_layers
from engine.memory import (
    PoolPlan,
    PoolSizing,
    device_memory,
    gib,
    parse_bytes,
    plan_pool,
)
from engine.parallel.config import SINGLE_RANK, ParallelConfig
from engine.precision import DtypeChoice, resolve_dtype

logger = logging.getLogger(__name__)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class StartPlan(NamedTuple):
    dtype: DtypeChoice
    kv_dtype: str
    layout: KVLayout
    pool: PoolPlan
    weights_bytes: int


def pool_sizing(num_pages: int | None, kv_cache_memory: str | None, mem_fraction: float | None) -> PoolSizing:
    """The three pool flags as a ``PoolSizing`` (``ValueError`` on a bad size or more than one given)."""
    return PoolSizing(num_pages=num_pages, mem_fraction=mem_fraction,
                      kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory))


def plan_start(weights_dir: str, dtype: str, kv_dtype: str | None, device: torch.device, page_size: int,
               sizing: PoolSizing, flags: frozenset[str] | None = None,
               parallel: ParallelConfig = SINGLE_RANK) -> StartPlan:
    """Dtype, KV layout and pool size of a worker serving ``weights_dir`` on ``device``; logs the dtype
    choice and the pool size once. ``parallel``: one rank of a tensor-parallel worker (its pool's layout; the
    weight bytes stay the whole checkpoint's, an over-estimate of a rank's share that only shrinks its pool)."""
    tensors = checkpoint_tensors(weights_dir)
    cfg = detect_mtp_layers(ModelConfig.from_model_dir(weights_dir), [t.name for t in tensors])
    choice = resolve_dtype(dtype, tensors, device, cfg.hidden_size, flags)
    if choice.reason != "given":
        (logger.warning if choice.widened else logger.info)("dtype auto -> %s: %s", choice.dtype, choice.reason)
    kv = kv_dtype or choice.dtype
    layout = KVLayout.for_model(cfg, page_size, kv, parallel)
    wbytes = weights_bytes(tensors, DTYPE_BYTES[choice.dtype])
    pool = plan_pool(sizing, layout.bytes_per_page(), wbytes, device_memory(device))
    logger.info("KV pool: %d pages of %d tokens (%s, %s)", pool.num_pages, page_size, gib(pool.pool_bytes),
                pool.reason)
    return StartPlan(choice, kv, layout, pool, wbytes)
