"""The decode worker's continuous-batching scheduler.

A request walks through::

    add() ──> RUNNING ──step()...──> FINISHED (stop | length)
               │   ▲
     pool full │   │ pages free again: its KV recomputed (prompt + output so far)
               ▼   │
              PREEMPTED
                 └──abort / deadline / needs more than the whole pool──> ABORTED (abort | error)

A request joins once its KV has arrived (the server adds it after ``kvtransfer`` reports a complete,
verified transfer into pages this worker reserved) and leaves when finished; every ``step()`` is one
batched forward over all running requests (or one speculative draft+verify round when a
``spec`` decoder is attached): schedule -> forward -> sample -> postprocess. Tokens are emitted
through each request's ``emit`` callback as they are produced. Pages grow one page at a time; when
the pool runs out, the youngest running request is preempted (vLLM's recompute preemption): its pages
are freed, its tokens so far are kept, and once enough pages are free again its KV is recomputed from
the prompt and the tokens it already produced (chunked, with the MTP layer's KV for speculation) and it
continues as if nothing happened: the client sees a pause, not an error. A request that cannot fit
even alone in the whole pool ends with a clear error (never a hang), and its pages are freed. A running
request is never ended or starved for room that reservations of incoming transfers hold: when it is the
only one left to run it waits for them (keeping its pages), and no new reservation is granted while any
admitted request waits for pages (``refusal()``, asked by ``Reserve``, which also applies ``max_running``).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, SamplingParams, sample
from engine.speculative.prefill import PrefillChunk, prefill_forward
from worker.heartbeat import Heartbeat

logger = logging.getLogger(__name__)


class State(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What a request's ``emit`` receives: new tokens and, on the last event, why it ended."""
    token_ids: list[int]
    finish_reason: str = ""
    """``stop``, ``length``, ``abort`` or ``error``; empty while running."""
    message: str = ""
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    accept_len: float = 0.0


@dataclass(eq=False)
class DecodeTask:
    req_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    """Tokens already produced (at least the first token, sampled by prefill)."""
    params: SamplingParams
    pages: list[int]
    """Pages holding the KV of ``cached_len`` tokens (reserved at transfer time, owned by this task)."""
    cached_len: int
    emit: Callable[[TokenEvent], None]
    deadline: float | None = None
    state: State = State.RUNNING
    abort_reason: str = ""
    sampler: SamplerState | None = None
    steps: int = 0
    emitted: int = 0
    arrival: int = 0
    """Admission order: the youngest (largest) is preempted first."""
    preemptions: int = 0
    spec_rounds: int = 0
    spec_tokens: int = 0
    spec_off: bool = False
    """Speculation stopped paying for this request (see ``DecodeScheduler.spec_fallback``): plain steps."""
    draft_hidden: torch.Tensor | None = None
    """``[H]`` the MTP draft state shipped with the KV (``engine.speculative.seq.SpecSeq.draft_hidden``): the first
    round speculates. None: it verifies the last token alone and its draft extend creates the state."""

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = SamplerState(self.params, self.prompt_ids, list(self.output_ids))


class Speculator(Protocol):
    """A speculative decoder: one draft + verify round for a batch; returns new tokens per task."""

    def step(self, tasks: list[DecodeTask], ensure_pages: Callable[[DecodeTask, int], None]) -> list[list[int]]: ...

    def accept_len(self, task: DecodeTask) -> float: ...

    @property
    def last_verify_s(self) -> float: ...


class DecodeScheduler:
    def __init__(self, model: GlmForCausalLM, pool: KVPool, eos_ids: tuple[int, ...] = (),
                 max_running: int = 64, stop_checker: Callable[[DecodeTask], str | None] | None = None,
                 spec: Speculator | None = None) -> None:
        self.model, self.pool, self.eos_ids = model, pool, set(eos_ids)
        self.max_running = max_running
        self.stop_checker = stop_checker
        """Returns a truncated-text reason (``stop``) when a stop string appeared (needs a tokenizer)."""
        self.spec = spec
        self.spec_fallback = True
        """Switch a request to plain decoding once its speculation costs more than it gains: after
        ``spec_probe_rounds`` rounds, if its tokens per round are below the round's cost in plain steps
        (round time / its verify forward's time, both measured here). Greedy output is unchanged; the
        request's MTP KV is no longer kept, so the switch is for the rest of the request."""
        self.spec_probe_rounds = 8
        self.spec_fallbacks = 0
        self._round_cost = 0.0
        """EMA of a speculative round's time over its verify forward's time (~ plain steps per round)."""
        self._running: list[DecodeTask] = []
        self._preempted: list[DecodeTask] = []
        """Waiting for pages, oldest preemption first; their pages are freed, their tokens kept."""
        self._arrivals = 0
        self.preemptions = 0
        self.recompute_chunk = 2048
        """Tokens per forward when a preempted request's KV is recomputed."""
        self._pending_prefill: list[DecodeTask] = []
        self._num_waiting = 0
        """Running requests that skipped the last step waiting for pages held by reservations."""
        self._tasks: dict[str, DecodeTask] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.heartbeat = Heartbeat()
        self.tokens_out = 0
        self.busy_s = 0.0

    # -- public, thread-safe ---------------------------------------------------------------------
    def add(self, task: DecodeTask) -> None:
        with self._cv:
            if task.req_id in self._tasks:
                raise ValueError(f"duplicate request id {task.req_id!r}")
            if len(self._running) >= self.max_running:
                raise PoolExhausted(0, self.pool.allocator.num_free)
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
        """Conditional disaggregation: prefill ``task.prompt_ids`` here (no transfer), then decode.

        Pages are allocated now (``PoolExhausted`` propagates: nothing is kept); the first token is
        emitted like any other. ``task.output_ids`` must be empty and ``cached_len`` 0.
        """
        if task.output_ids or task.cached_len:
            raise ValueError("a local prefill starts from the prompt alone")
        task.pages = self.pool.allocator.alloc(self.pool.pages_for(len(task.prompt_ids) + 1), task.req_id)
        with self._cv:
            if task.req_id in self._tasks:
                self.pool.allocator.decref(task.pages)
                raise ValueError(f"duplicate request id {task.req_id!r}")
            self._tasks[task.req_id] = task
            self._arrivals += 1
            task.arrival = self._arrivals
            self._pending_prefill.append(task)
            self._cv.notify()

    def abort(self, req_id: str, reason: str = "cancelled") -> bool:
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
            if admitted >= self.max_running:
                return (f"max_running={self.max_running} requests are running or on their way "
                        f"({len(self._running)} running, {len(self._pending_prefill)} prefilling, "
                        f"{num_reserved} reserved)")
            if self._preempted or self._num_waiting:
                return (f"the KV pool is short: {len(self._preempted)} preempted and {self._num_waiting} running "
                        f"requests wait for pages")
            return ""

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self._thread.start()

    def health_problem(self) -> str:
        """Why this scheduler cannot serve (thread dead, or stalled with work pending), or ""."""
        if self._thread is None or self._stop:
            return ""
        return self.heartbeat.problem(self._thread, bool(self._running or self._pending_prefill or self._preempted))

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout=30)
        with self._cv:
            for t in self._running + self._preempted:
                t.abort_reason = t.abort_reason or "shutdown"
            self._reap()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._running and not self._pending_prefill and not self._preempted:
                    self.heartbeat.beat()
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    return
            try:
                if not self.step():  # only preempted requests, waiting for pages: no busy loop
                    with self._cv:
                        self._cv.wait(timeout=0.05)
                self.heartbeat.beat()
            except Exception:  # noqa: BLE001 - end the batch with an error, keep the worker alive
                logger.exception("decode step failed")
                with self._cv:
                    for t in list(self._running):
                        self._finish(t, "error", "internal error in decode step")

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> bool:
        with self._cv:
            self._reap()
            local, self._pending_prefill = self._pending_prefill, []
        if local:
            try:
                self._local_prefill(local)
            except Exception:  # noqa: BLE001 - fail these requests (pages freed, event sent), keep decoding
                logger.exception("local prefill of %d requests failed", len(local))
                with self._cv:
                    for t in local:
                        self._finish(t, "error", "internal error in local prefill")
        resumed = self._resume_preempted()
        with self._cv:
            before = len(self._running)
            tasks = self._make_room()
            changed = len(self._running) != before
        if not tasks:  # progress: a local prefill, a resumed request, or one ended or preempted just now
            return bool(local or resumed or changed)
        t0 = time.perf_counter()
        if self.spec is not None:
            new_tokens = self._spec_and_plain_step(tasks)
        else:
            new_tokens = self._plain_step(tasks)
        self.busy_s += time.perf_counter() - t0
        with self._cv:
            for task, toks in zip(tasks, new_tokens):
                if task.state is not State.RUNNING or not toks:
                    continue
                self._deliver(task, toks)
        return True

    def _local_prefill(self, tasks: list[DecodeTask]) -> None:
        """One batched forward over the prompts (short by construction), first tokens, MTP pass."""
        def sample_first(logits: torch.Tensor, rows: list[int]) -> list[int]:
            return sample(logits, [tasks[i].sampler for i in rows]).token_ids.tolist()

        # the draft layer's KV over the prompt and, when speculating, the draft state
        plan = [PrefillChunk(t.pages, 0, t.prompt_ids, draft=self.spec is not None) for t in tasks]
        results = prefill_forward(self.model, self.pool, plan, sample_first)
        firsts = [r.next_token for r in results]
        for t, r in zip(tasks, results):
            t.draft_hidden = r.draft_hidden
        with self._cv:
            for t, f in zip(tasks, firsts):
                t.cached_len = len(t.prompt_ids)
                if t.abort_reason:
                    t.state = State.RUNNING
                    self._running.append(t)
                    continue  # reaped (and its pages freed) at the next step
                self._running.append(t)
                self._deliver(t, [f])

    def _spec_and_plain_step(self, tasks: list[DecodeTask]) -> list[list[int]]:
        """One speculative round for the requests it pays for, one plain step for the others."""
        spec = [t for t in tasks if not t.spec_off]
        plain = [t for t in tasks if t.spec_off]
        out: dict[str, list[int]] = {}
        if spec:
            t0 = time.perf_counter()
            toks = self.spec.step(spec, self._ensure_pages)
            dt, verify = time.perf_counter() - t0, self.spec.last_verify_s
            if verify > 0:
                ratio = dt / verify
                self._round_cost = ratio if not self._round_cost else 0.8 * self._round_cost + 0.2 * ratio
            for t, tk in zip(spec, toks):
                out[t.req_id] = tk
                if tk:
                    t.spec_rounds += 1
                    t.spec_tokens += len(tk)
                    self._maybe_fall_back(t)
        if plain:
            for t, tk in zip(plain, self._plain_step(plain)):
                out[t.req_id] = tk
        return [out.get(t.req_id, []) for t in tasks]

    def _maybe_fall_back(self, task: DecodeTask) -> None:
        if not self.spec_fallback or task.spec_rounds < self.spec_probe_rounds or not self._round_cost:
            return
        per_round = task.spec_tokens / task.spec_rounds
        if per_round < self._round_cost:
            task.spec_off = True
            self.spec_fallbacks += 1
            logger.info("%s: speculation off (%.2f tokens per round, a round costs %.2f plain steps)",
                        task.req_id, per_round, self._round_cost)

    # -- preemption --------------------------------------------------------------------------------
    def _make_room(self) -> list[DecodeTask]:
        """Give every running request the page its next token needs, oldest first, preempting the youngest
        while the pool is short; -> the requests that run this step. Under ``_cv``.

        A request ends for lack of room only when it alone needs more than the whole pool. When it is the
        only one left to run and the rest of the pool is held by others (reservations of incoming
        transfers, local prefills) it waits for them, keeping its pages, and skips the step; meanwhile
        ``refusal()`` turns new reservations away, so what holds the pool can only shrink: a transfer
        completes (its request then runs and, being younger, is preempted first), fails or expires."""
        waiting: list[DecodeTask] = []
        for task in sorted(self._running, key=lambda t: t.arrival):
            while task in self._running:
                try:
                    self._ensure_pages(task, task.cached_len + 1)
                    break
                except PoolExhausted as e:
                    need = self.pool.pages_for(task.cached_len + 1)
                    if need > self.pool.num_pages:
                        self._finish(task, "error", f"decode KV pool exhausted: {e}; this request alone needs "
                                                    f"{need} pages, more than the pool's {self.pool.num_pages}")
                        break
                    victim = max((t for t in self._running if t not in waiting), key=lambda t: t.arrival)
                    if victim is task and all(t is task or t in waiting for t in self._running):
                        waiting.append(task)  # the pages it needs are held by others than running requests
                        break
                    self._preempt(victim)
        self._num_waiting = len(waiting)
        return [t for t in self._running if t not in waiting]

    def _preempt(self, task: DecodeTask) -> None:
        self._running.remove(task)
        self._release_pages(task)
        task.cached_len = 0
        task.preemptions += 1
        self.preemptions += 1
        self._preempted.append(task)
        logger.info("preempted %s (%d tokens so far): KV pool full, %d running", task.req_id,
                    len(task.prompt_ids) + len(task.output_ids), len(self._running))

    def _resume_preempted(self) -> bool:
        """Recompute the KV of the oldest preempted request once the pool can hold it (plus a page of
        headroom per running request, so it is not preempted again at once)."""
        with self._cv:
            if not self._preempted:
                return False
            task = self._preempted[0]
            n = len(task.prompt_ids) + len(task.output_ids) - 1  # the last output token is the next input
            need = self.pool.pages_for(n + 1)
            if need > self.pool.num_pages:
                self._preempted.pop(0)
                self._finish(task, "error", f"decode KV pool exhausted: this request needs {need} pages, the "
                                            f"pool has {self.pool.num_pages}")
                return True
            if self.pool.allocator.num_free < need + len(self._running):
                return False
            task.pages = self.pool.allocator.alloc(need, task.req_id)
            self._preempted.pop(0)
        try:
            self._recompute(task, n)
        except Exception:  # noqa: BLE001 - fail this request (pages freed, event sent), keep decoding
            logger.exception("recomputing the KV of preempted %s failed", task.req_id)
            with self._cv:
                self._finish(task, "error", "internal error while resuming a preempted request")
            return True
        with self._cv:
            task.cached_len = n
            self._running.append(task)
        return True

    def _recompute(self, task: DecodeTask, n: int) -> None:
        """KV of the first ``n`` tokens of prompt + output into ``task.pages``, chunked; the MTP layer's too
        (its pair i is token i+1 with the main model's hidden i), as a prefill worker ships it."""
        seq = task.prompt_ids + task.output_ids
        for s in range(0, n, self.recompute_chunk):
            e = min(n, s + self.recompute_chunk)
            # the token after the chunk is known: nothing is sampled, no MTP pair deferred
            [res] = prefill_forward(self.model, self.pool, [PrefillChunk(task.pages, s, seq[s:e], seq[e],
                                                                          draft=e == n and self.spec is not None)])
            task.draft_hidden = res.draft_hidden  # the last chunk's: the request speculates at once

    def _ensure_pages(self, task: DecodeTask, num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens) - len(task.pages)
        if need > 0:
            task.pages += self.pool.allocator.alloc(need, task.req_id)

    def _plain_step(self, tasks: list[DecodeTask]) -> list[list[int]]:
        live = []
        for t in tasks:
            try:
                self._ensure_pages(t, t.cached_len + 1)
                live.append(t)
            except PoolExhausted as e:
                with self._cv:
                    self._finish(t, "error", f"decode KV pool exhausted: {e}")
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
        acc = 0.0
        if self.spec is not None:  # a request that stopped speculating reports its rounds' figure
            acc = task.spec_tokens / task.spec_rounds if task.spec_off else self.spec.accept_len(task)
        if reason:
            self._finish(task, reason, new_tokens=out, logprobs=lp, accept_len=acc)
        else:
            task.emitted += len(out)
            task.emit(TokenEvent(out, logprobs=lp, accept_len=acc))

    def _check_finished(self, task: DecodeTask, new: list[int]) -> str:
        p = task.params
        for tok in new:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                return "stop"
        if len(task.output_ids) >= p.max_tokens:
            return "length"
        if p.stop and self.stop_checker is not None and self.stop_checker(task):
            return "stop"
        return ""

    # -- cleanup ---------------------------------------------------------------------------------
    def _finish(self, task: DecodeTask, reason: str, message: str = "", new_tokens: list[int] | None = None,
                logprobs=None, accept_len: float = 0.0) -> None:
        if task.state is not State.RUNNING:
            return
        task.state = State.FINISHED if reason in ("stop", "length") else State.ABORTED
        if task in self._running:
            self._running.remove(task)
        self._tasks.pop(task.req_id, None)
        self._release_pages(task)
        task.emit(TokenEvent(new_tokens or [], reason, message, logprobs or [], accept_len))

    def _release_pages(self, task: DecodeTask) -> None:
        if task.pages:
            self.pool.allocator.decref(task.pages)
            task.pages = []

    def _reap(self) -> None:
        now = time.monotonic()
        for task in [t for t in self._preempted
                     if t.abort_reason or (t.deadline is not None and now > t.deadline)]:
            self._preempted.remove(task)
            self._running.append(task)  # finished just below, like any running request
        for task in [t for t in self._pending_prefill if t.abort_reason]:
            self._pending_prefill.remove(task)
            self._running.append(task)
        for task in list(self._running):
            if task.deadline is not None and now > task.deadline and not task.abort_reason:
                task.abort_reason = "deadline exceeded"
            if task.abort_reason:
                self._finish(task, "abort", task.abort_reason)
