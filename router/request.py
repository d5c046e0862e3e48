# over 400 lines: one request's whole life in order: reservation, prefill, KV transfer, decode stream, retries, failover.
"""One ``Generate`` call through the cluster. Lifecycle::

    VALIDATED ──Reserve on a decode worker (next one on RESOURCE_EXHAUSTED)──> RESERVED
        (every decode worker full, or others already waiting: the request waits in the router's admission
         queue, ``router.admission``, until room frees or its deadline passes, then tries again)
    RESERVED ──Prefill on the chosen prefill worker, KV shipped to the reservation──> PREFILLED
        (first token streamed to the client at once; a prefill that fails before it - worker gone,
         queue full, transfer failed - is retried once, preferably on another worker, with a fresh
         reservation under a new internal id)
    PREFILLED ──Decode stream, forwarded chunk by chunk──> FINISHED (last chunk: finish_reason, usage, metrics)
    any state ──client cancel / deadline / worker error──> ABORTED: Abort(req_id) to every worker that saw it

The decode worker is always called, even when the first token already ends the request (EOS, stop
token, max_tokens == 1): it answers with a finish chunk and frees the reservation itself.

Conditional disaggregation: when the prompt is shorter than ``local_prefill_below``, reservation and
prefill are skipped: ``Decode(local_prefill=True)`` goes straight to the best decode worker, which
prefills the prompt itself (no transfer) and streams the first token as its first chunk. A decode
worker whose status says ``info['local_prefill'] == '0'`` is never asked to. An aggregated router
(``RouterConfig.aggregated``: no prefill workers) takes this path for every prompt; when no decode worker
can prefill, the request ends UNAVAILABLE saying why (never silently refused for want of a prefill worker).
A decode worker that refuses a local prefill for room (RESOURCE_EXHAUSTED before any token: ``max_running``, a
short pool) is passed over for the next one, as a full reservation is; none left sends the request to the
admission queue too. A prompt larger than every decode worker's whole pool is refused at once (it never fits).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Coroutine, Protocol

import grpc

from common.reasons import AbortReason, FinishReason, Role
from protos.pdserve.v1 import generation_pb2, worker_pb2
from router.admission import AdmissionQueue, Rejection, Waiter
from router.config import RouterConfig
from router.policy import PrefillPolicy, order_decode, use_local_prefill
from router.prefix_index import PromptHashes
from router.registry import Registry, Span, Worker
from router.text import Detokenizer, TextCodec
from router.validate import RequestError, ValidRequest

logger = logging.getLogger(__name__)
_RETRIABLE_PREFILL = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Decode stream errors that mean the worker (not the request) failed, or has no room for it after all
(RESOURCE_EXHAUSTED: full between its reservation and the stream): the request resumes elsewhere."""


class Phase(enum.Enum):
    VALIDATED = "validated"
    RESERVED = "reserved"
    PREFILLED = "prefilled"
    FINISHED = "finished"
    ABORTED = "aborted"


def new_req_id(client_req_id: str) -> str:
    """Internal id: unique even when two clients reuse one request_id."""
    suffix = uuid.uuid4().hex
    return f"{client_req_id}.{suffix[:8]}" if client_req_id else suffix[:16]


class RunOwner(Protocol):
    """What a run needs from the router that owns it (``router.core.RouterCore``), so this module never imports
    its owner back."""

    cfg: RouterConfig
    registry: Registry
    policy: PrefillPolicy
    codec: TextCodec | None
    queue: AdmissionQueue

    def page_size(self) -> int: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a tracked background task (awaited or cancelled when the router closes)."""

    async def abort_on(self, w: Worker, req_id: str, why: str) -> None: ...


class GenerateRun:
    def __init__(self, core: RunOwner, valid: ValidRequest, client_req_id: str, priority: int,
                 deadline: float, t_received: float) -> None:
        self.core, self.valid, self.priority = core, valid, priority
        self.original = valid
        """The client's request; ``valid`` becomes prompt + streamed tokens after a failover."""
        self.client_req_id = client_req_id or new_req_id("")
        self.req_id = new_req_id(client_req_id) if client_req_id else self.client_req_id
        self._base_id = self.req_id
        self.emitted: list[int] = []
        """Token ids already streamed to the client (what a failover resumes after)."""
        self.excluded: set[str] = set()
        """Decode workers this request lost mid-stream (not chosen again for it)."""
        self.refused: set[str] = set()
        """Decode workers that had no room for its local prefill: not asked again until it waited for room."""
        self.waiter: Waiter | None = None
        """Its place in the admission queue while it waits for decode room (or tries for it), else None."""
        self._wakes_at_try = 0
        """The admission queue's ``num_wakes`` when its last try began."""
        self.full: list[str] = []
        """"name: why" of each decode worker that refused this request's local prefill for room before any token
        (``DecodeFull``): the next one is tried, none left is RESOURCE_EXHAUSTED (as full reservations are)."""
        self.deadline, self.t0 = deadline, t_received
        self.phase = Phase.VALIDATED
        self.touched: list[tuple[Worker, str]] = []
        """(worker, internal id) pairs that may hold state for this request: aborted unless FINISHED."""
        self.metrics = generation_pb2.RequestMetrics()
        self.cached_tokens = 0
        self.first_token: int | None = None
        self._accept: list[list[float]] = []
        """Per decode attempt: [its worker's accept length so far (cumulative over the request's rounds there),
        the tokens it streamed]."""
        self._detok = Detokenizer(core.codec) if core.codec is not None else None
        self._live_calls: list = []
        self.cutoff: RequestError | None = None
        """Set by ``cut_off`` (a drain's grace period ended): how the request ends."""

    # -- helpers ---------------------------------------------------------------------------------------
    def remaining(self) -> float:
        if self.cutoff is not None:
            raise self.cutoff
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request finished")
        return left

    def short_timeout(self) -> float:
        return min(self.core.cfg.rpc_timeout_s, self.remaining())

    def abort(self, why: str) -> None:
        """Free the request everywhere (idempotent; runs in the background, never blocks the caller)."""
        if self.phase in (Phase.FINISHED, Phase.ABORTED):
            return
        self.phase = Phase.ABORTED
        for call in self._live_calls:
            call.cancel()
        for w, req_id in self.touched:
            self.core.spawn(self.core.abort_on(w, req_id, why))

    def cut_off(self, why: str) -> None:
        """End the request with UNAVAILABLE ``why``: its worker calls are cancelled and raise it where they
        are awaited (``_prefill``, ``_decode``), and so does its next ``remaining()``."""
        self.cutoff = RequestError(grpc.StatusCode.UNAVAILABLE, why)
        for call in list(self._live_calls):
            call.cancel()
        if self.waiter is not None:
            self.core.queue.kick(self.waiter)

    def _response(self, ids: list[int], finish: str = "", logprobs=(), message: str = ""
                  ) -> generation_pb2.GenerateResponse:
        text = self._detok.step(ids) if self._detok is not None and ids else ""
        r = generation_pb2.GenerateResponse(request_id=self.client_req_id, token_ids=ids, text=text,
                                            finish_reason=finish, logprobs=logprobs, message=message)
        if finish:
            if self._detok is not None:
                r.text += self._detok.flush()
            r.usage.prompt_tokens = len(self.original.prompt_ids)
            r.usage.cached_tokens = self.cached_tokens
            r.usage.completion_tokens = len(self.emitted)
            spec = [(a, n) for a, n in self._accept if a > 0 and n > 0]  # failover: weighted by tokens
            self.metrics.accept_len = sum(a * n for a, n in spec) / sum(n for _, n in spec) if spec else 0.0
            r.metrics.CopyFrom(self.metrics)
        return r

    # -- the request -----------------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            while True:
                try:
                    self._wakes_at_try = self.core.queue.num_wakes
                    if self.waiter is None and self.core.queue.busy:  # others wait for room: behind them
                        await self._wait_for_room("others wait for decode room")
                    async with contextlib.aclosing(self._attempt()) as attempt:
                        async for resp in attempt:
                            yield resp
                    self.phase = Phase.FINISHED
                    return
                except NoRoom as e:
                    await self._wait_for_room(e.message)
                except DecodeFull as full:  # nothing streamed, nothing held there: the next decode worker
                    full.worker.refused_at = time.monotonic()
                    self.full.append(full.message)
                    self.refused.add(full.worker.key)
                except DecodeLost as lost:
                    done = self._failover(lost)
                    if done is not None:  # every token was already streamed: only the finish was lost
                        yield done
                        self.phase = Phase.FINISHED
                        return
        except RequestError as e:
            self.abort(e.message)
            raise
        except BaseException:  # cancelled by the client or the deadline, or closed: free the workers
            self.abort(AbortReason.CANCELLED)
            raise
        finally:
            if self.waiter is not None:  # cancelled, expired, cut off or failed while queued
                self.metrics.router_queue_s += self.core.queue.leave(self.waiter)
                self.waiter = None

    async def _wait_for_room(self, why: str) -> None:
        """Wait in the admission queue until this request may try the decode workers again (``router.admission``):
        RESOURCE_EXHAUSTED with a Retry-After when the queue is full, DEADLINE_EXCEEDED at the deadline."""
        self.check_fits()
        q = self.core.queue
        if self.waiter is None:
            self.waiter = q.enter(self, f"no decode worker has room for this request ({why})", self._wakes_at_try)
        else:
            q.no_room(self.waiter)
        self.refused.clear()  # full a moment ago; asked again on the next try
        self.full.clear()
        await q.turn(self.waiter)

    def _admitted(self) -> None:
        """A decode worker took the request: it leaves the admission queue (the next one tries at once)."""
        if self.waiter is not None:
            self.metrics.router_queue_s += self.core.queue.admit(self.waiter)
            self.waiter = None

    def check_fits(self) -> None:
        """RESOURCE_EXHAUSTED at once for a prompt that needs more pages (its first output token included) than
        any healthy decode worker's whole pool: no amount of waiting would make room for it."""
        page = self.core.page_size()
        pools = [w for w in self.core.registry.healthy(Role.DECODE) if w.status is not None and w.status.pages_total]
        if not page or not pools:
            return
        n, big = len(self.valid.prompt_ids), max(pools, key=lambda w: w.status.pages_total)
        need = math.ceil((n + 1) / page)
        if need > big.status.pages_total:
            self.core.queue.metrics.rejected(Rejection.NEVER_FITS)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the prompt ({n} tokens) needs {need} KV pages of {page} tokens, more than any decode "
                               f"worker's whole pool holds (the largest: {big.name}'s {big.status.pages_total} pages): "
                               f"it can never be served")

    async def _attempt(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One reservation + prefill + decode stream. The decode worker counts this request as in flight
        from its reservation to the end of its stream (``holds``), so a burst spreads over the workers."""
        with contextlib.ExitStack() as holds:
            dw, req_id, first = await self._first_token(holds)
            holds.callback(self.core.queue.wake)  # when this request leaves the worker, its pages are free
            if first is not None:
                self.emitted.append(self.first_token)
                if self.metrics.ttft_s == 0:
                    self.metrics.ttft_s = time.monotonic() - self.t0
                yield first
            async with contextlib.aclosing(self._decode(dw, req_id, local=first is None)) as chunks:
                async for resp in chunks:
                    yield resp

    def _failover(self, lost: "DecodeLost") -> generation_pb2.GenerateResponse | None:
        """Resume after a decode worker failed mid-stream: the next attempt prefills the prompt plus the
        tokens already streamed (the prefix cache holds most of it) and decodes the rest elsewhere.
        Greedy output is unchanged; a seeded sampled stream continues with fresh draws."""
        self.core.spawn(self.core.abort_on(lost.worker, lost.req_id, "failed over"))
        done = self.metrics.failovers
        if done >= self.core.cfg.max_failovers:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"{lost.message}; the request's failover budget ({self.core.cfg.max_failovers}) "
                               f"is spent after {len(self.emitted)} streamed tokens")
        self.remaining()  # DEADLINE_EXCEEDED rather than a failover past the deadline
        self.metrics.failovers = done + 1
        self.excluded.add(lost.worker.key)
        left = self.original.max_tokens - len(self.emitted)
        logger.warning("request %s: %s; failing over after %d streamed tokens (%d left, failover %d of %d)",
                       self.client_req_id, lost.message, len(self.emitted), left, done + 1, self.core.cfg.max_failovers)
        if left <= 0:
            return self._response([], FinishReason.LENGTH)
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(self.original.sampling)
        sampling.max_tokens = left
        self.valid = ValidRequest(self.original.prompt_ids + self.emitted, sampling, left)
        self.req_id = f"{self._base_id}.f{done + 1}"
        self.phase = Phase.VALIDATED
        return None

    async def _first_token(self, holds: contextlib.ExitStack
                           ) -> tuple[Worker, str, generation_pb2.GenerateResponse | None]:
        """Reserve + prefill with one retry; returns the decode worker, the internal id in use there and the
        first response (None when the decode worker prefills locally). The decode worker's in-flight count
        is entered into ``holds``."""
        local = self._local_decode_worker()
        if local is not None:
            self._stay_at(local, holds)
            self.touched.append((local, self.req_id))
            self.metrics.prefill_worker = self.metrics.decode_worker = local.name
            return local, self.req_id, None
        tried: set[str] = set()
        for attempt in range(2):
            req_id = self.req_id if attempt == 0 else f"{self.req_id}.retry{attempt}"
            try_holds = contextlib.ExitStack()
            try:
                with try_holds:  # a failed try releases its reservation's count
                    dw, ticket = await self._reserve(req_id, try_holds)
                    self._admitted()
                    pw = self._choose_prefill(tried)
                    first = await self._prefill(pw, req_id, ticket)
                    holds.enter_context(try_holds.pop_all())
                    return dw, req_id, first
            except grpc.aio.AioRpcError as e:
                self.core.spawn(self.core.abort_on(dw, req_id, "prefill failed"))
                self.core.spawn(self.core.abort_on(pw, req_id, "prefill failed"))
                code, msg = e.code(), f"prefill worker {pw.name}: {e.details()}"
                if attempt == 0 and code in _RETRIABLE_PREFILL and self.deadline > time.monotonic():
                    if code is grpc.StatusCode.UNAVAILABLE:
                        await self.core.registry.confirm_failure(pw, msg)
                    logger.warning("request %s: %s (%s); retrying once", self.client_req_id, msg, code.name)
                    tried.add(pw.key)
                    self.metrics.retries += 1
                    continue
                raise RequestError(code, msg) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _stay_at(w: Worker, holds: contextlib.ExitStack) -> None:
        """Count this request at decode worker ``w`` until ``holds`` closes: its call there is a ``Span`` of
        two RPCs (Reserve, then the Decode stream) with the prefill in between."""
        holds.callback(w.track(Span()).end)

    def _local_decode_worker(self) -> Worker | None:
        """Conditional disaggregation: the decode worker to prefill this (short) prompt itself, if any. An
        aggregated router has no other way: no such worker is ``RequestError`` UNAVAILABLE."""
        n, cfg = len(self.valid.prompt_ids), self.core.cfg
        if n >= cfg.local_prefill_below and not cfg.aggregated:
            return None
        page = max(1, self.core.page_size())
        order = order_decode([w.candidate() for w in self._decode_workers()],
                             math.ceil((n + self.valid.max_tokens) / page))
        for c in order:
            if use_local_prefill(n, cfg, c):
                return self.core.registry.workers[c.worker_id]
        if cfg.aggregated and self.full:
            raise _no_room(self.full)
        if cfg.aggregated:
            names = ", ".join(self.core.registry.workers[c.worker_id].name for c in order)
            why = f"decode workers {names} do not prefill prompts themselves" if order else "no healthy decode worker"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"this cluster has no prefill workers (aggregated) "
                               f"and {why}")
        return None

    def _decode_workers(self) -> list[Worker]:
        ws = [w for w in self.core.registry.healthy(Role.DECODE)
              if w.key not in self.excluded and w.key not in self.refused]
        now = time.monotonic()
        return [w for w in ws if w.suspended_until <= now] or ws  # a recently stalled one only as a last resort

    async def _reserve(self, req_id: str, holds: contextlib.ExitStack) -> tuple[Worker, worker_pb2.TransferTicket]:
        """A reservation on the best decode worker that has room (the next one on RESOURCE_EXHAUSTED); the
        chosen worker counts the request from the moment it is asked (``holds``)."""
        reg = self.core.registry
        page = max(1, self.core.page_size())
        need = math.ceil((len(self.valid.prompt_ids) + self.valid.max_tokens) / page)
        cands, cfg = [w.candidate() for w in self._decode_workers()], self.core.cfg
        resident = {}  # decode-side reuse: the prompt tokens each decode worker already holds (its cache events)
        if cfg.decode_residency_tokens and page > 1 and len(cands) > 1:
            blocks = reg.decode_index.match(PromptHashes(self.valid.prompt_ids, page), [c.worker_id for c in cands])
            resident = {k: n * page for k, n in blocks.items() if n}
        order = order_decode(cands, need, resident, cfg.decode_residency_tokens, cfg.decode_residency_max_credit)
        if not order and self.full:
            raise _no_room(self.full)
        if not order:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        full, failed = [], []
        for c in order:
            w = reg.workers[c.worker_id]
            req = worker_pb2.ReserveRequest(request_id=req_id, num_tokens=len(self.valid.prompt_ids),
                                            max_new_tokens=self.valid.max_tokens, prompt_ids=self.valid.prompt_ids)
            self.touched.append((w, req_id))
            try:
                with contextlib.ExitStack() as asking:  # a refused or failed reservation releases its count
                    self._stay_at(w, asking)  # concurrent requests see this one while it is being reserved
                    resp = await w.stub.Reserve(req, metadata=reg.metadata, timeout=self.short_timeout())
                    holds.enter_context(asking.pop_all())
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    w.refused_at = time.monotonic()
                    full.append(f"{w.name}: {e.details()}")
                    continue
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.remaining()  # our own deadline first
                    failed.append(f"{w.name}: {e.code().name} {e.details()}")
                    self.core.spawn(reg.confirm_failure(w, e.details() or e.code().name))
                    continue
                raise RequestError(e.code(), f"decode worker {w.name} refused the reservation: {e.details()}") from e
            self.phase = Phase.RESERVED
            self.metrics.decode_worker = w.name
            self.metrics.decode_resident_tokens = resp.ticket.resident_tokens  # not shipped: already there
            return w, resp.ticket
        if full:
            raise _no_room(full + failed)
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker answered: " + "; ".join(failed))

    def _choose_prefill(self, tried: set[str]) -> Worker:
        reg = self.core.registry
        healthy = reg.healthy(Role.PREFILL)
        pool = [w for w in healthy if w.key not in tried] or healthy
        if not pool:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        page = self.core.page_size()
        prompt = PromptHashes(self.valid.prompt_ids, page) if page else None
        choice = self.core.policy.choose([w.candidate() for w in pool], prompt, reg.index)
        return reg.workers[choice.worker_id]

    async def _prefill(self, pw: Worker, req_id: str, ticket) -> generation_pb2.GenerateResponse:
        req = worker_pb2.PrefillRequest(request_id=req_id, token_ids=self.valid.prompt_ids,
                                        sampling=self.valid.sampling,
                                        ticket=ticket, priority=self.priority)
        self.touched.append((pw, req_id))
        self.metrics.prefill_worker = pw.name
        call = pw.track(pw.stub.Prefill(req, metadata=self.core.registry.metadata, timeout=self.remaining()))
        self._live_calls.append(call)
        pw.live_calls.add(call)
        try:
            r = await call
        except asyncio.CancelledError:
            if self.cutoff is not None:
                raise self.cutoff from None
            if call not in pw.dropped_calls:
                raise
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"left the rotation during the call ({pw.last_error or 'unhealthy'})"
                                       ) from None
        finally:
            pw.live_calls.discard(call)
            pw.dropped_calls.discard(call)
            self._live_calls.remove(call)
        self.phase = Phase.PREFILLED
        self.first_token = r.first_token
        self.cached_tokens = r.cached_tokens
        m = self.metrics
        m.queue_s, m.prefill_s, m.kv_transfer_s, m.kv_transfer_bytes = r.queue_s, r.prefill_s, r.transfer_s, \
            r.transfer_bytes
        lps = [r.first_logprob] if self.valid.sampling.logprobs and r.HasField("first_logprob") else []
        return self._response([r.first_token], logprobs=lps)

    async def _taken(self, call) -> None:
        """A decode worker that takes a local prefill says so at once (its initial metadata): the request leaves the
        admission queue then, not after the prefill. One that refuses it ends the call (raised by the stream)."""
        await call.initial_metadata()
        if not call.done():
            self._admitted()

    async def _decode(self, dw: Worker, req_id: str, local: bool) -> AsyncIterator[generation_pb2.GenerateResponse]:
        prefix = [] if local else [self.first_token]
        req = worker_pb2.DecodeRequest(request_id=req_id, prompt_ids=self.valid.prompt_ids, output_prefix=prefix,
                                       sampling=self.valid.sampling, local_prefill=local,
                                       transfer_timeout_s=min(self.core.cfg.transfer_timeout_s, self.remaining()))
        call = dw.stub.Decode(req, metadata=self.core.registry.metadata, timeout=self.remaining())
        self._live_calls.append(call)
        chunks, stall = call.__aiter__(), self.core.cfg.decode_stall_timeout_s
        attempt = [0.0, 0]
        self._accept.append(attempt)
        try:
            if local and self.waiter is not None:
                await self._taken(call)
            while True:
                left = self.remaining()
                try:
                    async with asyncio.timeout(min(stall, left)):  # no task per chunk, unlike wait_for
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    if left <= stall:  # the request's deadline bound this wait, not the stall limit: the event
                        # loop's timers may fire a little early (uvloop's are whole milliseconds), so do not ask
                        # the clock again, and never suspend a healthy worker for the client's deadline
                        call.cancel()
                        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           "deadline exceeded before the request finished") from None
                    call.cancel()
                    self.core.registry.suspend(dw, f"a decode stream stalled {stall:g}s", seconds=stall)
                    self.core.spawn(self.core.registry.confirm_failure(dw, f"decode stream stalled {stall:g}s"))
                    raise DecodeLost(dw, req_id,
                                     f"decode worker {dw.name}: no token for {stall:g}s (stalled)") from None
                ids = list(chunk.token_ids)
                if ids and self.metrics.ttft_s == 0:  # local prefill: the decode worker's first token
                    self.metrics.ttft_s = time.monotonic() - self.t0
                self.emitted += ids
                if chunk.accept_len > 0:  # the worker's figure so far: the last one covers every round
                    attempt[0] = chunk.accept_len
                attempt[1] += len(ids)
                yield self._response(ids, chunk.finish_reason, chunk.logprobs, chunk.message)
                if chunk.finish_reason:
                    return
        except grpc.aio.AioRpcError as e:
            if local and e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and not attempt[1]:
                raise DecodeFull(dw, f"{dw.name}: {e.details()}") from None
            if e.code() in _FAILOVER_CODES:
                if e.code() is grpc.StatusCode.UNAVAILABLE:
                    self.core.spawn(self.core.registry.confirm_failure(dw, e.details() or "UNAVAILABLE"))
                raise DecodeLost(dw, req_id, f"decode worker {dw.name}: {e.code().name} {e.details()}") from None
            raise RequestError(e.code(), f"decode worker {dw.name}: {e.details()}") from None
        except asyncio.CancelledError:
            if self.cutoff is None:
                raise
            raise self.cutoff from None
        finally:
            self._live_calls.remove(call)
        raise DecodeLost(dw, req_id, f"decode worker {dw.name} ended the stream without a finish")


class NoRoom(RequestError):
    """No decode worker has room for the request now (RESOURCE_EXHAUSTED): it waits in the admission queue."""


def _no_room(reasons: list[str]) -> NoRoom:
    """RESOURCE_EXHAUSTED naming why each decode worker had no room ("name: why")."""
    return NoRoom(grpc.StatusCode.RESOURCE_EXHAUSTED, "; ".join(reasons))


class DecodeFull(Exception):
    """A decode worker refused a local prefill for room (``max_running``, a short pool) before any token."""

    def __init__(self, worker: Worker, message: str) -> None:
        super().__init__(message)
        self.worker, self.message = worker, message


class DecodeLost(Exception):
    """A decode worker failed mid-stream (died, unreachable, or ended without a finish)."""

    def __init__(self, worker: Worker, req_id: str, message: str) -> None:
        super().__init__(message)
        self.worker, self.req_id, self.message = worker, req_id, message
