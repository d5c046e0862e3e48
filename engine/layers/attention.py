# over 400 lines: MLA and DSA attention: prefill, decode and the paged paths share the projections and the cache layout.
"""Attention over the paged KV cache: GQA (glm4_moe) and MLA + DSA (glm_moe_dsa)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kvcache.pool import KVPool
from engine.layers import cpu_attention
from engine.layers.cpu_gemv import linear
from engine.layers.fused import FusedProjection
from engine.layers.gqa_graph import GQAArgs
from engine.layers.norm import RMSNorm, rms_norm
from engine.layers.rotary import RotaryTable, apply_half, apply_interleaved

# Below this many queries per request MLA runs absorbed in the latent space (decode,
# verification); above it the latent is expanded to per-head K/V (prefill chunks).
MLA_ABSORB_MAX_Q = 16


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         causal: bool = False) -> torch.Tensor:
    """q ``[B, H, Tq, D]``, k ``[B, Hk, S, D]``, v ``[B, Hk, S, Dv]`` (Hk divides H) -> ``[B, H, Tq, Dv]``."""
    dv = v.shape[-1]
    pad = q.device.type == "cpu" and q.dtype == torch.float32 and dv < q.shape[-1] and q.shape[-2] > MLA_ABSORB_MAX_Q
    if pad:
        # torch's CPU flash kernel needs Dv == D, else SDPA takes the math path (materialised [Tq, S]
        # scores, ~4x slower at 8k): zero-pad V and drop the padding from the output. fp32 prefill
        # only: decode and speculative verify (Tq <= MLA_ABSORB_MAX_Q) keep one kernel so they round
        # alike, and in bf16 the flash kernel's rounding moved a near-tie 190 tokens into a greedy
        # run (tests/engine/test_spec.py), so bf16 (8x slower than fp32 on this AVX2 CPU anyway)
        # stays on the math path.
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out[..., :dv] if pad else out


class GQAAttention(nn.Module):
    """GLM-4.5 attention: optional q/k/v bias, optional per-head QK RMSNorm, partial rotate-half RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d, kvh = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self._fused_qkv = FusedProjection()

    def tokenwise_weights(self, in_norm: RMSNorm) -> GQAArgs:
        """``gqa_tokenwise``'s weights and constants (``in_norm``: the layer's input_layernorm)."""
        cfg = self.cfg
        w, b, _ = self._fused_qkv.weight([(m.weight, m.bias) for m in (self.q_proj, self.k_proj, self.v_proj)])
        qn, kn = (self.q_norm, self.k_norm) if cfg.use_qk_norm else (None, None)
        return GQAArgs(in_norm.weight, in_norm.eps, w, b, None if qn is None else qn.weight,
                       None if kn is None else kn.weight, cfg.rms_norm_eps if qn is None else qn.eps,
                       cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable) -> None:
        """Only the new tokens' K/V, as ``forward`` writes them, without attention (see ``MLAAttention``)."""
        self._store_kv(self.k_proj(x), self.v_proj(x), batch, pool, *rope.lookup(batch.positions, x.dtype))

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, pool: KVPool, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise and rotate the new tokens' projected K ``[T, KVH * D]``, write it and V, return them
        ``[T, KVH, D]``."""
        cfg = self.cfg
        T = k.shape[0]
        k = k.view(T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.use_qk_norm:
            k = self.k_norm(k)
        k = apply_half(k, cos, sin)
        v = v.view(T, cfg.num_key_value_heads, cfg.head_dim)
        pool.write(self.layer_idx, "k", batch.out_slots, k)
        pool.write(self.layer_idx, "v", batch.out_slots, v)
        return k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable,
                topk_prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        T = x.shape[0]
        q, k, v = self._fused_qkv(x, [(m.weight, m.bias) for m in (self.q_proj, self.k_proj, self.v_proj)])
        q = q.view(T, cfg.num_attention_heads, cfg.head_dim)
        if cfg.use_qk_norm:
            q = self.q_norm(q)
        cos, sin = rope.lookup(batch.positions, x.dtype)
        q = apply_half(q, cos, sin)
        k, v = self._store_kv(k, v, batch, pool, cos, sin)
        if (cpu_attention.usable(q, k, v) and min(batch.q_lens) >= cpu_attention.min_tokens()
                and all(m is None for m in batch.tree_masks)):
            # prompt chunks on a CPU (decode and verify steps, a few queries each, take the paged kernel)
            o = self._prompts_attention(q, k, v, batch, pool)
        elif batch.single_fresh and not pool.layout.is_fp8:
            o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
                     cfg.softmax_scale, causal=True)[0].transpose(0, 1)  # [T, H, D]
        elif self.paged_kernel(pool):  # decode / verify: the context read in place by slot
            o = batch.unpad_q(cpu_attention.paged_attention(
                batch.pad_q(q), pool.flat(self.layer_idx, "k"), pool.flat(self.layer_idx, "v"), batch.kv_slots,
                batch.step_mask, cfg.softmax_scale))
        else:
            kk = pool.read(self.layer_idx, "k", batch.kv_slots, x.dtype).transpose(1, 2)  # [B, KVH, S, D]
            vv = pool.read(self.layer_idx, "v", batch.kv_slots, x.dtype).transpose(1, 2)
            qq = batch.pad_q(q).transpose(1, 2)  # [B, H, Tq, D]
            o = batch.unpad_q(sdpa(qq, kk, vv, batch.attn_mask, cfg.softmax_scale).transpose(1, 2))
        return linear(o.reshape(T, -1), self.o_proj.weight, self.o_proj.bias), None

    @staticmethod
    def paged_kernel(pool: KVPool) -> bool:
        """Decode and verify steps attend in ``cpu_attention.paged_attention`` (CPU, a pool it reads as stored, the
        kernel built): eager steps here and the compiled graphs (``gqa_graph.GQAConsts``) alike, so both round the
        same way."""
        return pool.device.type == "cpu" and not pool.layout.is_fp8 and cpu_attention.decode_kernel()

    def _prompts_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                           pool: KVPool) -> torch.Tensor:
        """Causal attention of each request's chunk (its rows of q ``[T, H, D]``) over its own keys, in our CPU
        kernel, one call per request: the chunk's own K/V for a fresh prompt, else its pages (the cached prefix,
        or fp8 KV as decode steps will read it) -> ``[T, H, D]``."""
        outs, s = [], 0
        for b, (n, cached, kv_len) in enumerate(zip(batch.q_lens, batch.cached_lens, batch.kv_lens)):
            if cached or pool.layout.is_fp8:
                slots = batch.kv_slots[b, :kv_len]
                kb = pool.read(self.layer_idx, "k", slots, q.dtype)
                vb = pool.read(self.layer_idx, "v", slots, q.dtype)
            else:
                kb, vb = k[s:s + n], v[s:s + n]
            outs.append(cpu_attention.causal_attention(q[s:s + n], kb, vb, self.cfg.softmax_scale))
            s += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def dsa_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of each row's ``k`` best keys in a TOTAL order: by score, equal scores by
    position (the earlier key first); returned in position order (ascending), so the attention over them sums
    in an order that does not depend on last-bit differences between scores either (a GEMM over 1 row and
    over 6 rounds differently; compiled bf16 verify steps of several requests reordered their keys).

    ``scores.topk`` alone leaves ties to the selection algorithm, which picks differently for rows of
    different lengths or with different masked (-inf) tails: a decode step's row [S] and a verify step's
    row [S + drafts] chose different keys among equal scores, so speculation was not lossless once the
    context outgrew ``index_topk`` (exact ties are common: a key whose every head dot product is negative
    scores exactly 0 after the ReLU). With the total order a query's selection depends only on its own
    scores, never on the row's shape, so decode, verify, batched (padded) rows, chunked prefill and the
    compiled graphs select the same keys. One int64 top-k: the high 32 bits are the fp32 score mapped
    to an order-preserving integer, the low 32 bits rank positions (lower first)."""
    bits = scores.float().view(torch.int32)
    mag = bits & 0x7FFFFFFF  # integer ops only: no compiler pass may fold them the way it may fold float ones
    ordered = torch.where(bits < 0, -mag, mag).to(torch.int64)  # monotone in the float value; -0.0 == +0.0
    pos = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    top = (ordered * (1 << 32) + ((1 << 32) - 1 - pos)).topk(k, dim=-1, sorted=False).indices
    return top.sort(dim=-1).values


class DSAIndexer(nn.Module):
    """DeepSeek Sparse Attention indexer (GLM-5 variant: interleaved RoPE).

    score(q_t, k_s) = sum_h w_h(t) * relu(q_{t,h} . k_s) * index_head_dim^-0.5, w = weights_proj(x) * H^-0.5;
    each query keeps its ``index_topk`` best causal keys. The indexer key (LayerNorm'd, RoPE on its first
    ``qk_rope_head_dim`` dims) is cached as the ``index`` KV component. ``MLAAttention`` rotates the indexer's
    key and queries together with its own (one rotation per layer).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)  # kept fp32

    @staticmethod
    def head_weights_of(w_lin: torch.Tensor, n_heads: int) -> torch.Tensor:
        """``w_lin = weights_proj(x)`` [T, H] -> w = w_lin * H^-0.5 in fp32."""
        return w_lin.float() * n_heads ** -0.5

    def select(self, w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, batch: ForwardBatch) -> "TopK":
        """-> the top-k causal keys of every query (indices ``[B, Tq, k]`` + which of them are causal).
        ``w`` [T, H] from ``head_weights_of``, ``q`` [T, H, D] the RoPE'd queries ``wq_b(q_resid)``."""
        cfg = self.cfg
        H, D = cfg.index_n_heads, cfg.index_head_dim
        qp, wp = batch.pad_q(q).float() * D ** -0.5, batch.pad_q(w)  # [B, Tq, H, D], [B, Tq, H]
        kt = keys.float().transpose(1, 2)  # [B, D, S]
        B, tq, S = qp.shape[0], qp.shape[1], kt.shape[2]
        scores = torch.empty(B, tq, S)
        step = max(1, INDEX_BLOCK_ELEMS // max(1, B * H * S))  # bound the [t, H, S] head scores
        for s0 in range(0, tq, step):
            t = min(tq, s0 + step) - s0
            hs = torch.bmm(qp[:, s0:s0 + t].reshape(B, t * H, D), kt).relu_()  # one GEMM for all heads
            w_blk = wp[:, s0:s0 + t].reshape(B * t, 1, H)
            out = scores[:, s0:s0 + t]
            if out.is_contiguous():  # B == 1: the head-weighted sum lands in place, no copy
                torch.bmm(w_blk, hs.view(B * t, H, S), out=out.view(B * t, 1, S))
            else:
                out.copy_(torch.bmm(w_blk, hs.view(B * t, H, S)).view(B, t, S))
        k = min(cfg.index_topk, S)
        c = batch.single_causal_start
        if c is not None and tq == 1:  # one decoding request: S = c + 1 keys, none in the future
            return TopK(dsa_topk(scores, k), None)
        if c is not None:  # one causal request (S = c + tq): only the last tq keys can lie in the future
            scores[0, :, c:].masked_fill_(torch.ones(tq, tq, dtype=torch.bool, device=scores.device).triu_(1),
                                          float("-inf"))
            idx = dsa_topk(scores, k)  # [1, Tq, k]
            valid = idx <= (c + torch.arange(tq, device=idx.device))[None, :, None]
            return TopK(idx, valid)
        causal = batch.attn_mask[:, 0]
        scores.masked_fill_(~causal, float("-inf"))
        idx = dsa_topk(scores, k)  # [B, Tq, k]
        if tq == 1 and min(batch.kv_lens) >= k:  # decode steps: every query has >= k causal (finite) scores,
            return TopK(idx, None)                 # so all it picks are causal: no validity mask to carry
        # a query with fewer than k causal keys also picks masked ones: they stay masked
        valid = causal.gather(-1, idx)
        return TopK(idx, valid)


class TopK(NamedTuple):
    """DSA selection shared by the layers of one forward: ``idx [B, Tq, k]`` key positions, ``valid`` the
    causal ones among them (None: all of them, as for one decoding request with more than k keys)."""
    idx: torch.Tensor
    valid: torch.Tensor | None

    def mask(self, S: int) -> torch.Tensor:
        """The selection as a bool attention mask ``[B, 1, Tq, S]`` (for the dense-masked path)."""
        B, tq, _ = self.idx.shape
        sel = torch.zeros(B, tq, S, dtype=torch.bool, device=self.idx.device)
        if self.valid is None:
            return sel.scatter_(-1, self.idx, True).unsqueeze(1)
        return sel.scatter_(-1, self.idx, self.valid).unsqueeze(1)


# Sparse MLA gathers [Tq, k, L + r] latents per query block; this bounds one block's elements.
SPARSE_BLOCK_ELEMS = 1 << 24
# The indexer's per-block [t, H, S] head scores are bounded likewise.
# 3 MB fp32, about what one core's L2 + its share of L3 hold, so relu and the head-weighted sum read the
# GEMM's output from cache: a 2k chunk's scores at 20k context (4 heads, dim 32), medians of 5,
# 1 / 2 threads: 418 / 213 ms vs 417 / 269 ms with 16 MB blocks; at 4k context 43 / 28 vs 72 / 30 ms.
INDEX_BLOCK_ELEMS = 3 << 18
# Gathering k selected latents per query is memory-bound (about 3.6 flop/byte); a dense GEMM over all S
# keys with the selection as a mask is compute-bound. On CPU the gather only pays off for short query
# blocks (decode, verify) or when the selection is a small fraction of the context. Measured on the
# default model (index_topk 128, 2k-token chunks, 2 threads; gather vs mask): 2k context 0.32 vs
# 0.23 s, 5k 1.06 vs 1.06 s, 10k 2.67 vs 3.59 s: the break-even is near S = 40 k.
SPARSE_MIN_CONTEXT_RATIO = 40


def sparse_mla(q: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor], kv_lora_rank: int, topk: TopK,
               scale: float) -> torch.Tensor:
    """DSA attention in the latent space over each query's selected keys only (what FlashMLA's sparse
    kernel computes): cost Tq * k instead of Tq * S, and only the selected keys are read.

    q ``[B, Tq, H, L + r]`` (absorbed query); ``gather(idx [B, t, k])`` -> the latent ++ rope keys at those
    context positions ``[B, t, k, L + r]``. Returns ``[B, Tq, H, L]``.
    """
    B, tq, H, D = q.shape
    k = topk.idx.shape[-1]
    out = None
    step = max(1, SPARSE_BLOCK_ELEMS // max(1, B * k * D))
    first = torch.arange(k, device=q.device) == 0 if topk.valid is not None else None
    for s in range(0, tq, step):
        e = min(tq, s + step)
        sel = gather(topk.idx[:, s:e])  # [B, t, k, L + r]
        scores = torch.matmul(q[:, s:e], sel.transpose(-1, -2)).mul_(scale)  # [B, t, H, k]
        if first is not None:
            valid = topk.valid[:, s:e]
            valid = valid | (~valid.any(-1, keepdim=True) & first)  # padding queries: no NaN rows
            scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        o = torch.matmul(p, sel[..., :kv_lora_rank])  # [B, t, H, L]
        if e - s == tq:
            return o
        if out is None:
            out = q.new_empty(B, tq, H, kv_lora_rank)
        out[:, s:e] = o
    return out


def head_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., H, a]``, ``w [H, a, b]`` -> ``[..., H, b]``: one bmm over heads, what einsum
    ``...ha,hab->...hb`` runs, without its ~10 us of Python planning per call (4 calls per layer)."""
    H, a = x.shape[-2], x.shape[-1]
    y = torch.bmm(x.reshape(-1, H, a).transpose(0, 1), w)  # [H, N, b]
    return y.transpose(0, 1).reshape(*x.shape[:-1], w.shape[-1])


class MLADims(NamedTuple):
    """The constants of one call of ``mla_tokenwise`` (fixed per model and batch kind; compiled graphs
    specialise on them)."""
    H: int             # attention heads
    nope: int          # qk_nope_head_dim
    r: int             # qk_rope_head_dim
    L: int             # kv_lora_rank
    Hi: int            # indexer heads (0: the layer has no indexer of its own)
    Di: int            # index_head_dim
    need_topk: bool    # the context outgrows index_topk: the indexer scores it
    absorb: bool       # decode / verify: queries absorbed into the latent space


class MLATokens(NamedTuple):
    """What ``mla_tokenwise`` computes per token: the KV to store and the queries."""
    latent: torch.Tensor           # [T, L] kv_a_layernorm(c_kv)
    krope: torch.Tensor            # [T, r] RoPE'd shared key
    index_key: torch.Tensor        # [T, Di] the indexer key (zeros for a layer without an indexer)
    q_nope: torch.Tensor           # [T, H, nope]
    q_rot: torch.Tensor            # [T, H, r] RoPE'd
    q_lat: torch.Tensor | None     # [T, H, L + r]: W_UK-absorbed q_nope ++ q_rot (``absorb``)
    q_index: torch.Tensor | None   # [T, Hi, Di] RoPE'd indexer queries (``need_topk`` with an indexer)
    index_w: torch.Tensor | None   # [T, Hi] fp32 indexer head weights


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """The weights and norm constants ``mla_tokenwise`` reads (``MLAAttention.tokenwise_weights``): fixed per
    layer, collected once while the decode graphs are compiled."""
    in_ln: torch.Tensor | None
    """input_layernorm weight; None when ``x`` is normed already."""
    in_eps: float
    """input_layernorm epsilon (unused without ``in_ln``)."""
    w_x: torch.Tensor
    """``[rows, hidden]`` q_a_proj, kv_a_proj_with_mqa, the indexer's wk (and weights_proj) as one GEMM."""
    b_x: torch.Tensor | None
    """Their biases (None: no bias)."""
    sizes: list[int]
    """Output rows of each fused projection, in order."""
    qa_ln: torch.Tensor
    """q_a_layernorm weight."""
    qa_eps: float
    """q_a_layernorm epsilon."""
    w_qb: torch.Tensor
    """q_b_proj weight ``[H * (nope + r), q_lora_rank]``."""
    w_iqb: torch.Tensor | None
    """The indexer's wq_b weight (None: the layer has no indexer)."""
    kn_w: torch.Tensor | None
    """The indexer's k_norm weight."""
    kn_b: torch.Tensor | None
    """The indexer's k_norm bias."""
    kn_eps: float
    """The indexer's k_norm epsilon."""
    kva_ln: torch.Tensor
    """kv_a_layernorm weight."""
    kva_eps: float
    """kv_a_layernorm epsilon."""
    w_uk: torch.Tensor
    """``[H, nope, L]`` W_UK (kv_b_proj's key rows), absorbed into the queries."""
    w_wp: torch.Tensor | None
    """The indexer's weights_proj when it keeps its own dtype (fp32 in a low-precision model), else None
    (fused into ``w_x``)."""


def mla_tokenwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: MLAWeights, d: MLADims) -> MLATokens:
    """Everything an MLA layer computes token by token before attention, as a function of tensors and
    constants: run eagerly, or traced into one compiled graph per shape class (``engine.layers.decode_graph``).
    ``x`` [T, hidden] is the layer input (``w.in_ln`` its input_layernorm, None when ``x`` is normed already),
    ``cos`` / ``sin`` its RoPE rows (``RotaryTable.lookup``)."""
    T = x.shape[0]
    h = x if w.in_ln is None else rms_norm(x, w.in_ln, w.in_eps)
    # q_a, kv_a, the indexer's wk and (same dtype) weights_proj read h: one GEMM (1 call instead of 4)
    proj = linear(h, w.w_x, w.b_x).split(w.sizes, dim=-1)
    q_resid = rms_norm(proj[0], w.qa_ln, w.qa_eps)
    q = linear(q_resid, w.w_qb).view(T, d.H, d.nope + d.r)
    ckv = proj[1]
    # every RoPE of the layer as ONE rotation (the same values as rotating each part alone)
    parts = [ckv[:, None, d.L:]]
    k_idx = None
    if d.Hi:
        k_idx = F.layer_norm(proj[2], (d.Di,), w.kn_w, w.kn_b, w.kn_eps)  # [T, Di]
        parts.append(k_idx[:, None, :d.r])
    o = len(parts)
    parts.append(q[..., d.nope:])
    scored = d.Hi > 0 and d.need_topk
    if scored:
        q_idx = F.linear(q_resid, w.w_iqb).view(T, d.Hi, d.Di)
        parts.append(q_idx[..., :d.r])
    rot = apply_interleaved(torch.cat(parts, dim=1), cos, sin)
    latent = rms_norm(ckv[:, :d.L], w.kva_ln, w.kva_eps)
    if d.Hi:
        index_key = torch.cat([rot[:, 1], k_idx[:, d.r:]], dim=-1)
    else:  # keep the slot defined (shipped and checked like any other component)
        index_key = torch.zeros(T, d.Di, dtype=ckv.dtype, device=ckv.device)
    q_nope, q_rot = q[..., :d.nope], rot[:, o:o + d.H]
    q_lat = torch.cat([head_bmm(q_nope, w.w_uk), q_rot], dim=-1) if d.absorb else None
    q_index = index_w = None
    if scored:
        q_index = torch.cat([rot[:, o + d.H:], q_idx[..., d.r:]], dim=-1)
        w_lin = proj[3] if w.w_wp is None else F.linear(h.to(w.w_wp.dtype), w.w_wp)
        index_w = DSAIndexer.head_weights_of(w_lin, d.Hi)
    return MLATokens(latent, rot[:, 0], index_key, q_nope, q_rot, q_lat, q_index, index_w)


class MLAAttention(nn.Module):
    """GLM-5 multi-head latent attention with the DSA indexer.

    KV per token: ``latent`` = kv_a_layernorm(c_kv) [kv_lora_rank], ``rope`` = RoPE'd shared key
    [qk_rope_head_dim], ``index`` = indexer key. Decode runs absorbed (``W_UK`` folded into the query,
    ``W_UV`` applied after attention) so no per-head K/V is ever materialised for the context.

    A layer runs as ``mla_tokenwise`` (projections, norms, RoPE: per token), ``attend`` (KV writes, DSA
    selection, attention over the paged context: per request) and the decoder layer's token-wise rest.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        H = cfg.num_attention_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.shares_topk = cfg.indexer_type(layer_idx) == "shared"
        self.indexer = None if self.shares_topk else DSAIndexer(cfg)
        self._fused_x = FusedProjection()

    def w_kv(self) -> torch.Tensor:
        """kv_b_proj's weight as ``[H, nope + v, kv_lora_rank]`` (W_UK rows, then W_UV rows)."""
        cfg = self.cfg
        return self.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                          cfg.kv_lora_rank)

    def tokenwise_weights(self, in_norm: RMSNorm | None) -> MLAWeights:
        """``mla_tokenwise``'s weights (``in_norm``: the input_layernorm to apply, None when ``x`` is normed)."""
        cfg, idx = self.cfg, self.indexer
        mods = [self.q_a_proj, self.kv_a_proj_with_mqa]
        w_wp = None
        if idx is not None:
            mods.append(idx.wk)
            if idx.weights_proj.weight.dtype == self.q_a_proj.weight.dtype:
                mods.append(idx.weights_proj)
            else:  # kept fp32 in a low-precision model: its own GEMM
                w_wp = idx.weights_proj.weight
        w_x, b_x, sizes = self._fused_x.weight([(m.weight, m.bias) for m in mods])
        return MLAWeights(
            in_ln=None if in_norm is None else in_norm.weight, in_eps=0.0 if in_norm is None else in_norm.eps,
            w_x=w_x, b_x=b_x, sizes=sizes, qa_ln=self.q_a_layernorm.weight, qa_eps=self.q_a_layernorm.eps,
            w_qb=self.q_b_proj.weight, w_iqb=None if idx is None else idx.wq_b.weight,
            kn_w=None if idx is None else idx.k_norm.weight, kn_b=None if idx is None else idx.k_norm.bias,
            kn_eps=1e-6 if idx is None else idx.k_norm.eps, kva_ln=self.kv_a_layernorm.weight,
            kva_eps=self.kv_a_layernorm.eps, w_uk=self.w_kv()[:, :cfg.qk_nope_head_dim], w_wp=w_wp)

    def dims(self, need_topk: bool, absorb: bool) -> MLADims:
        """``mla_tokenwise``'s constants for a batch kind."""
        cfg = self.cfg
        return MLADims(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                       0 if self.indexer is None else cfg.index_n_heads, cfg.index_head_dim, need_topk, absorb)

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable) -> None:
        """Only the new tokens' KV (latent, rope key, indexer key), bit for bit what ``forward`` writes,
        without the attention: for a pass whose output is not read, only its cache (the MTP layer over a
        prompt). ``x`` is normed already."""
        cos, sin = rope.lookup(batch.positions, x.dtype)
        self.store_kv(mla_tokenwise(x, cos, sin, self.tokenwise_weights(None), self.dims(False, False)), batch, pool)

    def store_kv(self, t: MLATokens, batch: ForwardBatch, pool: KVPool) -> None:
        L = self.layer_idx
        pool.write(L, "latent", batch.out_slots, t.latent)
        pool.write(L, "rope", batch.out_slots, t.krope)
        pool.write(L, "index", batch.out_slots, t.index_key)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable,
                topk_prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` normed -> (o_proj output, the DSA selection); ``DecoderLayer`` runs the same pieces itself."""
        cos, sin = rope.lookup(batch.positions, x.dtype)
        absorb = max(batch.q_lens) <= MLA_ABSORB_MAX_Q
        t = mla_tokenwise(x, cos, sin, self.tokenwise_weights(None),
                          self.dims(batch.max_kv_len > self.cfg.index_topk, absorb))
        o, topk = self.attend(t, batch, pool, topk_prev)
        if absorb:
            o = head_bmm(o, self.w_kv()[:, self.cfg.qk_nope_head_dim:].transpose(1, 2))  # apply W_UV
        return self.o_proj(o.reshape(x.shape[0], -1)), topk

    def attend(self, t: MLATokens, batch: ForwardBatch, pool: KVPool, topk_prev: TopK | None
               ) -> tuple[torch.Tensor, TopK | None]:
        """Store the new tokens' KV and attend over each request's paged context -> (``[T, H, L]`` latent
        outputs when ``t.q_lat`` is set (W_UV not yet applied), else ``[T, H, v]``; the DSA selection)."""
        cfg, L, dtype = self.cfg, self.layer_idx, t.latent.dtype
        self.store_kv(t, batch, pool)
        topk = None
        if batch.max_kv_len > cfg.index_topk:
            if self.indexer is not None:
                keys = pool.read(L, "index", batch.kv_slots, dtype)
                topk = self.indexer.select(t.index_w, t.q_index, keys, batch)
            else:
                if topk_prev is None:
                    raise ValueError(f"layer {L} shares the DSA top-k but no previous layer produced one")
                topk = topk_prev
        if topk is not None and (t.q_lat is not None or
                                 batch.max_kv_len >= SPARSE_MIN_CONTEXT_RATIO * topk.idx.shape[-1]):
            # each query attends only to its selected keys, read straight from the pool by slot
            def gather(idx: torch.Tensor) -> torch.Tensor:
                slots = batch.kv_slots.gather(1, idx.reshape(idx.shape[0], -1)).view(idx.shape)  # [B, t, k]
                return torch.cat([pool.read(L, "latent", slots, dtype), pool.read(L, "rope", slots, dtype)], -1)
            if t.q_lat is not None:
                o_lat = sparse_mla(batch.pad_q(t.q_lat), gather, cfg.kv_lora_rank, topk, cfg.softmax_scale)
                return batch.unpad_q(o_lat), topk  # [T, H, L]
            w_kv = self.w_kv()
            q_lat = torch.cat([head_bmm(batch.pad_q(t.q_nope), w_kv[:, :cfg.qk_nope_head_dim]),
                               batch.pad_q(t.q_rot)], dim=-1)  # absorb W_UK
            o_lat = sparse_mla(q_lat, gather, cfg.kv_lora_rank, topk, cfg.softmax_scale)  # [B, Tq, H, L]
            o = head_bmm(o_lat, w_kv[:, cfg.qk_nope_head_dim:].transpose(1, 2))  # apply W_UV
        else:
            o = self._dense(t, topk, batch, pool, dtype)
        return batch.unpad_q(o), topk

    def _dense(self, t: MLATokens, topk: TopK | None, batch: ForwardBatch, pool: KVPool,
               dtype: torch.dtype) -> torch.Tensor:
        """Attention over the whole context (the DSA selection, if any, as a mask) -> ``[B, Tq, H, L]``
        (absorbed) or ``[B, Tq, H, v]``."""
        cfg, L = self.cfg, self.layer_idx
        H, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        lat = pool.read(L, "latent", batch.kv_slots, dtype)  # [B, S, L]
        krope = pool.read(L, "rope", batch.kv_slots, dtype)  # [B, S, r]
        if topk is None:
            mask = batch.attn_mask
        elif batch.single_causal_start is not None:  # its selection holds causal keys only: no [Tq, S] AND
            mask = topk.mask(batch.max_kv_len)
        else:
            mask = batch.attn_mask & topk.mask(batch.max_kv_len)
        if t.q_lat is not None:
            qq = batch.pad_q(t.q_lat).transpose(1, 2)  # [B, H, Tq, L + r]
            kk = torch.cat([lat, krope], dim=-1)[:, None]  # [B, 1, S, L + r]
            return sdpa(qq, kk, lat[:, None], mask, cfg.softmax_scale).transpose(1, 2)  # [B, Tq, H, L]
        kv = self.kv_b_proj(lat).view(*lat.shape[:2], H, nope + cfg.v_head_dim)
        k = torch.cat([kv[..., :nope], krope[:, :, None].expand(-1, -1, H, -1)], dim=-1)
        qq = torch.cat([batch.pad_q(t.q_nope), batch.pad_q(t.q_rot)], dim=-1).transpose(1, 2)
        return sdpa(qq, k.transpose(1, 2), kv[..., nope:].transpose(1, 2), mask, cfg.softmax_scale).transpose(1, 2)
