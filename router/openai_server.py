"""The router's OpenAI-compatible HTTP front door (aiohttp, on the router's own event loop).

    GET  /v1/models                     the served model
    POST /v1/completions                prompt: text or token ids
    POST /v1/chat/completions           messages rendered with the model's chat template (router.chat)
    GET  /health   /version   /metrics  open (no API key), like vLLM's

A request goes through exactly the path a gRPC ``Generate`` takes: ``RouterCore.open_run`` (admission,
validation, deadline), then ``RouterCore.observe`` (routing, retries, failover, metrics, access log), streamed
through ``router.relay`` (a slow reader does not hold the decode worker; ``stream_write_timeout_s``); only
the JSON in and out differs (``router.openai_protocol``). The client's deadline is the ``x-request-timeout-s``
header (seconds; the router's ``request_timeout_s`` caps it). A client that disconnects cancels its request:
the handler task is cancelled (aiohttp's ``handler_cancellation``) and the run aborts on every worker. Errors
are OpenAI's error JSON with the gRPC status mapped to HTTP (``openai_protocol.HTTP_STATUS``); an error after
a stream started is sent as one ``data: {"error": ...}`` event before ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import time
from importlib import metadata

from aiohttp import web

from protos.tls import TLSConfig
from router.chat import ChatTemplate, ChatTemplateError
from router.metrics import CONTENT_TYPE
from router.openai_protocol import ApiError, Answer, OpenAIRequest, chat_messages, parse_chat, parse_completion
from router.relay import relay
from router.validate import RequestError

logger = logging.getLogger(__name__)
TIMEOUT_HEADER = "x-request-timeout-s"
REQUEST_ID_HEADER = "x-request-id"
STREAM_TAIL_TIMEOUT_S = 5.0
"""How long the last events of a stream (an error, ``[DONE]``) may wait for a slow reader."""
JSON_BYTES_PER_REQUEST_BYTE = 8
"""A JSON body may be this many times the largest GenerateRequest (token ids and escapes take room)."""


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class OpenAIServer:
    def __init__(self, core, host: str, port: int, api_key: str | None, max_request_bytes: int,
                 grace_s: float, tls: TLSConfig | None = None) -> None:
        self.core, self.host = core, host
        self._ssl = tls.http_context() if tls is not None else None
        self.scheme = "https" if tls is not None else "http"
        self._bind_port = 0 if port == -1 else port
        self.port = 0
        self._token = api_key.encode() if api_key else None
        self._chat: ChatTemplate | None = None
        self._chat_dir: str | None = None
        app = web.Application(client_max_size=max_request_bytes * JSON_BYTES_PER_REQUEST_BYTE,
                              middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._bind_port, ssl_context=self._ssl)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise OSError(e.errno, f"cannot bind the HTTP port {self.host}:{self._bind_port} ({e.strerror}): "
                          "--http-port 0 turns it off, -1 picks a free port") from None
        self.port = self._runner.addresses[0][1]
        logger.info("OpenAI-compatible HTTP on %s://%s/v1", self.scheme, self.address)

    async def stop(self) -> None:
        """Refuse new connections, give in-flight requests the grace period, then cancel them."""
        await self._runner.cleanup()

    # -- plumbing ---------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """API key on /v1/*, ``x-request-id`` echoed, every error as OpenAI's error JSON."""
        req_id = request.headers.get(REQUEST_ID_HEADER, "")
        try:
            if request.path.startswith("/v1/") and self._token is not None:
                got = request.headers.get("Authorization", "")
                if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), self._token)):
                    raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
            resp = await handler(request)
        except ApiError as e:
            if not e.counted and request.method == "POST":
                self.core.metrics.refused(req_id, e.code, "http", e.message)
            resp = web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = web.json_response(ApiError(e.status, e.reason or "error").body(), status=e.status)
        if req_id and not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = req_id
        return resp

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge as e:
            raise ApiError(413, f"request body over {e.max_size} bytes") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _model_dir(self) -> str:
        """``--model`` of the router, else the workers' model dir ("" while neither is known)."""
        info = self.core.registry.model_info()
        return self.core.cfg.model or (info.model_dir if info is not None else "")

    def _model_name(self) -> str:
        model_dir = self._model_dir()
        return self.core.cfg.served_model_name or os.path.basename(model_dir.rstrip("/")) or "pdserve"

    def _check_model(self, name: str) -> None:
        info = self.core.registry.model_info()
        known = {self._model_name(), self._model_dir(), info.model_dir if info is not None else ""} - {""}
        if name and name not in known:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves {self._model_name()!r})",
                           "model")

    def _chat_template(self) -> ChatTemplate:
        model_dir = self._model_dir()
        if model_dir != self._chat_dir:
            self._chat_dir, self._chat = model_dir, ChatTemplate.from_model_dir(model_dir)
        if self._chat is None:
            raise ApiError(400, f"the model ({model_dir or 'unknown yet'}) has no chat template in its "
                           "tokenizer_config.json: use /v1/completions")
        return self._chat

    # -- endpoints ----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.core.draining:
            return web.Response(status=503, text="shutting down")
        ok = self.core.registry.serving()
        return web.Response(status=200 if ok else 503, text="" if ok else f"no healthy {self.core.cfg.serving_needs}")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.core.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        info = self.core.registry.model_info()
        card = {"id": self._model_name(), "object": "model", "created": 0, "owned_by": "pdserve",
                "root": self._model_dir(),
                "max_model_len": info.max_context if info is not None else None}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        body = await self._json(request)
        oreq = parse_completion(body)
        self._check_model(oreq.model)
        return await self._generate(request, oreq, t0)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        body = await self._json(request)
        self._check_model(body.get("model") if isinstance(body.get("model"), str) else "")
        messages = chat_messages(body)
        try:
            text = self._chat_template().render(messages, add_generation_prompt=body.get("add_generation_prompt",
                                                                                       True))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        return await self._generate(request, parse_chat(body, text), t0)

    async def _generate(self, request: web.Request, oreq: OpenAIRequest, t0: float) -> web.StreamResponse:
        core = self.core
        oreq.request.request_id = request.headers.get(REQUEST_ID_HEADER, "")
        try:
            run = await core.open_run(oreq.request, _timeout(request), t0, "http")
        except RequestError as e:
            raise ApiError.from_grpc(e.code, e.message, e.retry_after_s) from None
        info = core.registry.model_info()
        answer = Answer(oreq, run.client_req_id, oreq.model or self._model_name(), int(time.time()), core.codec,
                        info.eos_token_ids if info is not None else ())
        headers = {REQUEST_ID_HEADER: run.client_req_id}
        if not oreq.stream:
            try:
                async with contextlib.aclosing(core.serve(run, "http")) as responses:
                    async for resp in responses:
                        answer.add(resp)
            except RequestError as e:
                raise ApiError.from_grpc(e.code, e.message, e.retry_after_s) from None
            return web.json_response(answer.final(), headers=headers)
        return await self._stream(request, run, answer, headers)

    async def _stream(self, request: web.Request, run, answer: Answer, headers: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj, timeout_s: float) -> None:
            async with asyncio.timeout(timeout_s):
                await resp.write(_event(obj))

        async def write(r) -> None:  # relay bounds every write (stream_write_timeout_s, the deadline)
            chunk = answer.chunk(r)
            if chunk is not None:
                await resp.write(_event(chunk))

        core, error = self.core, None
        try:
            with core.admitted():  # until the client took every response or was cut off (router/relay.py)
                first = answer.first_chunk()
                if first is not None:
                    await send(first, min(core.cfg.stream_write_timeout_s, run.remaining()))
                await relay(run, core.observe(run, "http"), write, core.cfg.stream_write_timeout_s)
            if answer.oreq.include_usage:
                await send(answer.usage_chunk(), STREAM_TAIL_TIMEOUT_S)
        except RequestError as e:
            error = ApiError.from_grpc(e.code, e.message, e.retry_after_s).body()
        except (TimeoutError, ConnectionResetError) as e:
            run.abort("client stopped reading" if isinstance(e, TimeoutError) else "client went away")
            if request.transport is not None:
                request.transport.close()
            return resp
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            if error is not None:
                await send(error, STREAM_TAIL_TIMEOUT_S)
            await send(b"[DONE]", STREAM_TAIL_TIMEOUT_S)
            await resp.write_eof()
        return resp


def _event(obj) -> bytes:
    """One server-sent event: ``data: <JSON>`` (or ``data: [DONE]``) and a blank line."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _timeout(request: web.Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise ApiError(400, f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}")
    return v
