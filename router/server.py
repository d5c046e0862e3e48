"""The router's gRPC server: public ``Generation`` and ``Admin`` services over the worker registry.

``RouterServer.start()`` starts the registry (health polls, cache-event streams), sizes the public port's
message limit from the served model (``RouterConfig.max_request_bytes``), binds the port and serves the
standard health service (SERVING once at least one prefill and one decode worker are in rotation) and
server reflection. ``stop()`` drains: health NOT_SERVING and new requests refused (UNAVAILABLE, HTTP 503)
at once, the requests in flight get ``grace_s`` to finish, what is left is ended with UNAVAILABLE saying
the grace period ran out (``GenerateRun.cut_off``); then every background task (aborts to workers
included) is cancelled and awaited and the channels closed.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc._cython import cygrpc  # ExecuteBatchError: gRPC's aio API exports no public name for it
from google.protobuf.message import DecodeError

from common.reasons import Role
from protos import rpc, tls
from common.net import check_bind
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import RouterConfig
from router.core import RouterCore
from router.openai_server import OpenAIServer
from router.relay import relay
from router.validate import RequestError, max_context_of, max_request_bytes

logger = logging.getLogger(__name__)
PUBLIC_SERVICES = ("pdserve.v1.Generation", "pdserve.v1.Admin")


class MalformedRequest:
    """What the lenient deserializer hands ``Generate`` for bytes that are not a GenerateRequest."""

    def __init__(self, error: str) -> None:
        self.error = error


def parse_generate_request(raw: bytes) -> generation_pb2.GenerateRequest | MalformedRequest:
    try:
        return generation_pb2.GenerateRequest.FromString(raw)
    except DecodeError as e:  # grpc would answer UNKNOWN "Unexpected DecodeError"; we say what is wrong
        return MalformedRequest(str(e))


def add_generation_service(servicer: "GenerationServicer", server: grpc.aio.Server) -> None:
    """``add_GenerationServicer_to_server`` with a deserializer that never raises (see MalformedRequest)."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=parse_generate_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Generation", handlers),))
    server.add_registered_method_handlers("pdserve.v1.Generation", handlers)


def retry_trailer(e: RequestError) -> tuple[tuple[str, str], ...]:
    """``retry-after`` (whole seconds) in the trailing metadata of a refusal under load, as HTTP's header."""
    return () if e.retry_after_s is None else (("retry-after", str(e.retry_after_s)),)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request, context):
        core, t0 = self.core, time.monotonic()
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed GenerateRequest: {request.error}")
        try:
            run = await core.open_run(request, context.time_remaining(), t0, "grpc")
        except RequestError as e:
            await context.abort(e.code, e.message, retry_trailer(e))
        context.add_done_callback(lambda ctx: run.abort("rpc ended") if ctx.cancelled() else None)
        with core.admitted():  # until the client took every response or was cut off (router/relay.py)
            try:
                await relay(run, core.observe(run, "grpc"), context.write, core.cfg.stream_write_timeout_s)
            except RequestError as e:
                try:
                    await context.abort(e.code, e.message, retry_trailer(e))
                except cygrpc.ExecuteBatchError:
                    # a client that took no response for stream_write_timeout_s: its last write is still
                    # queued in gRPC's core, so no status can follow it; the call ends with the connection
                    logger.debug("request %s: %s (the client reads nothing: no status sent)", run.req_id, e.message)
                    raise asyncio.CancelledError from None


class AdminServicer(generation_pb2_grpc.AdminServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def GetClusterStatus(self, request, context):
        workers = await self.core.registry.live_status(timeout_s=min(2.0, self.core.cfg.health_timeout_s))
        info = self.core.registry.model_info()
        return generation_pb2.ClusterStatus(workers=workers, model=info.model_dir if info is not None else "")

    async def InjectFault(self, request, context):
        """Forward a fault to one worker (``--fault-injection`` on both): the named one, or the prefill
        worker with the most requests in flight."""
        reg = self.core.registry
        if not self.core.cfg.fault_injection:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "fault injection is off: start the router with --fault-injection")
        if request.kind != "drop-kv":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fault {request.kind!r}: the router "
                                "forwards 'drop-kv' (kill-* faults are signals: pdserve bench sends them)")
        pool = [w for w in reg.workers.values() if w.role == Role.PREFILL and
                (w.name == request.worker_id if request.worker_id else w.healthy and not w.excluded)]
        if not pool:
            await context.abort(grpc.StatusCode.NOT_FOUND if request.worker_id else grpc.StatusCode.UNAVAILABLE,
                                f"no prefill worker {request.worker_id!r}" if request.worker_id
                                else "no healthy prefill worker")
        w = max(pool, key=lambda w: w.inflight)
        try:
            return await w.stub.InjectFault(request, metadata=reg.metadata, timeout=self.core.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"prefill worker {w.name}: {e.details()}")


class RouterServer:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        secret = rpc.cluster_secret(cfg.cluster_secret)
        self.core = RouterCore(cfg, secret)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._health = None
        self._serving: bool | None = None
        self.max_request_bytes = 0
        """The public port's gRPC max receive message length (set by ``start``)."""
        self.http: OpenAIServer | None = None
        """The OpenAI-compatible HTTP front door (``cfg.http_port``; None when off)."""

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        check_bind(self.cfg.host, self.cfg.api_key, "router")
        await self.core.registry.start()  # first: the message size limit comes from the served model
        self.max_request_bytes = await self._request_limit()
        self.server = rpc.make_server(self.cfg.api_key, "API key", max_receive_bytes=self.max_request_bytes)
        add_generation_service(GenerationServicer(self.core), self.server)
        generation_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.core), self.server)
        self._health = rpc.add_health_and_reflection(self.server, PUBLIC_SERVICES)
        self.port = tls.bind(self.server, f"{self.cfg.host}:{self.cfg.port}", self.cfg.tls)
        if self.port == 0:
            await self.core.registry.close()
            raise OSError(f"cannot bind {self.cfg.host}:{self.cfg.port}")
        await self._set_serving(False)
        self.core.registry.on_change = lambda: self.core.spawn(self._update_health())
        await self._update_health()
        await self.server.start()
        if self.cfg.http_port:
            self.http = OpenAIServer(self.core, self.cfg.host, self.cfg.http_port, self.cfg.api_key,
                                     self.max_request_bytes, self.cfg.grace_s, self.cfg.tls)
            try:
                await self.http.start()
            except OSError:
                self.http = None  # it cleaned itself up
                await self.stop()
                raise
        logger.info("router listening on %s (%d prefill, %d decode workers, routing %s)", self.address,
                    len(self.cfg.prefill), len(self.cfg.decode), self.cfg.routing)

    async def _request_limit(self) -> int:
        """``cfg.max_request_bytes``, or derived from the served model's context (``max_request_bytes``):
        as a worker reports it (waiting one health poll), else from ``--model``'s config.json (a router
        with discovery starts before its workers); without either, the generic gRPC limit."""
        if self.cfg.max_request_bytes:
            return self.cfg.max_request_bytes
        info = await self.core.registry.wait_model_info(self.cfg.health_timeout_s) if self.cfg.prefill or \
            self.cfg.decode else None
        max_context = info.max_context if info is not None else max_context_of(self.cfg.model)
        if max_context is None:
            logger.warning("no worker reported the model within %.1fs and --model names none: the public port "
                           "accepts messages of up to %d bytes (set --max-request-bytes to bound them)",
                           self.cfg.health_timeout_s, rpc.MAX_MESSAGE_BYTES)
            return rpc.MAX_MESSAGE_BYTES
        return max_request_bytes(max_context)

    async def _update_health(self) -> None:
        await self._set_serving(self.core.registry.serving() and not self.core.draining)

    async def _set_serving(self, serving: bool) -> None:
        if serving != self._serving:
            self._serving = serving
            await rpc.set_serving(self._health, PUBLIC_SERVICES, serving)

    async def stop(self) -> None:
        if self.server is not None:
            self.core.draining = True
            await self._set_serving(False)
            logger.info("draining: not admitting, %d requests in flight get %gs", self.core.inflight,
                        self.cfg.grace_s)
            cut = await self.core.drain(self.cfg.grace_s)
            if cut:
                logger.warning("drain: %d requests did not finish within %gs and were ended", cut, self.cfg.grace_s)
            await asyncio.gather(self.server.stop(grace=1.0),
                                 self.http.stop() if self.http is not None else asyncio.sleep(0))
        await self.core.close(timeout_s=self.cfg.rpc_timeout_s)
        await self.core.registry.close()

