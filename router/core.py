"""``RouterCore``: what every request a router serves shares (config, worker registry, policy, tokenizer,
metrics, the background-task set) and the admission every front door goes through (``open_run``: the gRPC
``Generate`` of ``router.server`` and the OpenAI HTTP API of ``router.openai_server``), then ``serve`` /
``observe`` (a ``GenerateRun`` streamed, counted in flight, measured, logged) and ``drain`` at shutdown. The
admission queue (``router.admission``) is one per router: every request that finds no decode room waits there,
whichever front door it came through, in aggregated mode too.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator

import grpc

from common.reasons import Role
from protos.pdserve.v1 import generation_pb2, worker_pb2
from router.admission import AdmissionQueue, Rejection
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.policy import make_policy
from router.registry import Registry, Worker
from router.request import GenerateRun
from router.text import TextCodec
from router.validate import RequestError, check_prompt, precheck

logger = logging.getLogger(__name__)
TOKENIZER_THREADS = 2
"""Threads that tokenize text prompts (the tokenizer releases the GIL: they use other cores)."""


class RouterCore:
    """What every request shares: config, registry, policy, tokenizer and the background-task set."""

    def __init__(self, cfg: RouterConfig, secret: str | None) -> None:
        self.cfg = cfg
        self.registry = Registry(cfg, secret)
        self.policy = make_policy(cfg)
        self.codec: TextCodec | None = TextCodec.from_model_dir(cfg.model)
        self._codec_tried = cfg.model is not None
        self.inflight = 0
        self.draining = False
        """Set by ``RouterServer.stop``: new requests are refused, the ones in flight run on."""
        self._runs: set[GenerateRun] = set()
        """Runs being served (``observe``): what a drain cuts off when its grace period ends."""
        self._tasks: set[asyncio.Task] = set()
        self.metrics = RouterMetrics()
        self.queue = AdmissionQueue(cfg.max_queued, cfg.queue_aging_s, self.metrics)
        """Requests waiting for decode room; woken when room may have appeared (``Registry.on_room``, a request
        held at a decode worker ending, ``abort_on`` a decode worker)."""
        self.registry.on_room = self.queue.wake
        self._tokenizer = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="router-tokenize")

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count one public request in flight while the block runs (released however it ends)."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def page_size(self) -> int:
        info = self.registry.model_info()
        return info.page_size if info is not None else 0

    def ensure_codec(self, model_dir: str, has_tokenizer: bool) -> None:
        """Load the tokenizer from the workers' model dir the first time it is known (same machine)."""
        if not self._codec_tried and has_tokenizer and model_dir:
            self._codec_tried = True
            self.codec = TextCodec.from_model_dir(model_dir)

    async def encode(self, text: str) -> list[int]:
        """Tokenize on the tokenizer threads: a long text never stalls the event loop (health checks and
        every other stream keep flowing)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, self.codec.encode, text)

    async def open_run(self, request: generation_pb2.GenerateRequest, time_left_s: float | None,
                       t0: float, api: str) -> GenerateRun:
        """Admission and validation shared by every front door (gRPC ``Generate``, the OpenAI HTTP API):
        the request becomes a ``GenerateRun`` whose deadline is the client's (``time_left_s``, None: none)
        capped by ``request_timeout_s``, or ``RequestError`` (counted in the metrics) says why not."""
        try:
            if self.draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down: not admitting new "
                                   "requests")
            if self.inflight >= self.cfg.max_inflight:
                self.metrics.rejected(Rejection.MAX_INFLIGHT)
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router is at its limit of "
                                   f"{self.cfg.max_inflight} requests in flight (queued ones included); retry "
                                   f"later", retry_after_s=self.queue.retry_after_s())
            model = self.registry.model_info()
            if model is None or not self.registry.serving():
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no healthy {self.cfg.serving_needs}: " +
                                   _why_unavailable(self.registry))
            self.ensure_codec(model.model_dir, model.has_tokenizer)
            # everything cheap first: a text is tokenized (off the loop) only once the rest is valid
            precheck(request, model, self.codec is not None)
            with self.admitted():  # a text waiting for the tokenizer holds a slot (the check above saw it free)
                text_ids = await self.encode(request.text) if request.WhichOneof("prompt") == "text" else None
            valid = check_prompt(request, model, text_ids)
            left = math.inf if time_left_s is None else time_left_s
            budget = self.cfg.request_timeout_s if math.isinf(left) else min(left, self.cfg.request_timeout_s)
            run = GenerateRun(self, valid, request.request_id, request.priority, t0 + budget, t0)
            run.check_fits()  # a prompt no decode pool can ever hold is refused now, never queued
            if self.queue.busy:  # it would wait behind them: refused here, before an HTTP stream starts
                self.queue.check_room("requests wait for decode room")
        except RequestError as e:
            self.metrics.refused(request.request_id, e.code, api, e.message)
            raise
        return run

    async def serve(self, run: GenerateRun, api: str) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """``observe(run)`` counted in flight while it runs."""
        with self.admitted():
            async with contextlib.aclosing(self.observe(run, api)) as responses:
                async for resp in responses:
                    yield resp

    async def observe(self, run: GenerateRun, api: str) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """``run.stream()`` observed by the metrics and logged once it ends (one access log line per
        request, however it ends)."""
        obs = self.metrics.start(run, api)
        self._runs.add(run)
        try:
            async with contextlib.aclosing(run.stream()) as responses:
                async for resp in responses:
                    obs.chunk(resp)
                    yield resp
        except RequestError as e:
            obs.end(e.code)
            raise
        except BaseException:
            obs.end(grpc.StatusCode.CANCELLED)
            raise
        finally:
            self._runs.discard(run)
        obs.end(grpc.StatusCode.OK)

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, wait up to ``grace_s`` for the requests in flight, then cut off the rest (each
        ends with UNAVAILABLE saying why). Returns how many were cut off."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # shutdown only: a bounded poll instead of an event on every request
        left = list(self._runs)
        for run in left:
            run.cut_off(f"the server is shutting down: the request did not finish within the {grace_s:g}s "
                        "grace period")
        deadline = time.monotonic() + 5.0  # the cut-off streams end their RPCs with the status
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(left)

    async def abort_on(self, w: Worker, req_id: str, why: str) -> None:
        try:
            await w.stub.Abort(worker_pb2.AbortRequest(request_id=req_id), metadata=self.registry.metadata,
                               timeout=self.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.debug("abort of %s on %s failed (%s): %s", req_id, w.address, why, e.code().name)
            return
        if w.role == Role.DECODE:  # its pages are free now (freed by this abort, or by its stream's end, which
            self.queue.wake()      # the worker handled first): a queued request may fit

    async def close(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for t in list(self._tasks):
            t.cancel()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)


def _why_unavailable(reg: Registry) -> str:
    parts = []
    for w in reg.workers.values():
        state = "in rotation" if w.healthy and not w.excluded else (w.excluded or w.last_error or "not answered yet")
        parts.append(f"{w.role} {w.address}: {state}")
    return "; ".join(parts) or "no workers configured"
