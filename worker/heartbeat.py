"""A worker's liveness as its scheduler thread reports it (``GetStatus`` turns it into ``healthy``)."""
from __future__ import annotations

import threading
import time


class Heartbeat:
    """When a scheduler thread last made progress. A worker whose scheduler thread died, or that has work
    and has not finished a step for ``stall_after_s``, reports itself unhealthy in ``GetStatus``: the
    router takes it out of rotation (its health poll still answers: gRPC runs on the event loop)."""

    def __init__(self, stall_after_s: float = 60.0) -> None:
        if not stall_after_s > 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self.beat_s = time.monotonic()

    def beat(self) -> None:
        self.beat_s = time.monotonic()

    def problem(self, thread: threading.Thread | None, busy: bool) -> str:
        """Why the scheduler is not healthy, or ""."""
        if thread is not None and not thread.is_alive():
            return "scheduler thread is not running"
        quiet = time.monotonic() - self.beat_s
        if busy and quiet > self.stall_after_s:
            return f"no scheduler step finished for {quiet:.0f}s with work pending (stall limit {self.stall_after_s:g}s)"
        return ""
