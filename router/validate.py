"""Request validation: a ``GenerateRequest`` either becomes a ``ValidRequest`` or a ``RequestError`` carrying
the gRPC status code and a message that names the offending value.

Checked against the model the workers serve (``ModelInfo``, from their ``WorkerStatus.info``), so a bad
request never reaches a worker. ``max_tokens == 0`` on the wire means "unset" (proto3 has no presence for
it) and takes the documented default of 16; a Python client refuses ``max_tokens < 1`` before sending.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import grpc
from google.protobuf import unknown_fields

from protos.pdserve.v1 import generation_pb2

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_REQUEST_ID_LEN = 128
"""Longest client ``request_id``. The router's internal ids append at most ``MAX_ID_SUFFIX_LEN`` characters
to it and the KV data plane carries ids of up to 256 (``kvtransfer.protocol.MAX_REQ_ID_LEN``)."""
MAX_ID_SUFFIX_LEN = 9 + 4 + 7
"""``.<8 hex>`` (each call) + ``.f<n>`` (failover n <= 99, see ``RouterConfig.max_failovers``) + ``.retry1``
(the prefill retry); see ``router.request``."""
_REQUEST_ID = re.compile(r"[\x21-\x7e]*")
"""Printable ASCII without spaces: one byte a character, nothing that rewrites a log line."""


class RequestError(Exception):
    """A request the router refuses or could not serve: ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router knows about the served model (from any healthy worker's status)."""
    vocab_size: int
    max_context: int
    page_size: int
    eos_token_ids: tuple[int, ...]
    model_dir: str = ""
    has_tokenizer: bool = False
    model_hash: str = ""

    @classmethod
    def from_info(cls, info: Mapping[str, str], model_hash: str = "") -> "ModelInfo":
        """Parse ``WorkerStatus.info``; raises ValueError naming a missing or malformed key."""
        try:
            eos = tuple(int(x) for x in info.get("eos_token_ids", "").split(",") if x.strip())
            return cls(vocab_size=int(info["vocab_size"]), max_context=int(info["max_context"]),
                       page_size=int(info["page_size"]), eos_token_ids=eos, model_dir=info.get("model_dir", ""),
                       has_tokenizer=info.get("has_tokenizer") == "1", model_hash=model_hash)
        except (KeyError, ValueError) as e:
            raise ValueError(f"worker status info lacks a valid {e}: {dict(info)}") from None


@dataclass(frozen=True, slots=True)
class ValidRequest:
    prompt_ids: list[int]
    sampling: generation_pb2.SamplingParams
    """A copy with ``max_tokens`` resolved (never 0)."""
    max_tokens: int


def _bad(msg: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def _check_unknown(msg, what: str) -> None:
    nums = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
    if nums:
        raise _bad(f"{what} has fields this server does not understand (numbers {nums}); "
                   "upgrade the server or drop them")


def _check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise _bad(f"request_id is {len(rid)} characters long; at most {MAX_REQUEST_ID_LEN} are allowed")
    if not _REQUEST_ID.fullmatch(rid):
        raise _bad("request_id may hold printable ASCII characters only (no spaces or control characters)")


def _prompt_ids(req: generation_pb2.GenerateRequest, encode: Callable[[str], list[int]] | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not req.text:
            raise _bad("empty prompt: text is empty")
        if encode is None:
            raise _bad("text prompts need the model's tokenizer.json on the router (python -m router --model DIR); "
                       "send token_ids instead")
        ids = encode(req.text)
        if not ids:
            raise _bad("empty prompt: the text encodes to no tokens")
        return ids
    if kind == "token_ids" and req.token_ids.ids:
        return list(req.token_ids.ids)
    raise _bad("empty prompt: set text or a non-empty token_ids")


def _check_sampling(sp: generation_pb2.SamplingParams, model: ModelInfo, has_stop_checker: bool) -> None:
    if sp.HasField("temperature") and (math.isnan(sp.temperature) or sp.temperature < 0):
        raise _bad(f"temperature must be >= 0, got {sp.temperature}")
    if sp.HasField("top_p") and not 0.0 < sp.top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {sp.top_p}")
    if not 0.0 <= sp.min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {sp.min_p}")
    if sp.top_k > model.vocab_size:
        raise _bad(f"top_k must be <= the vocabulary size {model.vocab_size}, got {sp.top_k}")
    if sp.HasField("repetition_penalty") and not (sp.repetition_penalty > 0 and math.isfinite(sp.repetition_penalty)):
        raise _bad(f"repetition_penalty must be > 0, got {sp.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(sp, name)
        if not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {v}")
    if sp.logprobs > MAX_LOGPROBS:
        raise _bad(f"logprobs must be <= {MAX_LOGPROBS}, got {sp.logprobs}")
    bad = [t for t in sp.stop_token_ids if t >= model.vocab_size]
    if bad:
        raise _bad(f"stop token id {bad[0]} outside the vocabulary (size {model.vocab_size})")
    if sp.stop:
        if any(not s for s in sp.stop):
            raise _bad("stop strings must be non-empty")
        if not has_stop_checker:
            raise _bad("stop strings need a tokenizer on the workers; use stop_token_ids")


def validate(req: generation_pb2.GenerateRequest, model: ModelInfo,
             encode: Callable[[str], list[int]] | None = None) -> ValidRequest:
    """Raises ``RequestError`` (INVALID_ARGUMENT) with a human message on the first problem found."""
    _check_unknown(req, "GenerateRequest")
    _check_unknown(req.sampling, "SamplingParams")
    _check_request_id(req.request_id)
    ids = _prompt_ids(req, encode)
    if max(ids) >= model.vocab_size:
        bad = next(t for t in ids if t >= model.vocab_size)
        raise _bad(f"token id {bad} outside the vocabulary (size {model.vocab_size})")
    if len(ids) >= model.max_context:
        raise _bad(f"prompt of {len(ids)} tokens is longer than the context ({model.max_context} tokens, "
                   "one of which must be left for the answer)")
    sp = req.sampling
    max_tokens = sp.max_tokens or DEFAULT_MAX_TOKENS
    if len(ids) + max_tokens > model.max_context:
        raise _bad(f"max_tokens {max_tokens} is beyond the context: prompt {len(ids)} + {max_tokens} > "
                   f"{model.max_context} tokens")
    _check_sampling(sp, model, model.has_tokenizer)
    out = generation_pb2.SamplingParams()
    out.CopyFrom(sp)
    out.max_tokens = max_tokens
    return ValidRequest(ids, out, max_tokens)
