# over 400 lines: the whole decode step as one compiled graph (layers, MTP, head) with its named input dataclasses.
"""Decode and verify steps of MLA decoder layers through compiled graphs.

A decode step of a small model is bound by per-op overhead (~450 eager torch ops per step of the default
model, each a few microseconds of dispatch for a few hundred flops). An MLA layer is written as functions
of tensors and constants: ``mla_tokenwise`` (norms, projections, RoPE, W_UK absorption), then
``paged_mla_attention`` (KV writes into the flat pool buffers, the DSA indexer's top-k, sparse attention
in the latent space) and ``layer_post`` (W_UV, o_proj, residuals, the FFN with the MoE's routing and
gather experts). ``GlmForCausalLM.compile_decode`` runs ``mla_decode_layer`` (all three) through
``torch.compile`` for decode and verify steps: one graph call per layer, inductor fusing the gathers and
elementwise work around the GEMMs; on CPU with its C++ wrapper, so no Python runs between kernels.
Graphs are dynamic in the token count, the request count, the context length and the pool size: one
token, one request and each layer kind (dense MLP / MoE) give the few specialised ones (``RECOMPILE_LIMIT``).

GLM-4.5's GQA layers run the same way through ``gqa_decode_layer`` (``engine.layers.gqa_graph``), in the
per-layer and the whole-step graphs. fp8 KV pools too: the graphs quantise writes and dequantise reads as
``KVPool.write`` / ``read`` do (``kv_write`` / ``kv_read``). What the graphs do not cover runs the eager path
(for MLA with the same token-wise functions, ``tokenwise`` and ``after_attention`` around
``MLAAttention.attend``): prefill and batches whose requests have different query counts. Routed experts run inside the graph on
the gather path (<= ``GRAPH_EXACT_GATHER_MAX_PAIRS`` token-expert pairs; dense-weight experts, or MXFP4 experts on
the dense weights their DequantCache holds); larger batches run the experts' own eager strategies
between the graph and the residual add. When every FFN of a step completes inside, the whole step
(embedding, layers, final norm, LM head) is one graph: ``mla_decode_stack``.

Compiled and eager steps agree to float rounding, not bitwise (fused kernels round differently). Neither
path is bitwise batch-invariant: a GEMM over 1 row and over 6 rows rounds differently (eager
``F.linear`` included), so "lossless" speculation means greedy output equal to plain greedy decoding of
the same path, tested on both (``tests/engine/test_spec.py``, ``tests/engine/test_decode_graph.py``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch
from engine.kvcache.pool import KVPool
from engine.layers.attention import (
    GQAAttention,
    MLAAttention,
    MLADims,
    MLATokens,
    MLAWeights,
    TopK,
    dsa_topk,
    head_bmm,
    mla_tokenwise,
)
from engine.layers.gqa_graph import (
    GQAArgs,
    GQAConsts,
    KVBuf,
    gqa_tokenwise,
    kv_read,
    kv_write,
    paged_gqa_attention,
)
from engine.layers.mlp import FFNArgs, ffn_tokenwise
from engine.layers.norm import rms_norm
from engine.moe.router import Routing
from engine.moe.tuned_table import FUSED_GATHER_MAX_PAIRS
from engine.shapes import REDUCED_PRECISION

__all__ = ["DecodeGraphs", "GQALayerWeights", "LayerWeights", "MLADims", "MTPInput", "PostWeights", "layer_post"]


@dataclass(frozen=True, slots=True)
class PostWeights:
    """The weights ``layer_post`` reads: the decoder layer after its attention."""
    w_uv: torch.Tensor | None
    """``[H, L, v]`` W_UV (kv_b_proj's value rows) for absorbed attention outputs; None: ``o`` is ``[T, H, v]``."""
    o_w: torch.Tensor
    """o_proj weight."""
    o_b: torch.Tensor | None
    """o_proj bias (None: no bias)."""
    ln_w: torch.Tensor
    """post_attention_layernorm weight."""
    ln_eps: float
    """post_attention_layernorm epsilon."""
    ffn: FFNArgs
    """The FFN's (``ffn_tokenwise``)."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """Everything an MLA decoder layer's token-wise functions read besides the step's tensors
    (``DecoderLayer._weight_args``): collected once per layer and batch kind while compiled."""
    pre: MLAWeights
    """``mla_tokenwise``'s weights."""
    dims: MLADims
    """``mla_tokenwise``'s constants for the batch kind (context scored by the indexer, absorbed queries)."""
    post: PostWeights
    """``layer_post``'s weights."""


@dataclass(frozen=True, slots=True)
class GQALayerWeights:
    """Everything a GQA decoder layer's token-wise functions read besides the step's tensors
    (``DecoderLayer._weight_args``)."""
    pre: GQAArgs
    """``gqa_tokenwise``'s weights and constants."""
    post: PostWeights
    """``layer_post``'s weights (``w_uv`` None)."""


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The tensors of one decode / verify step that every layer reads."""
    cos: torch.Tensor
    """RoPE cosines of the step's tokens (``RotaryTable.lookup``)."""
    sin: torch.Tensor
    """RoPE sines."""
    out_slots: torch.Tensor
    """``[T]`` where each new token's KV is written."""
    kv_slots: torch.Tensor
    """``[B, S]`` each request's context slots (padding: slot 0)."""
    mask: torch.Tensor | None
    """``[B, Tq, S]`` causal + valid keys; None: every key of every query (one decoding request)."""


@dataclass(frozen=True, slots=True)
class MTPInput:
    """An MTP layer's input side: its block reads ``eh_proj([enorm(embed(ids)); hnorm(prev_hidden)])``
    (``GlmForCausalLM._mtp_input``)."""
    prev_hidden: torch.Tensor
    """``[T, hidden]`` the target's final-normed hidden states at the same positions."""
    en_w: torch.Tensor
    """enorm weight."""
    en_eps: float
    """enorm epsilon."""
    hn_w: torch.Tensor
    """hnorm weight."""
    hn_eps: float
    """hnorm epsilon."""
    eh_w: torch.Tensor
    """eh_proj weight ``[hidden, 2 * hidden]``."""


@dataclass(frozen=True, slots=True)
class HeadWeights:
    """The model's ends around its layers in a whole-step graph."""
    embed_w: torch.Tensor
    """embed_tokens weight."""
    norm_w: torch.Tensor
    """The final norm's weight (the MTP layer's shared_head_norm for an MTP step)."""
    norm_eps: float
    """Its epsilon."""
    lm_w: torch.Tensor
    """lm_head weight."""
    row_gemv: bool = False
    """One row of logits reads a bf16 / fp16 ``lm_w`` as a fused multiply-sum, not the small-M ``mm`` (``lm_head``);
    only where verify steps need not round as decode steps do (``DecodeGraphs.exact_verify`` False)."""
    lm_w_narrow: torch.Tensor | None = None
    """An fp32 model's LM head held in bf16 too, when every value is a bf16 value (a bf16 checkpoint read in
    fp32): the row GEMV reads it instead of ``lm_w``, half the bytes, the same products (``lm_head``)."""


class GraphLayer(NamedTuple):
    """One layer of ``mla_decode_stack``."""
    bufs: tuple[KVBuf, ...]   # the layer's flat pool buffers (``pool_views``): latent / rope / index, or k / v
    consts: PagedConsts | GQAConsts
    weights: LayerWeights | GQALayerWeights


def layer_post(x: torch.Tensor, o: torch.Tensor, w: PostWeights
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Routing | None]:
    """The decoder layer after attention: ``o`` [T, H, L] latent outputs (``w.w_uv`` [H, L, v] applies W_UV)
    or [T, H, v] -> o_proj, residual, post_attention_layernorm, FFN, residual. Returns ``(x, h, y, routing)``:
    with ``routing`` None ``x`` is the layer's output; else the routed experts are the caller's
    (``x + finish_ffn(experts, h, y, routing)``)."""
    if w.w_uv is not None:
        o = head_bmm(o, w.w_uv)
    x = x + F.linear(o.reshape(x.shape[0], -1), w.o_w, w.o_b)
    h = rms_norm(x, w.ln_w, w.ln_eps)
    y, routing = ffn_tokenwise(h, w.ffn)
    if routing is None:
        return x + y, h, None, None
    return x, h, y, routing


class PagedConsts(NamedTuple):
    """Constants of one ``paged_mla_attention`` call."""
    index_topk: int    # keys each query keeps when the indexer scores the context
    score: bool        # the layer's own indexer scores the context (else ``topk_prev`` or all keys)
    sparse: bool       # attend to the selected keys only (the context outgrew index_topk)
    scale: float       # softmax scale
    L: int             # kv_lora_rank


def paged_mla_attention(t: MLATokens, bufs: tuple[KVBuf, ...], step: StepInputs,
                        prev_idx: torch.Tensor | None, prev_valid: torch.Tensor | None, c: PagedConsts
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``MLAAttention.attend`` for absorbed queries of requests with the same query count, as a function of
    tensors: writes the new tokens' KV into the flat pool buffers ``bufs`` (latent, rope, index: [slots, ...])
    at ``step.out_slots``, selects each query's keys (the DSA indexer's top-k, ``prev_*`` for a layer that
    shares its previous layer's, or every key of a short context) and attends over them in the latent space.
    Returns (o_lat [T, H, L], the selection [B, Tq, k] and its validity or None)."""
    lat_buf, rope_buf, idx_buf = bufs
    out_slots, kv_slots, mask = step.out_slots, step.kv_slots, step.mask
    kv_write(lat_buf, out_slots, t.latent)
    kv_write(rope_buf, out_slots, t.krope)
    kv_write(idx_buf, out_slots, t.index_key)
    B, S = kv_slots.shape
    T, H, D = t.q_lat.shape
    q = t.q_lat.view(B, -1, H, D)  # [B, Tq, H, L + r]
    tq = q.shape[1]
    valid = None
    if c.score:  # DSAIndexer.select: sum_h w_h relu(q_h . k) over the context, top-k per query
        Hi, Di = t.q_index.shape[1], t.q_index.shape[2]
        keys = kv_read(idx_buf, kv_slots.reshape(-1), t.latent.dtype).view(B, S, Di).to(torch.float32)
        qi = t.q_index.float().view(B, tq * Hi, Di) * Di ** -0.5
        hs = torch.bmm(qi, keys.transpose(1, 2)).relu_().view(B * tq, Hi, S)
        scores = torch.bmm(t.index_w.view(B * tq, 1, Hi), hs).view(B, tq, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        idx = dsa_topk(scores, c.index_topk)  # [B, Tq, k]
        if mask is not None:
            valid = mask.gather(-1, idx)
    elif c.sparse:
        idx, valid = prev_idx, prev_valid
    else:  # a short context: every key, the mask as validity
        idx = torch.arange(S, device=kv_slots.device).expand(B, tq, S)
        valid = mask
    k = idx.shape[-1]
    slots = kv_slots.gather(1, idx.reshape(B, tq * k)).view(-1)
    sel = torch.cat([kv_read(lat_buf, slots, t.latent.dtype), kv_read(rope_buf, slots, t.latent.dtype)],
                    dim=-1).view(T, k, D)
    # one bmm over the T = B * Tq queries (not a 4-D matmul over [B, Tq]): the same kernel whatever B is, so a
    # query's row rounds alike verified alone or beside other requests (a 4-D matmul with B and Tq both
    # dynamic took another path in bf16 and broke speculative == plain greedy for batches)
    scores = torch.bmm(t.q_lat, sel.transpose(1, 2)) * c.scale  # [T, H, k]
    if valid is not None:
        scores = scores.masked_fill(~valid.reshape(T, 1, k), float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(t.q_lat.dtype)
    o = torch.bmm(p, sel[..., :c.L])  # [T, H, L]
    return o, (idx if c.score else None), valid


def mla_decode_layer(x: torch.Tensor, step: StepInputs, bufs: tuple[KVBuf, ...],
                     prev_idx: torch.Tensor | None, prev_valid: torch.Tensor | None, c: PagedConsts, w: LayerWeights):
    """A whole MLA decoder layer for decode / verify steps: ``mla_tokenwise``, ``paged_mla_attention``,
    ``layer_post``. Returns ``layer_post``'s outputs and the selection."""
    t = mla_tokenwise(x, step.cos, step.sin, w.pre, w.dims)
    o, idx, valid = paged_mla_attention(t, bufs, step, prev_idx, prev_valid, c)
    return layer_post(x, o, w.post), idx, valid


def gqa_decode_layer(x: torch.Tensor, step: StepInputs, bufs: tuple[KVBuf, KVBuf], c: GQAConsts,
                     w: GQALayerWeights):
    """A whole GQA decoder layer for decode / verify steps: ``gqa_tokenwise``, ``paged_gqa_attention``,
    ``layer_post``. Returns ``layer_post``'s outputs."""
    q, k, v = gqa_tokenwise(x, step.cos, step.sin, w.pre)
    o = paged_gqa_attention(q, k, v, bufs, step.out_slots, step.kv_slots, step.mask, c)
    return layer_post(x, o, w.post)


def mla_decode_stack(ids: torch.Tensor, step: StepInputs, layers: tuple[GraphLayer, ...], head: HeadWeights,
                     logits_index: torch.Tensor | None, mtp: MTPInput | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's decode / verify forward: embedding, ``mla_decode_layer`` (``gqa_decode_layer`` for a GQA
    layer) per layer (every FFN complete inside), final norm, LM head. Returns (fp32 logits of ``logits_index``'s rows or of all, the final-normed
    hidden states). With ``mtp`` it is an MTP layer's forward: its input is
    eh_proj([enorm(embed(ids)); hnorm(prev_hidden)]) (``GlmForCausalLM._mtp_input``)."""
    x = F.embedding(ids, head.embed_w)
    if mtp is not None:
        x = F.linear(torch.cat([rms_norm(x, mtp.en_w, mtp.en_eps), rms_norm(mtp.prev_hidden, mtp.hn_w, mtp.hn_eps)],
                               dim=-1), mtp.eh_w)
    prev_idx = prev_valid = None
    for layer in layers:
        if isinstance(layer.consts, GQAConsts):
            x = gqa_decode_layer(x, step, layer.bufs, layer.consts, layer.weights)[0]
            continue
        (x, _, _, _), idx, valid = mla_decode_layer(x, step, layer.bufs, prev_idx, prev_valid, layer.consts,
                                                    layer.weights)
        if layer.consts.score:
            prev_idx, prev_valid = idx, valid
    hidden = rms_norm(x, head.norm_w, head.norm_eps)
    sel = hidden if logits_index is None else hidden.index_select(0, logits_index)
    return lm_head(sel, head), hidden


def lm_head(h: torch.Tensor, head: HeadWeights) -> torch.Tensor:
    """``h`` [N, hidden] -> fp32 logits [N, vocab]. With ``head.row_gemv`` one row (a batch-1 decode step) is a
    multiply-sum that inductor fuses into one reduction reading the narrow weight once: the bf16 ``mm`` of one
    row (oneDNN's small-M path) took 1,440 us compiled for the peers' 32000 x 256 head, the reduction 801 us
    (docs/performance.md). Rounded to the weight's dtype as ``F.linear`` rounds its output. An fp32 model whose
    head holds bf16 values reads ``head.lm_w_narrow`` (16 of the 46 MB a batch-1 step of the peers' glm4_moe
    read in fp32 are saved)."""
    if head.row_gemv and h.shape[0] == 1:
        if head.lm_w_narrow is not None:  # fp32 logits from the exact bf16 copy: no rounding of the sum
            return (head.lm_w_narrow.float() * h.float()).sum(-1)[None]
        return (head.lm_w.float() * h.float()).sum(-1).to(head.lm_w.dtype).float()[None]
    return F.linear(h, head.lm_w).float()


MLA_KV = ("latent", "rope", "index")
GQA_KV = ("k", "v")


def pool_views(pool: KVPool, layer: int, names: tuple[str, ...] = MLA_KV) -> tuple[KVBuf, ...]:
    """The layer's flat KV buffers (MLA: latent / rope / index; GQA: k / v) as ``KVBuf``s, dynamic in their
    slot count (any pool size shares the graphs)."""
    views = pool.flat_views(layer, names)
    if pool.layout.is_fp8:  # the bytes as uint8 (CPU has no fp8 index_copy / index_select) and the scales
        cache = pool.__dict__.setdefault("_fp8_graph_views", {})
        bufs = cache.get((layer, names))
        if bufs is None:
            bufs = cache[(layer, names)] = tuple((v.view(torch.uint8), pool.flat_scale(layer, n))
                                                 for v, n in zip(views, names))
    else:
        bufs = tuple((v, None) for v in views)
    for b in bufs:
        for t in b:
            if t is not None and getattr(t, "_dynamo_dynamic_indices", None) is None:
                torch._dynamo.mark_dynamic(t, 0)
    return bufs


def _compile(fn: Callable, device: torch.device) -> Callable:
    # Callers mark the dynamic dimensions (``_dynamic``, ``DecodeGraphs.batch_inputs``, ``pool_views``);
    # everything else, the weights included, keeps static shapes (specialised kernels).
    options = {"cpp_wrapper": True} if device.type == "cpu" else {}
    return torch.compile(fn, fullgraph=True, options=options)


RECOMPILE_LIMIT = 64
"""Graphs per function: shape classes (one token or several, one request or several, a short or a long
context) times layer kinds (dense MLP, MoE with the experts inside or left to the caller). torch's default
(8) would make the ninth a hard error under ``fullgraph``."""
_thread = threading.local()


def _limits() -> None:
    """torch._dynamo's config is per thread (a decode worker steps in its scheduler thread)."""
    if not getattr(_thread, "set", False):
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(RECOMPILE_LIMIT, getattr(cfg, name)))
        _thread.set = True


def _dynamic(compiled: bool, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark the token dimension dynamic from the first multi-token call on, so one graph serves every
    token count above 1 (one token gets its own graph: torch specialises size 1 whatever the marks)."""
    if compiled:
        _limits()
    if compiled and ts[0].shape[0] > 1:
        for t in ts:
            torch._dynamo.mark_dynamic(t, 0)
    return ts


class DecodeGraphs:
    """The token-wise halves of an MLA decoder layer: ``pre`` = ``mla_tokenwise``, ``post`` =
    ``layer_post``, eager or compiled (shared by all layers of a model: one graph per shape class)."""

    def __init__(self, compiled: bool, device: torch.device | str = "cpu", exact_verify: bool = True) -> None:
        self.compiled = compiled
        self.exact_verify = exact_verify
        """Verify steps must round as decode steps do (a model that speculates): bf16 / fp16 routed experts
        stay eager (``REDUCED_PRECISION``). False (no MTP layers, so no verify steps): they run inside."""
        if compiled:
            self.pre = _compile(mla_tokenwise, torch.device(device))
            self.post = _compile(layer_post, torch.device(device))
            self.layer = _compile(mla_decode_layer, torch.device(device))
            self.stack = _compile(mla_decode_stack, torch.device(device))
            self.gqa_layer = _compile(gqa_decode_layer, torch.device(device))
        else:
            self.pre, self.post, self.layer, self.stack = mla_tokenwise, layer_post, mla_decode_layer, mla_decode_stack
            self.gqa_layer = gqa_decode_layer

    def tokenwise(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: MLAWeights, d: MLADims
                  ) -> MLATokens:
        """``mla_tokenwise(x, cos, sin, w, d)``."""
        return self.pre(*_dynamic(self.compiled, x, cos, sin), w, d)

    def after_attention(self, x: torch.Tensor, o: torch.Tensor, w: PostWeights
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Routing | None]:
        """``layer_post(x, o, w)``."""
        return self.post(*_dynamic(self.compiled, x, o), w)

    def run_layer(self, attn: MLAAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch, pool: KVPool, topk: TopK | None, w: LayerWeights):
        """``mla_decode_layer`` for ``attn``'s layer over a batch of requests with equal query counts ->
        (``layer_post``'s outputs, the DSA selection)."""
        c = self.consts(attn, batch, pool)
        if c.sparse and not c.score and topk is None:
            raise ValueError(f"layer {attn.layer_idx} shares the DSA top-k but no previous layer produced one")
        mask = self.batch_inputs(batch, x, cos, sin)
        prev = (None, None) if topk is None or c.score else (topk.idx, topk.valid)
        step = StepInputs(cos, sin, batch.out_slots, batch.kv_slots, mask)
        out, idx, valid = self.layer(x, step, pool_views(pool, attn.layer_idx), *prev, c, w)
        if c.score:
            topk = TopK(idx, valid)
        return out, topk

    def run_gqa_layer(self, attn: GQAAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      batch: ForwardBatch, pool: KVPool, w: GQALayerWeights):
        """``gqa_decode_layer`` for ``attn``'s layer over a batch of requests with equal query counts ->
        ``layer_post``'s outputs."""
        mask = self.batch_inputs(batch, x, cos, sin)
        step = StepInputs(cos, sin, batch.out_slots, batch.kv_slots, mask)
        return self.gqa_layer(x, step, pool_views(pool, attn.layer_idx, GQA_KV), self.consts(attn, batch, pool), w)

    @staticmethod
    def consts(attn: MLAAttention | GQAAttention, batch: ForwardBatch, pool: KVPool) -> PagedConsts | GQAConsts:
        if isinstance(attn, GQAAttention):
            return GQAConsts(attn.cfg.softmax_scale, attn.paged_kernel(pool))
        cfg = attn.cfg
        need = batch.max_kv_len > cfg.index_topk
        return PagedConsts(cfg.index_topk, need and attn.indexer is not None, need, cfg.softmax_scale,
                           cfg.kv_lora_rank)

    @staticmethod
    def batch_inputs(batch: ForwardBatch, *token_major: torch.Tensor) -> torch.Tensor | None:
        """Mark the batch's tensors dynamic (tokens, requests, context length) -> the attention mask
        ``[B, Tq, S]`` (None for one decoding request: it sees every key)."""
        _dynamic(True, batch.out_slots, *token_major)
        B, tq = batch.num_reqs, batch.q_lens[0]
        mask = batch.step_mask
        dims = [(batch.kv_slots, 1)]
        if B > 1:
            dims.append((batch.kv_slots, 0))
        if mask is not None:
            dims += [(mask, 2)] + ([(mask, 0)] if B > 1 else []) + ([(mask, 1)] if tq > 1 else [])
        for t, d in dims:
            torch._dynamo.mark_dynamic(t, d)
        return mask

    def run_stack(self, layers: list[tuple[MLAAttention | GQAAttention, LayerWeights | GQALayerWeights]], batch: ForwardBatch, pool: KVPool,
                  ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head: HeadWeights, all_logits: bool,
                  mtp: MTPInput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole decode / verify forward (embedding, every layer, final norm, LM head) as one graph call;
        ``layers`` are ``(attn, weights)`` of layers whose FFN completes inside the graph; ``mtp`` see
        ``mla_decode_stack``."""
        li = None if all_logits else batch.logits_index
        mask = self.batch_inputs(batch, ids, cos, sin, *(() if mtp is None else (mtp.prev_hidden,)))
        if li is not None and li.shape[0] > 1:
            torch._dynamo.mark_dynamic(li, 0)
        per_layer = tuple(GraphLayer(pool_views(pool, a.layer_idx, GQA_KV if isinstance(a, GQAAttention) else MLA_KV),
                                     self.consts(a, batch, pool), w) for a, w in layers)
        step = StepInputs(cos, sin, batch.out_slots, batch.kv_slots, mask)
        return self.stack(ids, step, per_layer, head, li, mtp)

    def experts_in_graph(self, experts: torch.nn.Module, num_pairs: int, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        """The routed experts' (w13, w2) and the strategy (``GRAPH_MOE_IMPLS``) when they run inside the
        graph, else None (the caller runs ``experts`` eagerly, with their own strategy choice): MX experts through
        the fused kernel's op (``MXRoutedExperts.graph_weights``, up to ``GRAPH_EXACT_GATHER_MAX_PAIRS`` pairs where
        the model verifies, else ``FUSED_GATHER_MAX_PAIRS``), dense-weight experts, or MX experts the user forced onto
        a dequantized copy (``MXRoutedExperts.gather_weights``).

        A model that verifies (``exact_verify``) runs them inside on the gather path only, as eager experts
        do, for <= ``GRAPH_EXACT_GATHER_MAX_PAIRS`` token-expert pairs and not in reduced precision (``REDUCED_PRECISION``).
        One that never verifies runs them inside at any batch size (the whole step one graph):
        ``gather_fused`` for <= ``GRAPH_GATHER_MAX_PAIRS`` pairs, then ``dense`` when every token through
        every expert costs at most ``GRAPH_DENSE_MAX_WASTE`` times the routed work; larger layers stay eager."""
        if not self.compiled:
            return None
        if self.exact_verify:
            strategy = ("gather" if num_pairs <= GRAPH_EXACT_GATHER_MAX_PAIRS and dtype not in REDUCED_PRECISION
                        else None)
        else:
            strategy = graph_moe_strategy(num_pairs, experts.num_experts, experts.topk)
        mx = getattr(experts, "graph_weights", None)
        # MX experts: the fused kernel as one op, batch-invariant and the very kernel eager decode runs: a token
        # rounds alike in a decode and a verify graph, in any dtype (the op does its own rounding, inductor none)
        mx_limit = GRAPH_EXACT_GATHER_MAX_PAIRS if self.exact_verify else FUSED_GATHER_MAX_PAIRS
        if mx is not None and num_pairs <= mx_limit and (w := mx(dtype)) is not None:
            return w
        fn = getattr(experts, "gather_weights", None)
        if strategy is None or fn is None:
            return None
        w = fn(dtype)
        return None if w is None else (w[0], w[1], strategy)


GRAPH_EXACT_GATHER_MAX_PAIRS = 64
"""Graphs of models that verify run their fp32 experts on the (batch-invariant) gather path up to this many
token-expert pairs: a decode step of 32 requests of a top-2 model is then one graph. Default model (glm5-tiny,
E=8, top-2, fp32), ``bench.bench_decode --batches 8,32 --new 48``: 16 pairs (before) 4,397 / 6,452 tok/s, 64 pairs
4,837 / 8,585 (transformers 980-1,050 / 1,727-1,879 in the same runs)."""
GRAPH_GATHER_MAX_PAIRS = 32
"""Graphs of models without verify steps run ``gather_fused`` up to this many token-expert pairs. Measured
on the peers' glm4_moe layer (E=16, H=256, I=128, top-4, bf16, 2 threads, us per layer, compiled): 8 tokens
gather_fused 245 / dense 315 (eager: grouped 444, sorted 1,503); 32 tokens dense 338 / gather_fused 604 (eager
grouped 506)."""
GRAPH_DENSE_MAX_WASTE = 4
"""``dense`` computes E / top-k times the routed work: beyond this ratio the experts stay eager."""


def graph_moe_strategy(num_pairs: int, num_experts: int, topk: int) -> str | None:
    """Inside-graph strategy of a model without verify steps (``DecodeGraphs.experts_in_graph``)."""
    if num_pairs <= GRAPH_GATHER_MAX_PAIRS:
        return "gather_fused"
    return "dense" if num_experts <= GRAPH_DENSE_MAX_WASTE * topk else None


# REDUCED_PRECISION (engine.shapes): models in these dtypes that speculate (``DecodeGraphs.exact_verify``: models
# with MTP layers) run their routed experts eagerly between graphs, at every batch size. Inside a graph
# inductor fuses the experts' math and rounds to bf16 once per fused kernel where eager rounds after every op;
# with the experts inside for small steps only (<= 16 pairs, as then), a decode step of 4 requests
# (inside) and their verify step (outside) rounded a token differently, and speculative greedy decoding of a
# batch diverged from plain decoding within 10-54 tokens (docs/performance.md). Eager experts round alike at
# any batch size. fp32 rounding differences are far below any greedy margin seen: fp32 keeps them inside. A model
# without MTP layers never verifies, so its bf16 experts run inside too (the whole batch-1 step one graph).
EAGER = DecodeGraphs(compiled=False)
