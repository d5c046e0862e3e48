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


OnLayerDone = Callable[[int], None]
"""The KV layer handoff, one name everywhere: ``on_layer_done(layer)`` is called on the forward's thread right
after ``layer``'s KV of every request in the batch is written to the pool (the MTP layer is index
``num_hidden_layers``, called after its pass), so the data plane can ship it while the next layer computes
(``kvtransfer.sender.LayerSends``, ``prefill.scheduler``)."""


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
    on_layer_done: OnLayerDone | None = field(default=None)
    """Called after each layer's KV is written (``OnLayerDone``): kvtransfer streams from here."""
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
            # A normal tensor whoever asks first: the model's forward (inference mode) or a caller that edits it
            # before the forward (the tree proposer). A compiled graph guards on its inputs' dispatch keys: an
            # inference tensor one step and a normal one the next compiled the same step's graph twice.
            with torch.inference_mode(False):
                self._mask = self._build_mask()
        return self._mask

    def _build_mask(self) -> torch.Tensor:
        """Vectorised over requests (a per-request loop cost ~6 tensor ops per request per layer-0 call)."""
        B, tq, smax = len(self.q_lens), max(self.q_lens), self.max_kv_len
        dev = self.kv_slots.device
        # causal: new token i of request b (sequence index c_b + i) sees keys 0 .. c_b + i
        qpos = torch.tensor(self.cached_lens, device=dev)[:, None] + torch.arange(tq, device=dev)  # [B, tq]
        mask = torch.arange(smax, device=dev) <= qpos[:, :, None]  # [B, tq, S]
        if self.q_lens.count(tq) != B:  # padding queries attend to key 0 only: no NaN rows
            pad = ~self.q_valid
            mask.masked_fill_(pad[:, :, None], False)
            mask[:, :, 0] |= pad
        for b, tree in enumerate(self.tree_masks):
            if tree is not None:
                n, c = self.q_lens[b], self.cached_lens[b]
                mask[b, :n, c:c + n] = tree.to(device=dev, dtype=torch.bool)
        return mask.unsqueeze(1)

    @property
    def step_mask(self) -> torch.Tensor | None:
        """A decode / verify step's mask ``[B, Tq, S]`` (``attn_mask`` without its head axis), None for one request
        decoding one token: it sees every key."""
        return None if len(self.q_lens) == 1 and self.q_lens[0] == 1 else self.attn_mask[:, 0]

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
        """Vectorised over requests: a fixed ~20 tensor ops whatever the batch size (a per-request loop of
        tensor ops cost 2.9 ms per decode step at 32 requests); Python touches only lengths and page ids."""
        if not reqs:
            raise ValueError("empty batch")
        B = len(reqs)
        q_lens = [len(r.token_ids) for r in reqs]
        cached = [r.cached_len for r in reqs]
        kv_lens = [c + n for c, n in zip(cached, q_lens)]
        need = [-(-kv // page_size) for kv in kv_lens]
        max_pages = max(need)
        flat_pages: list[int] = []
        for r, n, kv, np_ in zip(reqs, q_lens, kv_lens, need):
            if n < 1:
                raise ValueError("every request in a batch needs at least one new token")
            table = r.page_table.tolist() if isinstance(r.page_table, torch.Tensor) else r.page_table
            if len(table) < np_:
                raise ValueError(f"page table of {len(table)} pages cannot hold {kv} tokens "
                                 f"(page_size {page_size})")
            flat_pages.extend(table[:np_])
            flat_pages.extend([0] * (max_pages - np_))
            if r.positions is not None and len(r.positions) != n:
                raise ValueError(f"{len(r.positions)} positions for {n} tokens")
            if r.tree_mask is not None and tuple(r.tree_mask.shape) != (n, n):
                raise ValueError(f"tree_mask shape {tuple(r.tree_mask.shape)} != ({n}, {n})")
        tq, smax, T = max(q_lens), max(kv_lens), sum(q_lens)
        starts = [0] * B
        for b in range(1, B):
            starts[b] = starts[b - 1] + q_lens[b - 1]
        logit_idx: list[int] = []
        for r, s, n in zip(reqs, starts, q_lens):
            k = min(max(r.num_logits, 1), n)
            logit_idx.extend(range(s + n - k, s + n))
        # the small integer inputs travel as ONE host tensor (each torch.tensor call costs ~5 us)
        list_ids = all(isinstance(r.token_ids, (list, tuple)) for r in reqs)
        ints = flat_pages + cached + logit_idx
        if list_ids:
            ints += [t for r in reqs for t in r.token_ids]
        host = torch.tensor(ints, dtype=torch.long)
        o = len(flat_pages)
        pages, cached_t, logits_index = host[:o].view(B, max_pages, 1), host[o:o + B], host[o + B:o + B + len(logit_idx)]
        if list_ids:
            ids = host[o + B + len(logit_idx):]
        else:
            ids = torch.cat([torch.as_tensor(r.token_ids, dtype=torch.long).reshape(-1) for r in reqs])
        # slot of sequence index j = page_table[j // page_size] * page_size + j % page_size; 0 past the end
        # a tensor of its own, row-major (strides (smax, 1)) for every B: a compiled step guards on its inputs'
        # strides (.contiguous() keeps a one-row slice's page-padded row stride: a context off the page boundary
        # compiled a second one-request graph) and, for a view, on its base's sizes (a flat reshape's view
        # compiled 4 graphs after warm-up in test_no_compile_after_warm_up)
        kv_slots = (pages * page_size + torch.arange(page_size, dtype=torch.long)).view(B, -1)[:, :smax] \
            .clone(memory_format=torch.contiguous_format)
        if kv_lens.count(smax) != B:
            kv_len_t = (cached_t + torch.tensor(q_lens, dtype=torch.long))[:, None]
            kv_slots = kv_slots.masked_fill(torch.arange(smax)[None, :] >= kv_len_t, 0)
        # sequence index of each new token: cached_len + i
        ar = torch.arange(tq, dtype=torch.long)
        seq_idx = cached_t[:, None] + ar  # [B, tq]
        if q_lens.count(tq) == B:  # decode steps, verification: no padding
            q_valid = torch.ones(B, tq, dtype=torch.bool)
            q_index = torch.arange(T, dtype=torch.long).view(B, tq)
            seq_flat = seq_idx.view(-1)
            out_slots = kv_slots.gather(1, seq_idx).view(-1)
        else:
            q_valid = ar[None, :] < torch.tensor(q_lens, dtype=torch.long)[:, None]  # [B, tq]
            q_index = (torch.tensor(starts, dtype=torch.long)[:, None] + ar).masked_fill_(~q_valid, 0)
            seq_flat = seq_idx[q_valid]
            out_slots = kv_slots.gather(1, seq_idx.clamp(max=smax - 1))[q_valid]
        if all(r.positions is None for r in reqs):
            pos = seq_flat
        else:
            pos = torch.cat([seq_flat[s:s + n] if r.positions is None else torch.as_tensor(r.positions, dtype=torch.long)
                             for r, s, n in zip(reqs, starts, q_lens)])
        dev = torch.device(device)
        if dev.type != "cpu":  # built on the host, moved once each
            ids, pos, out_slots, kv_slots, q_index, q_valid, logits_index = (
                t.to(dev) for t in (ids, pos, out_slots, kv_slots, q_index, q_valid, logits_index))
        return cls(input_ids=ids, positions=pos, out_slots=out_slots, kv_slots=kv_slots, q_index=q_index,
                   q_valid=q_valid, logits_index=logits_index, q_lens=q_lens, kv_lens=kv_lens, max_kv_len=smax,
                   cached_lens=cached, tree_masks=[r.tree_mask for r in reqs])
