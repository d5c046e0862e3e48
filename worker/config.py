"""The settings every worker process takes, prefill and decode alike: ``WorkerConfig``.

Its fields are the workers' command-line flags (``common.flags`` makes one ``--flag`` per field, the field's
docstring its help); each role adds its own fields in a subclass (``prefill.config.PrefillWorkerConfig``,
``decode.config.DecodeWorkerConfig``). Stdlib only (the router imports ``worker.process``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import flags, logs

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` choices."""
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")
"""``--kv-dtype`` choices."""
MOE_PARALLEL = ("tp", "ep")
"""``--moe-parallel`` choices."""
HOST_CACHE_POLICIES = ("write_back", "write_through")
"""``--host-cache-policy`` choices (``prefill.host_cache.HostCachePolicy``)."""
PREFIX_CACHE_CHOICES = ("on", "off")
"""A decode worker's ``--prefix-cache`` (decode-side prefix reuse) and the cluster's ``--decode-prefix-cache``."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str | None = None
    """model directory (default: the default model)"""
    host: str = "127.0.0.1"
    """address the worker's gRPC port (and a decode worker's KV port) binds; a non-loopback one needs the
    cluster secret"""
    port: int = 0
    """gRPC port (0: any free port, printed in the PDSERVE_READY line)"""
    worker_id: str | None = None
    """name in the router's status and logs (default: ROLE-PORT)"""
    dtype: str = "auto"
    """compute dtype (auto: the checkpoint's where this device computes it fast, else float32)"""
    kv_dtype: str | None = None
    """KV cache dtype (default: the compute dtype)"""
    page_size: int = 16
    """tokens per KV page"""
    num_pages: int | None = None
    """KV pool pages (at most one of the three sizes)"""
    kv_cache_memory: str | None = None
    """KV pool bytes (8GiB, 512MB, ...)"""
    mem_fraction: float | None = None
    """fraction of the device's memory for weights, activations and the KV pool (default: 0.9 on a GPU; on a
    CPU at most 4096 pages)"""
    device: str = "auto"
    """torch device (auto: cuda when there is one, else cpu)"""
    cluster_secret: str | None = None
    """shared secret of the cluster's gRPC and KV ports (default: $PDSERVE_CLUSTER_SECRET)"""
    expect_model_hash: str | None = None
    """refuse to start if the model differs"""
    threads: int = 0
    """torch intra-op threads (0: torch's default). Co-located workers should split the cores: oversubscribed
    OpenMP threads make small decode ops tens of times slower"""
    stall_after: float = 60.0
    """seconds a scheduler may go without finishing a step while it has work before the worker reports itself
    unhealthy (the router then drains it)"""
    tls_cert: str | None = None
    """PEM certificate: serve the worker's gRPC port over TLS"""
    tls_key: str | None = None
    """PEM private key of --tls-cert"""
    tls_ca: str | None = None
    """PEM CA bundle: require client certificates it signed (mutual TLS)"""
    grace_s: float = 30.0
    """on SIGTERM: seconds the requests in flight get to finish (new ones go to other workers)"""
    metrics_port: int = 0
    """Prometheus /metrics of this worker on its own port (0: off, -1: any free port; reported as
    info['metrics_port'] in its status)"""
    tp: int = 1
    """tensor-parallel size: this worker is TP rank processes (rank 0 serves, the others follow it;
    worker.ranks)"""
    moe_parallel: str = "tp"
    """with --tp > 1: split each routed expert's intermediate dim (tp) or partition the experts (ep)"""
    rank_timeout_s: float = 60.0
    """with --tp > 1: a collective waiting longer raises (a silent rank never hangs the others forever)"""
    rank_failure_exit_s: float = 2.0
    """with --tp > 1: after a rank dies, report unhealthy this long, then exit so the supervisor restarts
    every rank of the worker"""


def add_worker_args(p: argparse.ArgumentParser, cls: type[WorkerConfig] = WorkerConfig,
                    choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """The flags of ``cls`` (``WorkerConfig`` or a role's subclass, ``choices`` for its own fields) and the logging
    flags."""
    flags.add_config_args(p, cls, choices={"dtype": DTYPES, "kv_dtype": KV_DTYPES,
                                                  "moe_parallel": MOE_PARALLEL, **(choices or {})})
    logs.add_log_args(p)
