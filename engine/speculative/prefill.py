"""The MTP layer's share of prefill: fill its KV over the prompt and produce the first draft state.

MTP pair ``i`` (position ``i``, slot ``i`` of the MTP layer, pool layer ``num_hidden_layers``)
needs the *next* token ``x_{i+1}`` and the target hidden ``h_i``. A prefill chunk covering target
positions ``c .. e-1`` has ``h_c .. h_{e-1}`` after its target forward, so its MTP forward runs
pairs ``c .. e-1`` given ``next_token = x_e``: the prompt's next token for an inner chunk (the
prompt is known in full), the first sampled token for the last chunk. One MTP forward per chunk,
right after the chunk's target forward, nothing recomputed.

When ``x_e`` is not known yet (a prompt still streaming in), pass ``next_token=None``: the boundary
pair ``e-1`` is deferred with a **one-token lag** and runs at the head of the next call, which gets
the previous result's ``carry_hidden`` (``h_{e-1}``)::

    chunk 1 (c = 0),  x_e1 unknown:  pairs 0 .. e1-2                      -> carry = h_{e1-1}
    chunk 2 (c = e1), x_e2 unknown:  pairs e1-1 .. e2-2  (carry + chunk)   -> carry = h_{e2-1}
    last chunk + x_n:                pairs c-1 .. n-1                     -> draft_hidden

Cached prefixes: pair ``i`` depends on ``x_0 .. x_{i+1}``, one token past position ``i``. A
prefix cache that matched ``m`` tokens therefore guarantees the MTP KV of pairs ``0 .. m-2`` only:
pair ``m-1`` was written with the ``x_m`` of whichever request filled the page. Either resume at
``c <= m - 1`` (pair ``c-1`` valid; call with ``carry_hidden=None``), or key the cache on token
pairs as sglang's EAGLE radix cache does. Resuming at ``c = m`` with a stale pair ``m-1`` (and
never rewriting it: the page is shared) is safe - a stale MTP entry only lowers the acceptance
of the drafts, verification keeps the output exact.

Every caller (a prefill worker's chunks, a decode worker's local prefill and its recompute of a preempted
request, ``SpecEngine``) runs the whole recipe through ``prefill_forward``: one target forward over the
chunks, the next token sampled for the chunks that end what is known, then the MTP pass above.

Disaggregation: the decode side needs the pages (the MTP layer's KV travels with the target's),
the first token and, optionally, ``draft_hidden`` (``H`` values); without it the decode side's
first step is a plain one (see ``engine.speculative.seq``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from engine.batch import BatchRequest, ForwardBatch, OnLayerDone
from engine.kvcache.pool import KVPool
from engine.models.glm import GlmForCausalLM
from engine.speculative.proposer import MTP_LAYER


@dataclass(slots=True)
class MTPChunk:
    """One request's prefill chunk, after its target forward."""
    pages: Sequence[int]
    cached_len: int
    """Target tokens cached before this chunk (``c``)."""
    token_ids: Sequence[int]
    """The chunk's tokens ``x_c .. x_{e-1}``."""
    hiddens: torch.Tensor
    """``[e - c, H]`` the target's final-normed hiddens of the chunk (``ForwardResult.hidden`` rows)."""
    next_token: int | None = None
    """``x_e``: the prompt's next token (inner chunk) or the first sampled token (last chunk); None defers
    pair ``e-1`` to the next call (one-token lag)."""
    carry_hidden: torch.Tensor | None = None
    """``h_{c-1}`` from the previous chunk's result when its boundary pair is still deferred."""
    draft: bool = True
    """With ``next_token``: compute the MTP output at pair ``e-1`` (the draft state). False: its KV only (an
    inner chunk of a prefill worker, whose draft state nobody reads)."""


class MTPPrefillResult(NamedTuple):
    carry_hidden: torch.Tensor | None
    """``[H]`` pass as ``carry_hidden`` with the next chunk when ``next_token`` was None, else None."""
    draft_hidden: torch.Tensor | None
    """``[H]`` MTP output at pair ``e - 1`` when ``next_token`` was given; after the last chunk this is
    ``SpecSeq.draft_hidden`` (ship it to the decode side with the pages)."""
    draft_logits: torch.Tensor | None
    """``[V]`` its logits (after the last chunk: the depth-1 draft distribution)."""


def _pairs(ch: MTPChunk) -> tuple[int, list[int], torch.Tensor]:
    """-> (first pair position, input tokens, prev hiddens) of the pairs this chunk can run."""
    n = len(ch.token_ids)
    if n < 1 or ch.hiddens.shape[0] != n:
        raise ValueError(f"chunk of {n} tokens with {ch.hiddens.shape[0]} hiddens")
    ids, hid = list(ch.token_ids[1:]), [ch.hiddens[:-1]]
    start = ch.cached_len
    if ch.carry_hidden is not None:
        if ch.cached_len == 0:
            raise ValueError("carry_hidden given for a chunk at position 0")
        ids, hid, start = [int(ch.token_ids[0])] + ids, [ch.carry_hidden[None]] + hid, start - 1
    if ch.next_token is not None:
        ids, hid = ids + [int(ch.next_token)], hid + [ch.hiddens[-1:]]
    return start, ids, torch.cat(hid)


def mtp_prefill_batch(model: GlmForCausalLM, pool: KVPool, chunks: Sequence[MTPChunk]) -> list[MTPPrefillResult]:
    """The MTP pass over the chunks of several requests (pages must already cover the chunk): a KV-only
    pass, and one forward for the last pair of each chunk given its next token."""
    if not model.has_mtp:
        raise ValueError("the model has no MTP layer")
    plans = [_pairs(ch) for ch in chunks]
    # Only a chunk given its next token needs an MTP output, and only at its last pair: every other pair
    # just writes its KV (``mtp_kv``, no attention / MoE / LM head), then one forward runs those last pairs.
    kv_reqs, kv_hid, out_reqs, out_hid, rows = [], [], [], [], {}
    for i, (start, ids, hid) in enumerate(plans):
        n_kv = len(ids) - (chunks[i].next_token is not None and chunks[i].draft)
        if n_kv > 0:
            kv_reqs.append(BatchRequest(chunks[i].pages, start, ids[:n_kv]))
            kv_hid.append(hid[:n_kv])
        if n_kv < len(ids):
            rows[i] = len(out_reqs)
            out_reqs.append(BatchRequest(chunks[i].pages, start + n_kv, ids[n_kv:]))
            out_hid.append(hid[n_kv:])
    if kv_reqs:
        model.mtp_kv(ForwardBatch.build(kv_reqs, pool.page_size, pool.device), pool, torch.cat(kv_hid), MTP_LAYER)
    out = None
    if out_reqs:
        batch = ForwardBatch.build(out_reqs, pool.page_size, pool.device)
        out = model.forward_mtp(batch, pool, torch.cat(out_hid), MTP_LAYER)
        last = batch.logits_index
    results = []
    for i, ch in enumerate(chunks):
        if ch.next_token is None:
            results.append(MTPPrefillResult(ch.hiddens[-1], None, None))
        elif not ch.draft:
            results.append(MTPPrefillResult(None, None, None))
        else:
            j = rows[i]
            results.append(MTPPrefillResult(None, out.hidden[last[j]], out.logits[j]))
    return results


def mtp_prefill(model: GlmForCausalLM, pool: KVPool, pages: Sequence[int], cached_len: int,
                new_token_ids: Sequence[int], hiddens: torch.Tensor, next_token: int | None = None,
                carry_hidden: torch.Tensor | None = None) -> MTPPrefillResult:
    """Single-request form of ``mtp_prefill_batch`` (see the module doc for the chunk contract)."""
    return mtp_prefill_batch(model, pool, [MTPChunk(pages, cached_len, new_token_ids, hiddens, next_token,
                                                     carry_hidden)])[0]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One request's chunk of a batched prefill forward (``prefill_forward``)."""
    pages: Sequence[int]
    """The request's pages; they must already cover ``cached_len + len(token_ids)`` tokens."""
    cached_len: int
    """Tokens already in the KV before this chunk (``c``)."""
    token_ids: Sequence[int]
    """The chunk's tokens ``x_c .. x_{e-1}``."""
    next_token: int | None = None
    """``x_e`` when known (an inner prompt chunk, a recomputed sequence); None: the chunk ends what is known
    and ``x_e`` is sampled from its last logits."""
    draft: bool = False
    """Compute the MTP draft state at pair ``e-1`` (the request speculates next); else the MTP KV only."""


class PrefillChunkResult(NamedTuple):
    next_token: int
    """``x_e``: the chunk's ``next_token`` when given, else the sampled one."""
    draft_hidden: torch.Tensor | None
    """``[H]`` the MTP output at pair ``e-1`` (``SpecSeq.draft_hidden``) when ``draft`` and the model has MTP."""
    draft_logits: torch.Tensor | None
    """``[V]`` its logits (the depth-1 draft distribution), with ``draft_hidden``."""


SampleNext = Callable[[torch.Tensor, list[int]], list[int]]
"""``(logits [k, V], chunk indices) -> k next tokens``: the caller's sampler for the chunks that end what is
known (it records what else it wants from the sampling, log-probabilities say)."""


def prefill_forward(model: GlmForCausalLM, pool: KVPool, chunks: Sequence[PrefillChunk],
                    sample_next: SampleNext | None = None,
                    on_layer_done: OnLayerDone | None = None) -> list[PrefillChunkResult]:
    """Prefill plus MTP KV, the one recipe: a target forward over every chunk, ``sample_next`` over the
    chunks without a ``next_token``, then (a model with an MTP layer) the MTP pass over every chunk given its
    next token (``mtp_prefill_batch``). ``on_layer_done(layer)`` (``engine.batch.OnLayerDone``) is called after each target layer's KV is
    written and, with MTP, once more with the MTP layer's index (``num_hidden_layers``) after its pass."""
    batch = ForwardBatch.build([BatchRequest(c.pages, c.cached_len, c.token_ids) for c in chunks],
                               pool.page_size, pool.device)
    batch.on_layer_done = on_layer_done
    out = model(batch, pool)
    nexts = [c.next_token for c in chunks]
    rows = [i for i, t in enumerate(nexts) if t is None]
    if rows:
        if sample_next is None:
            raise ValueError(f"chunks {rows} have no next_token and no sampler was given")
        for i, tok in zip(rows, sample_next(out.logits[rows], rows)):
            nexts[i] = int(tok)
    if not model.has_mtp:
        return [PrefillChunkResult(t, None, None) for t in nexts]
    offsets = [0, *itertools.accumulate(len(c.token_ids) for c in chunks)]  # each chunk's rows of out.hidden
    mtp = [MTPChunk(c.pages, c.cached_len, c.token_ids, out.hidden[offsets[i]:offsets[i + 1]], nexts[i], draft=c.draft)
           for i, c in enumerate(chunks)]
    res = mtp_prefill_batch(model, pool, mtp)
    if on_layer_done is not None:
        on_layer_done(model.cfg.num_hidden_layers)
    return [PrefillChunkResult(t, r.draft_hidden, r.draft_logits) for t, r in zip(nexts, res)]
