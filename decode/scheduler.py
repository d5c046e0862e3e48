"""The decode worker's continuous-batching scheduler.

A request walks through::

    add() ──> RUNNING ──step()...──> FINISHED (stop | length)
               │   ▲
     pool full │   │ pages free again: its KV recomputed (prompt + output so far)
               ▼   │
              PREEMPTED
                 └──abort / deadline / needs more than the whole pool──> ABORTED (abort | error)

A request joins once its KV has arrived (the server adds it after ``kvtransfer`` reports a complete,
verified transfer into pages this worker reserved), or prefills here (``add_local``: conditional
disaggregation, and every prompt of an aggregated cluster), and leaves when finished; every ``step()`` is
at most one local prefill forward (chunked: ``prefill_chunk`` tokens of a prompt, ``prefill_budget`` in all,
so a long prompt takes several steps and the running requests keep streaming between them) then one
batched forward over all running requests (or one speculative draft+verify round when a
``spec`` decoder is attached): schedule -> forward -> sample -> postprocess. Tokens are emitted
through each request's ``emit`` callback as they are produced. Pages grow one page at a time; when
the pool runs out, the youngest running request is preempted and recomputed later (``decode.preemption``:
the client sees a pause, not an error); a request that cannot fit even alone in the whole pool ends with a
clear error (never a hang), and its pages are freed. No new reservation is granted while any admitted request
waits for pages (``refusal()``, asked by ``Reserve``, which also applies ``max_running``). Speculation goes
through ``decode.speculation.SpeculationAdapter``; settings are a frozen ``DecodeConfig``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator

import torch

from common.reasons import AbortReason, FinishReason
from decode.admission import DecodeAdmission
from decode.config import DecodeConfig
from decode.preemption import PreemptionManager
from decode.speculation import SpeculationAdapter, Speculator
from decode.task import DecodeTask, State, TokenEvent
from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.sampling import sample
from engine.speculative.prefill import PrefillChunk, prefill_forward
from worker.scheduler_thread import SchedulerThread

logger = logging.getLogger(__name__)


__all__ = ["DecodeConfig", "DecodeScheduler", "DecodeTask", "Speculator", "State", "TokenEvent"]


@contextlib.contextmanager
def intra_op_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``num_threads`` (0: unchanged) inside, restored after."""
    before = torch.get_num_threads()
    if num_threads and num_threads != before:
        torch.set_num_threads(num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
    else:
        yield


class DecodeScheduler(SchedulerThread):
    def __init__(self, model: GlmForCausalLM, pool: KVPool, eos_ids: tuple[int, ...] = (),
                 config: DecodeConfig | None = None, stop_checker: Callable[[DecodeTask], str | None] | None = None,
                 spec: Speculator | None = None, admission: DecodeAdmission | None = None) -> None:
        super().__init__()  # the scheduler thread, its condition variable and heartbeat
        config = config or DecodeConfig()
        self.model, self.pool, self.eos_ids, self.config = model, pool, set(eos_ids), config
        self.admission = admission or DecodeAdmission(pool)
        """The owner of every page a request holds: the scheduler asks it to allocate, grow and release."""
        if self.admission.pool is not pool:
            raise ValueError("the admission's pool must be the scheduler's")
        self.stop_checker = stop_checker
        """Returns a truncated-text reason (``stop``) when a stop string appeared (needs a tokenizer)."""
        self.speculation = None if spec is None else SpeculationAdapter(spec, config)
        self.preemption = PreemptionManager(model, self.admission, config, self._finish, draft=spec is not None)
        self._running: list[DecodeTask] = []
        self._arrivals = 0
        self._pending_prefill: list[DecodeTask] = []
        """Local prefills in arrival order, each ``cached_len`` tokens into its prompt (its pages hold it all)."""
        self._tasks: dict[str, DecodeTask] = {}
        self.tokens_out = 0
        self.busy_s = 0.0

    # -- public, thread-safe ---------------------------------------------------------------------
    def add(self, task: DecodeTask) -> None:
        with self._cv:
            if task.req_id in self._tasks:
                raise ValueError(f"duplicate request id {task.req_id!r}")
            if len(self._running) >= self.config.max_running:
                raise PoolExhausted(0, self.admission.num_free)
            self._tasks[task.req_id] = task
            self._arrivals += 1
            task.arrival = self._arrivals
            self._running.append(task)
            self._cv.notify()
        done = self._check_finished(task, task.output_ids[-1:] if task.output_ids else [])
        if done:  # e.g. the first token was already EOS / max_tokens == 1
            with self._cv:
                self._finish(task, done)

    def add_local(self, task: DecodeTask) -> None:
        """Prefill ``task.prompt_ids`` here (no transfer: conditional disaggregation, aggregated mode), then decode.

        Pages for the whole prompt are allocated now (``PoolExhausted`` propagates: nothing is kept); the prompt
        is prefilled in chunks over the next steps (``DecodeConfig.prefill_chunk``), from the end of its prefix
        still resident in the prefix cache (``decode.admission``), and its first token, sampled after the last
        chunk, is emitted like any other. ``task.output_ids`` must be empty and ``cached_len`` 0.
        """
        if task.output_ids or task.cached_len:
            raise ValueError("a local prefill starts from the prompt alone")
        self.admission.alloc_prompt(task)
        with self._cv:
            if task.req_id in self._tasks:
                self.admission.release(task)
                raise ValueError(f"duplicate request id {task.req_id!r}")
            self._tasks[task.req_id] = task
            self._arrivals += 1
            task.arrival = self._arrivals
            self._pending_prefill.append(task)
            self._cv.notify()

    def abort(self, req_id: str, reason: str = AbortReason.CANCELLED) -> bool:
        with self._cv:
            task = self._tasks.get(req_id)
            if task is None:
                return False
            task.abort_reason = task.abort_reason or reason
            self._cv.notify()
            return True

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_pending(self) -> int:
        """Local prefills waiting for the next step (admitted, not yet running)."""
        return len(self._pending_prefill)

    def refusal(self, num_reserved: int) -> str:
        """Why a new reservation must be refused now, or "" (the decode worker's ``Reserve`` asks before it
        allocates anything): ``max_running`` counts the requests whose KV is on its way (``num_reserved``
        reservations) as running, so the limit holds before the prefill, not after the transfer; and
        requests already admitted come first: none is given pages while one waits for them (preempted,
        or running but short of its next page)."""
        with self._cv:
            admitted = len(self._running) + len(self._pending_prefill) + num_reserved
            if admitted >= self.config.max_running:
                return (f"max_running={self.config.max_running} requests are running or on their way "
                        f"({len(self._running)} running, {len(self._pending_prefill)} prefilling, "
                        f"{num_reserved} reserved)")
            pre = self.preemption
            if pre.preempted or pre.num_waiting:
                return (f"the KV pool is short: {len(pre.preempted)} preempted and {pre.num_waiting} running "
                        f"requests wait for pages")
            return ""

    @property
    def num_preempted(self) -> int:
        return len(self.preemption.preempted)

    @property
    def preemptions(self) -> int:
        """Preemptions so far."""
        return self.preemption.num_preemptions

    @property
    def spec_fallbacks(self) -> int:
        """Requests switched from speculation to plain decoding so far."""
        return 0 if self.speculation is None else self.speculation.num_fallbacks

    thread_name = "decode-scheduler"
    idle_after_empty_step_s = 0.05  # only preempted requests, waiting for pages: no busy loop

    def has_work(self) -> bool:
        return bool(self._running or self._pending_prefill or self.preemption.preempted)

    def on_step_error(self) -> None:
        for t in self._running + self._pending_prefill:
            self._finish(t, FinishReason.ERROR, "internal error in decode step")

    def stop(self) -> None:
        self.stop_thread()
        with self._cv:
            for t in self._running + self._pending_prefill + self.preemption.preempted:
                t.abort_reason = t.abort_reason or AbortReason.SHUTDOWN
            self._reap()

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> bool:
        with self._cv:
            self._reap()
            local = self._schedule_prefill()
        if local:
            try:
                with intra_op_threads(self.config.prefill_threads):
                    self._local_prefill(local)
            except Exception:  # noqa: BLE001 - fail these requests (pages freed, event sent), keep decoding
                logger.exception("local prefill of %d chunks failed", len(local))
                with self._cv:
                    for t, _, _ in local:
                        self._finish(t, FinishReason.ERROR, "internal error in local prefill")
        resumed = self._resume_preempted()
        with self._cv:
            before = len(self._running)
            tasks = self.preemption.make_room(self._running)
            changed = len(self._running) != before
        if not tasks:  # progress: a local prefill, a resumed request, or one ended or preempted just now
            return bool(local or resumed or changed)
        t0 = time.perf_counter()
        if self.speculation is not None:
            new_tokens = self.speculation.step(tasks, self._ensure_pages, self._plain_step)
        else:
            new_tokens = self._plain_step(tasks)
        self.busy_s += time.perf_counter() - t0
        with self._cv:
            for task, toks in zip(tasks, new_tokens):
                if task.state is not State.RUNNING or not toks:
                    continue
                self._deliver(task, toks)
        return True

    def _schedule_prefill(self) -> list[tuple[DecodeTask, int, int]]:
        """This step's local prefill chunks ``(task, start, end)``, under the lock: the prompts in arrival order,
        each at most ``prefill_chunk`` tokens, all together at most ``prefill_budget``. Unlike the prefill
        worker's, these steps keep their lengths (no ``engine.shapes.bucket_chunks``): in bf16 the trimmed chunk
        boundaries moved near-ties, so greedy output left the offline engine's at the same chunk size (3 of 6
        tiny-model prompts); with whole chunks it equals it (tests/decode/test_decode_local_prefill.py)."""
        budget, chunks = self.config.prefill_budget, []
        for t in self._pending_prefill:
            if budget <= 0:
                break
            n = min(self.config.prefill_chunk, len(t.prompt_ids) - t.cached_len, budget)
            chunks.append((t, t.cached_len, t.cached_len + n))
            budget -= n
        return chunks

    def _local_prefill(self, chunks: list[tuple[DecodeTask, int, int]]) -> None:
        """One batched forward over this step's prompt chunks (and the MTP layer's KV). An inner chunk's next
        token is the prompt's own; a prompt's last chunk samples its first token (and, when speculating, the
        draft state), and the request starts running."""
        def sample_first(logits: torch.Tensor, rows: list[int]) -> list[int]:
            return sample(logits, [chunks[i][0].sampler for i in rows]).token_ids.tolist()

        plan = [PrefillChunk(t.pages, s, t.prompt_ids[s:e], t.prompt_ids[e] if e < len(t.prompt_ids) else None,
                             draft=e == len(t.prompt_ids) and self.speculation is not None) for t, s, e in chunks]
        results = prefill_forward(self.model, self.pool, plan, sample_first)
        with self._cv:
            for (t, _, e), r in zip(chunks, results):
                t.cached_len = e
                if e < len(t.prompt_ids):
                    continue  # more chunks in the next steps (or reaped there, if aborted meanwhile)
                t.draft_hidden = r.draft_hidden
                self._pending_prefill.remove(t)
                self._running.append(t)
                if not t.abort_reason:  # an aborted one is reaped (its pages freed) at the next step
                    self._deliver(t, [r.next_token])

    # -- preemption (decode.preemption) -------------------------------------------------------------
    def _resume_preempted(self) -> bool:
        """Recompute the KV of the oldest preempted request once the pool can hold it."""
        with self._cv:
            task, n, progressed = self.preemption.take_resumable(len(self._running))
        if task is None:
            return progressed
        try:
            self.preemption.recompute(task, n)
        except Exception:  # noqa: BLE001 - fail this request (pages freed, event sent), keep decoding
            logger.exception("recomputing the KV of preempted %s failed", task.req_id)
            with self._cv:
                self._finish(task, FinishReason.ERROR, "internal error while resuming a preempted request")
            return True
        with self._cv:
            task.cached_len = n
            self._running.append(task)
        return True

    def _ensure_pages(self, task: DecodeTask, num_tokens: int) -> None:
        self.admission.grow(task, num_tokens)

    def _plain_step(self, tasks: list[DecodeTask]) -> list[list[int]]:
        live = []
        for t in tasks:
            try:
                self._ensure_pages(t, t.cached_len + 1)
                live.append(t)
            except PoolExhausted as e:
                with self._cv:
                    self._finish(t, FinishReason.ERROR, f"decode KV pool exhausted: {e}")
        if not live:
            return [[] for _ in tasks]
        reqs = [BatchRequest(t.pages, t.cached_len, [t.output_ids[-1]]) for t in live]
        out = self.model(ForwardBatch.build(reqs, self.pool.page_size, self.pool.device), self.pool)
        res = sample(out.logits, [t.sampler for t in live])
        by_task = {}
        for i, t in enumerate(live):
            t.cached_len += 1
            tok = int(res.token_ids[i])
            if res.logprobs is not None and t.params.logprobs:
                n = t.params.logprobs
                t._pending_logprobs = [(tok, float(res.logprobs[i]), res.top_ids[i, :n].tolist(),
                                        res.top_logprobs[i, :n].tolist())]
            by_task[t.req_id] = [tok]
        return [by_task.get(t.req_id, []) for t in tasks]

    def _deliver(self, task: DecodeTask, toks: list[int]) -> None:
        """Append accepted tokens, cut at the first stop condition, emit."""
        out = []
        reason = ""
        for tok in toks:
            task.output_ids.append(tok)
            task.sampler.output_ids.append(tok)
            out.append(tok)
            reason = self._check_finished(task, [tok])
            if reason:
                break
        task.steps += 1
        self.tokens_out += len(out)
        lp = getattr(task, "_pending_logprobs", [])
        task._pending_logprobs = []
        acc = 0.0 if self.speculation is None else self.speculation.accept_len(task)
        if reason:
            self._finish(task, reason, new_tokens=out, logprobs=lp, accept_len=acc)
        else:
            task.emitted += len(out)
            task.emit(TokenEvent(out, logprobs=lp, accept_len=acc))

    def _check_finished(self, task: DecodeTask, new: list[int]) -> str:
        p = task.params
        for tok in new:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                return FinishReason.STOP
        if len(task.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        if p.stop and self.stop_checker is not None and self.stop_checker(task):
            return FinishReason.STOP
        return ""

    # -- cleanup ---------------------------------------------------------------------------------
    def _finish(self, task: DecodeTask, reason: str, message: str = "", new_tokens: list[int] | None = None,
                logprobs=None, accept_len: float = 0.0) -> None:
        if task.state is not State.RUNNING:
            return
        task.state = State.FINISHED if reason in (FinishReason.STOP, FinishReason.LENGTH) else State.ABORTED
        if task in self._running:
            self._running.remove(task)
        if task in self._pending_prefill:
            self._pending_prefill.remove(task)
        self._tasks.pop(task.req_id, None)
        self.admission.release(task)
        task.emit(TokenEvent(new_tokens or [], reason, message, logprobs or [], accept_len))

    def _reap(self) -> None:
        now = time.monotonic()
        self._running += self.preemption.take_ended(now)  # finished just below, like any running request
        for task in self._running + self._pending_prefill:
            if task.deadline is not None and now > task.deadline and not task.abort_reason:
                task.abort_reason = AbortReason.DEADLINE
            if task.abort_reason:
                self._finish(task, FinishReason.ABORT, task.abort_reason)
