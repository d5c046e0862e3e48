"""A follower rank (1..N-1) of a tensor-parallel worker: ``python -m worker.follower ...``, started by rank 0
(``worker.ranks.RankGroup.start``), never by hand.

It dies with rank 0 (``PR_SET_PDEATHSIG``), joins the group, loads the model, says it is ready (its model
hash in the group's store), then runs rank 0's commands until ``exit``: a model call on its own model
and pool, a pool write (``write_pages``, ``scatter_pages``, ``move_kv``), a gather of its KV heads (``gather_pages``), a new pool, a ``ping``. A command whose model call
raises is logged and skipped (rank 0 ran the same inputs and failed the same way); a broken channel (rank
0 gone, a collective timeout) ends the process.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from common import logs
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model, resolve_device
from engine.fingerprint import model_hash
from engine.parallel import ParallelConfig, destroy_tp_group, init_tp_group
from engine.speculative.decoder import move_kv
from worker.rank_wire import Command, CommandChannel
from worker.rank_pages import gather_heads, gather_stats, output_stats, write_head_slices, write_pages
from worker.ranks import backend_for, batch_from

logger = logging.getLogger("worker.follower")
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (rank 0) dies; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the collective timeout still ends us
        logger.warning("no PR_SET_PDEATHSIG here: a follower outlives a killed rank 0 by up to --timeout-s")
    if os.getppid() != parent_pid:
        sys.exit(f"follower: rank 0 (pid {parent_pid}) is already gone")


class Follower:
    def __init__(self, model, device: torch.device, parallel: ParallelConfig) -> None:
        self.model, self.device, self.parallel = model, device, parallel
        self.pools: dict[int, KVPool] = {}

    def run(self, chan: CommandChannel) -> None:
        while True:
            cmd = chan.recv()
            if cmd.op == "exit":
                return
            try:
                self.handle(cmd)
            except Exception:  # noqa: BLE001 - rank 0 failed on the same inputs; keep following it
                logger.exception("follower: command %r failed", cmd.op)

    @torch.inference_mode()
    def handle(self, cmd: Command) -> None:
        m, t = cmd.meta, cmd.tensors
        if cmd.op == "ping":
            return
        if cmd.op == "pool":
            self.pools[m["handle"]] = KVPool(KVLayout.from_dict(m["layout"]), m["num_pages"], self.device)
            return
        logits = None
        if cmd.op == "logits":
            logits = self.model.logits(t["hidden"])
        elif cmd.op == "write_pages":
            write_pages(self.pools[m["pool"]], t["pages"], t)
        elif cmd.op == "gather_pages":
            gather_heads(self.pools[m["pool"]], t["pages"], self.parallel.tp_size, root=False)
        elif cmd.op == "scatter_pages":
            write_head_slices(self.pools[m["pool"]], t["pages"], t, self.parallel)
        elif cmd.op == "move_kv":
            move_kv(self.pools[m["pool"]], range(m["start"], m["stop"]), t["src"], t["dst"])
        elif cmd.op == "forward":
            logits = self.model(batch_from(m, t), self.pools[m["pool"]], m["all_logits"]).logits
        elif cmd.op == "mtp_kv":
            self.model.mtp_kv(batch_from(m, t), self.pools[m["pool"]], t["prev_hidden"], m["k"])
        elif cmd.op == "forward_mtp":
            logits = self.model.forward_mtp(batch_from(m, t), self.pools[m["pool"]], t["prev_hidden"], m["k"],
                                            m["all_logits"]).logits
        else:
            raise ValueError(f"unknown command {cmd.op!r}")
        if m.get("check"):  # rank 0 compares every rank's logits with its own
            gather_stats(output_stats(logits), dist.get_world_size(), self.device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser("pdserve follower rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--moe-impl", default="auto")
    p.add_argument("--moe-parallel", default="tp", choices=["tp", "ep"])
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=0)
    logs.add_log_args(p)
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    logs.setup_logging(args.log_level, args.log_format)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(args.rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False,
                          timeout=timedelta(seconds=max(args.timeout_s, 60.0)))
    pc = ParallelConfig(args.world_size, args.rank, args.moe_parallel)
    init_tp_group(pc, args.master_port, backend_for(device), args.timeout_s, device=device)
    model, _ = load_model(args.model, args.dtype, str(device), args.moe_impl, parallel=pc)
    store.set(f"ready/{args.rank}", model_hash(args.model))
    logger.info("follower rank %d/%d ready (pid %d)", args.rank, args.world_size, os.getpid())
    try:
        Follower(model, device, pc).run(CommandChannel(device))
    except Exception as e:  # noqa: BLE001 - a broken channel (rank 0 gone, a collective timeout): leave loudly
        sys.exit(f"follower rank {args.rank}: the rank group is gone ({e})")
    destroy_tp_group()


if __name__ == "__main__":
    main()
