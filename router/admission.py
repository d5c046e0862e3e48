"""The router's admission queue: requests wait here while no decode worker has room for them, and are admitted
as pages free (vLLM's and SGLang's waiting queue, in front of the whole cluster rather than one engine).

A request's way through it (``router.request.GenerateRun`` drives it)::

    arrives ──nobody waits, a decode worker takes it──> admitted (never queued)
    arrives ──every decode worker is full, or others already wait──> WAITING (``enter``; past ``max_queued``:
        RESOURCE_EXHAUSTED with a Retry-After)
    WAITING ──it ranks first and nobody is trying──> TRYING: asks the decode workers for room (one request at a
        time, so the queue's order is the order of admission)
    TRYING ──a worker took it──> admitted (``admit``: it leaves, and the next one tries at once: room may be left)
    TRYING ──every worker is full──> WAITING again (``no_room``), keeping its place: nobody passes the head of the
        line, so a large request is not starved by a stream of small ones (they queue behind it while the pages
        it needs free up: reserve-ahead by the line itself)
    WAITING / TRYING ──deadline (DEADLINE_EXCEEDED), client cancel, drain cut-off, an error──> left (``leave``)

Rank: highest priority first, then arrival (FIFO within a priority); every ``aging_s`` seconds of waiting raise a
request by one priority level, so a low-priority request behind higher-priority traffic is admitted in bounded
time too.

Push, not poll: ``wake()`` is called when room may have appeared (a request held at a decode worker ended, an
abort freed a request's pages, a decode worker's status shows pages freed or fewer running, a worker joined,
and, for room freed out of this router's sight (another router's requests), the first status of a worker after
it refused one); it starts the head's try. Wakes are counted: a request refused by every worker tries again at once when a wake
came while it was trying (room freed meanwhile), so none is lost; otherwise it waits for the next one.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from router.validate import RequestError

RATE_WINDOW_S = 10.0
"""Admissions over this window estimate how fast the queue drains (Retry-After)."""
MAX_RETRY_AFTER_S = 60


class Rejection(enum.StrEnum):
    """``pdserve:requests_rejected`` reasons."""
    QUEUE_FULL = "queue_full"
    """The admission queue held ``max_queued`` requests."""
    NO_QUEUE = "no_queue"
    """No decode worker had room and ``max_queued`` is 0."""
    DEADLINE = "deadline"
    """The request's deadline passed while it waited."""
    NEVER_FITS = "never_fits"
    """Its prompt needs more pages than any decode worker's whole pool holds."""
    MAX_INFLIGHT = "max_inflight"
    """The router had ``max_inflight`` requests (queued ones included)."""


class QueuedRun(Protocol):
    """What the queue reads of a request (``router.request.GenerateRun``)."""

    client_req_id: str
    priority: int
    t0: float
    """``time.monotonic()`` at arrival: FIFO order and aging count from it (a failover keeps its place)."""

    def remaining(self) -> float:
        """Seconds to the deadline; raises ``RequestError`` past it (or once the run was cut off)."""


def _past_deadline(run: QueuedRun) -> bool:
    """The run's deadline has passed (a cut-off run, whose ``remaining`` raises another code, has not)."""
    try:
        run.remaining()
    except RequestError as e:
        return e.code is grpc.StatusCode.DEADLINE_EXCEEDED
    return False


class QueueMetrics(Protocol):
    """The gauges and counters the queue keeps (``router.metrics.RouterMetrics``)."""

    def queue_changed(self, num_waiting: int) -> None: ...

    def rejected(self, reason: str) -> None: ...


class Slot(enum.Enum):
    WAITING = "waiting"
    TRYING = "trying"
    LEFT = "left"


@dataclass(eq=False)
class Waiter:
    """One request in the queue."""
    run: QueuedRun
    seq: int
    """Tie-break after arrival time (two requests in one clock tick)."""
    t_enqueued: float
    wakes_at_try: int = 0
    """``AdmissionQueue.num_wakes`` when its last try began: a later wake means room may have freed since."""
    state: Slot = Slot.WAITING
    expired: bool = False
    """Its refusal was counted as a deadline one (``_expired``, or ``leave`` past the deadline)."""
    event: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the request should look at its state again (its turn came, or it was cut off)."""

    def rank(self, now: float, aging_s: float) -> tuple[float, float, int]:
        """Smallest first: priority raised by one level per ``aging_s`` waited, then arrival."""
        boost = (now - self.run.t0) / aging_s if aging_s > 0 else 0.0
        return -(self.run.priority + boost), self.run.t0, self.seq


class AdmissionQueue:
    """The waiting requests of one cluster (one router). Runs on the event loop only: no locks."""

    def __init__(self, max_queued: int, aging_s: float, metrics: QueueMetrics) -> None:
        self.max_queued, self.aging_s, self.metrics = max_queued, aging_s, metrics
        self._waiters: list[Waiter] = []
        self._trying: Waiter | None = None
        self.num_wakes = 0
        """``wake()`` calls so far (a request notes it when it starts trying, see ``Waiter.wakes_at_try``)."""
        self._seq = 0
        self._admissions: collections.deque[float] = collections.deque(maxlen=1024)
        self.num_admitted = 0
        """Requests admitted after waiting, since start."""

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        """Requests wait: a new one queues behind them rather than taking the room they wait for."""
        return bool(self._waiters)

    def position(self, w: Waiter) -> int:
        """1-based place of ``w`` in the current order."""
        now = time.monotonic()
        mine = w.rank(now, self.aging_s)
        return 1 + sum(1 for o in self._waiters if o is not w and o.rank(now, self.aging_s) < mine)

    # -- entering and leaving --------------------------------------------------------------------------
    def check_room(self, why: str) -> None:
        """Refuse a request that would have to wait in a full queue (RESOURCE_EXHAUSTED, Retry-After)."""
        if self.max_queued == 0:
            self.metrics.rejected(Rejection.NO_QUEUE)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why} (no admission queue: --max-queued 0)",
                               retry_after_s=1)
        if len(self._waiters) >= self.max_queued:
            self.metrics.rejected(Rejection.QUEUE_FULL)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{why}, and the admission queue is full ({len(self._waiters)} requests wait, "
                               f"--max-queued {self.max_queued}); retry later", retry_after_s=self.retry_after_s())

    def enter(self, run: QueuedRun, why: str, wakes_at_try: int) -> Waiter:
        """Queue ``run`` (``why``: what it waits for, for the refusal's message); ``RequestError`` when full.
        ``wakes_at_try``: ``num_wakes`` when it last tried the workers itself (a wake since: the head tries now)."""
        self.check_room(why)
        self._seq += 1
        w = Waiter(run, self._seq, time.monotonic(), wakes_at_try)
        self._waiters.append(w)
        self.metrics.queue_changed(len(self._waiters))
        if wakes_at_try != self.num_wakes:
            self._promote()
        return w

    def leave(self, w: Waiter) -> float:
        """Take ``w`` out, however its wait ended (idempotent); returns the seconds it waited. When it was
        trying, the next request gets its turn."""
        if w.state is not Slot.LEFT and not w.expired and _past_deadline(w.run):
            # gRPC cancelled the handler at the client's deadline before our own timer fired (the two fall on
            # the same instant; which runs first is the event loop's order): still a deadline refusal
            w.expired = True
            self.metrics.rejected(Rejection.DEADLINE)
        return self._remove(w)

    def admit(self, w: Waiter) -> float:
        """``w`` got room: it leaves, and the next request tries at once (admitted, so no refusal even at its
        deadline). Returns the seconds it waited."""
        if w.state is not Slot.LEFT:
            self._admissions.append(time.monotonic())
            self.num_admitted += 1
        return self._remove(w)

    def _remove(self, w: Waiter) -> float:
        if w.state is Slot.LEFT:
            return 0.0
        trying = w.state is Slot.TRYING
        w.state = Slot.LEFT
        self._waiters.remove(w)
        self.metrics.queue_changed(len(self._waiters))
        if trying:
            self._trying = None
            self._promote()
        return time.monotonic() - w.t_enqueued

    # -- turns -----------------------------------------------------------------------------------------
    async def turn(self, w: Waiter) -> None:
        """Wait until ``w`` may ask the decode workers for room (its state is TRYING). Raises
        DEADLINE_EXCEEDED at the request's deadline, or what ``run.remaining()`` raises (a drain's cut-off)."""
        while w.state is Slot.WAITING:
            try:
                left = w.run.remaining()
            except RequestError as e:
                if e.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise self._expired(w) from None
                raise
            try:
                async with asyncio.timeout(left):
                    await w.event.wait()
            except TimeoutError:
                raise self._expired(w) from None
            w.event.clear()

    def no_room(self, w: Waiter) -> None:
        """``w`` tried and every decode worker was full: it waits again, keeping its place. A wake that came
        during its try (room freed meanwhile) gives the head another try at once."""
        if w.state is not Slot.TRYING:
            return
        w.state = Slot.WAITING
        self._trying = None
        if w.wakes_at_try != self.num_wakes:
            self._promote()

    def wake(self) -> None:
        """Room may have appeared at a decode worker: the head of the line tries (push, never a timer)."""
        self.num_wakes += 1
        self._promote()

    def kick(self, w: Waiter) -> None:
        """Make ``w`` look at its run again now (it was cut off: ``turn`` raises)."""
        w.event.set()

    def _promote(self) -> None:
        """The best-ranked waiting request starts its try, unless one is under way."""
        if self._trying is not None or not self._waiters:
            return
        now = time.monotonic()
        head = min(self._waiters, key=lambda o: o.rank(now, self.aging_s))
        head.state = Slot.TRYING
        head.wakes_at_try = self.num_wakes
        self._trying = head
        head.event.set()

    # -- refusals --------------------------------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Whole seconds a refused client should wait: the queue's length over its recent admission rate."""
        now = time.monotonic()
        recent = sum(1 for t in self._admissions if now - t <= RATE_WINDOW_S)
        if not recent:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(len(self._waiters) * RATE_WINDOW_S / recent)))

    def _expired(self, w: Waiter) -> RequestError:
        if not w.expired:
            w.expired = True
            self.metrics.rejected(Rejection.DEADLINE)
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"deadline exceeded after {time.monotonic() - w.t_enqueued:.2f}s in the admission "
                            f"queue waiting for decode room (place {self.position(w)} of {len(self._waiters)})",
                            retry_after_s=self.retry_after_s())
