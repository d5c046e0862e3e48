"""How many KV pages a worker's pool gets: from a page count, a byte budget, or a fraction of the
device's memory (vLLM's ``--gpu-memory-utilization``), and refused with the numbers before anything is
allocated when it cannot fit.

    budget of a fraction F = F x total memory - weights - ACTIVATION_RESERVE_BYTES
    a pool fits when          pages x page bytes <= available memory - weights - ACTIVATION_RESERVE_BYTES

"Memory" is the GPU's for a CUDA worker (``torch.cuda.mem_get_info``) and the host's for a CPU worker
(``/proc/meminfo`` ``MemTotal`` / ``MemAvailable``, lowered to a cgroup v2 limit when one is set). The
weights are estimated from the checkpoint headers in the compute dtype, before the model is loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

ACTIVATION_RESERVE_BYTES = 1 << 30
"""Room kept for activations, the sampler, transfer staging and the allocator's slack."""
DEFAULT_MEM_FRACTION = {"cuda": 0.9, "cpu": 0.8}
"""The fraction of the device's memory a worker may use when none is given: a GPU leaves 10% to the
driver and other contexts, a CPU host 20% to the OS and every other process."""
CPU_DEFAULT_NUM_PAGES = 4096
"""On a CPU the default pool is at most this many pages (less when less fits): host memory is shared
with every other process, so a CPU worker does not claim it all unless asked (--mem-fraction)."""
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class PoolSizeError(ValueError):
    """The asked-for pool cannot fit; the message carries the numbers."""


class DeviceMemory(NamedTuple):
    device: str
    total_bytes: int
    available_bytes: int


class PoolPlan(NamedTuple):
    num_pages: int
    page_bytes: int
    reason: str
    """How the size was chosen (logged at start-up)."""

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """At most one of the three; none: the device's default (``DEFAULT_MEM_FRACTION``; on a CPU capped at
    ``CPU_DEFAULT_NUM_PAGES``)."""

    num_pages: int | None = None
    """A fixed page count (``--num-pages``)."""
    kv_cache_memory: int | None = None
    """Bytes for the pool (``--kv-cache-memory``)."""
    mem_fraction: float | None = None
    """Fraction of the device's total memory for weights, activations and the pool (``--mem-fraction``)."""

    def __post_init__(self) -> None:
        given = [n for n in ("num_pages", "kv_cache_memory", "mem_fraction") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError("give at most one of " + ", ".join("--" + n.replace("_", "-") for n in given))
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"--num-pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")


def parse_bytes(s: str) -> int:
    """``8GiB`` / ``512MB`` / ``1.5G`` / ``1000000`` -> bytes (K, M, G, T are powers of 1000; KiB, MiB,
    GiB, TiB powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", s)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size in bytes: {s!r} (e.g. 8GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def host_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> DeviceMemory:
    """The host's memory, lowered to this cgroup's limit (v2) when there is one."""
    vals = {}
    with open(meminfo) as f:
        for line in f:
            key, _, rest = line.partition(":")
            vals[key] = int(rest.split()[0]) * 1024
    total, avail = vals["MemTotal"], vals.get("MemAvailable", vals.get("MemFree", 0))
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            total, avail = min(total, int(limit)), min(avail, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return DeviceMemory("cpu", total, avail)


def device_memory(device: torch.device) -> DeviceMemory:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(str(device), total, free)
    return host_memory()


def plan_pool(sizing: PoolSizing, page_bytes: int, weights_bytes: int, mem: DeviceMemory) -> PoolPlan:
    """The pool's page count; ``PoolSizeError`` with the numbers when the asked-for pool cannot fit."""
    room = mem.available_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES
    fit = max(0, room // page_bytes)
    where = (f"{gib(mem.available_bytes)} of {gib(mem.total_bytes)} available on {mem.device}, weights "
             f"~{gib(weights_bytes)}, {gib(ACTIVATION_RESERVE_BYTES)} kept for activations: at most {fit} pages "
             f"of {page_bytes} bytes fit")
    if sizing.num_pages is not None or sizing.kv_cache_memory is not None:
        if sizing.num_pages is not None:
            n, asked = sizing.num_pages, f"--num-pages {sizing.num_pages}"
        else:
            n, asked = sizing.kv_cache_memory // page_bytes, f"--kv-cache-memory {sizing.kv_cache_memory}"
            if n < 1:
                raise PoolSizeError(f"{asked} holds no page: one page takes {page_bytes} bytes")
        if n > fit:
            raise PoolSizeError(f"KV pool of {n} pages ({gib(n * page_bytes)}, {asked}) does not fit: {where}")
        return PoolPlan(n, page_bytes, asked)
    kind = "cuda" if mem.device.startswith("cuda") else "cpu"
    frac = sizing.mem_fraction if sizing.mem_fraction is not None else DEFAULT_MEM_FRACTION[kind]
    budget = int(frac * mem.total_bytes) - weights_bytes - ACTIVATION_RESERVE_BYTES
    n = max(0, budget // page_bytes)
    asked = f"--mem-fraction {frac:g}" + ("" if sizing.mem_fraction is not None else " (default)")
    if sizing.mem_fraction is None and kind == "cpu":
        n = min(n, CPU_DEFAULT_NUM_PAGES, fit)
        asked = f"at most {CPU_DEFAULT_NUM_PAGES} pages on a CPU (default)"
    if n < 1:
        raise PoolSizeError(f"{asked} leaves no room for a KV pool: {frac:g} x {gib(mem.total_bytes)} on "
                            f"{mem.device} minus weights ~{gib(weights_bytes)} and "
                            f"{gib(ACTIVATION_RESERVE_BYTES)} for activations is {gib(budget)}")
    if n > fit:
        raise PoolSizeError(f"KV pool of {n} pages ({gib(n * page_bytes)}, {asked}) does not fit: {where}")
    return PoolPlan(n, page_bytes, asked)
