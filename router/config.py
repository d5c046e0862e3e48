"""Router configuration: one frozen dataclass; the ``python -m router`` flags are generated from its fields."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass

ROUTING_POLICIES = ("cache_aware", "round_robin", "least_load", "random")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Address the public gRPC port binds to (beyond loopback only with an API key)."""
    port: int = 50051
    """Public gRPC port (0: pick a free one; the chosen one is printed)."""
    prefill: tuple[str, ...] = ()
    """Prefill worker gRPC addresses (host:port)."""
    decode: tuple[str, ...] = ()
    """Decode worker gRPC addresses (host:port)."""
    api_key: str | None = None
    """Require ``authorization: Bearer <api_key>`` on the public services (health and reflection stay open)."""
    cluster_secret: str | None = None
    """Secret for the internal worker plane (default: $PDSERVE_CLUSTER_SECRET)."""
    model: str | None = None
    """Model directory used only for its tokenizer.json (default: the workers' model_dir)."""
    routing: str = "cache_aware"
    """Prefill policy: cache_aware, round_robin, least_load or random."""
    balance_abs_threshold: int = 4
    """cache_aware: loads are imbalanced when max - min load exceeds this (requests) ..."""
    balance_rel_threshold: float = 1.5
    """... and max load exceeds min load times this; imbalanced -> least load, else the longest prefix."""
    local_prefill_below: int = 0
    """Prompts shorter than this are prefilled on the decode worker itself (0: always disaggregate)."""
    max_inflight: int = 256
    """Requests the router admits at once; beyond it, RESOURCE_EXHAUSTED (no unbounded queue)."""
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
    transfer_timeout_s: float = 60.0
    """How long a decode worker waits for the prompt's KV after Decode starts."""
    startup_timeout_s: float = 120.0
    """How long ``python -m router`` waits for the first status of every worker before serving anyway."""
    grace_s: float = 3.0
    """Grace period for in-flight calls on shutdown."""

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_inflight", "unhealthy_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval_s", "health_timeout_s", "rpc_timeout_s", "request_timeout_s",
                     "transfer_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance thresholds must be abs >= 0 and rel >= 1, got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")
        if self.local_prefill_below < 0:
            raise ValueError(f"local_prefill_below must be >= 0, got {self.local_prefill_below}")
        for addr in self.prefill + self.decode:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {addr!r}")


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each field (the single source of the flag help)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


def add_config_args(p: argparse.ArgumentParser, cls=RouterConfig, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field: tuples take comma lists, bools are switches, ``str | None`` default to None."""
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _kind(f)
        if kind is bool:
            p.add_argument(flag, action="store_true", help=docs.get(f.name))
        elif kind is tuple:
            p.add_argument(flag, type=_comma_list, default=f.default, help=docs.get(f.name))
        else:
            choices = ROUTING_POLICIES if f.name == "routing" else None
            p.add_argument(flag, type=kind, default=f.default, choices=choices, help=docs.get(f.name))


def config_from_args(args: argparse.Namespace, cls=RouterConfig, **overrides) -> RouterConfig:
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    return cls(**{**kw, **overrides})


def _kind(f: dataclasses.Field) -> type:
    t = str(f.type)
    if t.startswith("tuple"):
        return tuple
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str


def _comma_list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())
