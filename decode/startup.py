"""A decode worker's torch start-up (``decode.server.amain`` runs ``load_decode_model`` on a thread of its own:
``worker.omp``): the model, its KV pools, the MTP speculator and the warmed-up decode graphs."""
from __future__ import annotations

import logging
from typing import NamedTuple

from decode.config import DecodeWorkerConfig
from engine.kvcache import KVPool
from engine.speculative.worker import make_speculator
from engine.warmup import warm_up_decode
from kvtransfer import ShmKVPool
from worker.model_proxy import load_rank_model

logger = logging.getLogger("decode.server")


class LoadedDecodeModel(NamedTuple):
    """What ``load_decode_model`` returns."""

    model: object
    """The serving model (``worker.model_proxy.ModelProxy`` over every rank under TP)."""
    local_model: object
    """This rank's own model."""
    cfg: object
    pool: KVPool
    landing: KVPool
    """Where received KV lands: ``pool``, or a full-layout pool when TP splits the KV heads."""
    spec: object
    """The MTP speculator, or None."""


def load_decode_model(wcfg: DecodeWorkerConfig, weights_dir: str, weights_hash: str, plan, ranks) -> LoadedDecodeModel:
    """A decode worker's torch start-up: the model, its KV pools, the speculator and, with ``--compile``, the decode
    graphs compiled and warmed up. ``amain`` runs it on a thread of its own (``worker.omp``)."""
    model, local_model, cfg, layout = load_rank_model(weights_dir, plan.dtype.dtype, wcfg.device, plan.layout, ranks,
                                                      weights_hash)
    pool = make_pool(layout, plan.pool.num_pages, wcfg.shm)
    spec = build_speculator(wcfg, model, cfg, pool)
    # split KV heads (GQA under TP): KV lands whole in a full-layout landing pool, then each rank takes its heads
    landing = pool if ranks is None or not ranks.kv_split else \
        make_pool(plan.layout, max(1, plan.pool.num_pages // wcfg.tp), wcfg.shm)
    if wcfg.compile:
        model.compile_decode()
        took = warm_up_decode(model, cfg, plan.kv_dtype, wcfg.page_size,
                              wcfg.speculative if spec is not None else None)
        logger.info("decode graphs compiled and warmed up in %.1fs", took)
    return LoadedDecodeModel(model, local_model, cfg, pool, landing, spec)


def make_pool(layout, num_pages: int, shm: bool):
    """The KV pool: in shared memory when asked (same-host prefill workers then copy pages instead of
    sending them over TCP), else, or when the segment cannot be created, a private one."""
    if shm:
        try:
            return ShmKVPool(layout, num_pages)
        except OSError as e:
            logger.warning("KV pool in shared memory failed (%s): using a private pool; prefill workers on this "
                           "host will ship KV over TCP", e)
    return KVPool(layout, num_pages)


def build_speculator(wcfg: DecodeWorkerConfig, model, cfg, pool):
    """MTP speculative decoding when asked for and the model has an MTP layer (says so once otherwise)."""
    if wcfg.no_speculative or not wcfg.speculative or wcfg.speculative == "off":
        return None
    if not model.has_mtp:
        logger.warning("model has no MTP layer: running without speculative decoding")
        return None
    return make_speculator(model, cfg, pool, wcfg.speculative, cost_model=wcfg.spec_cost_model)
