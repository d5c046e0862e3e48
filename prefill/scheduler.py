"""The prefill worker's scheduler: chunked, batched prefill over a radix prefix cache.

A request walks through::

    QUEUED ──admit──> RUNNING ──last chunk──> TRANSFERRING ──acked──> DONE
       │                 │                         │
       └──abort/deadline─┴─────────────────────────┴──> ABORTED / FAILED (pages freed)

Each ``step()`` is schedule -> forward -> sample -> postprocess:

* schedule: running requests continue first, then queued ones are admitted (highest priority,
  then FCFS) while the token budget and pages last; admission (``prefill.admission``, the page owner) matches
  the prefix cache and its host and disk tiers, evicting LRU pages when short, and allocates private pages for the rest;
* forward: one batched forward over every scheduled chunk; each layer's KV is handed to the
  request's ``KVSink`` as soon as it is written (transfer overlaps compute); then one batched MTP
  forward over the same chunks (the draft KV the decode side needs), whose next tokens are the
  prompt's following tokens or, for a last chunk, the sampled first token;
* postprocess: a finished request's transfer is completed off-thread; its full pages go into the
  prefix cache, the rest are freed.
"""
from __future__ import annotations

import enum
import heapq
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.reasons import AbortReason
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, SamplingParams, sample
from engine.shapes import bucket_chunks, buckets_steps
from engine.speculative.prefill import PrefillChunk, prefill_forward
from worker.scheduler_thread import SchedulerThread
from prefill.admission import PrefillAdmission
from prefill.host_cache import HostCache
from prefill.radix import Match, RadixCache
from prefill.sink import KVSink, LocalSink, TransferFailed

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


class RequestAborted(RuntimeError):
    def __init__(self, req_id: str, reason: str) -> None:
        super().__init__(f"request {req_id} aborted: {reason}")
        self.reason = reason


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    TRANSFERRING = "transferring"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    chunk_size: int = 2048
    """Max new tokens of one request per forward (a 20k prompt takes 10 steps)."""
    max_batch_tokens: int = 4096
    """Token budget of one forward over all scheduled chunks."""
    max_queue: int = 64
    """Queued requests beyond this are refused (RESOURCE_EXHAUSTED), never buffered."""
    max_running: int = 16

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_batch_tokens < self.chunk_size:
            raise ValueError(f"need 1 <= chunk_size ({self.chunk_size}) <= max_batch_tokens "
                             f"({self.max_batch_tokens})")
        if self.max_queue < 1 or self.max_running < 1:
            raise ValueError("max_queue and max_running must be >= 1")


@dataclass(frozen=True, slots=True)
class PrefillResult:
    req_id: str
    first_token: int
    first_logprob: float | None
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    first_top: tuple[list[int], list[float]] = ([], [])
    """The ``params.logprobs`` most likely first tokens and their logprobs (empty lists when not asked)."""


@dataclass(eq=False)
class PrefillTask:
    req_id: str
    token_ids: list[int]
    params: SamplingParams
    on_done: Callable[[PrefillResult | BaseException], None]
    sink: KVSink = field(default_factory=LocalSink)
    priority: int = 0
    deadline: float | None = None
    """``time.monotonic()`` after which the request is aborted."""
    state: State = State.QUEUED
    match: Match | None = None
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    computed: int = 0
    sink_started: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_start: float = 0.0
    abort_reason: str = ""
    first_token: int = -1
    first_logprob: float | None = None
    first_top: tuple[list[int], list[float]] = ([], [])
    draft_hidden: torch.Tensor | None = None
    """``[H]`` the MTP draft state after the last chunk (shipped with the KV when the decode side asks)."""
    t_forward_done: float = 0.0


class PrefillScheduler(SchedulerThread):
    """Owns the model, the pool and the prefix cache of one prefill worker. Thread-safe API."""

    def __init__(self, model: GlmForCausalLM, pool: KVPool, config: PrefillConfig = PrefillConfig(),
                 on_cache_event: Callable[[list[int], list[int]], None] | None = None,
                 host_cache: HostCache | None = None) -> None:
        super().__init__()  # the scheduler thread, its condition variable and heartbeat
        self.model, self.pool, self.config = model, pool, config
        self.bucketed = buckets_steps(pool.device, model.lm_head.weight.dtype)
        """Steps take ``bucket_floor`` tokens (``engine.shapes``: bf16 / fp16 on CPU)."""
        self.cache = RadixCache(pool.allocator, pool.page_size, on_cache_event)
        self.host = self.cache.lower = host_cache  # the prefix cache's host tier (None: off): pool evictions go there
        self.admission = PrefillAdmission(pool, self.cache, host_cache)
        """The owner of every page a request holds (``prefill.admission``): the scheduler asks it to admit and release."""
        self._queue: list[tuple[int, int, PrefillTask]] = []
        self._seq = itertools.count()
        self._running: list[PrefillTask] = []
        self._tasks: dict[str, PrefillTask] = {}
        self._finisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefill-finish")
        self.tokens_done = 0
        self.busy_s = 0.0

    # -- public, thread-safe -------------------------------------------------------------------
    def submit(self, task: PrefillTask) -> None:
        if not task.token_ids:
            raise ValueError("empty prompt")
        with self._cv:
            if task.req_id in self._tasks:
                raise ValueError(f"duplicate request id {task.req_id!r}")
            if len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"prefill queue full ({self.config.max_queue} waiting)")
            self._tasks[task.req_id] = task
            heapq.heappush(self._queue, (-task.priority, next(self._seq), task))
            self._cv.notify()

    def abort(self, req_id: str, reason: str = AbortReason.CANCELLED) -> bool:
        """A queued request leaves the queue (and frees its slot) at once; a running one is reaped at the
        start of the next step (the forward in progress may be writing its pages); a transferring one's
        transfer is aborted."""
        with self._cv:
            task = self._tasks.get(req_id)
            if task is None:
                return False
            task.abort_reason = task.abort_reason or reason
            if task.state is State.QUEUED:
                self._drop_queued(task)
            elif task.state is State.TRANSFERRING:
                task.sink.abort(reason)
            self._cv.notify()
            return True

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._running)

    thread_name = "prefill-scheduler"
    idle_after_empty_step_s = 0.05  # queued requests waiting for pages a transfer holds: no busy loop

    def has_work(self) -> bool:
        return bool(self._queue or self._running or self._has_aborts())

    def busy(self) -> bool:
        return bool(self._queue or self._running)

    def on_step_error(self) -> None:
        for t in self._running:
            t.abort_reason = t.abort_reason or AbortReason.INTERNAL
        self._reap_aborted()

    def stop(self) -> None:
        self.stop_thread()
        with self._cv:
            for task in list(self._tasks.values()):
                task.abort_reason = task.abort_reason or AbortReason.SHUTDOWN
                if task.state is State.TRANSFERRING:  # its finisher thread is waiting for DONE: end that now
                    task.sink.abort("prefill worker shutting down")
            self._reap_aborted()
        self._finisher.shutdown(wait=True)

    def _has_aborts(self) -> bool:
        return any(t.abort_reason for t in self._tasks.values() if t.state is not State.TRANSFERRING)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        with self._cv:
            self._reap_aborted()
            chunks = self._schedule()
        if not chunks:
            return False
        self._start_sinks(chunks)
        t0 = time.perf_counter()
        self._forward(chunks)
        self.busy_s += time.perf_counter() - t0
        return True

    def _schedule(self) -> list[tuple[PrefillTask, int, int]]:
        budget = self.config.max_batch_tokens
        chunks = []
        for task in self._running:
            n = min(self.config.chunk_size, len(task.token_ids) - task.computed, budget)
            if n > 0:
                chunks.append((task, task.computed, task.computed + n))
                budget -= n
        while self._queue and budget > 0 and len(self._running) < self.config.max_running:
            task = self._queue[0][2]
            admitted = self._admit(task)
            if admitted is None:  # can never fit: failed, try the next one
                heapq.heappop(self._queue)
                continue
            if not admitted:
                break
            heapq.heappop(self._queue)
            n = min(self.config.chunk_size, len(task.token_ids) - task.computed, budget)
            chunks.append((task, task.computed, task.computed + n))
            budget -= n
        return bucket_chunks(chunks) if self.bucketed else chunks

    def _admit(self, task: PrefillTask) -> bool | None:
        """True: running now. False: not enough pages yet. None: can never fit (failed)."""
        try:
            self.admission.admit(task)
        except PoolExhausted as e:
            if not self._running and not any(t.state is State.TRANSFERRING for t in self._tasks.values()):
                # nothing running or transferring will free pages: this request can never fit
                self._fail(task, e)
                return None
            return False
        task.state, task.t_start = State.RUNNING, time.monotonic()
        self._running.append(task)
        return True

    @staticmethod
    def _start_sinks(chunks: list[tuple[PrefillTask, int, int]]) -> None:
        """Outside the lock: a sink's start ships the cached prefix and may wait for send slots, which
        must not block ``submit`` / ``abort`` (the gRPC event loop) meanwhile."""
        for t, s, _ in chunks:
            if s == t.num_cached and not t.sink_started:
                t.sink_started = True
                try:
                    t.sink.start(t.pages, t.num_cached)
                except Exception as e:  # noqa: BLE001 - a sink failing to start fails only its request
                    t.abort_reason = t.abort_reason or f"transfer start failed: {e}"

    def _forward(self, chunks: list[tuple[PrefillTask, int, int]]) -> None:
        def on_layer_done(layer: int) -> None:  # engine.batch.OnLayerDone: each request's sink ships it
            for t, s, e in chunks:
                if not t.abort_reason:
                    t.sink.send(layer, s, e)

        def sample_first(logits: torch.Tensor, rows: list[int]) -> list[int]:
            res = sample(logits, [SamplerState(chunks[i][0].params, chunks[i][0].token_ids) for i in rows])
            for j, i in enumerate(rows):
                t = chunks[i][0]
                t.first_logprob = float(res.logprobs[j]) if res.logprobs is not None else None
                n = t.params.logprobs
                if n and res.top_ids is not None:
                    t.first_top = (res.top_ids[j, :n].tolist(), res.top_logprobs[j, :n].tolist())
            return res.token_ids.tolist()

        # an inner chunk's next token is the prompt's; a finishing one samples the first token and, with MTP,
        # computes the draft state shipped with the pages
        plan = [PrefillChunk(t.pages, s, t.token_ids[s:e], t.token_ids[e] if e < len(t.token_ids) else None,
                             draft=e == len(t.token_ids)) for t, s, e in chunks]
        for (t, _, e), res in zip(chunks, prefill_forward(self.model, self.pool, plan, sample_first, on_layer_done)):
            if e == len(t.token_ids):
                t.first_token, t.draft_hidden = res.next_token, res.draft_hidden
        with self._cv:
            for t, s, e in chunks:
                t.computed = e
                self.tokens_done += e - s
                if e == len(t.token_ids) and not t.abort_reason:
                    t.state, t.t_forward_done = State.TRANSFERRING, time.monotonic()
                    self._running.remove(t)
                    self._finisher.submit(self._finish, t)

    def _finish(self, task: PrefillTask) -> None:
        t0 = time.monotonic()
        try:
            sr = task.sink.finish(task.draft_hidden)
        except Exception as e:  # noqa: BLE001
            with self._cv:
                self._release(task)
                task.state = State.FAILED
                self._tasks.pop(task.req_id, None)
            task.on_done(e if isinstance(e, TransferFailed) else TransferFailed(str(e)))
            return
        try:
            with self._cv:
                self._release(task, insert=True)
                task.state = State.DONE
                self._tasks.pop(task.req_id, None)
        except Exception as e:  # noqa: BLE001 - a bug here must still answer the caller, not leave it waiting
            logger.exception("prefill %s: releasing its pages failed", task.req_id)
            with self._cv:
                task.state = State.FAILED
                self._tasks.pop(task.req_id, None)
            task.on_done(e)
            return
        task.on_done(PrefillResult(
            req_id=task.req_id, first_token=task.first_token, first_logprob=task.first_logprob,
            cached_tokens=task.num_cached, queue_s=task.t_start - task.t_arrival,
            prefill_s=task.t_forward_done - task.t_start, transfer_s=time.monotonic() - t0,
            transfer_bytes=sr.num_bytes, first_top=task.first_top))

    # -- cleanup -------------------------------------------------------------------------------
    def _release(self, task: PrefillTask, insert: bool = False) -> None:
        """Give a task's pages back (``prefill.admission``) and wake a queued request waiting for them."""
        self.admission.release(task, insert)
        self._cv.notify()

    def _fail(self, task: PrefillTask, exc: BaseException) -> None:
        task.state = State.FAILED
        self._tasks.pop(task.req_id, None)
        task.on_done(exc)

    def _reap_aborted(self) -> None:
        now = time.monotonic()
        for task in list(self._tasks.values()):
            if task.deadline is not None and now > task.deadline and not task.abort_reason:
                task.abort_reason = AbortReason.DEADLINE
            if not task.abort_reason or task.state is State.TRANSFERRING:
                continue
            if task.state is State.QUEUED:
                self._drop_queued(task)
                continue
            if task.state is State.RUNNING:
                self._running.remove(task)
                task.sink.abort(task.abort_reason)
                self._release(task)
            task.state = State.ABORTED
            self._tasks.pop(task.req_id, None)
            task.on_done(RequestAborted(task.req_id, task.abort_reason))

    def _drop_queued(self, task: PrefillTask) -> None:
        """Remove an aborted, still queued task (it holds no page yet) and answer its caller. Under the lock."""
        self._queue = [q for q in self._queue if q[2] is not task]
        heapq.heapify(self._queue)
        task.state = State.ABORTED
        self._tasks.pop(task.req_id, None)
        task.on_done(RequestAborted(task.req_id, task.abort_reason))
