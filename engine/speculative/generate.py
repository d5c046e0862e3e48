"""In-process speculative generation over an ``engine.offline.Engine``'s model and pool.

The smallest complete loop with MTP speculation, for tests, benchmarks and ``pdserve run``:
chunked prefill of each request (``prefill_forward``: target forward, then the chunk's MTP pass), the first
token sampled as the plain engine does, then ``SpecDecoder.step`` over every running request
until all finish; pages are freed when a request finishes.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from common.reasons import FinishReason
from engine.offline import Engine, GenerationResult
from engine.sampling import SamplerState, SamplingParams, sample
from engine.speculative.config import SpecConfig
from engine.speculative.cost import DraftCostModel
from engine.speculative.decoder import SpecDecoder
from engine.speculative.metrics import SpecMetrics
from engine.speculative.oracle import OracleDrafts
from engine.speculative.prefill import PrefillChunk, prefill_forward
from engine.speculative.seq import SpecSeq

logger = logging.getLogger(__name__)


class SpecRunResult(NamedTuple):
    results: list[GenerationResult]
    metrics: SpecMetrics


class SpecEngine:
    """Speculative ``generate`` over ``engine``'s model and KV pool (its MTP layer's KV included)."""

    def __init__(self, engine: Engine, spec: SpecConfig, oracle: OracleDrafts | None = None,
                 cost_model: DraftCostModel | None = None) -> None:
        """``oracle``: benchmark mode, drafts from the target's greedy continuation (``engine.speculative.oracle``);
        ``cost_model``: each step's draft length from measured step times (``engine.speculative.cost``)."""
        self.engine, self.spec = engine, spec
        self.model, self.cfg, self.pool = engine.model, engine.cfg, engine.pool
        self.decoder = SpecDecoder(self.model, self.pool, spec, self.cfg.eos_token_ids, oracle=oracle,
                                   cost_model=cost_model)

    @property
    def metrics(self) -> SpecMetrics:
        return self.decoder.metrics

    def _finish_reason(self, seq: SpecSeq) -> str:
        p, tok = seq.sampler.params, seq.last_token
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.cfg.eos_token_ids):
            return FinishReason.STOP
        return FinishReason.LENGTH if len(seq.output_ids) >= p.max_tokens else ""

    def prefill(self, seq: SpecSeq, prompt_ids: Sequence[int]) -> None:
        """Chunked target prefill, each chunk followed by its MTP pass; samples the first token."""
        n = len(prompt_ids)
        while seq.cached_len < n:
            c = seq.cached_len
            chunk = list(prompt_ids[c:c + self.engine.chunk_size])
            self.decoder.grow_pages(seq, c + len(chunk))
            last = c + len(chunk) == n  # an inner chunk's next token is the prompt's; the last one samples it
            [res] = prefill_forward(self.model, self.pool,
                                    [PrefillChunk(seq.pages, c, chunk, None if last else prompt_ids[c + len(chunk)],
                                                  draft=last)],
                                    lambda logits, _: sample(logits, [seq.sampler]).token_ids.tolist())
            seq.cached_len += len(chunk)
        seq.output_ids.append(res.next_token)
        seq.finish_reason = self._finish_reason(seq)
        if not seq.finish_reason:
            seq.draft_hidden, seq.draft_logits = res.draft_hidden, res.draft_logits

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[GenerationResult]:
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        limit = self.cfg.max_position_embeddings
        for p, sp in zip(prompts, plist):
            if not p:
                raise ValueError("empty prompt")
            if len(p) + sp.max_tokens + self.spec.num_step_slots > limit:
                raise ValueError(f"prompt ({len(p)}) + max_tokens ({sp.max_tokens}) + draft slots "
                                 f"({self.spec.num_step_slots}) exceeds the context ({limit})")
        seqs = [SpecSeq(f"req-{i}", SamplerState(sp, list(p)), [], 0, None)
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        try:
            for s, p in zip(seqs, prompts):
                self.prefill(s, p)
            running = [s for s in seqs if not s.finish_reason]
            while running:
                self.decoder.step(running)
                running = [s for s in running if not s.finish_reason]
        finally:
            for s in seqs:
                if s.pages:
                    self.pool.allocator.free(s.pages)
                    s.pages = []
        return [GenerationResult(s.req_id, list(p), list(s.output_ids), s.finish_reason)
                for s, p in zip(seqs, prompts)]


def run_speculative(model, cfg, prompts: Sequence[Sequence[int]], params: SamplingParams, spec: SpecConfig | str,
                    kv_dtype: str = "float32", page_size: int = 16, num_pages: int | None = None) -> SpecRunResult:
    """What ``pdserve run --speculative 3/1/4`` calls: generate and report the acceptance metrics."""
    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    if num_pages is None:
        longest = max(len(p) for p in prompts) + params.max_tokens + spec.num_step_slots
        num_pages = max(64, len(prompts) * (longest // page_size + 2))
    eng = SpecEngine(Engine(model, cfg, kv_dtype=kv_dtype, page_size=page_size, num_pages=num_pages), spec)
    results = eng.generate(prompts, params)
    logger.info("speculative %s: accept_len %.3f over %d verify steps", spec, eng.metrics.accept_len,
                eng.metrics.num_verify_steps)
    return SpecRunResult(results, eng.metrics)
