"""OpenAI's completions and chat-completions JSON <-> the router's ``GenerateRequest`` / ``GenerateResponse``.

Requests: ``parse_completion`` / ``parse_chat`` turn a JSON body into an ``OpenAIRequest`` (a
``GenerateRequest`` plus what shapes the answer) or raise ``ApiError`` (HTTP 400, naming the field). The
fields vLLM accepts beyond OpenAI's are taken too (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``priority``); what the workers cannot do (``n`` > 1, ``best_of``,
``echo``, ``logit_bias``, ``min_tokens`` > 0, tools, ``suffix``) is refused with a 400 that says so rather
than silently ignored. Value checks (ranges, vocabulary, context) are the router's own
(``router.validate``), shared with gRPC.

Responses: ``OutputText`` assembles the answer's text as vLLM does: the text of a final EOS or stop
token id is left out, a stop string and everything after it are cut, and while streaming the last
``len(longest stop string) - 1`` characters are held back so a stop string is never half sent.
``stop_reason`` is the stop string or stop token id that ended the request (None for EOS or length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc

from common.reasons import FinishReason
from protos.pdserve.v1 import generation_pb2
from router.text import Detokenizer, TextCodec
from router.validate import MAX_LOGPROBS

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
}
"""gRPC status of a refused or failed request -> HTTP status (anything else: 500)."""
GRPC_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED}
"""The other way, for the errors only the HTTP layer finds (the metrics count requests by gRPC status)."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 504: "timeout"}
UNSUPPORTED = {"best_of": "best_of > 1", "echo": "echo", "logit_bias": "logit_bias", "suffix": "suffix",
               "tools": "tools", "functions": "functions", "min_tokens": "min_tokens > 0"}
"""Fields the workers cannot honour: a request that sets them (to anything but their no-op value) gets a 400."""
_NOOP = {"best_of": (None, 1), "echo": (None, False), "logit_bias": (None, {}), "suffix": (None, ""),
         "tools": (None, []), "functions": (None, []), "min_tokens": (None, 0)}


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error JSON (``body()``)."""

    def __init__(self, status: int, message: str, param: str | None = None, counted: bool = False,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.counted = counted
        """The router core counted the request already (in its metrics and access log)."""
        self.retry_after_s = retry_after_s
        """Sent as ``Retry-After`` (a refusal under load: 429, or 504 after waiting in the admission queue)."""

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, retry_after_s: int | None = None) -> "ApiError":
        return cls(HTTP_STATUS.get(code, 500), message, counted=True, retry_after_s=retry_after_s)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    @property
    def code(self) -> grpc.StatusCode:
        return GRPC_STATUS.get(self.status, grpc.StatusCode.UNKNOWN)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    request: generation_pb2.GenerateRequest
    """What goes through the router (its request_id is set from ``x-request-id`` by the HTTP layer)."""
    model: str
    """The model the client named ("" if it named none)."""
    chat: bool
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: one last chunk with ``usage`` and no choices."""
    num_logprobs: int | None
    """Top alternatives per token in the answer (None: no logprobs at all)."""


def _get(body: dict, name: str, kind, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ApiError(400, f"{name} must be {getattr(kind, '__name__', kind)}, got {type(v).__name__}", name)
    if kind is float and not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number, got {v}", name)
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ApiError(400, f"{name} must be a list of non-negative integers", name)
    return v


def _sampling(body: dict, max_tokens: int | None) -> generation_pb2.SamplingParams:
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in _NOOP[name]:
            raise ApiError(400, f"{what} is not supported by this server", name)
    if _get(body, "n", int, 1) != 1:
        raise ApiError(400, "n > 1 is not supported: send the request n times (with different seeds)", "n")
    sp = generation_pb2.SamplingParams()
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        sp.max_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):
        v = _get(body, name, float)
        if v is not None:
            setattr(sp, name, v)
    sp.min_p = _get(body, "min_p", float, 0.0)
    sp.frequency_penalty = _get(body, "frequency_penalty", float, 0.0)
    sp.presence_penalty = _get(body, "presence_penalty", float, 0.0)
    top_k = _get(body, "top_k", int, 0)
    if top_k < -1:
        raise ApiError(400, f"top_k must be -1 (off), 0 (off) or positive, got {top_k}", "top_k")
    sp.top_k = max(top_k, 0)
    seed = _get(body, "seed", int)
    if seed is not None:
        sp.seed = seed % 2**64  # OpenAI's seed is signed; the same seed gives the same stream
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    sp.stop.extend(stop)
    sp.stop_token_ids.extend(_int_list(body.get("stop_token_ids") or [], "stop_token_ids"))
    sp.ignore_eos = _get(body, "ignore_eos", bool, False)
    return sp


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    if opts and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    return stream, _get(opts, "include_usage", bool, False)


def _check_logprobs(n: int, name: str) -> int:
    if not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", name)
    return n


def parse_completion(body: dict) -> OpenAIRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    req = generation_pb2.GenerateRequest(priority=max(0, _get(body, "priority", int, 0)))
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        req.token_ids.ids.extend(_int_list(prompt, "prompt"))
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "a batch of prompts is not supported: send one request per prompt", "prompt")
    else:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    req.sampling.CopyFrom(_sampling(body, _get(body, "max_tokens", int)))
    n = _get(body, "logprobs", int)
    if n is not None:
        req.sampling.logprobs = max(1, _check_logprobs(n, "logprobs"))
    stream, usage = _stream_flags(body)
    return OpenAIRequest(req, _get(body, "model", str, ""), False, stream, usage, n)


def chat_messages(body: dict) -> list[dict]:
    """The messages with list contents flattened to text (text parts joined by newlines, as vLLM does)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or any(p.get("type") != "text" for p in content) or \
                    not all(isinstance(t, str) for t in parts):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**m, "content": content})
    return out


def parse_chat(body: dict, prompt_text: str) -> OpenAIRequest:
    """``POST /v1/chat/completions`` once its messages are rendered to ``prompt_text``."""
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    req = generation_pb2.GenerateRequest(text=prompt_text, priority=max(0, _get(body, "priority", int, 0)))
    req.sampling.CopyFrom(_sampling(body, max_tokens))
    n = None
    if _get(body, "logprobs", bool, False):
        n = _check_logprobs(_get(body, "top_logprobs", int, 0), "top_logprobs")
        req.sampling.logprobs = max(1, n)
    elif body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    stream, usage = _stream_flags(body)
    return OpenAIRequest(req, _get(body, "model", str, ""), True, stream, usage, n)


class OutputText:
    """The answer's text as vLLM returns it (see the module docstring), chunk by chunk."""

    def __init__(self, codec: TextCodec | None, sampling: generation_pb2.SamplingParams,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._detok = Detokenizer(codec) if codec is not None else None
        self.stop = list(sampling.stop)
        self._stop_ids = set(sampling.stop_token_ids)
        self._eos = set() if sampling.ignore_eos else set(eos_token_ids)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stop_reason: str | int | None = None

    def add(self, ids: list[int], finish: str) -> str:
        """The new text to send for this chunk (``finish``: its finish_reason, "" while streaming)."""
        if finish == FinishReason.STOP and ids and (ids[-1] in self._stop_ids or ids[-1] in self._eos):
            if ids[-1] in self._stop_ids:
                self.stop_reason = ids[-1]
            ids = ids[:-1]  # the stop token's own text is not part of the answer
        if self._detok is not None:
            self.text += self._detok.step(ids) if ids else ""
            if finish:
                self.text += self._detok.flush()
        end = max(self._sent, len(self.text) - self._holdback)
        if finish:
            end = len(self.text)
            if finish == FinishReason.STOP and self.stop_reason is None and self.stop:
                hits = [(pos, s) for pos, s in ((self.text.find(s), s) for s in self.stop) if pos >= 0]
                if hits:
                    pos, self.stop_reason = min(hits)
                    end = max(pos, self._sent)
                    self.text = self.text[:end]
        delta = self.text[self._sent:end]
        self._sent = end
        return delta


def usage_json(u: generation_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0  # JSON has no -inf (vLLM's clamp)


class Answer:
    """One request's answer in OpenAI's shapes: streamed chunks (``chunk``, ``usage_chunk``) or one
    response at the end (``final``)."""

    def __init__(self, oreq: OpenAIRequest, req_id: str, model: str, created: int, codec: TextCodec | None,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.oreq, self.model, self.created, self.codec = oreq, model, created, codec
        self.id = ("chatcmpl-" if oreq.chat else "cmpl-") + req_id
        self.out = OutputText(codec, oreq.request.sampling, eos_token_ids)
        self.finish: str | None = None
        self.usage = generation_pb2.Usage()
        self._lp: dict = {"content": []} if oreq.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                             "text_offset": []}
        self._offset = 0

    def _token(self, tid: int) -> str:
        return self.codec.decode([tid]) if self.codec is not None else f"token_id:{tid}"

    def _logprobs(self, lps) -> dict:
        """``lps`` in OpenAI's shape (chat: ``content`` entries; completions: parallel lists)."""
        n = self.oreq.num_logprobs or 0
        out: dict = {"content": []} if self.oreq.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                             "text_offset": []}
        for lp in lps:
            tok = self._token(lp.token_id)
            tops = [(self._token(t), _finite(v)) for t, v in list(zip(lp.top_ids, lp.top_logprobs))[:n]]
            if self.oreq.chat:
                out["content"].append({"token": tok, "logprob": _finite(lp.logprob), "bytes": list(tok.encode()),
                                       "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                        for t, v in tops]})
            else:
                out["tokens"].append(tok)
                out["token_logprobs"].append(_finite(lp.logprob))
                out["top_logprobs"].append({**dict(tops), tok: _finite(lp.logprob)})
                out["text_offset"].append(self._offset)
                self._offset += len(tok)
        for k, v in out.items():
            self._lp[k].extend(v)
        return out

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, stream: bool) -> dict:
        c: dict = {"index": 0}
        if self.oreq.chat:
            if stream:
                c["delta"] = {"content": text} if text else {}
            else:
                c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = logprobs
        c["finish_reason"] = finish
        c["stop_reason"] = self.out.stop_reason if finish else None
        return c

    def _envelope(self, choices: list[dict], stream: bool) -> dict:
        kind = ("chat.completion" if self.oreq.chat else "text_completion") + (".chunk" if stream and
                                                                                self.oreq.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def add(self, resp: generation_pb2.GenerateResponse) -> tuple[str, dict | None]:
        """Feed one router response: the new text and its logprobs (OpenAI's shape, None if not asked)."""
        text = self.out.add(list(resp.token_ids), resp.finish_reason)
        lps = self._logprobs(resp.logprobs) if self.oreq.num_logprobs is not None else None
        if resp.finish_reason:
            self.finish = resp.finish_reason
            self.usage.CopyFrom(resp.usage)
        return text, lps

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role (as OpenAI's do); completions have no such chunk."""
        if not self.oreq.chat:
            return None
        return self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], True)

    def chunk(self, resp: generation_pb2.GenerateResponse) -> dict | None:
        """The SSE chunk for one router response (None when it carries no token, no finish and no logprobs). A token
        whose text is not out yet (part of a UTF-8 character, a special token, text held back for a stop string)
        still gets its chunk, with empty text, as vLLM's server sends it: a client sees each token arrive (its TTFT
        and inter-token times are the tokens', not the text's)."""
        text, lps = self.add(resp)
        if not text and not resp.token_ids and not resp.finish_reason and not (lps and any(lps.values())):
            return None
        return self._envelope([self._choice(text, lps, resp.finish_reason or None, True)], True)

    def usage_chunk(self) -> dict:
        return {**self._envelope([], True), "usage": usage_json(self.usage)}

    def final(self) -> dict:
        lps = self._lp if self.oreq.num_logprobs is not None else None
        return {**self._envelope([self._choice(self.out.text, lps, self.finish, False)], False),
                "usage": usage_json(self.usage)}
