"""Tensor- and expert-parallel execution of one worker's model over several rank processes (issue 30).

``config`` (``ParallelConfig``: the split), ``group`` (the process group and collectives), ``shard`` (which
slice of each checkpoint tensor a rank loads), ``layers`` (the vocab-parallel embedding / LM head, the TP
decoder-layer forward, expert-parallel dispatch; the MLA replicated-latent reasoning is written there).
Only the light modules are re-exported here (``layers`` imports the model's layers, which import ``config``).
"""
from engine.parallel.config import SINGLE_RANK, ParallelConfig
from engine.parallel.group import (
    CommStats,
    all_gather_last,
    all_reduce_,
    check_same_on_all_ranks,
    comm_stats,
    destroy_tp_group,
    init_tp_group,
    is_tp,
    tp_config,
    tp_group,
)

__all__ = ["CommStats", "ParallelConfig", "SINGLE_RANK", "all_gather_last", "all_reduce_", "check_same_on_all_ranks", "comm_stats",
           "destroy_tp_group", "init_tp_group", "is_tp", "tp_config", "tp_group"]
