"""The description of a pdserve cluster, declared once: ``ClusterSpec``, which both launchers consume.

    spec = ClusterSpec(model=DIR, prefill=1, decode=2, router=RouterConfig(port=0))
    spec.router_argv()                                     # + the worker addresses (local) or discovery (Ray)
    spec.prefill_argv(WorkerSlot("prefill-0", threads=4))  # python -m prefill.server ...
    spec.decode_argv(WorkerSlot("decode-0", threads=4))    # python -m decode.server ...

``pdserve serve`` (``cluster.local.LocalClusterConfig``) and ``pdserve launch``
(``cluster.ray_launcher.RayLaunchConfig``) subclass it with their own options only, and both commands' flags
are generated from it (``add_cluster_args``): an option added here is an option of both, in their ``--config``
files too, and reaches the processes through the ``*_argv`` methods both launchers call.

The router's options are the fields of ``router.config.RouterConfig``, all but ``ROUTER_OWNED`` (which a
launcher sets from the cluster): a field added there is a flag of both commands and reaches the router
unedited. The KV transport's are ``kvtransfer.config.TransportConfig``'s, given to both worker kinds.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from common import flags, logs
from common.net import check_bind
from common.reasons import Role
from kvtransfer.config import TransportConfig, add_transport_args
from protos import tls
from router import config as router_config
from router.config import RouterConfig
from worker.config import DTYPES, HOST_CACHE_POLICIES, KV_DTYPES, MOE_PARALLEL, PREFIX_CACHE_CHOICES

ROUTER_OWNED = ("prefill", "decode", "aggregated", "model", "api_key", "cluster_secret", "tls_cert", "tls_key",
                "tls_ca", "startup_timeout_s", "grace_s")
"""``RouterConfig`` fields a launcher sets from the cluster (worker addresses, aggregated mode, the model,
secrets, TLS, the timeouts every process shares); every other field is a cluster option (``ROUTER_OPTIONS``)."""
ROUTER_OPTIONS = tuple(f.name for f in dataclasses.fields(RouterConfig) if f.name not in ROUTER_OWNED)
"""The router's fields that are flags of ``pdserve serve`` and ``pdserve launch``, passed to the router as given."""
CHOICES = {"dtype": DTYPES, "kv_dtype": KV_DTYPES, "moe_parallel": MOE_PARALLEL, "log_format": logs.LOG_FORMATS,
           "host_cache_policy": HOST_CACHE_POLICIES, "decode_prefix_cache": PREFIX_CACHE_CHOICES}
SPECULATION_OFF = ("", "off")


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """What a launcher decides for one worker beyond the spec: its name and its share of the machine."""

    worker_id: str
    """Its name in the router's status and the logs (``prefill-0``)."""
    threads: int
    """torch threads of its steps."""
    prefill_threads: int = 0
    """Decode workers: threads of their own prefill forwards (0: ``threads``)."""
    mem_fraction: float | None = None
    """Fraction of its device's memory (None: the worker's default)."""
    model_hash: str | None = None
    """The worker refuses to start unless its model hashes to this (None: not checked)."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model: str | None = None
    """Model directory, the same path on every node (default: the shipped default model)."""
    prefill: int = 1
    """Prefill workers; 0: aggregated (no prefill workers: each decode worker prefills every prompt itself,
    chunked, for a small machine or a single node)."""
    decode: int = 1
    """Decode workers."""
    prefill_tp: int = 1
    """Rank processes (tensor-parallel size) per prefill worker, on one node, started, supervised and
    restarted as one worker."""
    decode_tp: int = 1
    """Rank processes (tensor-parallel size) per decode worker (as --prefill-tp)."""
    moe_parallel: str = "tp"
    """With a tp > 1: split each routed expert's intermediate dim (tp) or partition the experts (ep)."""
    dtype: str = "auto"
    """Compute dtype of the workers (auto: the checkpoint's where the device computes it fast, else float32)."""
    kv_dtype: str | None = None
    """KV cache dtype (default: the compute dtype; alias --kv-cache-dtype)."""
    page_size: int = 16
    """KV page size in tokens."""
    num_pages: int | None = None
    """KV pages per worker (default: sized from memory; at most one of num_pages, kv_cache_memory, mem_fraction)."""
    kv_cache_memory: str | None = None
    """KV pool bytes per worker (8GiB, 512MB, ...)."""
    mem_fraction: float | None = None
    """Memory for weights, activations and KV pools: serve: the fraction of this host's (or GPU's) memory for
    all workers together, split equally; launch: each worker's fraction of its own device (default: 0.9 on a
    GPU; on a CPU at most 4096 pages per worker)."""
    speculative: str = "5/1/6"
    """MTP speculation STEPS/TOPK/DRAFT_TOKENS of the decode workers, or off."""
    no_spec_fallback: bool = False
    """Decode workers keep speculating for every request, even when its drafts are rarely accepted (default:
    such a request switches to plain decoding)."""
    compile_decode: bool = False
    """Decode workers run decode / verify steps through compiled graphs (torch.compile, warmed up at start: a
    few minutes the first time on 2 CPU cores, far less once inductor's disk cache holds them)."""
    decode_weights: str = "mxfp4"
    """Decode workers' routed experts: mxfp4 / mxfp6_e2m3 / mxfp6_e3m2 / mxfp8 (the model quantized once and
    cached under $PDSERVE_HOME/quantized), model (the checkpoint as it is), or a quantized copy's directory
    (e.g. a Quark export). A model that is already quantized is served as it is."""
    prefill_chunk: int = 2048
    """Decode workers' own prefill (--prefill 0, --local-prefill-below): prompt tokens per step; a longer prompt
    continues over the next steps while the running requests keep decoding."""
    host_cache_bytes: str = "auto"
    """Each prefill worker's host-memory tier of the prefix cache, below its KV pool (64M, 40G, 8GiB; 0: off; auto:
    twice its KV pool, at most a quarter of the host memory available when it starts)."""
    host_cache_policy: str = "write_back"
    """When a page enters the host tier: write_back (when the KV pool evicts it) or write_through (as soon as the
    prefix cache takes it); the disk tier's pages come down on eviction from the host tier or as it stores them."""
    disk_cache_dir: str | None = None
    """Local directory of the prefill workers' disk tier of the prefix cache, below the host tier: each worker
    keeps its pages in a subdirectory named after it (DIR/prefill-0, ...), which a restarted worker indexes again;
    with launch, a path on each node's local disk (default: off)."""
    disk_cache_bytes: str = "auto"
    """Each prefill worker's disk tier budget (64M, 40G; 0: off; auto: half its directory's free space at start,
    plus what it holds; off without --disk-cache-dir)."""
    load_timeout_s: float = 2.0
    """Seconds a prefill request waits for its prefix to load from the host and disk tiers once it could run; past
    them it goes on with what has loaded and recomputes the rest (the same output)."""
    decode_prefix_cache: str = "on"
    """Decode workers keep finished requests' KV pages as an evictable prefix cache, so a session's next turn is
    shipped only the tail of its prompt and routed to the decode worker holding the rest (decode-side reuse), or
    off."""
    no_shm: bool = False
    """Decode pools in private memory: prefill workers on the same host ship KV over TCP too (default: shared
    memory, pages copied)."""
    stall_after_s: float = 60.0
    """A worker whose scheduler has work and finished no step for this long reports itself unhealthy (the
    router drains it)."""
    threads_per_worker: int = 0
    """torch threads per worker (0: serve: split this machine's cores between the workers; launch: the CPUs of
    its bundle). A decode worker's own prefill forwards take at least its share of the cores."""
    api_key: str | None = None
    """Require 'authorization: Bearer KEY' on the router's public port (every user sees it in ps: prefer
    --api-key-file or $PDSERVE_API_KEY)."""
    tls_cert: str | None = None
    """PEM certificate, at a path every node can read: the router's gRPC and HTTP ports and every worker's gRPC
    port serve TLS (the KV data plane stays HMAC-authenticated: see protos/tls.py)."""
    tls_key: str | None = None
    """PEM private key of --tls-cert."""
    tls_ca: str | None = None
    """PEM CA bundle for mutual TLS between the router and the workers (default: trust --tls-cert itself)."""
    log_level: str = "INFO"
    """Log level of the router and every worker."""
    log_format: str = "text"
    """Router and worker logs as text lines or one JSON object per line."""
    startup_timeout_s: float = 300.0
    """Seconds every process may take to become ready (alias --startup-timeout)."""
    grace_s: float = 30.0
    """On stop (SIGTERM, Ctrl-C): the router stops admitting and gives the requests in flight this long to
    finish, then ends the rest with UNAVAILABLE; workers drain the same way."""
    max_restarts: int = 5
    """Times a worker that dies is restarted (serve: on its old address, backoff 1 s doubling up to 30 s;
    launch: Ray restarts its actor, -1: forever)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router's options (``ROUTER_OPTIONS``: flags of their own, e.g. --max-inflight)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """How prefill workers ship KV (--kv-transport, --mooncake-protocol), given to both worker kinds."""

    def __post_init__(self) -> None:
        if self.log_format not in logs.LOG_FORMATS:
            raise ValueError(f"log_format must be one of {logs.LOG_FORMATS}, got {self.log_format!r}")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need at least one decode worker and no negative count of prefill workers (0: "
                             f"aggregated), got {self.prefill} + {self.decode}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if (self.prefill and self.prefill_tp < 1) or self.decode_tp < 1 or self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"need --prefill-tp ({self.prefill_tp}) and --decode-tp ({self.decode_tp}) >= 1 and "
                             f"--moe-parallel tp or ep (got {self.moe_parallel!r})")
        if self.startup_timeout_s <= 0 or self.stall_after_s <= 0 or self.grace_s < 0:
            raise ValueError(f"startup_timeout_s ({self.startup_timeout_s}) and stall_after_s "
                             f"({self.stall_after_s}) must be > 0, grace_s ({self.grace_s}) >= 0")
        if self.decode_prefix_cache not in PREFIX_CACHE_CHOICES:
            raise ValueError(f"decode_prefix_cache must be one of {PREFIX_CACHE_CHOICES}, got "
                             f"{self.decode_prefix_cache!r}")
        if not self.load_timeout_s >= 0:
            raise ValueError(f"load_timeout_s must be >= 0, got {self.load_timeout_s}")
        if self.host_cache_policy not in HOST_CACHE_POLICIES:
            raise ValueError(f"host_cache_policy must be one of {HOST_CACHE_POLICIES}, got {self.host_cache_policy!r}")
        if self.disk_cache_bytes not in ("auto", "0") and not self.disk_cache_dir:
            raise ValueError(f"--disk-cache-bytes {self.disk_cache_bytes} needs --disk-cache-dir")
        if not self.decode_weights:
            raise ValueError("decode_weights must be 'model', an MX format or a directory, got ''")
        check_bind(self.router.host, self.api_key, "the router (give --api-key)")
        tls.tls_config(self.tls_cert, self.tls_key, self.tls_ca)  # ValueError for a half-given pair or a bad file

    @property
    def aggregated(self) -> bool:
        """No prefill workers: the decode workers prefill every prompt."""
        return self.prefill == 0

    @property
    def speculation(self) -> str | None:
        """The decode workers' STEPS/TOPK/DRAFT_TOKENS, None when off."""
        return None if self.speculative in SPECULATION_OFF else self.speculative

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == Role.PREFILL else self.decode_tp

    def resolved(self, model: str, decode_weights: str | None):
        """This spec as a launcher starts it: the model directory, the decode workers' checkpoint (None: the
        model's own) and the TLS files as absolute paths (what ``*_argv`` pass on)."""
        paths = {k: os.path.abspath(v) for k in ("tls_cert", "tls_key", "tls_ca", "disk_cache_dir")
                 if (v := getattr(self, k))}
        return dataclasses.replace(self, model=os.path.abspath(model), decode_weights=decode_weights or "model",
                                   **paths)

    # -- command lines --------------------------------------------------------------------------------
    def router_argv(self) -> list[str]:
        """``python -m router`` / ``router.discovery`` flags, less the worker addresses (the local launcher lists
        them, the Ray router actor adds its discovery file). The API key goes through the environment."""
        args = [a for name in ROUTER_OPTIONS for a in _flag(name, getattr(self.router, name))]
        args += _flag("model", self.model) + ["--startup-timeout-s", repr(self.startup_timeout_s),
                                              "--grace-s", repr(self.grace_s)]
        args += ["--aggregated"] if self.aggregated else []
        return args + logs.log_args(self.log_level, self.log_format) + self._tls_args()

    def prefill_argv(self, slot: WorkerSlot) -> list[str]:
        """``python -m prefill.server`` flags (the launcher adds ``--host``)."""
        args = self._worker_argv(Role.PREFILL, slot) + (["--fault-injection"] if self.router.fault_injection else [])
        args += [] if self.host_cache_bytes == "auto" else ["--host-cache-bytes", self.host_cache_bytes]
        policy = self.host_cache_policy
        args += [] if policy == "write_back" else ["--host-cache-policy", policy]
        if self.disk_cache_dir:  # one directory per worker (it locks it), the same one after a restart
            args += ["--disk-cache-dir", os.path.join(self.disk_cache_dir, slot.worker_id)]
        args += [] if self.load_timeout_s == 2.0 else ["--load-timeout-s", repr(self.load_timeout_s)]
        return args + ([] if self.disk_cache_bytes == "auto" else ["--disk-cache-bytes", self.disk_cache_bytes])

    def decode_argv(self, slot: WorkerSlot) -> list[str]:
        """``python -m decode.server`` flags (the launcher adds ``--host``). Its own prefill forwards (aggregated
        mode, ``--local-prefill-below``) get ``slot.prefill_threads``."""
        args = self._worker_argv(Role.DECODE, slot) + ["--kv-port", "0"] + ([] if self.no_shm else ["--shm"])
        args += [] if self.decode_weights == "model" else ["--quantized-model", self.decode_weights]
        args += ["--speculative", self.speculation] if self.speculation else ["--no-speculative"]
        args += ["--no-spec-fallback"] if self.no_spec_fallback else []
        args += ["--compile"] if self.compile_decode else []
        args += [] if self.decode_prefix_cache == "on" else ["--prefix-cache", self.decode_prefix_cache]
        return args + ["--prefill-chunk", str(self.prefill_chunk),
                       "--prefill-threads", str(slot.prefill_threads or slot.threads)]

    def worker_argv(self, role: str, slot: WorkerSlot) -> list[str]:
        return self.prefill_argv(slot) if role == Role.PREFILL else self.decode_argv(slot)

    def _worker_argv(self, role: str, slot: WorkerSlot) -> list[str]:
        args = _flag("model", self.model) + [
            "--port", "0", "--worker-id", slot.worker_id, "--dtype", self.dtype, "--page-size", str(self.page_size),
            "--threads", str(slot.threads), "--stall-after", repr(self.stall_after_s), "--grace-s", repr(self.grace_s),
            "--metrics-port", "-1"]  # Prometheus /metrics on a free port, listed in GetClusterStatus
        args += _flag("kv_dtype", self.kv_dtype) + _flag("num_pages", self.num_pages)
        args += _flag("kv_cache_memory", self.kv_cache_memory) + _flag("mem_fraction", slot.mem_fraction)
        args += _flag("expect_model_hash", slot.model_hash)
        if self.tp(role) > 1:  # one worker = tp rank processes, rank 0 starts and supervises the others
            args += ["--tp", str(self.tp(role)), "--moe-parallel", self.moe_parallel]
        if self.transport != TransportConfig():  # the default (auto) is the workers' own
            args += [a for f in dataclasses.fields(TransportConfig) for a in _flag(f.name, getattr(self.transport,
                                                                                                   f.name))]
        return args + logs.log_args(self.log_level, self.log_format) + self._tls_args()

    def _tls_args(self) -> list[str]:
        return [a for k in ("tls_cert", "tls_key", "tls_ca") for a in _flag(k, getattr(self, k))]


def _flag(name: str, value) -> list[str]:
    """``--name value`` as the processes' parsers (``common.flags``) read it: a switch when True, nothing for
    None or False, a comma list for a tuple."""
    if value is None or value is False:
        return []
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if isinstance(value, tuple):
        return [flag, ",".join(value)]
    return [flag, repr(value) if isinstance(value, float) else str(value)]


def add_cluster_args(p: argparse.ArgumentParser, cls: type[ClusterSpec] = ClusterSpec, skip: tuple[str, ...] = (),
                     choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """The flags of ``cls`` (``ClusterSpec`` or a launcher's subclass): its own fields', the router's options,
    the KV transport's and ``--api-key-file``."""
    flags.add_config_args(p, cls, skip=("router", "transport", *skip), choices={**CHOICES, **(choices or {})})
    router_config.add_config_args(p, skip=ROUTER_OWNED)
    add_transport_args(p)
    flags.add_api_key_file_arg(p)
    # both commands serve HTTP on vLLM's port by default; the config's default (off) is for library callers
    p.set_defaults(http_port=flags.DEFAULT_HTTP_PORT)


def cluster_config_from_args(args: argparse.Namespace, cls: type[ClusterSpec] = ClusterSpec, **overrides):
    """``cls`` from the flags of ``add_cluster_args`` (``overrides`` win, e.g. the API key read from a file)."""
    router = RouterConfig(**{name: getattr(args, name) for name in ROUTER_OPTIONS})
    return flags.config_from_args(args, cls, router=router, transport=flags.config_from_args(args, TransportConfig),
                                  **overrides)
