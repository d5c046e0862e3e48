"""The one check of which addresses are private to this machine, and the refusal to serve beyond them
without a secret (gRPC servers, the KV-transfer listener, the load generator's fault injection). Stdlib only."""
from __future__ import annotations

import ipaddress

from common import env


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot be reached from another machine: ``localhost`` and loopback IPs
    (``127.0.0.0/8``, ``::1``, bracketed or not). A hostname may resolve anywhere and the empty host binds
    every interface: both are reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: str | bytes | None, what: str) -> None:
    """Refuse to expose an unauthenticated service beyond loopback: ValueError naming ``what`` and the fix."""
    if not is_loopback(host) and not secret:
        raise ValueError(f"{what} would listen on {host or 'every interface'} without a secret: set "
                         f"{env.CLUSTER_SECRET} (or pass a secret / API key), or bind to 127.0.0.1")
