"""The tensor-parallel process group of one worker and the collectives the model's layers call.

``init_tp_group`` joins this process to its worker's ``torch.distributed`` world (the whole world is the TP
group: one worker = one world): gloo for a CPU model, nccl for a ``cuda`` one (NVIDIA and ROCm), rendezvous
over TCP at 127.0.0.1 unless told otherwise. Like torch.distributed's own default group, the group is
process-wide state: a process belongs to at most one worker.

Failure: every collective carries the group's timeout. With gloo a rank that died makes its peers' next
collective raise (at once when the connection drops, at the latest after ``timeout_s``), never hang. With
nccl the watchdog aborts the surviving ranks' communicator after ``timeout_s`` (the process exits with the
error); the worker's supervisor then sees the group as dead either way.

``CommStats`` counts what the layers move per rank (payload bytes), for the benchmark's communication volume.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.config import ParallelConfig

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class CommStats:
    """Collectives this process ran since the last ``reset`` (payload bytes per rank)."""
    num_all_reduce: int = 0
    all_reduce_bytes: int = 0
    """Bytes of the tensors all-reduced (each rank's input size)."""
    num_all_gather: int = 0
    all_gather_bytes: int = 0
    """Bytes of the gathered outputs (every rank's slice, this rank's own included)."""

    def reset(self) -> None:
        self.num_all_reduce = self.all_reduce_bytes = self.num_all_gather = self.all_gather_bytes = 0

    @property
    def total_bytes(self) -> int:
        return self.all_reduce_bytes + self.all_gather_bytes


@dataclass(slots=True)
class _TPState:
    pc: ParallelConfig
    backend: str
    timeout_s: float
    stats: CommStats


_state: _TPState | None = None


def default_backend(device: torch.device | str | None = None) -> str:
    """nccl for a ``cuda`` device (both NVIDIA and ROCm), else gloo."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tp_group(pc: ParallelConfig, master_port: int, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, master_addr: str = "127.0.0.1",
                  device: torch.device | str | None = None) -> None:
    """Join rank ``pc.tp_rank`` of a ``pc.tp_size``-rank group (blocks until every rank joined, at most
    ``timeout_s``). At tp_size 1 no process group is made and every collective is a no-op. ``backend`` None:
    ``default_backend(device)``."""
    global _state
    if _state is not None:
        raise RuntimeError(f"this process already belongs to a TP group ({_state.pc}); destroy_tp_group first")
    backend = backend or default_backend(device)
    if pc.tp_size > 1:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one worker's TP group "
                               "is the whole world")
        kw = {}
        if backend == "nccl":
            dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            kw["device_id"] = dev
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=pc.tp_rank,
                                world_size=pc.tp_size, timeout=timedelta(seconds=timeout_s), **kw)
        logger.info("rank %d/%d joined the TP group (%s, tcp://%s:%d, timeout %.0fs)", pc.tp_rank, pc.tp_size,
                    backend, master_addr, master_port, timeout_s)
    _state = _TPState(pc, backend, timeout_s, CommStats())


def destroy_tp_group() -> None:
    """Leave the group (a no-op when this process is in none)."""
    global _state
    if _state is not None and _state.pc.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = None


def tp_config() -> ParallelConfig:
    """This process's ParallelConfig (tp_size 1 when it joined no group)."""
    return ParallelConfig() if _state is None else _state.pc


def tp_group() -> dist.ProcessGroup | None:
    """The TP process group (torch.distributed's world), None at tp_size 1."""
    return dist.group.WORLD if is_tp() else None


def is_tp() -> bool:
    return _state is not None and _state.pc.tp_size > 1


def comm_stats() -> CommStats:
    """The counters of this process's collectives (zeros and never counted at tp_size 1)."""
    return CommStats() if _state is None else _state.stats


def _active() -> _TPState | None:
    if _state is None:
        raise RuntimeError("a tensor-parallel layer ran in a process that joined no TP group: call "
                           "engine.parallel.init_tp_group before running a model loaded with tp_size > 1")
    return _state if _state.pc.tp_size > 1 else None


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks, in place; returns ``t`` (a no-op at tp_size 1)."""
    s = _active()
    if s is None:
        return t
    dist.all_reduce(t)
    s.stats.num_all_reduce += 1
    s.stats.all_reduce_bytes += t.numel() * t.element_size()
    return t


def all_gather_last(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``t [..., n]`` on every rank -> ``[..., tp_size * n]``, rank r's slice at ``[r*n, (r+1)*n)`` (a no-op at
    tp_size 1). ``width``: keep only the first ``width`` columns (the padded vocabulary's logits -> exactly
    ``vocab_size``), cut from the parts before the one concatenation (no second copy)."""
    s = _active()
    if s is None:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(s.pc.tp_size)]
    dist.all_gather(parts, t)
    if width is not None:
        n = t.shape[-1]
        parts = [p[..., :max(0, min(n, width - r * n))] for r, p in enumerate(parts)]
    out = torch.cat(parts, dim=-1)
    s.stats.num_all_gather += 1
    s.stats.all_gather_bytes += out.numel() * out.element_size()
    return out


def check_same_on_all_ranks(label: str, value: str) -> None:
    """Raise ``ValueError`` naming every rank's value when the ranks disagree on ``value`` (a model hash, a
    config): a loud error at start instead of silently different shards."""
    s = _active()
    if s is None:
        return
    digest = torch.frombuffer(bytearray(hashlib.sha256(value.encode()).digest()), dtype=torch.uint8)
    dev = torch.device("cuda", torch.cuda.current_device()) if s.backend == "nccl" else torch.device("cpu")
    parts = [torch.empty_like(digest, device=dev) for _ in range(s.pc.tp_size)]
    dist.all_gather(parts, digest.to(dev))
    if any(not torch.equal(parts[0], p) for p in parts[1:]):
        texts = [p.cpu().numpy().tobytes().hex()[:12] for p in parts]
        raise ValueError(f"the {s.pc.tp_size} ranks disagree on {label}: rank {s.pc.tp_rank} has {value!r}; "
                         f"sha256 prefixes by rank: {texts}")
