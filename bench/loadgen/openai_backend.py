"""``pdserve bench --backend openai``: the same workloads against any OpenAI-compatible server (pdserve's
HTTP front door, vLLM, SGLang, llama.cpp's server), through ``/v1/completions`` with streaming.

``OpenAIGeneration`` stands in for the gRPC ``GenerationStub``: ``Generate(req)`` returns a call whose
chunks look like ``GenerateResponse`` (token ids, finish_reason, usage), so ``StepRunner`` measures both
backends with one code path. Every request streams with ``stream_options.include_usage``, ``max_tokens``
= the requested output length and ``ignore_eos`` (vLLM's and llama.cpp's extension), greedy. A server
streams text, not token ids: each SSE event of a choice counts as one arrival, its text possibly empty (a token
whose text is not out yet: vLLM's and pdserve's servers send it; the ITL gap, as vLLM's bench counts it) and the finishing event carries the rest of ``usage.completion_tokens``, so tokens received
and TPOT use the server's own token count. HTTP failures become the gRPC status codes the report counts
(429 -> RESOURCE_EXHAUSTED, 504 -> DEADLINE_EXCEEDED, ...).

``server_info`` stands in for ``Admin.GetClusterStatus``: ``/v1/models`` names the model and, on vLLM and
pdserve, its context (``max_model_len``); the vocabulary size must come from ``--vocab-size`` (or use
``--text-prompts``).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import aiohttp
import grpc

from common.reasons import FinishReason
from protos.pdserve.v1 import generation_pb2

GRPC_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
                500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def server_info(session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                      model: str | None) -> dict[str, Any]:
    """{'model', 'max_context', 'vocab_size': None, 'workers': [], 'backend': 'openai'} from /v1/models, or
    {'error': ...}; ``model`` (when given) must be one of the served models."""
    try:
        async with session.get(base_url.rstrip("/") + "/models", headers=_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {body}", "model": model}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}", "model": model}
    cards = body.get("data") or []
    names = [c.get("id") for c in cards]
    if model is not None and names and model not in names:
        raise ValueError(f"--model {model!r} is not served at {base_url} (it serves {names})")
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
    return {"backend": "openai", "base_url": base_url, "model": model or card.get("id"),
            "max_context": card.get("max_model_len"), "vocab_size": None, "page_size": None, "workers": []}


def connector() -> aiohttp.TCPConnector:
    """A new connection per request (``force_close``): llama.cpp's server announces keep-alive and then
    closes the connection after every streamed response, so a pooled connection failed every second request
    of a run ("Can not write request body", "Server disconnected"). A loopback connect costs ~0.1 ms, the
    same for every server measured."""
    return aiohttp.TCPConnector(limit=0, force_close=True)


class OpenAIGeneration:
    """``Generate(req, metadata, timeout)`` over ``POST {base_url}/completions`` (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, api_key: str | None) -> None:
        self.session, self.url, self.model = session, base_url.rstrip("/") + "/completions", model
        self.headers = _headers(api_key)

    def Generate(self, req: generation_pb2.GenerateRequest, metadata=(), timeout: float | None = None
                 ) -> "_Call":
        body = {"model": self.model, "max_tokens": req.sampling.max_tokens, "ignore_eos": req.sampling.ignore_eos,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                "prompt": req.text if req.WhichOneof("prompt") == "text" else list(req.token_ids.ids)}
        return _Call(self, body, {**self.headers, "x-request-id": req.request_id}, timeout)


class _Call:
    """One streaming completion, iterated like a grpc.aio stream (``cancel()`` drops the connection)."""

    def __init__(self, gen: OpenAIGeneration, body: dict, headers: dict, timeout: float | None) -> None:
        self.gen, self.body, self.headers, self.timeout = gen, body, headers, timeout
        self._task: asyncio.Task | None = None

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self._task = asyncio.current_task()
        try:
            async with asyncio.timeout(self.timeout):
                async with self.gen.session.post(self.gen.url, json=self.body, headers=self.headers) as r:
                    if r.status != 200:
                        text = await r.text()
                        raise _error(GRPC_OF_HTTP.get(r.status, grpc.StatusCode.UNKNOWN), f"HTTP {r.status}: "
                                     f"{text[:500]}")
                    async for chunk in _events(r):
                        yield chunk
        except TimeoutError:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s") from None
        except aiohttp.ClientError as e:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from None


async def _events(r: aiohttp.ClientResponse) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """SSE ``data:`` events -> GenerateResponse-shaped chunks (one token per text event; the finish chunk
    holds the tokens the count still lacks)."""
    received, finish, done_sent = 0, "", False
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            err = ev["error"]
            code = err.get("code") if isinstance(err, dict) else None
            raise _error(GRPC_OF_HTTP.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int)
                         else grpc.StatusCode.UNKNOWN, str(err.get("message", err) if isinstance(err, dict) else err))
        for c in ev.get("choices") or []:
            if c.get("text") or not c.get("finish_reason"):  # a token; an empty finishing choice is not one
                received += 1
                yield generation_pb2.GenerateResponse(token_ids=[0])
            finish = c.get("finish_reason") or finish
        usage = ev.get("usage")
        if usage and not done_sent:  # vLLM: an event of its own; llama.cpp: on the finishing choice
            done = generation_pb2.GenerateResponse(finish_reason=finish or FinishReason.LENGTH)
            done.usage.prompt_tokens = usage.get("prompt_tokens") or 0
            done.usage.completion_tokens = usage.get("completion_tokens") or 0
            done.usage.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            done.token_ids.extend([0] * max(0, done.usage.completion_tokens - received))
            done_sent = True
            yield done
    if finish and not done_sent:  # a server that ignores include_usage: the lengths stay unknown (0)
        yield generation_pb2.GenerateResponse(finish_reason=finish)
