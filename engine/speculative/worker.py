"""``SpecDecoder`` behind the decode scheduler's ``Speculator`` protocol.

The scheduler (``decode.scheduler``) owns its tasks, appends the tokens a step returns and checks
stop conditions itself; this adapter keeps only what speculation adds per request (the draft
state and acceptance counters) in a table keyed by ``req_id``, dropped as soon as a request no
longer comes with the running batch. A task needs ``req_id``, ``pages`` (grown in place by the
scheduler's ``ensure_pages``), ``cached_len`` and ``sampler`` (its ``output_ids`` end with the last
token); an optional ``draft_hidden`` attribute (shipped by prefill) saves the first plain step.

Pool pressure degrades instead of failing the batch: a task the pool cannot give its draft slots
takes a plain step; one that cannot get a single slot gets no tokens and its ``abort_reason`` is
set, which the scheduler reaps at its next step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.config import ModelConfig
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.speculative.config import SpecConfig
from engine.speculative.cost import DraftCostConfig, DraftCostModel
from engine.speculative.decoder import SpecDecoder
from engine.speculative.metrics import SpecStats
from engine.speculative.seq import SpecSeq

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Draft:
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    num_steps: int = 0
    num_accepted: int = 0


class MTPSpeculator:
    def __init__(self, model: GlmForCausalLM, cfg: ModelConfig, pool: KVPool, spec: SpecConfig,
                 cost_model: DraftCostModel | None = None) -> None:
        self.spec = spec
        self.decoder = SpecDecoder(model, pool, spec, cfg.eos_token_ids, cost_model=cost_model)
        self._drafts: dict[str, _Draft] = {}

    @property
    def metrics(self):
        return self.decoder.metrics

    def step(self, tasks: Sequence[Any], ensure_pages: Callable[[Any, int], None]) -> list[list[int]]:
        """One speculative round over ``tasks``; returns the new tokens of each (untruncated)."""
        self._drafts = {t.req_id: self._drafts.get(t.req_id) or _Draft(getattr(t, "draft_hidden", None))
                        for t in tasks}
        live, seqs = [], []
        for t in tasks:
            try:
                ensure_pages(t, t.cached_len + 1)
            except PoolExhausted as e:
                if hasattr(t, "abort_reason") and not t.abort_reason:
                    t.abort_reason = f"decode KV pool exhausted: {e}"
                continue
            d = self._drafts[t.req_id]
            live.append(t)
            seqs.append(SpecSeq(t.req_id, t.sampler, t.pages, t.cached_len, d.hidden, d.logits))
        if not seqs:
            return [[] for _ in tasks]
        by_id = {t.req_id: t for t in live}

        def grow(seq: SpecSeq, num_tokens: int) -> None:
            task = by_id[seq.req_id]
            ensure_pages(task, num_tokens)
            seq.pages = task.pages

        self.decoder.ensure_pages = grow
        results = self.decoder.step(seqs, emit=False)
        out: dict[str, list[int]] = {}
        for t, s, r in zip(live, seqs, results):
            d = self._drafts[t.req_id]
            d.hidden, d.logits = s.draft_hidden, s.draft_logits
            d.num_steps += 1
            d.num_accepted += r.num_accepted
            t.cached_len = s.cached_len
            if r.logprobs:
                t._pending_logprobs = r.logprobs
            out[t.req_id] = r.token_ids
        return [out.get(t.req_id, []) for t in tasks]

    @property
    def last_verify_s(self) -> float:
        return self.decoder.last_verify_s

    def stats(self) -> SpecStats:
        """Acceptance counters and rates of every request so far, for draft depths 1..num_steps."""
        return self.metrics.snapshot(self.spec.num_steps)

    def accept_len(self, task: Any) -> float:
        """This request's tokens per verify step so far (1 + mean accepted drafts)."""
        d = self._drafts.get(task.req_id)
        return 1.0 + d.num_accepted / d.num_steps if d is not None and d.num_steps else 0.0


def make_speculator(model: GlmForCausalLM, cfg: ModelConfig, pool: KVPool, spec: str | SpecConfig,
                    cost_model: bool = False) -> MTPSpeculator:
    """What ``decode.server`` calls for ``--speculative STEPS/TOPK/DRAFT_TOKENS`` (``--spec-cost-model``: each
    step's draft length from ``engine.speculative.cost``)."""
    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    logger.info("MTP speculative decoding %s (%d draft tokens verified per step%s)", spec, spec.num_drafts,
                ", at most: a cost model chooses" if cost_model else "")
    return MTPSpeculator(model, cfg, pool, spec, DraftCostModel(DraftCostConfig(spec.num_steps)) if cost_model else None)
