"""Local supervision: a worker of ``pdserve serve`` that dies is restarted on its old address.

Lifecycle of one worker slot (``Supervisor.poll`` runs every half second from the serve loop)::

    RUNNING --exits--> DEAD: its shm segments are removed, its exit code and log tail are logged
    DEAD --backoff (backoff_s x 2^restarts, at most max_backoff_s)--> STARTING: the same command on the
         same port (a dead listener leaves no TIME_WAIT), its log in NAME.restartN.log
    STARTING --ready line--> RUNNING: the router's health poll finds it on the address it knows and
         takes it back into rotation (requests that were on it failed over meanwhile)
    DEAD with max_restarts spent --> GAVE_UP: logged once; the router routes around it

A worker that stays up ``reset_after_s`` gets its restart count back, so a rare crash never exhausts it.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    """Restarts per worker before it is left dead (0: never restart)."""
    backoff_s: float = 1.0
    """Wait before the first restart; it doubles with each further one."""
    max_backoff_s: float = 30.0
    """The longest wait between restarts."""
    reset_after_s: float = 600.0
    """A worker up this long gets its restart count back."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.backoff_s < 0 or self.max_backoff_s < 0 or self.reset_after_s <= 0:
            raise ValueError(f"restart policy needs max_restarts, backoff_s, max_backoff_s >= 0 and reset_after_s > 0, "
                             f"got {self.max_restarts}, {self.backoff_s}, {self.max_backoff_s}, {self.reset_after_s}")

    def backoff(self, restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** restarts)


class SlotState(enum.Enum):
    RUNNING = "running"
    DEAD = "dead"
    STARTING = "starting"
    GAVE_UP = "gave up"


@dataclass(slots=True)
class _Slot:
    state: SlotState = SlotState.RUNNING
    restarts: int = 0
    next_at: float = 0.0
    up_since: float = 0.0


class Supervisor:
    """Restarts the dead workers of a started ``LocalCluster`` (see the module docstring)."""

    def __init__(self, cluster, policy: RestartPolicy) -> None:
        self.cluster, self.policy = cluster, policy
        now = time.monotonic()
        self._slots = {w.name: _Slot(up_since=now) for w in cluster.workers}

    def poll(self) -> list[str]:
        """One pass over the workers; returns what happened, one line each, for the caller to log."""
        events: list[str] = []
        now = time.monotonic()
        for i, w in enumerate(self.cluster.workers):
            slot = self._slots[w.name]
            if w.proc.poll() is None:
                if slot.state is SlotState.STARTING and w.address is None and self._ready(w):
                    slot.state, slot.up_since = SlotState.RUNNING, now
                    events.append(f"{w.name} is back (pid {w.pid}) on {w.address}")
                elif slot.state is SlotState.RUNNING and slot.restarts and now - slot.up_since > \
                        self.policy.reset_after_s:
                    slot.restarts = 0
                continue
            if slot.state in (SlotState.RUNNING, SlotState.STARTING):
                w.clean_up_after_exit()  # its shm segments, now
                events.append(f"{w.name} (pid {w.pid}) exited with code {w.proc.returncode}; log tail:\n"
                              f"{w.log_tail(2000)}")
                if slot.restarts >= self.policy.max_restarts:
                    slot.state = SlotState.GAVE_UP
                    events.append(f"{w.name}: not restarted ({slot.restarts} restarts already, --max-restarts "
                                  f"{self.policy.max_restarts}); the router routes around it")
                    continue
                slot.state, slot.next_at = SlotState.DEAD, now + self.policy.backoff(slot.restarts)
                events.append(f"{w.name}: restarting in {self.policy.backoff(slot.restarts):g}s (restart "
                              f"{slot.restarts + 1} of {self.policy.max_restarts})")
            if slot.state is SlotState.DEAD and now >= slot.next_at:
                slot.restarts += 1
                new = self.cluster.restart_worker(i, slot.restarts)
                slot.state = SlotState.STARTING
                events.append(f"{new.name}: restarted as pid {new.pid}, log {new.log_path}")
        return events

    @staticmethod
    def _ready(w) -> bool:
        try:
            return w.poll_ready()
        except RuntimeError:  # exited before its ready line: the next pass sees it dead
            return False
