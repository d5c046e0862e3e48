"""The prefill worker's scheduler: chunked, batched prefill over a radix prefix cache.

A request walks through::

    QUEUED ──admit──> RUNNING ──last chunk──> TRANSFERRING ──acked──> FINISHED
       │                 │                         │
       └──abort/deadline─┴─────────────────────────┴──> ABORTED / FAILED (pages freed)

Each ``step()`` is schedule -> forward -> sample -> postprocess:

* schedule: running requests continue first, then queued ones are admitted (highest priority,
  then FCFS) while the token budget and pages last; admission (``prefill.admission``, the page owner) matches
  the prefix cache and its host and disk tiers, evicting LRU pages when short, and allocates private pages for the rest.
  A lower tier's prefix loads on a loader thread from the request's arrival (``add``); a request still loading is
  passed over (the others run), past ``load_timeout_s`` it goes on with what has loaded and recomputes the rest;
* forward: one batched forward over every scheduled chunk; each layer's KV is handed to the
  request's ``KVSink`` as soon as it is written (transfer overlaps compute); then one batched MTP
  forward over the same chunks (the draft KV the decode side needs), whose next tokens are the
  prompt's following tokens or, for a last chunk, the sampled first token;
* postprocess: a finished request's sink is told to finish and the step goes on; once the receiver has
  acknowledged the KV, the transfer's I/O thread calls back (``_acked``): the full pages go into the prefix cache,
  the rest are freed, and the request is answered. No thread waits on a transfer; one that outlives its sink's
  ``timeout_s`` or its deadline is cancelled by the next step.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from concurrent.futures import Future
from typing import Callable

import torch

from common.reasons import AbortReason
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.kvcache.radix import RadixCache
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, sample
from engine.shapes import bucket_chunks, buckets_steps
from engine.speculative.prefill import PrefillChunk, prefill_forward
from prefill.admission import Admitted, PrefillAdmission
from prefill.host_cache import HostCache
from prefill.sink import SinkResult, TransferFailed, failed
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, PrefillTask, QueueFull, RequestAborted, State
from worker.scheduler_thread import SchedulerThread

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""``stop`` waits this long for the transfers it cancelled to answer their requests (their I/O threads call back)."""


class PrefillScheduler(SchedulerThread):
    """Owns the model, the pool and the prefix cache of one prefill worker. Thread-safe API."""

    def __init__(self, model: GlmForCausalLM, pool: KVPool, config: PrefillConfig | None = None,
                 on_cache_event: Callable[[list[int], list[int]], None] | None = None,
                 host_cache: HostCache | None = None) -> None:
        super().__init__()  # the scheduler thread, its condition variable and heartbeat
        self.model, self.pool, self.config = model, pool, config or PrefillConfig()
        self.bucketed = buckets_steps(pool.device, model.lm_head.weight.dtype)
        """Steps take ``bucket_floor`` tokens (``engine.shapes``: bf16 / fp16 on CPU)."""
        self.cache = RadixCache(pool.allocator, pool.page_size, on_cache_event)
        self.host = self.cache.lower = host_cache  # the prefix cache's host tier (None: off): pool evictions go there
        self.admission = PrefillAdmission(pool, self.cache, host_cache, self._cv, self.config.prefetch)
        """The owner of every page a request holds (``prefill.admission``): the scheduler asks it to admit and release."""
        self._queue: list[tuple[int, int, PrefillTask]] = []
        self._seq = itertools.count()
        self._running: list[PrefillTask] = []
        self._tasks: dict[str, PrefillTask] = {}
        self.tokens_done = 0
        self.busy_s = 0.0

    # -- public, thread-safe -------------------------------------------------------------------
    def add(self, task: PrefillTask) -> None:
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
        self.admission.prefetch(task, lambda: task.state is State.QUEUED and not task.abort_reason)

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
                self._abort_transfer(task, reason)
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
                if task.state is State.TRANSFERRING:  # its sink answers once the cancel reaches its I/O thread
                    self._abort_transfer(task, "prefill worker shutting down")
            self._reap_aborted()
            if not self._cv.wait_for(lambda: not any(t.state is State.TRANSFERRING for t in self._tasks.values()),
                                     timeout=STOP_WAIT_S):
                logger.warning("prefill scheduler stopped with transfers still unanswered after %.0fs", STOP_WAIT_S)
        self.admission.close()  # loads still running end (and free their pages) first

    def _has_aborts(self) -> bool:
        now = time.monotonic()
        return any(self._transfer_overdue(t, now) if t.state is State.TRANSFERRING else t.abort_reason
                   for t in self._tasks.values())

    @staticmethod
    def _transfer_overdue(task: PrefillTask, now: float) -> bool:
        """A transfer to cancel: its request was aborted, or it outlived its deadline or its sink's ``timeout_s``."""
        if task.transfer_aborted:
            return False
        timeout = task.sink.timeout_s
        return (bool(task.abort_reason) or (task.deadline is not None and now > task.deadline)
                or (timeout is not None and now > task.t_forward_done + timeout))

    def _abort_transfer(self, task: PrefillTask, reason: str) -> None:
        """Cancel a finishing transfer once; its sink's future fails and ``_acked`` answers the request."""
        if not task.transfer_aborted:
            task.transfer_aborted = True
            task.sink.abort(reason)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        with self._cv:
            self._reap_aborted()
            chunks = self._schedule()
            if not chunks and self.admission.num_loading:  # nothing else to run: wait for a load (or a timeout)
                self._cv.wait(timeout=self.idle_after_empty_step_s)
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
        now, taken = time.monotonic(), set()
        for entry in sorted(self._queue):  # highest priority, then FCFS
            if budget <= 0 or len(self._running) >= self.config.max_running:
                break
            task = entry[2]
            self.admission.cut_if_late(task, self.config.load_timeout_s, now)
            admitted = self._admit(task)
            if admitted is Admitted.NO_ROOM:
                break
            if admitted is Admitted.LOADING:  # its prefix is loading: the ones behind it run meanwhile
                continue
            taken.add(id(entry[2]))
            if admitted is Admitted.FAILED:  # can never fit: failed, try the next one
                continue
            n = min(self.config.chunk_size, len(task.token_ids) - task.computed, budget)
            chunks.append((task, task.computed, task.computed + n))
            budget -= n
        self._queue = [q for q in self._queue if id(q[2]) not in taken]
        heapq.heapify(self._queue)
        return bucket_chunks(chunks) if self.bucketed else chunks

    def _admit(self, task: PrefillTask, retry: bool = True) -> Admitted:
        try:
            if self.admission.admit(task) is Admitted.LOADING:
                return Admitted.LOADING
        except PoolExhausted as e:
            if not self._running and not any(t.state is State.TRANSFERRING for t in self._tasks.values()):
                # nothing running or transferring will free pages; only the queued requests' prefetches might
                freed, loading = self.admission.reclaim(q[2] for q in self._queue if q[2] is not task)
                if freed and retry:
                    return self._admit(task, retry=False)
                if loading:
                    return Admitted.NO_ROOM
                self.admission.drop_prefetch(task)
                self._fail(task, e)  # this request can never fit
                return Admitted.FAILED
            return Admitted.NO_ROOM
        task.state, task.t_start = State.RUNNING, time.monotonic()
        self._running.append(task)
        return Admitted.RUNNING

    @staticmethod
    def _start_sinks(chunks: list[tuple[PrefillTask, int, int]]) -> None:
        """Outside the lock: a sink's start ships the cached prefix and may wait for send slots, which
        must not block ``add`` / ``abort`` (the gRPC event loop) meanwhile."""
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
        finished = []
        with self._cv:
            for t, s, e in chunks:
                t.computed = e
                self.tokens_done += e - s
                if e == len(t.token_ids) and not t.abort_reason:
                    t.state, t.t_forward_done = State.TRANSFERRING, time.monotonic()
                    self._running.remove(t)
                    finished.append(t)
        for t in finished:  # outside the lock: a split-heads sink gathers them here
            self._finish(t)

    def _finish(self, task: PrefillTask) -> None:
        """Hand the finished prefill to its sink; ``_acked`` answers it once the receiver has the KV. No thread
        waits for that: the transfer's I/O thread calls back."""
        try:
            acked = task.sink.finish(task.draft_hidden)
        except Exception as e:  # noqa: BLE001 - a sink failing to finish fails only its request (``_acked`` says so)
            acked = failed(e)
        acked.add_done_callback(lambda f: self._acked(task, f))

    def _acked(self, task: PrefillTask, acked: Future[SinkResult]) -> None:
        """The transfer ended (on its I/O thread, or on this one when ``finish`` resolved at once): release the
        pages (a success's full pages join the prefix cache) and answer the request."""
        try:
            sr = acked.result()
        except Exception as e:  # noqa: BLE001 - the transfer failed, was cancelled or timed out
            with self._cv:
                self._release(task)
                task.state = State.ABORTED if task.abort_reason else State.FAILED
                self._tasks.pop(task.req_id, None)
                self._cv.notify_all()  # stop() may wait for the transfers it cancelled
            if task.abort_reason:  # cancelled or past its deadline while transferring: say so, not "failed"
                task.on_done(RequestAborted(task.req_id, task.abort_reason))
            else:
                task.on_done(e if isinstance(e, TransferFailed) else TransferFailed(str(e)))
            return
        try:
            with self._cv:
                self._release(task, insert=True)
                task.state = State.FINISHED
                self._tasks.pop(task.req_id, None)
                self._cv.notify_all()
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
            prefill_s=task.t_forward_done - task.t_start, transfer_s=time.monotonic() - task.t_forward_done,
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
            if task.state is State.TRANSFERRING:
                if self._transfer_overdue(task, now):
                    if task.deadline is not None and now > task.deadline:
                        task.abort_reason = task.abort_reason or AbortReason.DEADLINE
                    self._abort_transfer(task, task.abort_reason or
                                         f"KV transfer not acknowledged within {task.sink.timeout_s:g}s")
                continue
            if task.deadline is not None and now > task.deadline and not task.abort_reason:
                task.abort_reason = AbortReason.DEADLINE
            if not task.abort_reason:
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
        """Remove an aborted, still queued task (its prefetch, if any, given back) and answer its caller. Under the
        lock."""
        self._queue = [q for q in self._queue if q[2] is not task]
        heapq.heapify(self._queue)
        self.admission.drop_prefetch(task)
        task.state = State.ABORTED
        self._tasks.pop(task.req_id, None)
        task.on_done(RequestAborted(task.req_id, task.abort_reason))
