"""Generate in-process on a paged KV pool (no servers: ``pdserve run``, benchmarks, tests).

``Engine`` is the smallest complete generation loop: chunked prefill of each new request,
then one batched decode step per iteration over every running request, pages allocated as
sequences grow and freed when they finish. The prefill and decode workers build their
schedulers from the same pieces (``GlmForCausalLM.forward``, ``KVPool``, ``sample``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from common.reasons import FinishReason
from engine.batch import BatchRequest, ForwardBatch
from engine.config import ModelConfig
from engine.kvcache import KVLayout, KVPool
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, SamplingParams, sample


@dataclass(slots=True)
class Seq:
    req_id: str
    prompt_ids: list[int]
    sampler: SamplerState
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True, slots=True)
class GenerationResult:
    req_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """``length`` or ``stop``."""


class Engine:
    """In-process generation over one KV pool (used by ``pdserve run`` and tests)."""

    def __init__(self, model: GlmForCausalLM, cfg: ModelConfig, kv_dtype: str = "float32", page_size: int = 16,
                 num_pages: int = 1024, chunk_size: int = 2048) -> None:
        self.model, self.cfg = model, cfg
        self.layout = KVLayout.for_model(cfg, page_size=page_size, kv_dtype=kv_dtype, parallel=model.parallel)
        self.pool = KVPool(self.layout, num_pages, device=model.lm_head.weight.device)
        self.chunk_size = chunk_size

    def _ensure_pages(self, seq: Seq, num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages += self.pool.allocator.alloc(need, seq.req_id)

    def prefill(self, seq: Seq) -> torch.Tensor:
        """Run the prompt in chunks; returns last-token logits [1, V]."""
        ids = seq.prompt_ids
        logits = None
        while seq.cached_len < len(ids):
            chunk = ids[seq.cached_len:seq.cached_len + self.chunk_size]
            self._ensure_pages(seq, seq.cached_len + len(chunk))
            batch = ForwardBatch.build([BatchRequest(seq.pages, seq.cached_len, chunk)], self.pool.page_size,
                                       self.pool.device)
            logits = self.model(batch, self.pool).logits
            seq.cached_len += len(chunk)
        return logits

    def _finished(self, seq: Seq, tok: int) -> str:
        p = seq.sampler.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.cfg.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return ""

    def _append(self, seqs: Sequence[Seq], logits: torch.Tensor) -> None:
        res = sample(logits, [s.sampler for s in seqs])
        for s, tok in zip(seqs, res.token_ids.tolist()):
            s.output_ids.append(tok)
            s.sampler.output_ids.append(tok)
            s.finish_reason = self._finished(s, tok)

    def decode_step(self, seqs: Sequence[Seq]) -> None:
        """One batched decode step: each running request's last token through the model, then sample and
        append the next one (sets ``finish_reason`` when a request ends)."""
        for s in seqs:
            self._ensure_pages(s, s.cached_len + 1)
        reqs = [BatchRequest(s.pages, s.cached_len, [s.output_ids[-1]]) for s in seqs]
        logits = self.model(ForwardBatch.build(reqs, self.pool.page_size, self.pool.device), self.pool).logits
        for s in seqs:
            s.cached_len += 1
        self._append(seqs, logits)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        seqs = [Seq(f"req-{i}", list(p), SamplerState(params, list(p))) for i, p in enumerate(prompts)]
        for s in seqs:
            if not s.prompt_ids:
                raise ValueError("empty prompt")
            if len(s.prompt_ids) + params.max_tokens > self.cfg.max_position_embeddings:
                raise ValueError(f"prompt ({len(s.prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"context ({self.cfg.max_position_embeddings})")
        try:
            for s in seqs:
                self._append([s], self.prefill(s))
            running = [s for s in seqs if not s.finish_reason]
            while running:
                self.decode_step(running)
                running = [s for s in running if not s.finish_reason]
        finally:
            for s in seqs:
                if s.pages:
                    self.pool.allocator.free(s.pages)
                    s.pages = []
        return [GenerationResult(s.req_id, s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]
