"""The thread a worker's scheduler steps on, shared by the prefill and decode schedulers.

The subclass says when there is work (``has_work``), what one step does (``step``: True when it did
something) and how a step that raised ends its batch (``on_step_error``); the base owns the thread, the
condition variable every producer notifies, the heartbeat ``GetStatus`` reads and the stop. A step that
raises never kills the thread: the batch is failed and the worker keeps serving.
"""
from __future__ import annotations

import abc
import logging
import threading

from worker.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""How long an idle thread sleeps between heartbeats when nobody notifies it."""


class SchedulerThread(abc.ABC):
    thread_name = "scheduler"
    idle_after_empty_step_s = 0.0
    """Wait this long (or until notified) after a step that did nothing although work is pending (decode:
    requests preempted and waiting for pages), instead of spinning."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.heartbeat = Heartbeat()

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Called with ``self._cv`` held: whether the thread should step rather than sleep."""

    @abc.abstractmethod
    def step(self) -> bool:
        """One scheduling step; True when it made progress."""

    @abc.abstractmethod
    def on_step_error(self) -> None:
        """Called with ``self._cv`` held after ``step`` raised: end the batch it was running with an error."""

    def busy(self) -> bool:
        """Work that a stalled thread would leave waiting (the heartbeat's ``busy``); default ``has_work``."""
        return self.has_work()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def health_problem(self) -> str:
        """Why this scheduler cannot serve (thread dead, or stalled with work pending), or ""."""
        if self._thread is None or self._stop:
            return ""
        return self.heartbeat.problem(self._thread, self.busy())

    def stop_thread(self, timeout_s: float = 30.0) -> None:
        """Ask the thread to return after its current step and wait for it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.has_work():
                    self.heartbeat.beat()
                    self._cv.wait(timeout=IDLE_WAIT_S)
                if self._stop:
                    return
            try:
                if not self.step() and self.idle_after_empty_step_s > 0:
                    with self._cv:
                        self._cv.wait(timeout=self.idle_after_empty_step_s)
                self.heartbeat.beat()
            except Exception:  # a bug must not kill the worker silently: fail the batch, keep serving
                logger.exception("%s step failed", self.thread_name)
                with self._cv:
                    self.on_step_error()
