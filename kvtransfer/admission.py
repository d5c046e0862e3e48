"""Who may hold a connection on the KV port, and how loudly refusals are logged.

The port is reachable before anyone has proven they hold the cluster secret, so connections
still in the handshake must never crowd out peers that have. ``ConnectionGate`` keeps two
separate budgets::

    accepted --rate limit (per source host)--> refused at once (ERROR busy, closed)
        |
        v
    UNAUTHENTICATED  (at most max_unauthenticated; when full, the OLDEST one is closed to make room:
        |             a real sender finishes its handshake in a round trip, a slowloris peer never does;
        |             every one is closed after handshake_timeout_s anyway)
        v  HMAC proof + layout ok
    AUTHENTICATED    (at most max_connections; beyond that the new peer is refused with ERROR busy)

So slow or silent connections can hold at most ``max_unauthenticated`` sockets for at most
``handshake_timeout_s`` each, and no authenticated slot, and a flood of attempts costs one
accept and one close per attempt beyond the rate, with one summary log line per interval.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Generic, Hashable, TypeVar

MAX_TRACKED_HOSTS = 4096
"""Source hosts whose token buckets are remembered (least recently seen forgotten first)."""

C = TypeVar("C", bound=Hashable)


class TokenBucket:
    """``rate_per_s`` tokens per second, at most ``burst`` saved up; one token per attempt."""

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.tokens = float(burst)
        self.updated = now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class RateLimitedLog:
    """At most one line per ``interval_s`` per key; the next line says how many were suppressed meanwhile.

    A flood of refused connections would otherwise write one WARNING per attempt (the attack run saw
    ~1 MB/s of log)."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        self._last[key] = now
        dropped = self._suppressed.pop(key, 0)
        if dropped:
            self.logger.warning(msg + " (and %d more like it in the last %.0fs)", *args, dropped,
                                now - last if last is not None else 0.0)
        else:
            self.logger.warning(msg, *args)


class ConnectionGate(Generic[C]):
    """The two connection budgets of one receiver (event loop thread only)."""

    def __init__(self, max_authenticated: int, max_unauthenticated: int, rate_per_s: float, burst: int) -> None:
        self.max_authenticated = max_authenticated
        self.max_unauthenticated = max_unauthenticated
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.unauthenticated: collections.OrderedDict[C, None] = collections.OrderedDict()
        """Oldest first: the one to close when a new connection needs room."""
        self.authenticated: set[C] = set()
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self.num_rate_limited = 0
        self.num_evicted = 0
        self.num_refused_authenticated = 0

    def admit(self, conn: C, host: str) -> tuple[bool, C | None]:
        """A new connection from ``host``: (admitted, the unauthenticated connection to close for room)."""
        now = time.monotonic()
        bucket = self._buckets.pop(host, None) or TokenBucket(self.rate_per_s, self.burst, now)
        self._buckets[host] = bucket  # most recently seen last
        while len(self._buckets) > MAX_TRACKED_HOSTS:
            self._buckets.popitem(last=False)
        if not bucket.take(now):
            self.num_rate_limited += 1
            return False, None
        victim = None
        if len(self.unauthenticated) >= self.max_unauthenticated:
            victim, _ = self.unauthenticated.popitem(last=False)
            self.num_evicted += 1
        self.unauthenticated[conn] = None
        return True, victim

    def authenticate(self, conn: C) -> bool:
        """``conn`` proved the secret: move it to the authenticated budget (False: that budget is full)."""
        self.unauthenticated.pop(conn, None)
        if len(self.authenticated) >= self.max_authenticated:
            self.num_refused_authenticated += 1
            return False
        self.authenticated.add(conn)
        return True

    def remove(self, conn: C) -> None:
        self.unauthenticated.pop(conn, None)
        self.authenticated.discard(conn)
