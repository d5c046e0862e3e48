"""Request validation: a ``GenerateRequest`` either becomes a ``ValidRequest`` or a ``RequestError`` carrying
the gRPC status code and a message that names the offending value.

Checked against the model the workers serve (``ModelInfo``, from their ``WorkerStatus.info``), so a bad
request never reaches a worker. ``max_tokens == 0`` on the wire means "unset" (proto3 has no presence for
it) and takes the documented default of 16; a Python client refuses ``max_tokens < 1`` before sending.
"""
from __future__ import annotations

import json
import math
import os
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
MAX_TEXT_BYTES_PER_TOKEN = 32
"""A text prompt may hold at most ``max_context * 32`` UTF-8 bytes; a longer one is refused before it is
tokenized. Ordinary text averages ~4 bytes a token, so only a pathological text that would fit the context
is refused (and a text of at most ``max_context`` bytes always fits: every token covers at least one byte)."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` a request may name (the decode worker checks every new token against them)."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
"""Most stop strings, and characters in each (the decode worker decodes that many tokens every step)."""
REQUEST_OVERHEAD_BYTES = 64 * 1024
"""Room for everything in a GenerateRequest but the prompt: the id (128 B), 1024 stop ids (<= 5 KiB),
16 stop strings of 256 characters (<= 17 KiB) and the other sampling fields (~100 B)."""


def max_context_of(model_dir: str | None) -> int | None:
    """``max_position_embeddings`` from a model directory's config.json (what the workers report as
    ``max_context``), or None when there is none to read."""
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            n = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def max_request_bytes(max_context: int) -> int:
    """Largest well-formed GenerateRequest for a model of ``max_context`` tokens: the longest text prompt
    (``max_context * MAX_TEXT_BYTES_PER_TOKEN`` bytes; token ids take at most 5 bytes each) plus
    ``REQUEST_OVERHEAD_BYTES``. The router's public port refuses larger messages."""
    return max_context * MAX_TEXT_BYTES_PER_TOKEN + REQUEST_OVERHEAD_BYTES


class RequestError(Exception):
    """A request the router refuses or could not serve: ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        """Whole seconds the client should wait before retrying (gRPC trailer ``retry-after``, HTTP header
        ``Retry-After``), for a refusal under load; None: not a load refusal."""


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
    def from_status(cls, st: generation_pb2.WorkerStatus) -> ModelInfo:
        """The worker's typed ``WorkerStatus.model``; a worker that predates it: the same fields parsed from
        ``WorkerStatus.info`` (``from_info``). Raises ValueError when neither holds a usable contract."""
        if not st.HasField("model"):
            return cls.from_info(st.info, st.model_hash)
        m = st.model
        if not (m.vocab_size and m.max_context and m.page_size):
            raise ValueError(f"worker status model lacks vocab_size, max_context or page_size: {m}")
        return cls(vocab_size=m.vocab_size, max_context=m.max_context, page_size=m.page_size,
                   eos_token_ids=tuple(m.eos_token_ids), model_dir=m.model_dir, has_tokenizer=m.has_tokenizer,
                   model_hash=st.model_hash)

    @classmethod
    def from_info(cls, info: Mapping[str, str], model_hash: str = "") -> ModelInfo:
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


def _check_request_id(req_id: str) -> None:
    if len(req_id) > MAX_REQUEST_ID_LEN:
        raise _bad(f"request_id is {len(req_id)} characters long; at most {MAX_REQUEST_ID_LEN} are allowed")
    if not _REQUEST_ID.fullmatch(req_id):
        raise _bad("request_id may hold printable ASCII characters only (no spaces or control characters)")


def _check_text(req: generation_pb2.GenerateRequest, model: ModelInfo, has_tokenizer: bool) -> None:
    if not req.text:
        raise _bad("empty prompt: text is empty")
    if not has_tokenizer:
        raise _bad("text prompts need the model's tokenizer.json on the router (python -m router --model DIR); "
                   "send token_ids instead")
    limit = model.max_context * MAX_TEXT_BYTES_PER_TOKEN
    # characters <= UTF-8 bytes: the first test spares the encode of a text that is far too long
    if len(req.text) > limit or len(req.text.encode()) > limit:
        raise _bad(f"prompt text is longer than the context can hold: at most {limit} UTF-8 bytes "
                   f"({model.max_context} tokens x {MAX_TEXT_BYTES_PER_TOKEN}) are tokenized")


def _prompt_ids(req: generation_pb2.GenerateRequest, text_ids: list[int] | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not text_ids:
            raise _bad("empty prompt: the text encodes to no tokens")
        return text_ids
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
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(sp.stop_token_ids)}")
    bad = [t for t in sp.stop_token_ids if t >= model.vocab_size]
    if bad:
        raise _bad(f"stop token id {bad[0]} outside the vocabulary (size {model.vocab_size})")
    if sp.stop:
        if len(sp.stop) > MAX_STOP_STRINGS:
            raise _bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(sp.stop)}")
        if any(not s or len(s) > MAX_STOP_STRING_LEN for s in sp.stop):
            raise _bad(f"stop strings must be 1..{MAX_STOP_STRING_LEN} characters long")
        if not has_stop_checker:
            raise _bad("stop strings need a tokenizer on the workers; use stop_token_ids")


def precheck(req: generation_pb2.GenerateRequest, model: ModelInfo, has_tokenizer: bool) -> None:
    """Every check that needs no prompt token ids, text prompts' length included: what runs before a text
    is tokenized. Raises ``RequestError`` (INVALID_ARGUMENT) on the first problem found."""
    _check_unknown(req, "GenerateRequest")
    _check_unknown(req.sampling, "SamplingParams")
    _check_request_id(req.request_id)
    _check_sampling(req.sampling, model, model.has_tokenizer)
    if req.WhichOneof("prompt") == "text":
        _check_text(req, model, has_tokenizer)


def check_prompt(req: generation_pb2.GenerateRequest, model: ModelInfo,
                 text_ids: list[int] | None = None) -> ValidRequest:
    """The checks on the prompt's token ids (``text_ids``: the encoded text of a text prompt), after
    ``precheck``. Raises ``RequestError`` (INVALID_ARGUMENT) with a human message."""
    ids = _prompt_ids(req, text_ids)
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
    out = generation_pb2.SamplingParams()
    out.CopyFrom(sp)
    out.max_tokens = max_tokens
    return ValidRequest(ids, out, max_tokens)


def validate(req: generation_pb2.GenerateRequest, model: ModelInfo,
             encode: Callable[[str], list[int]] | None = None) -> ValidRequest:
    """``precheck`` + ``check_prompt`` in one call, a text prompt encoded with ``encode`` on this thread
    (the router's server tokenizes off its event loop instead)."""
    precheck(req, model, encode is not None)
    text = req.text if req.WhichOneof("prompt") == "text" else None
    return check_prompt(req, model, encode(text) if text is not None and encode is not None else None)
