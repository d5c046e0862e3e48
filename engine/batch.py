"""One batched forward over several requests, each with a cached prefix in pages.

Every kind of work goes through the same ``ForwardBatch``: a prefill chunk (many new
tokens over a cached prefix), a decode step (one token), speculative verification
(several tokens, optionally a draft tree with its own mask). Tokens of all requests are
flattened to ``[T]``; attention gathers each request's KV slots into a padded
``[B, S_max]`` view with one boolean mask ``[B, 1, Tq_max, S_max]``.

Slots versus positions: a request's token ``j`` (0-based over its whole sequence) lives
in slot ``page_table[j // page_size] * page_size + j % page_size``; its RoPE position is
normally ``j`` but a draft tree gives siblings the same position (depth), so positions
can be passed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass(slots=True)
class BatchRequest:
    """One request's share of a forward."""
    page_table: Sequence[int]
    """Pages holding the request's KV, in order; must cover ``cached_len + len(token_ids)`` tokens."""
    cached_len: int
    """Tokens already in the pages (the prefix this forward attends to)."""
    token_ids: Sequence[int] | torch.Tensor
    """New tokens to run."""
    positions: Sequence[int] | torch.Tensor | None = None
    """RoPE positions of the new tokens; default ``cached_len + arange``."""
    tree_mask: torch.Tensor | None = None
    """``[n_new, n_new]`` bool: which new tokens each new token sees (a draft tree). Default causal."""
    num_logits: int = 1
    """How many trailing new tokens need logits (1 for prefill/decode, all for verification)."""


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    out_slots: torch.Tensor          # [T] long, where each new token's KV is written
    kv_slots: torch.Tensor           # [B, S_max] long, padded with slot 0
    q_index: torch.Tensor            # [B, Tq_max] long into [T] (padding -> 0)
    q_valid: torch.Tensor            # [B, Tq_max] bool
    logits_index: torch.Tensor       # [N] long into [T]: tokens that need logits
    q_lens: list[int]
    kv_lens: list[int]
    max_kv_len: int
    cached_lens: list[int] = field(default_factory=list)
    tree_masks: list[torch.Tensor | None] = field(default_factory=list)
    on_layer_done: Callable[[int], None] | None = field(default=None)
    """Called after each layer's KV is written (layer index): kvtransfer streams from here."""
    _mask: torch.Tensor | None = field(default=None)

    @property
    def single_causal_start(self) -> int | None:
        """For one request with a plain causal mask: its cached length ``c`` (new token i sees keys
        0 .. c + i, and S = c + Tq); None otherwise. Lets the long-context paths mask only the
        [Tq, Tq] block where the future lies instead of building the [Tq, S] mask."""
        if len(self.q_lens) == 1 and self.tree_masks[0] is None:
            return self.cached_lens[0]
        return None

    @property
    def single_fresh(self) -> bool:
        """One request with no cached prefix and a causal mask: attention can skip the gather."""
        return self.single_causal_start == 0

    @property
    def attn_mask(self) -> torch.Tensor:
        """``[B, 1, Tq_max, S_max]`` bool, True = attend; built on first use (at 20k context a 2k chunk's
        mask is 40 MB, and the sparse long-context path never needs it)."""
        if self._mask is None:
            self._mask = self._build_mask()
        return self._mask

    def _build_mask(self) -> torch.Tensor:
        B, tq, smax = len(self.q_lens), max(self.q_lens), self.max_kv_len
        dev = self.kv_slots.device
        mask = torch.zeros(B, 1, tq, smax, dtype=torch.bool, device=dev)
        for b in range(B):
            n, kv_len, c = self.q_lens[b], self.kv_lens[b], self.cached_lens[b]
            # causal: new token i (sequence index c + i) sees keys 0 .. c + i
            m = torch.arange(kv_len, device=dev)[None, :] <= (c + torch.arange(n, device=dev))[:, None]
            tree = self.tree_masks[b]
            if tree is not None:
                m[:, c:] = tree.to(device=dev, dtype=torch.bool)
            mask[b, 0, :n, :kv_len] = m
            mask[b, 0, n:, 0] = True  # padding queries attend to one key: no NaN rows
        return mask

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @property
    def uniform_q(self) -> bool:
        """Every request runs the same number of new tokens (decode steps, verification, one request):
        padding is then a reshape, not a gather."""
        q = self.q_lens
        return q.count(q[0]) == len(q)

    def pad_q(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Tq_max, ...] (a view when ``uniform_q``; do not write to it)."""
        if self.uniform_q:
            return x.reshape(len(self.q_lens), self.q_lens[0], *x.shape[1:])
        return x[self.q_index]

    def unpad_q(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tq_max, ...] -> [T, ...] (requests concatenated in order)."""
        if self.uniform_q:
            return x.reshape(-1, *x.shape[2:])
        return x[self.q_valid]

    @classmethod
    def build(cls, reqs: Sequence[BatchRequest], page_size: int, device: torch.device | str = "cpu"
              ) -> "ForwardBatch":
        if not reqs:
            raise ValueError("empty batch")
        ids, pos, slots, q_lens, kv_lens, logit_idx = [], [], [], [], [], []
        offset = 0
        tables = []
        for r in reqs:
            n = len(r.token_ids)
            if n < 1:
                raise ValueError("every request in a batch needs at least one new token")
            kv_len = r.cached_len + n
            need_pages = -(-kv_len // page_size)
            if len(r.page_table) < need_pages:
                raise ValueError(f"page table of {len(r.page_table)} pages cannot hold {kv_len} tokens "
                                 f"(page_size {page_size})")
            table = torch.as_tensor(list(r.page_table[:need_pages]), dtype=torch.long)
            j = torch.arange(kv_len, dtype=torch.long)
            req_slots = table[j // page_size] * page_size + j % page_size  # [kv_len]
            tables.append(req_slots)
            ids.append(torch.as_tensor(r.token_ids, dtype=torch.long))
            p = (torch.arange(r.cached_len, kv_len, dtype=torch.long) if r.positions is None
                 else torch.as_tensor(r.positions, dtype=torch.long))
            if p.shape[0] != n:
                raise ValueError(f"{p.shape[0]} positions for {n} tokens")
            pos.append(p)
            slots.append(req_slots[r.cached_len:])
            q_lens.append(n)
            kv_lens.append(kv_len)
            k = min(max(r.num_logits, 1), n)
            logit_idx.append(torch.arange(offset + n - k, offset + n, dtype=torch.long))
            offset += n
        B, tq, smax = len(reqs), max(q_lens), max(kv_lens)
        kv_slots = torch.zeros(B, smax, dtype=torch.long)
        q_index = torch.zeros(B, tq, dtype=torch.long)
        q_valid = torch.zeros(B, tq, dtype=torch.bool)
        start = 0
        for b, r in enumerate(reqs):
            n, kv_len = q_lens[b], kv_lens[b]
            kv_slots[b, :kv_len] = tables[b]
            q_index[b, :n] = torch.arange(start, start + n)
            q_valid[b, :n] = True
            if r.tree_mask is not None and tuple(r.tree_mask.shape) != (n, n):
                raise ValueError(f"tree_mask shape {tuple(r.tree_mask.shape)} != ({n}, {n})")
            start += n
        dev = torch.device(device)
        return cls(input_ids=torch.cat(ids).to(dev), positions=torch.cat(pos).to(dev),
                   out_slots=torch.cat(slots).to(dev), kv_slots=kv_slots.to(dev),
                   q_index=q_index.to(dev), q_valid=q_valid.to(dev), logits_index=torch.cat(logit_idx).to(dev),
                   q_lens=q_lens, kv_lens=kv_lens, max_kv_len=smax,
                   cached_lens=[r.cached_len for r in reqs], tree_masks=[r.tree_mask for r in reqs])
