"""What a decode worker keeps per request to decode it speculatively.

A request arrives from prefill (``engine.speculative.prefill.prefill_forward``) with:

* ``pages`` holding the target KV of positions ``0..C-1`` (``C = cached_len``, the prompt length)
  and, in the MTP layer's slot of the same pages, the MTP KV of pairs ``0..C-1`` (pair ``i`` =
  input token ``x_{i+1}`` with target hidden ``h_i``, at position ``i``);
* ``output_ids = [x_C]``: the first token, sampled by prefill, not yet in the target KV;
* ``draft_hidden``: the MTP layer's normed output at pair ``C-1`` (its LM-head logits are the
  draft distribution of ``x_{C+1}``); prefill ships it with the KV, ``H`` values. Without it the
  first step verifies the last token alone (one plain step) and its draft extend creates it.

Each speculative step keeps this invariant: after it, ``cached_len`` grew by the number of
emitted tokens, the target KV covers ``0..cached_len-1``, the MTP KV covers pairs
``0..cached_len-1`` computed from *target* hiddens (the draft extend) and ``draft_hidden`` is
the MTP output at pair ``cached_len-1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplerState


@dataclass(slots=True)
class SpecSeq:
    req_id: str
    sampler: SamplerState
    """Sampling params, prompt and output ids (penalties), per-request generator (seed)."""
    pages: list[int]
    """KV pages of every layer, the MTP layer included; grown by ``SpecDecoder`` through its allocator."""
    cached_len: int
    """Tokens in the target KV: ``len(prompt) + len(output) - 1`` (the last token is not run yet)."""
    draft_hidden: torch.Tensor | None
    """``[H]`` MTP output hidden at pair ``cached_len - 1``; None when not known (e.g. a prefill worker that
    ships pages only): the next step is then a plain one whose draft extend creates it."""
    draft_logits: torch.Tensor | None = None
    """``[V]`` fp32 LM-head logits of ``draft_hidden`` when already computed (else recomputed)."""
    finish_reason: str = ""
    """``""`` while running, then ``stop`` or ``length``."""

    @property
    def output_ids(self) -> list[int]:
        return self.sampler.output_ids

    @property
    def last_token(self) -> int:
        return self.sampler.output_ids[-1]
