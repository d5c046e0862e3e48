"""One sweep step: send load for ``warmup + duration`` seconds, record every request, then drain.

Timeline of a step (times relative to its start, ``perf_counter`` seconds)::

    0 ──── warm-up ────> warmup_s ──── measured window ────> warmup_s + duration_s ── drain ──> (drain_timeout_s)
         sent, not measured       requests scheduled here are measured         no new sends; stragglers cancelled

Open loop (``rps``, ``trace``): requests go out on a precomputed schedule whatever the server does, each
as its own task, so an overloaded server shows up as growing TTFT, not as a slower client. Closed loop
(``concurrency``): N senders each send the next request when their previous one ends.

A request's ``status`` is ``OK`` only when its stream ended with finish_reason ``length`` or ``stop``;
otherwise it is the gRPC status code name (``RESOURCE_EXHAUSTED``, ``DEADLINE_EXCEEDED``, ...),
``finish:error`` / ``finish:abort`` for a stream that ended with that finish_reason, ``INCOMPLETE`` for a
stream that ended without one, or ``DRAIN_TIMEOUT`` when the bench cancelled it after the drain period.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from bench.loadgen.arrivals import poisson_arrivals
from bench.loadgen.config import BenchConfig
from bench.loadgen.workload import RequestSpec, Workload
from common.reasons import FinishReason
from protos.pdserve.v1 import generation_pb2

OK = "OK"
DRAIN_TIMEOUT = "DRAIN_TIMEOUT"
INCOMPLETE = "INCOMPLETE"
_GOOD_FINISH = (FinishReason.LENGTH, FinishReason.STOP)
PROGRESS_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class LoadStep:
    """One point of a sweep."""
    kind: str
    """'rps' (Poisson arrivals), 'concurrency' (closed loop) or 'trace' (recorded timestamps)."""
    value: float
    """Requests/s, requests in flight, or the trace speed-up."""

    @property
    def label(self) -> str:
        if self.kind == "rps":
            return f"rps {self.value:g}"
        if self.kind == "concurrency":
            return f"conc {int(self.value)}"
        return f"trace x{self.value:g}"


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are seconds since the step started."""
    index: int
    input_len: int
    output_len: int
    """Requested output tokens (max_tokens)."""
    t_sched: float
    """When the schedule wanted it sent (closed loop: when its sender was free)."""
    t_send: float = math.nan
    t_first: float | None = None
    """First chunk carrying a token."""
    t_end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried tokens."""
    chunk_tokens: list[int] = field(default_factory=list)
    """Tokens in each of those chunks (more than one with speculative decoding)."""
    status: str = ""
    """'' while in flight; see the module docstring."""
    detail: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    server_ttft_s: float = 0.0
    queue_s: float = 0.0
    """Time in the prefill worker's queue."""
    router_queue_s: float = 0.0
    """Time in the router's admission queue, waiting for decode room (``router.admission``)."""
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    decode_resident_tokens: int = 0
    """Prompt tokens its decode worker already held (decode-side reuse): their KV was not shipped."""
    accept_len: float = 0.0
    retries: int = 0
    failovers: int = 0
    session: int | None = None
    """agentic: the session this turn belongs to (None: not a session's turn)."""
    turn: int = 0
    """agentic: the turn's number within its session, from 0."""
    output_ids: list[int] = field(default_factory=list)
    """The token ids received, kept only by runners that send them back (``StepRunner.keep_output_ids``)."""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def e2e_s(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_send

    @property
    def num_tokens_received(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last token - first token) / (tokens - 1)."""
        n = self.num_tokens_received
        if n < 2 or self.t_first is None:
            return None
        return (self.chunk_times[-1] - self.t_first) / (n - 1)


@dataclass(slots=True)
class StepRecords:
    step: LoadStep
    window_start_s: float
    window_end_s: float
    records: list[RequestRecord]
    """Every request sent in the step, warm-up included, in send order."""
    elapsed_s: float = 0.0
    """Wall time of the whole step, drain included."""

    @property
    def window_s(self) -> float:
        return self.window_end_s - self.window_start_s

    @property
    def measured(self) -> list[RequestRecord]:
        """Requests scheduled inside the window (by schedule, not actual send time: with open-loop load the
        measured set is fixed by the seed, however late a busy client sends)."""
        return [r for r in self.records if self.window_start_s <= r.t_sched < self.window_end_s]


ProgressFn = Callable[[float, int, int, int], None]
"""on_progress(elapsed_s, num_sent, num_done, num_failed), called every PROGRESS_INTERVAL_S."""


def to_proto(spec: RequestSpec) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(max_tokens=spec.output_len, ignore_eos=True)
    req = generation_pb2.GenerateRequest(request_id=spec.req_id, sampling=sampling)
    if spec.text is not None:
        req.text = spec.text
    else:
        req.token_ids.ids.extend(spec.prompt_ids)
    return req


class StepRunner:
    """Sends one step's load through ``stub`` (a ``GenerationStub`` on a grpc.aio channel)."""

    keep_output_ids = False
    """Keep every token id received in ``RequestRecord.output_ids`` (a runner whose next prompt needs them)."""

    def __init__(self, stub, workload: Workload, cfg: BenchConfig, metadata=(), first_index: int = 0,
                 on_progress: ProgressFn | None = None) -> None:
        self.stub, self.workload, self.cfg, self.metadata = stub, workload, cfg, tuple(metadata)
        self.next_index = first_index
        self.on_progress = on_progress
        self.records: list[RequestRecord] = []
        self.num_done = self.num_failed = 0
        self._t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def run(self, step: LoadStep, warmup_s: float, duration_s: float, step_num: int = 0) -> StepRecords:
        """Run the step; ``step_num`` picks the arrival stream, so every step of a sweep has its own."""
        self._t0 = time.perf_counter()
        end = warmup_s + duration_s
        ticker = asyncio.create_task(self._tick())
        try:
            if step.kind == "concurrency":
                senders = [asyncio.create_task(self._closed_loop(end)) for _ in range(int(step.value))]
                await self._drain(senders, end)
            else:
                await self._drain(await self._open_loop(step, end, step_num), end)
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        if self.on_progress is not None:
            self.on_progress(self.now(), len(self.records), self.num_done, self.num_failed)
        return StepRecords(step, warmup_s, end, self.records, elapsed_s=self.now())

    # -- load shapes ---------------------------------------------------------------------------------------
    async def _open_loop(self, step: LoadStep, end: float, step_num: int) -> list[asyncio.Task]:
        if step.kind == "rps":
            times = poisson_arrivals(step.value, end, self.cfg.seed, step=step_num).tolist()
        else:  # trace: this step replays the whole file from its first entry
            times = [t for t in (self.workload.shape(i)[3] for i in range(len(self.workload))) if t < end]
        tasks = []
        for t in times:
            delay = t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            spec = self.workload.request(self.next_index)
            self.next_index += 1
            rec = self._record(spec, t)
            tasks.append(asyncio.create_task(self._send(rec, spec)))
        return tasks

    async def _closed_loop(self, end: float) -> None:
        while self.now() < end:
            spec = self.workload.request(self.next_index)
            self.next_index += 1
            await self._send(self._record(spec, self.now()), spec)

    async def _drain(self, tasks: list[asyncio.Task], end: float) -> None:
        """Wait for the step's tasks until ``end + drain_timeout_s``, then cancel what is left."""
        if tasks:
            left = max(0.0, end - self.now()) + self.cfg.drain_timeout_s
            _, pending = await asyncio.wait(tasks, timeout=left)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self.records:
            if not rec.status:
                rec.status, rec.detail = DRAIN_TIMEOUT, f"still running {self.cfg.drain_timeout_s:g}s after the window"
                self.num_failed += 1

    async def _tick(self) -> None:
        while self.on_progress is not None:
            self.on_progress(self.now(), len(self.records), self.num_done, self.num_failed)
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    # -- one request -----------------------------------------------------------------------------------
    def _record(self, spec: RequestSpec, t_sched: float) -> RequestRecord:
        rec = RequestRecord(spec.index, spec.input_len, spec.output_len, t_sched)
        self.records.append(rec)
        return rec

    async def _send(self, rec: RequestRecord, spec: RequestSpec) -> None:
        req = to_proto(spec)
        rec.t_send = self.now()
        call = self.stub.Generate(req, metadata=self.metadata, timeout=self.cfg.request_timeout_s)
        try:
            async for chunk in call:
                t = self.now()
                if chunk.token_ids:
                    if rec.t_first is None:
                        rec.t_first = t
                    rec.chunk_times.append(t)
                    rec.chunk_tokens.append(len(chunk.token_ids))
                    if self.keep_output_ids:
                        rec.output_ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    _finish(rec, chunk)
            rec.status = OK if rec.finish_reason in _GOOD_FINISH else (
                f"finish:{rec.finish_reason}" if rec.finish_reason else INCOMPLETE)
        except grpc.aio.AioRpcError as e:
            rec.status, rec.detail = e.code().name, e.details() or ""
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            rec.t_end = self.now()
        self.num_done += 1
        self.num_failed += rec.status != OK


def _finish(rec: RequestRecord, chunk: generation_pb2.GenerateResponse) -> None:
    u, m = chunk.usage, chunk.metrics
    rec.finish_reason = chunk.finish_reason
    rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens = u.prompt_tokens, u.cached_tokens, \
        u.completion_tokens
    rec.server_ttft_s, rec.queue_s, rec.prefill_s = m.ttft_s, m.queue_s, m.prefill_s
    rec.router_queue_s = m.router_queue_s
    rec.kv_transfer_s, rec.kv_transfer_bytes = m.kv_transfer_s, m.kv_transfer_bytes
    rec.decode_resident_tokens = m.decode_resident_tokens
    rec.accept_len, rec.retries, rec.failovers = m.accept_len, m.retries, m.failovers
