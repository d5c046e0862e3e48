"""The prefill scheduler's settings (``prefill.scheduler.PrefillScheduler``) and a prefill worker's flags
(``PrefillWorkerConfig``, read by ``prefill.server``)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.memory import parse_bytes
from prefill.host_cache import AUTO, HostCachePolicy
from worker.config import WorkerConfig

LOAD_TIMEOUT_S = 2.0
"""Default seconds a request waits for its prefix to load from the host / disk tier (``--load-timeout-s``)."""


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    chunk_size: int = 2048
    """Max new tokens of one request per forward (a 20k prompt takes 10 steps)."""
    max_batch_tokens: int = 4096
    """Token budget of one forward over all scheduled chunks."""
    max_queue: int = 64
    """Queued requests beyond this are refused (RESOURCE_EXHAUSTED), never buffered."""
    max_running: int = 16
    load_timeout_s: float = LOAD_TIMEOUT_S
    """A prefix still loading from the host / disk tier this long goes on with what has loaded (the rest recomputed)."""
    prefetch: bool = True
    """Load a lower tier's prefix on a loader thread from arrival; False: at admission, on the scheduler's thread."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_batch_tokens < self.chunk_size:
            raise ValueError(f"need 1 <= chunk_size ({self.chunk_size}) <= max_batch_tokens "
                             f"({self.max_batch_tokens})")
        if self.max_queue < 1 or self.max_running < 1 or self.load_timeout_s < 0:
            raise ValueError(f"need max_queue ({self.max_queue}) and max_running ({self.max_running}) >= 1, "
                             f"load_timeout_s ({self.load_timeout_s}) >= 0")


@dataclass(frozen=True, slots=True)
class PrefillWorkerConfig(WorkerConfig):
    """A prefill worker's flags: the common ones and its scheduler's (``PrefillConfig``)."""

    chunk_size: int = 2048
    """max new tokens of one request per forward (a 20k prompt takes 10 steps)"""
    max_batch_tokens: int = 4096
    """token budget of one forward over all scheduled chunks (at least --chunk-size)"""
    max_queue: int = 64
    """queued requests beyond this are refused (RESOURCE_EXHAUSTED), never buffered"""
    fault_injection: bool = False
    """accept InjectFault calls (resilience benchmarks: pdserve bench --fault drop-kv@S)"""
    host_cache_bytes: str = AUTO
    """host-memory tier of the prefix cache below the KV pool (64M, 40G, 8GiB; 0: off; auto: twice the KV pool,
    at most a quarter of the host memory available at start)"""
    host_cache_policy: str = HostCachePolicy.WRITE_BACK.value
    """when a page enters the host tier: write_back (when the KV pool evicts it) or write_through (as soon as the
    prefix cache takes it); the disk tier's pages come down on eviction from the host tier or as it stores them"""
    disk_cache_dir: str | None = None
    """local directory of the prefix cache's disk tier, below the host tier (one per worker; a restarted worker
    keeps what it holds)"""
    disk_cache_bytes: str = AUTO
    """byte budget of the disk tier (64M, 40G; 0: off; auto: half the directory's free space at start, plus what
    it holds; off without --disk-cache-dir)"""
    load_timeout_s: float = LOAD_TIMEOUT_S
    """seconds a request waits for its prefix to load from the host and disk tiers once it could run; past them it
    goes on with what has loaded and recomputes the rest (same output, counted as late pages)"""

    def __post_init__(self) -> None:
        if not self.load_timeout_s >= 0:
            raise ValueError(f"--load-timeout-s must be >= 0, got {self.load_timeout_s}")
        if self.host_cache_bytes.strip().lower() != AUTO:
            parse_bytes(self.host_cache_bytes)  # ValueError naming the value
        HostCachePolicy(self.host_cache_policy)
        if self.disk_cache_bytes.strip().lower() != AUTO and parse_bytes(self.disk_cache_bytes) and \
                not self.disk_cache_dir:
            raise ValueError(f"--disk-cache-bytes {self.disk_cache_bytes} needs --disk-cache-dir")
        if self.disk_cache_dir and self.host_cache_bytes.strip().lower() != AUTO and not parse_bytes(
                self.host_cache_bytes):
            raise ValueError("--disk-cache-dir needs the host tier (--host-cache-bytes not 0): pages reach the disk "
                             "through it")
