"""One speculative decoding step for a batch of running requests.

``SpecDecoder.step(seqs)``::

    reserve pages   cached_len + spec.num_step_slots tokens per request (``ensure_pages`` callback);
                    a request the pool cannot serve that far, or without draft state yet (its
                    ``draft_hidden`` is None), verifies its root alone: a plain decode step
    propose         num_steps - 1 MTP forwards -> a DraftTree per request (engine.speculative.proposer)
    verify forward  ONE target forward: root + drafts per request, tree mask, depth positions
    accept          greedy / Leviathan / recursive rejection per request (engine.speculative.verify)
    commit KV       accepted tree nodes off the contiguous chain get their target KV moved to
                    slots C + depth; rejected slots are simply left behind (cached_len does not
                    cover them and the next step overwrites them: no copy, no free)
    emit            append tokens, truncate at EOS / stop ids / max_tokens
    draft extend    one MTP forward over the accepted tokens with target hiddens (running ones)

The page table of a running request is never shrunk: the slack is the next step's draft space.
Pages are returned by whoever owns the request when it finishes.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

import torch

from common.reasons import FinishReason
from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache.pool import KVPool, PoolExhausted
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, apply_penalties, greedy_ids, probs_from_logits
from engine.speculative.config import SpecConfig
from engine.speculative.cost import DraftCostModel
from engine.speculative.metrics import SpecMetrics, step_depths
from engine.speculative.oracle import OracleDrafts
from engine.speculative.proposer import MTPProposer
from engine.speculative.seq import SpecSeq
from engine.speculative.tree import DraftTree
from engine.speculative.verify import VerifyResult, verify_chain_sampling, verify_greedy, verify_tree_sampling

EnsurePages = Callable[[SpecSeq, int], None]
"""``(seq, num_tokens)``: grow ``seq.pages`` in place to hold ``num_tokens``; raise ``PoolExhausted`` if
it cannot (taking nothing)."""

Logprob = tuple[int, float, list[int], list[float]]
"""(token, its logprob, top ids, top logprobs): post-penalty, pre-temperature, as ``engine.sampling.sample``."""


class SpecStepResult(NamedTuple):
    req_id: str
    token_ids: list[int]
    """Tokens emitted this step (appended to the request's output when the step emits)."""
    num_accepted: int
    """Drafts accepted by verification, before truncation at a stop condition."""
    finish_reason: str
    """``""`` (still running), ``stop`` or ``length``; always ``""`` with ``emit=False`` (the caller decides)."""
    logprobs: list[Logprob]
    """One entry per token of ``token_ids`` when the request asked for logprobs, else empty."""


def move_kv(pool: KVPool, layers: range, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the KV of flat slots ``src`` to ``dst`` in ``layers`` (all sources are read before any write)."""
    for layer in layers:
        for name in pool.buffers[layer]:
            flat = pool.flat(layer, name)
            if pool.layout.is_fp8:  # CPU has no fp8 indexing: move the bytes
                flat = flat.view(torch.uint8)
                scale = pool.flat_scale(layer, name)
                scale[dst] = scale[src]
            flat[dst] = flat[src]


def slot_of(pages: Sequence[int], index: int, page_size: int) -> int:
    return pages[index // page_size] * page_size + index % page_size


class SpecDecoder:
    """Runs speculative steps over a pool shared with the target model (MTP KV in layer N)."""

    def __init__(self, model: GlmForCausalLM, pool: KVPool, spec: SpecConfig, eos_token_ids: Sequence[int] = (),
                 ensure_pages: EnsurePages | None = None, metrics: SpecMetrics | None = None,
                 oracle: OracleDrafts | None = None, cost_model: DraftCostModel | None = None) -> None:
        self.model, self.pool, self.spec = model, pool, spec
        self.move_kv: Callable[[KVPool, range, torch.Tensor, torch.Tensor], None] = getattr(model, "move_kv", move_kv)
        """How accepted KV moves: ``move_kv`` here; a tensor-parallel worker's model proxy brings its own, which
        moves it on every rank (a pool write outside a model call, ``worker.ranks``)."""
        self.proposer = MTPProposer(model, pool, spec)
        self.proposer.oracle = oracle
        if cost_model is not None and not spec.is_chain:
            raise ValueError(f"the draft-length cost model needs a chain (eagle_topk 1), got {spec}")
        self.cost_model = cost_model
        """Chooses each greedy step's draft length (``engine.speculative.cost``); None: always ``num_steps``."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.ensure_pages = ensure_pages or self.grow_pages
        self.metrics = metrics or SpecMetrics()
        self.last_verify_s = 0.0
        """Seconds of the last round's target (verify) forward: about one plain decode step's cost."""

    def grow_pages(self, seq: SpecSeq, num_tokens: int) -> None:
        """The default ``ensure_pages``: allocate from the pool, owned by ``seq.req_id``."""
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages += self.pool.allocator.alloc(need, seq.req_id)

    def reserve(self, seq: SpecSeq) -> bool:
        """Pages for this step's drafts; when the pool cannot give them, pages for one token and
        ``False``: the request takes a plain (draft-free) step. ``PoolExhausted`` if not even that."""
        try:
            self.ensure_pages(seq, seq.cached_len + self.spec.num_step_slots)
            return True
        except PoolExhausted:
            self.ensure_pages(seq, seq.cached_len + 1)
            return False

    def step(self, seqs: Sequence[SpecSeq], emit: bool = True) -> list[SpecStepResult]:
        """One speculative round. ``emit=True`` appends the tokens to each request's output and stops at
        EOS / stop ids / max_tokens; ``emit=False`` returns them untruncated for a caller that appends
        and checks stop conditions itself (the draft extend then runs for every request)."""
        if not seqs:
            return []
        for s in seqs:
            if s.finish_reason or not s.output_ids:
                raise ValueError(f"{s.req_id}: only running requests with a first token can be stepped")
        t_step = time.perf_counter()
        room = [self.reserve(s) for s in seqs]
        num_drafts = None  # the spec's
        if self.cost_model is not None and all(s.sampler.params.greedy for s in seqs):
            num_drafts = self.cost_model.choose(len(seqs)).num_drafts
        drafting = [i for i, s in enumerate(seqs) if room[i] and s.draft_hidden is not None and num_drafts != 0]
        trees = [DraftTree.chain(s.last_token, []) for s in seqs]  # no draft state / no room: plain step
        if drafting:
            for i, tree in zip(drafting, self.proposer.propose([seqs[i] for i in drafting], num_drafts)):
                trees[i] = tree
        t0 = time.perf_counter()
        logits, hidden, offsets = self._verify_forward(seqs, trees)
        self.last_verify_s = time.perf_counter() - t0
        logits, verdicts = self._accept(seqs, trees, logits, offsets)
        self._commit_kv(seqs, trees, verdicts)
        results, live, live_ids, live_hidden = [], [], [], []
        num_tested = 0
        for s, tree, v, off in zip(seqs, trees, verdicts, offsets):
            emitted = self._emit(s, v.token_ids) if emit else list(v.token_ids)
            depths = step_depths(tree.depths, tree.children, v.path)
            num_tested += depths.tested_depth
            self.metrics.record(len(v.path), tree.num_nodes - 1, len(emitted), *depths)
            lps = self._logprobs(logits, [off + n for n in [0] + v.path], emitted, s.sampler.params.logprobs)
            results.append(SpecStepResult(s.req_id, emitted, len(v.path), s.finish_reason, lps))
            if not s.finish_reason:
                live.append(s)
                live_ids.append(v.token_ids)
                live_hidden.append(hidden[[off + n for n in [0] + v.path]])  # h_C .. h_{C+m}
        if live:
            self.proposer.extend(live, live_ids, live_hidden)
        for s, r in zip(seqs, results):
            s.cached_len += len(r.token_ids)
        if num_drafts is not None:
            uniform = num_drafts == 0 or len(drafting) == len(seqs)  # else some requests drafted less: untimed
            self.cost_model.observe(len(seqs), num_drafts, time.perf_counter() - t_step if uniform else None,
                                    sum(r.num_accepted for r in results), num_tested)
        return results

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[int], token_ids: list[int], n: int) -> list[Logprob]:
        """Emitted token j was predicted at verify row ``rows[j]`` (the root, then the accepted nodes)."""
        if n == 0:
            return []
        lp = torch.log_softmax(logits[rows[:len(token_ids)]], dim=-1)
        top = lp.topk(n, dim=-1)
        return [(t, float(lp[j, t]), top.indices[j].tolist(), top.values[j].tolist()) for j, t in enumerate(token_ids)]

    def _verify_forward(self, seqs: Sequence[SpecSeq], trees: list[DraftTree]
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        reqs = []
        for s, t in zip(seqs, trees):
            chain = t.is_chain
            reqs.append(BatchRequest(s.pages, s.cached_len, t.tokens,
                                     positions=None if chain else [s.cached_len + d for d in t.depths],
                                     tree_mask=None if chain else t.mask(), num_logits=t.num_nodes))
        batch = ForwardBatch.build(reqs, self.pool.page_size, self.pool.device)
        out = self.model(batch, self.pool)  # every token needs logits: rows of logits == rows of hidden
        offsets = torch.tensor([0] + batch.q_lens[:-1]).cumsum(0).tolist()
        return out.logits, out.hidden, offsets

    def _accept(self, seqs: Sequence[SpecSeq], trees: list[DraftTree], logits: torch.Tensor,
                offsets: list[int]) -> tuple[torch.Tensor, list[VerifyResult]]:
        """logits ``[sum N, V]`` fp32 -> (the penalised logits, the verdict of each request)."""
        if any(s.sampler.params.has_penalties for s in seqs):
            logits = logits.clone()
            for s, t, off in zip(seqs, trees, offsets):
                if s.sampler.params.has_penalties:  # node i's context = output + the drafts on its path
                    states = [SamplerState(s.sampler.params, s.sampler.prompt_ids,
                                           s.output_ids + t.path_tokens(i), s.sampler.generator)
                              for i in range(t.num_nodes)]
                    apply_penalties(logits[off:off + t.num_nodes], states)
        target_ids = greedy_ids(logits).tolist()
        sampling = [b for b, s in enumerate(seqs) if not s.sampler.params.greedy]
        probs = {}
        if sampling:
            rows = [offsets[b] + i for b in sampling for i in range(trees[b].num_nodes)]
            states = [seqs[b].sampler for b in sampling for _ in range(trees[b].num_nodes)]
            p = probs_from_logits(logits[rows], states).cpu()  # per-request walks run on the host
            start = 0
            for b in sampling:
                probs[b] = p[start:start + trees[b].num_nodes]
                start += trees[b].num_nodes
        out = []
        for b, (s, t, off) in enumerate(zip(seqs, trees, offsets)):
            if b not in probs:
                out.append(verify_greedy(t, target_ids[off:off + t.num_nodes]))
            elif t.draft_probs is not None:
                out.append(verify_chain_sampling(t, probs[b], s.sampler.generator))
            else:
                out.append(verify_tree_sampling(t, probs[b], s.sampler.generator))
        return logits, out

    def _commit_kv(self, seqs: Sequence[SpecSeq], trees: list[DraftTree], verdicts: list[VerifyResult]) -> None:
        """Accepted node n at depth d was written to slot ``C + n``; the sequence needs it at ``C + d``."""
        P, src, dst = self.pool.page_size, [], []
        for s, t, v in zip(seqs, trees, verdicts):
            for node in v.path:
                d = t.depths[node]
                if node != d:
                    src.append(slot_of(s.pages, s.cached_len + node, P))
                    dst.append(slot_of(s.pages, s.cached_len + d, P))
        self.metrics.num_moved_kv += len(src)
        if src:
            dev = self.pool.device
            self.move_kv(self.pool, range(self.model.cfg.num_hidden_layers), torch.tensor(src, device=dev),
                    torch.tensor(dst, device=dev))

    def _emit(self, seq: SpecSeq, token_ids: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; sets ``finish_reason``."""
        p = seq.sampler.params
        out = []
        for tok in token_ids:
            seq.output_ids.append(tok)
            out.append(tok)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                seq.finish_reason = FinishReason.STOP
            elif len(seq.output_ids) >= p.max_tokens:
                seq.finish_reason = FinishReason.LENGTH
            if seq.finish_reason:
                break
        return out
