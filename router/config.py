"""Router configuration: one frozen dataclass; the ``python -m router`` flags are generated from its fields."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import flags
from protos.tls import TLSConfig, tls_config

ROUTING_POLICIES = ("cache_aware", "round_robin", "least_load", "random")
DEFAULT_HTTP_PORT = flags.DEFAULT_HTTP_PORT
MAX_FAILOVERS = 99
"""Bounds the ``.f<n>`` suffix of internal request ids (``router.validate.MAX_ID_SUFFIX_LEN``)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Address the public gRPC port binds to (beyond loopback only with an API key)."""
    port: int = 50051
    """Public gRPC port (0: pick a free one; the chosen one is printed)."""
    http_port: int = 0
    """OpenAI-compatible HTTP port (``/v1/completions``, ``/v1/chat/completions``, ``/metrics``) on the same
    host: 0 turns it off, -1 picks a free port (the chosen one is printed). The commands (``python -m router``,
    ``pdserve serve``, ``pdserve launch``) default to 8000 (``DEFAULT_HTTP_PORT``)."""
    served_model_name: str = ""
    """The model name HTTP clients send (default: the last path component of the workers' model dir; the
    full model dir is accepted too)."""
    prefill: tuple[str, ...] = ()
    """Prefill worker gRPC addresses (host:port)."""
    decode: tuple[str, ...] = ()
    """Decode worker gRPC addresses (host:port)."""
    api_key: str | None = None
    """Require ``authorization: Bearer <api_key>`` on the public services (health and reflection stay open).
    Default: --api-key-file, else $PDSERVE_API_KEY (this flag shows the key to every user in ps)."""
    cluster_secret: str | None = None
    """Secret for the internal worker plane (default: $PDSERVE_CLUSTER_SECRET)."""
    tls_cert: str | None = None
    """PEM certificate: the public gRPC and HTTP ports serve TLS, and workers are dialled over TLS
    (``protos.tls``)."""
    tls_key: str | None = None
    """PEM private key of --tls-cert."""
    tls_ca: str | None = None
    """PEM CA bundle that signed the workers' certificates (and the router's client certificate for mutual
    TLS on the internal plane); default: --tls-cert itself."""
    model: str | None = None
    """Model directory used only for its tokenizer.json (default: the workers' model_dir)."""
    routing: str = "cache_aware"
    """Prefill policy: cache_aware, round_robin, least_load or random."""
    balance_abs_threshold: int = 4
    """cache_aware: loads are imbalanced when max - min load exceeds this (requests) ..."""
    balance_rel_threshold: float = 1.5
    """... and max load exceeds min load times this; imbalanced -> least load, else the longest prefix."""
    host_hit_weight: float = 0.9
    """cache_aware: what a prefix page a prefill worker holds in its host-memory tier counts for, against 1 for a
    page in its KV pool (a host hit is restored, not recomputed, but not free): device hit > host hit > none."""
    disk_hit_weight: float = 0.6
    """cache_aware: what a prefix page in a prefill worker's local-disk tier counts for (read from a file, slower
    than host memory, still far cheaper than a recompute): device hit > host hit > disk hit > none."""
    decode_residency_tokens: int = 512
    """Decode routing by residency (decode-side prefix reuse): prompt tokens a decode worker already holds (its
    prefix cache events) that count for one request of its load when the router orders the decode workers for
    a reservation (the resident worker wins at equal load, and at up to ``decode_residency_max_credit`` more); 0:
    ignore residency (least load only)."""
    decode_residency_max_credit: float = 2.0
    """At most this many requests of load a decode worker's resident prefix outweighs (a long resident session
    must not pile every turn on one worker: its decode steps slow every stream there)."""
    local_prefill_below: int = 0
    """Prompts shorter than this are prefilled on the decode worker itself (0: always disaggregate)."""
    aggregated: bool = False
    """No prefill workers (``pdserve serve --prefill 0``): every prompt is prefilled on its decode worker
    (``Decode(local_prefill=True)``, chunked there) and the router serves with decode workers alone. A decode
    worker that cannot prefill (``info['local_prefill'] == '0'``) is never asked; with none that can, requests
    end UNAVAILABLE saying so."""
    max_request_bytes: int = 0
    """Largest GenerateRequest the public port accepts (gRPC's max receive message length: larger messages
    get RESOURCE_EXHAUSTED from gRPC itself). 0: derived from the served model at start, max_context * 32
    + 64 KiB (``router.validate.max_request_bytes``), max_context as the first worker reports it within
    health_timeout_s, else from --model's config.json; 64 MiB when neither is known."""
    max_inflight: int = 256
    """Requests the router admits at once, queued ones included; beyond it, RESOURCE_EXHAUSTED (no unbounded
    queue)."""
    max_queued: int = 256
    """Requests that may wait in the router's admission queue (``router.admission``) for decode room: while no
    decode worker can take a request it waits there, highest priority first and FIFO within one, and is
    admitted as pages free; past this bound (or its deadline) it is refused with RESOURCE_EXHAUSTED (HTTP 429)
    and a Retry-After. 0: no queue (a request no decode worker has room for is refused at once)."""
    queue_aging_s: float = 10.0
    """Every this many seconds in the admission queue raise a waiting request by one priority level, so a
    low-priority request behind a stream of higher-priority ones is admitted in bounded time. 0: no aging."""
    health_interval_s: float = 1.0
    """How often every worker's GetStatus is polled."""
    health_timeout_s: float = 2.0
    """Timeout of one GetStatus poll."""
    unhealthy_after: int = 2
    """Consecutive failed polls before a worker leaves the rotation (one success puts it back)."""
    rpc_timeout_s: float = 10.0
    """Timeout of the short worker calls (Reserve, Abort)."""
    request_timeout_s: float = 600.0
    """Upper bound on a request's lifetime when the client sets no deadline."""
    stream_write_timeout_s: float = 20.0
    """Longest a response may wait for the client to take it (a client that stops reading: a zero HTTP/2
    flow-control window) before the request is cancelled and its slot released. Much shorter than
    ``request_timeout_s``: a blocked stream holds one of ``max_inflight`` slots while it waits."""
    transfer_timeout_s: float = 60.0
    """How long a decode worker waits for the prompt's KV after Decode starts."""
    max_failovers: int = 2
    """Times one request may resume on another decode worker after its decode worker failed mid-stream
    (the router re-prefills prompt + tokens already streamed; 0 disables failover; at most 99)."""
    decode_stall_timeout_s: float = 30.0
    """A decode stream silent this long (worker stalled, hung or cut off) is failed over like a dead one."""
    fault_injection: bool = False
    """Accept Admin.InjectFault and forward it to the worker (which must allow it too): for
    ``pdserve bench --fault drop-kv@S``. Off in production."""
    startup_timeout_s: float = 120.0
    """How long ``python -m router`` waits for the first status of every worker before serving anyway."""
    grace_s: float = 30.0
    """On SIGTERM the router stops admitting (health NOT_SERVING, new requests UNAVAILABLE) and gives the
    requests in flight this long to finish; what is left is then ended with UNAVAILABLE saying so."""

    @property
    def serving_needs(self) -> str:
        """What the router serves with, for its UNAVAILABLE and /health messages."""
        return "decode workers" if self.aggregated else "prefill and decode workers"

    def _check_cache_aware(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance thresholds must be abs >= 0 and rel >= 1, got {self.balance_abs_threshold} "
                             f"and {self.balance_rel_threshold}")
        for name in ("host_hit_weight", "disk_hit_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [-1, 65535] (0: off, -1: any free port), got {self.http_port}")
        if not 0 <= self.max_failovers <= MAX_FAILOVERS:
            raise ValueError(f"max_failovers must be in [0, {MAX_FAILOVERS}], got {self.max_failovers}")
        for name in ("max_request_bytes", "local_prefill_below", "max_queued", "queue_aging_s", "decode_residency_tokens",
                     "decode_residency_max_credit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_inflight", "unhealthy_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval_s", "health_timeout_s", "rpc_timeout_s", "request_timeout_s",
                     "stream_write_timeout_s",
                     "transfer_timeout_s", "decode_stall_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_cache_aware()
        if self.aggregated and self.prefill:
            raise ValueError(f"an aggregated router takes no prefill workers, got {', '.join(self.prefill)}")
        tls_config(self.tls_cert, self.tls_key, self.tls_ca)  # ValueError for a half-given pair or a bad file
        for addr in self.prefill + self.decode:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {addr!r}")

    @property
    def tls(self) -> TLSConfig | None:
        return tls_config(self.tls_cert, self.tls_key, self.tls_ca)


def add_config_args(p: argparse.ArgumentParser, cls=RouterConfig, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field (see ``common.flags``); ``--routing`` is limited to the known policies."""
    flags.add_config_args(p, cls, skip, choices={"routing": ROUTING_POLICIES})


def config_from_args(args: argparse.Namespace, cls=RouterConfig, **overrides) -> RouterConfig:
    return flags.config_from_args(args, cls, **overrides)
