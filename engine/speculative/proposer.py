"""Draft proposals from the model's MTP layer, chained EAGLE-style, and the draft extend.

Drafting a step for a request at cached length ``C`` (see ``engine.speculative.seq``):

* depth 1: the draft distribution is already known: LM head of ``draft_hidden`` (MTP pair ``C-1``);
* depth ``d + 1`` (``d = 1 .. num_steps - 1``): one batched MTP forward over the depth-``d``
  frontier, each node fed (its token, the MTP output hidden of its parent's forward) at pair
  position ``C + d - 1``. Chains feed one node per request; trees feed ``eagle_topk`` siblings
  that share the position and must not see each other: node ``r`` of depth ``d`` is written to
  slot ``C + (d - 1) * k + r`` and the attention mask over the draft slots is narrowed to the
  node's own ancestors (EAGLE-2 tree attention).

Those draft MTP entries are never copied back: the step's cached length does not cover them and
the draft extend after verification overwrites slots ``C .. C + m`` with MTP entries computed
from the *target* hiddens of the accepted tokens (sglang's "draft extend"), so the MTP KV of
every committed position equals what a non-speculative MTP pass over the sequence produces.

Tree growth (EAGLE-2, Li et al. 2024): score = cumulative draft log-prob; every frontier node
proposes its top-k children, the k best of the k * k become the next frontier; at the end the
``num_draft_tokens - 1`` best of all candidates are kept. A child's score never exceeds its
parent's (log q <= 0) and ties keep the shallower node first, so the kept set is ancestor-closed.
Chains under sampling draw each draft from the processed draft distribution q (Leviathan et
al. 2023) and keep q for verification; greedy chains take the argmax.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache.pool import KVPool
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, draw, greedy_ids, probs_from_logits
from engine.speculative.config import SpecConfig
from engine.speculative.oracle import OracleDrafts
from engine.speculative.seq import SpecSeq
from engine.speculative.tree import DraftTree

MTP_LAYER = 0
"""GLM checkpoints carry one MTP layer; it is chained for every draft depth."""


def rank_logprobs(logits: torch.Tensor, states: Sequence[SamplerState]
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Draft logits ``[R, V]`` -> (processed probs q ``[R, V]``, log-probs used to rank children ``[R, V]``).

    Greedy rows rank by the raw log-softmax (their q is one-hot); sampling rows by log q, the
    distribution after temperature / top-k / top-p / min-p. Clamped to <= 0 so scores never grow.
    q is None when every row is greedy (nothing is sampled from it)."""
    if all(s.params.greedy for s in states):
        return None, torch.log_softmax(logits.float(), dim=-1).clamp_max(0.0)
    q = probs_from_logits(logits, states)
    greedy = torch.tensor([s.params.greedy for s in states], device=logits.device)
    logp = torch.where(greedy[:, None], torch.log_softmax(logits.float(), dim=-1),
                       torch.log(q.clamp_min(1e-30)))
    return q, logp.clamp_max(0.0)


class MTPProposer:
    """Proposes a ``DraftTree`` per request and keeps the MTP KV in step with the target."""

    def __init__(self, model: GlmForCausalLM, pool: KVPool, spec: SpecConfig) -> None:
        if not model.has_mtp:
            raise ValueError("speculative decoding needs a checkpoint with an MTP layer (num_nextn_predict_layers)")
        self.model, self.pool, self.spec = model, pool, spec
        self.oracle: OracleDrafts | None = None
        """Benchmark mode (``engine.speculative.oracle``): the MTP forwards run, the oracle's tokens are drafted."""

    def draft_logits(self, seqs: Sequence[SpecSeq]) -> torch.Tensor:
        """``[B, V]`` depth-1 draft logits (cached ones reused, the rest from ``draft_hidden``)."""
        missing = [i for i, s in enumerate(seqs) if s.draft_logits is None]
        if missing:
            h = torch.stack([seqs[i].draft_hidden for i in missing])
            with torch.inference_mode():
                lg = self.model.logits(h)  # draft_hidden is already the MTP layer's normed output
            for j, i in enumerate(missing):
                seqs[i].draft_logits = lg[j]
        return torch.stack([s.draft_logits for s in seqs])

    def propose(self, seqs: Sequence[SpecSeq], num_drafts: int | None = None) -> list[DraftTree]:
        """One MTP forward per draft depth beyond the first, batched over ``seqs``. Pages must cover
        ``cached_len + spec.num_step_slots`` tokens. ``num_drafts`` (greedy chains only) drafts fewer than
        ``spec.num_steps`` tokens this step (the draft-length cost model's choice)."""
        spec, k = self.spec, self.spec.eagle_topk
        B = len(seqs)
        states = [s.sampler for s in seqs]
        greedy_chain = spec.is_chain and all(st.params.greedy for st in states)
        if not greedy_chain and (self.oracle is not None or num_drafts not in (None, spec.num_steps)):
            raise ValueError(f"oracle drafts and a per-step draft length need greedy chains (spec {spec})")
        if greedy_chain:
            return self._propose_greedy_chain(seqs, spec.num_steps if num_drafts is None else num_drafts)
        logits = self.draft_logits(seqs)[:, None]                 # [B, F=1, V]
        hidden = torch.stack([s.draft_hidden for s in seqs])[:, None]  # [B, F=1, H]
        dev = logits.device
        f_score = torch.zeros(B, 1, device=dev)                               # frontier scores
        f_cand = torch.full((B, 1), -1, dtype=torch.long, device=dev)         # frontier candidates (-1 = root)
        vis = torch.zeros(B, k, 0, dtype=torch.bool, device=dev)              # frontier -> visible draft slots
        toks, pars, scores, qs = [], [], [], []
        for d in range(1, spec.num_steps + 1):
            F = logits.shape[1]
            row_states = [st for st in states for _ in range(F)]
            q, logp = rank_logprobs(logits.reshape(B * F, -1), row_states)
            if spec.is_chain:
                tok = (greedy_ids(logp) if q is None else draw(q, row_states)).view(B, 1, 1)
                sc = f_score[:, :, None] + logp.gather(1, tok.view(-1, 1)).view(B, 1, 1)
                qs.append(q)
            else:
                top = logp.view(B, F, -1).topk(k, dim=-1)
                tok, sc = top.indices, f_score[:, :, None] + top.values  # [B, F, k]
            base = sum(t.shape[1] for t in toks)
            toks.append(tok.reshape(B, F * k))
            scores.append(sc.reshape(B, F * k))
            pars.append(f_cand[:, :, None].expand(B, F, k).reshape(B, F * k))
            if d == spec.num_steps:
                break
            # next frontier: the k best of this depth's F * k candidates
            sel = scores[-1].topk(k, dim=-1).indices if F * k > k else torch.arange(k, device=dev).expand(B, k)
            parent_f = sel // k                                    # [B, k] which frontier node proposed it
            f_cand, f_score = base + sel, scores[-1].gather(1, sel)
            f_tok = toks[-1].gather(1, sel)
            f_hid = hidden.gather(1, parent_f[:, :, None].expand(B, k, hidden.shape[-1]))
            if d > 1:
                vis = torch.cat([vis.gather(1, parent_f[:, :, None].expand(B, k, vis.shape[-1])),
                                 torch.nn.functional.one_hot(parent_f, k).bool()], dim=-1)
            logits, hidden = self._forward_frontier(seqs, d, f_tok, f_hid, vis)
        return self._select(seqs, toks, pars, scores, qs)

    def _propose_greedy_chain(self, seqs: Sequence[SpecSeq], num_drafts: int) -> list[DraftTree]:
        """Greedy chains (the common case): each depth's draft is the argmax of the draft logits, so
        no log-probs, scores or frontier bookkeeping (what ``propose``'s general walk computes
        for trees and sampling): ~25 fewer tensor ops per depth. With an oracle its token replaces the
        argmax and feeds the next depth's MTP forward."""
        if num_drafts == 0:
            return [DraftTree.chain(s.last_token, []) for s in seqs]
        logits = self.draft_logits(seqs)  # [B, V], B = len(seqs)
        hidden = torch.stack([s.draft_hidden for s in seqs])  # [B, H]
        toks = []
        for d in range(1, num_drafts + 1):
            tok = greedy_ids(logits)[:, None]  # [B, 1]
            if self.oracle is not None:
                tok = torch.tensor([[self.oracle.replace(s, d, t)] for s, t in zip(seqs, tok[:, 0].tolist())],
                                   dtype=tok.dtype, device=tok.device)
            toks.append(tok)
            if d == num_drafts:
                break
            logits, hidden = self._forward_frontier(seqs, d, tok, hidden[:, None], None)
            logits, hidden = logits[:, 0], hidden[:, 0]
        drafts = torch.cat(toks, 1).tolist()
        return [DraftTree.chain(s.last_token, drafts[b]) for b, s in enumerate(seqs)]

    def _forward_frontier(self, seqs: Sequence[SpecSeq], d: int, f_tok: torch.Tensor, f_hid: torch.Tensor,
                          vis: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP over the depth-``d`` frontier ``f_tok [B, k]`` with parent hiddens ``f_hid [B, k, H]``
        -> (logits ``[B, k, V]``, hiddens ``[B, k, H]``) for depth ``d + 1``."""
        B, k = f_tok.shape
        eye = torch.eye(k, dtype=torch.bool) if k > 1 else None
        # a chain's node sits at its own slot's position (the default); siblings share theirs
        reqs = [BatchRequest(s.pages, s.cached_len + (d - 1) * k, ids,
                             positions=[s.cached_len + d - 1] * k if k > 1 else None,
                             tree_mask=eye, num_logits=k) for s, ids in zip(seqs, f_tok.tolist())]
        batch = ForwardBatch.build(reqs, self.pool.page_size, self.pool.device)
        if k > 1 and d > 1:  # siblings share a position: each sees only its own ancestors' draft slots
            for b, s in enumerate(seqs):
                c = s.cached_len
                batch.attn_mask[b, 0, :k, c:c + (d - 1) * k] = vis[b]
        out = self.model.forward_mtp(batch, self.pool, f_hid.reshape(B * k, -1), MTP_LAYER)
        return out.logits.view(B, k, -1), out.hidden.view(B, k, -1)

    def _select(self, seqs: Sequence[SpecSeq], toks: list[torch.Tensor], pars: list[torch.Tensor],
                scores: list[torch.Tensor], qs: list[torch.Tensor | None]) -> list[DraftTree]:
        tok, par, score = torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(scores, 1)  # [B, M], depth order
        if self.spec.is_chain:
            q = torch.stack(qs, 1).cpu() if qs[0] is not None else None  # [B, steps, V], verified on the host
            return [DraftTree.chain(s.last_token, tok[b].tolist(), None if s.sampler.params.greedy else q[b])
                    for b, s in enumerate(seqs)]
        # stable sort: among equal scores the shallower (earlier) candidate wins -> ancestor-closed
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :self.spec.num_drafts]
        tok_l, par_l, order_l = tok.tolist(), par.tolist(), order.tolist()
        return [DraftTree.from_candidates(s.last_token, tok_l[b], par_l[b], order_l[b]) for b, s in enumerate(seqs)]

    def extend(self, seqs: Sequence[SpecSeq], token_ids: Sequence[list[int]], hiddens: Sequence[torch.Tensor]
               ) -> None:
        """Draft extend after verification, one MTP forward: for each request, pairs ``C .. C + m``
        from the emitted tokens ``x_{C+1} .. x_{C+m+1}`` and the target hiddens ``h_C .. h_{C+m}``
        (``[m + 1, H]``) of the accepted path. Sets ``draft_hidden``/``draft_logits`` for the next
        step; ``cached_len`` is still ``C`` on entry (the caller advances it)."""
        reqs = [BatchRequest(s.pages, s.cached_len, ids) for s, ids in zip(seqs, token_ids)]
        batch = ForwardBatch.build(reqs, self.pool.page_size, self.pool.device)
        out = self.model.forward_mtp(batch, self.pool, torch.cat(list(hiddens)), MTP_LAYER)
        last = batch.logits_index
        for i, s in enumerate(seqs):
            s.draft_hidden = out.hidden[last[i]].clone()  # not a view pinning the whole batch's hiddens
            s.draft_logits = out.logits[i].clone()
