"""GLM-5 (``glm_moe_dsa``) and GLM-4.5 (``glm4_moe``) causal LMs with their MTP layers, on paged KV.

Parameter names follow the Hugging Face checkpoints (``model.layers.{i}.self_attn.q_a_proj.weight``)
except where a tensor is restructured (stacked experts) or relocated (MTP); ``engine.loader`` holds
the explicit mapping table for those.
"""
from __future__ import annotations

from dataclasses import replace
import logging
from typing import NamedTuple

import torch
from torch import nn

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kvcache.pool import KVPool
from engine.layers.cpu_gemv import linear
from engine.layers.attention import MLA_ABSORB_MAX_Q, GQAAttention, MLAAttention
from engine.layers.decode_graph import (
    EAGER,
    REDUCED_PRECISION,
    DecodeGraphs,
    GQALayerWeights,
    HeadWeights,
    LayerWeights,
    MTPInput,
    PostWeights,
)
from engine.layers.mlp import MLP, MoE, finish_ffn
from engine.layers.norm import RMSNorm, add_rms_norm
from engine.layers.rotary import RotaryTable
from engine.parallel.config import SINGLE_RANK, ParallelConfig
from engine.parallel.layers import VocabParallelEmbedding, VocabParallelHead, tp_layer_forward

logger = logging.getLogger(__name__)


class ForwardResult(NamedTuple):
    logits: torch.Tensor   # [N, vocab] fp32 for batch.logits_index
    hidden: torch.Tensor   # [T, H] final-normed hidden states (the MTP layer's input)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, moe_impl: str = "auto",
                 parallel: ParallelConfig = SINGLE_RANK) -> None:
        """``cfg``: this rank's config (``ParallelConfig.rank_config``: its heads and intermediate sizes)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel = parallel
        attn_cls = MLAAttention if cfg.is_mla else GQAAttention
        self.self_attn = attn_cls(cfg, layer_idx)
        self.mlp = (MoE(cfg, moe_impl, parallel) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.graphs: DecodeGraphs = EAGER
        """How decode / verify steps run the layer's token-wise parts (``GlmForCausalLM.compile_decode``)."""
        self._frozen_args: dict[tuple, LayerWeights | GQALayerWeights] = {}
        """Compiled graphs' weight arguments, collected once (weights are frozen while compiled)."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable,
                topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.parallel.is_tp:  # this rank's heads / FFN slice and the all_reduces (engine.parallel.layers)
            return tp_layer_forward(self, x, batch, pool, rope, topk)
        attn = self.self_attn
        if not isinstance(attn, MLAAttention):
            g = self.graphs
            if g.compiled and batch.uniform_q and max(batch.q_lens) <= MLA_ABSORB_MAX_Q:
                cos, sin = rope.lookup(batch.positions, x.dtype)
                experts, experts_w = self._experts_in_graph(g, batch)
                x, h, y, routing = g.run_gqa_layer(attn, x, cos, sin, batch, pool, self._args(g, (False, True), experts_w))
                return (x if routing is None else x + finish_ffn(experts, h, y, routing)), topk
            h, topk = attn(self.input_layernorm(x), batch, pool, rope, topk)
            x, n = add_rms_norm(x, h, self.post_attention_layernorm)
            return x + self.mlp(n), topk
        # MLA: token-wise parts (eager, or compiled graphs for decode / verify) around the paged attention
        cfg = attn.cfg
        absorb = max(batch.q_lens) <= MLA_ABSORB_MAX_Q
        g = self.graphs if absorb else EAGER
        cos, sin = rope.lookup(batch.positions, x.dtype)
        experts, experts_w = self._experts_in_graph(g, batch)
        w = self._args(g, (batch.max_kv_len > cfg.index_topk, absorb), experts_w)
        if g.compiled and batch.uniform_q:
            (x, h, y, routing), topk = g.run_layer(attn, x, cos, sin, batch, pool, topk, w)
        else:
            t = g.tokenwise(x, cos, sin, w.pre, w.dims)
            o, topk = attn.attend(t, batch, pool, topk)
            x, h, y, routing = g.after_attention(x, o, w.post)
        if routing is not None:
            x = x + finish_ffn(experts, h, y, routing)
        return x, topk

    def graph_args(self, batch: ForwardBatch) -> LayerWeights | GQALayerWeights | None:
        """The weight arguments of this layer inside a whole-step graph (``GlmForCausalLM._stack_layers``),
        or None when its FFN cannot complete there (routed experts left to eager code)."""
        experts, experts_w = self._experts_in_graph(self.graphs, batch)
        if experts is not None and experts_w is None:
            return None
        cfg = self.self_attn.cfg
        return self._args(self.graphs, (cfg.is_mla and batch.max_kv_len > cfg.index_topk, True), experts_w)

    def _experts_in_graph(self, g: DecodeGraphs, batch: ForwardBatch) -> tuple[nn.Module | None, tuple | None]:
        """(the routed experts or None for a dense MLP, their dense weights when they run inside ``g``'s graph
        for this batch: ``DecodeGraphs.experts_in_graph``)."""
        experts = getattr(self.mlp, "experts", None)
        if experts is None:
            return None, None
        pairs = batch.num_tokens * self.self_attn.cfg.num_experts_per_tok
        return experts, g.experts_in_graph(experts, pairs, self.post_attention_layernorm.weight.dtype)

    def _args(self, g: DecodeGraphs, key: tuple[bool, bool], experts_w: tuple | None
              ) -> LayerWeights | GQALayerWeights:
        """The token-wise functions' weights. Compiled graphs take them collected once (weights are frozen
        while compiled), except the routed experts' dense weights: an MX layer's come from its DequantCache,
        which may drop and rebuild them."""
        full = key + (experts_w[2] if experts_w is not None else None,)
        w = self._frozen_args.get(full) if g.compiled else None
        if w is None:
            w = self._weight_args(*key, experts_w)
            if g.compiled:
                self._frozen_args[full] = w
        f = w.post.ffn
        if experts_w is not None and f.w13 is not experts_w[0]:
            w = replace(w, post=replace(w.post, ffn=f._replace(w13=experts_w[0], w2=experts_w[1], moe=experts_w[2])))
            if g.compiled:
                self._frozen_args[full] = w
        return w

    def _weight_args(self, need_topk: bool, absorb: bool, experts_w: tuple | None
                     ) -> LayerWeights | GQALayerWeights:
        """The token-wise functions' weights: ``mla_tokenwise``'s (GQA: ``gqa_tokenwise``'s) and ``layer_post``'s."""
        attn, pln = self.self_attn, self.post_attention_layernorm
        if not isinstance(attn, MLAAttention):  # GQA: ``gqa_tokenwise``'s, then o_proj on the heads' outputs
            post = PostWeights(w_uv=None, o_w=attn.o_proj.weight, o_b=attn.o_proj.bias, ln_w=pln.weight,
                               ln_eps=pln.eps, ffn=self.mlp.tokenwise_args(experts_w))
            return GQALayerWeights(attn.tokenwise_weights(self.input_layernorm), post)
        w_uv = attn.w_kv()[:, attn.cfg.qk_nope_head_dim:].transpose(1, 2) if absorb else None
        post = PostWeights(w_uv=w_uv, o_w=attn.o_proj.weight, o_b=attn.o_proj.bias, ln_w=pln.weight, ln_eps=pln.eps,
                           ffn=self.mlp.tokenwise_args(experts_w))
        return LayerWeights(attn.tokenwise_weights(self.input_layernorm), attn.dims(need_topk, absorb), post)


class MTPLayer(nn.Module):
    """Multi-token prediction layer (DeepSeek-V3 sec. 2.2; GLM stores it as ``model.layers.{N}``).

    h = block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])), logits = lm_head(shared_head_norm(h)),
    where h_i is the main model's final-normed hidden state at position i (as sglang and vLLM feed it).
    Its KV lives in pool layer ``num_hidden_layers + k``; the embedding and LM head are the main model's.
    """

    def __init__(self, cfg: ModelConfig, k: int, moe_impl: str = "auto",
                 parallel: ParallelConfig = SINGLE_RANK) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + k, moe_impl, parallel)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def narrow_copy(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` in bf16 when it is fp32 and every value is a bf16 value (a bf16 checkpoint served in fp32), else
    None: kernels that widen in registers then read half the bytes for the same products."""
    if w.dtype != torch.float32:
        return None
    narrow = w.detach().to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), w.detach()) else None


class GlmForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_impl: str = "auto", parallel: ParallelConfig = SINGLE_RANK) -> None:
        """``parallel``: this rank's share of a tensor-parallel worker (``engine.parallel``); the modules get
        their split shapes from ``parallel.rank_config(cfg)``. ``self.cfg`` stays the whole model's config."""
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        rcfg = parallel.rank_config(cfg)
        V, H = cfg.vocab_size, cfg.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(V, H, parallel) if parallel.is_tp else nn.Embedding(V, H)
        self.model.layers = nn.ModuleList([DecoderLayer(rcfg, i, moe_impl, parallel)
                                           for i in range(cfg.num_hidden_layers)])
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = VocabParallelHead(V, H, parallel) if parallel.is_tp else nn.Linear(H, V, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList([MTPLayer(rcfg, k, moe_impl, parallel) for k in range(cfg.num_mtp_layers)])
        self._rope: RotaryTable | None = None
        self._lm_narrow: torch.Tensor | None = None
        """The fp32 LM head's exact bf16 copy for batch-1 steps (``HeadWeights.lm_w_narrow``; ``compile_decode``)."""

    def compile_decode(self, enabled: bool = True) -> None:
        """Run the token-wise parts of every MLA layer (the MTP layers' too) through compiled graphs in
        decode and verify steps (``engine.layers.decode_graph``); ``False`` returns to eager. Graphs
        compile on first use (seconds per shape class; inductor caches them on disk). The weights the graphs
        read are collected once: after changing weights, call this again. A model without MTP layers never
        runs verify steps, so its bf16 / fp16 routed experts run inside the graphs too
        (``DecodeGraphs.exact_verify``)."""
        if enabled and self.parallel.is_tp:
            logger.warning("tensor parallel (tp_size %d): decode steps run EAGERLY, not through compiled graphs "
                           "(the all_reduces between a layer's attention and FFN are not inside the graphs yet); "
                           "expect slower decode steps than a compiled tp_size 1 worker", self.parallel.tp_size)
            enabled = False  # also: HeadWeights assume one rank holds the whole, unpadded vocab
        g = DecodeGraphs(True, self.lm_head.weight.device, exact_verify=self.has_mtp) if enabled else EAGER
        # only a model that never verifies reads it (``_run_stack``): no copy for one with MTP layers
        self._lm_narrow = narrow_copy(self.lm_head.weight) if enabled and not self.has_mtp else None
        for layer in list(self.model.layers) + [m.block for m in self.mtp]:
            layer.graphs = g
            layer._frozen_args.clear()

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def rope(self) -> RotaryTable:
        dev = self.lm_head.weight.device
        if self._rope is None or self._rope.inv_freq.device != dev:
            self._rope = RotaryTable(self.cfg.rotary_dim, self.cfg.rope_theta, dev)
        return self._rope

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, nn.Linear):  # a few rows: our GEMV where enabled (engine.layers.cpu_gemv)
            return linear(hidden, self.lm_head.weight).float()
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> ForwardResult:
        rope = self.rope()
        layers = self._stack_layers(self.model.layers, batch, pool)
        if layers is not None:  # one compiled graph for the whole step
            return self._run_stack(layers, batch, pool, self.model.norm, all_logits)
        x = self.model.embed_tokens(batch.input_ids)
        topk = None
        for layer in self.model.layers:
            x, topk = layer(x, batch, pool, rope, topk)
            if batch.on_layer_done is not None:
                batch.on_layer_done(layer.layer_idx)
        hidden = self.model.norm(x)
        sel = hidden if all_logits else hidden.index_select(0, batch.logits_index)
        return ForwardResult(self.logits(sel), hidden)

    def _run_stack(self, layers: list, batch: ForwardBatch, pool: KVPool, norm: RMSNorm, all_logits: bool,
                   mtp: MTPInput | None = None) -> ForwardResult:
        cos, sin = self.rope().lookup(batch.positions, self.lm_head.weight.dtype)
        g = layers[0][0].graphs
        w = self.lm_head.weight
        narrow = self._lm_narrow  # None for a model that verifies (``compile_decode``)
        head = HeadWeights(self.model.embed_tokens.weight, norm.weight, norm.eps, w,
                           row_gemv=not g.exact_verify and (w.dtype in REDUCED_PRECISION or narrow is not None),
                           lm_w_narrow=narrow)
        logits, hidden = g.run_stack(
            [(layer.self_attn, w) for layer, w in layers], batch, pool, batch.input_ids, cos, sin, head, all_logits,
            mtp)
        return ForwardResult(logits, hidden)

    def _stack_layers(self, layers: list, batch: ForwardBatch, pool: KVPool) -> list | None:
        """``[(layer, weight args)]`` when this decode / verify step can run as one compiled graph: every layer
        on compiled graphs (MLA or GQA), every FFN complete inside (no routed experts left to eager code), requests
        with equal query counts, no per-layer hook (fp8 pools included)."""
        g = layers[0].graphs
        if (not g.compiled or batch.on_layer_done is not None or not batch.uniform_q
                or max(batch.q_lens) > MLA_ABSORB_MAX_Q):
            return None
        out = []
        for layer in layers:
            args = layer.graph_args(batch)
            if args is None:
                return None
            out.append((layer, args))
        return out

    def _mtp_input(self, m: MTPLayer, batch: ForwardBatch, prev_hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]): the MTP block's input."""
        e = m.enorm(self.model.embed_tokens(batch.input_ids))
        return m.eh_proj(torch.cat([e, m.hnorm(prev_hidden)], dim=-1))

    @torch.inference_mode()
    def mtp_kv(self, batch: ForwardBatch, pool: KVPool, prev_hidden: torch.Tensor, k: int = 0) -> None:
        """Write MTP layer ``k``'s KV for ``batch`` (inputs as ``forward_mtp``) and nothing else: the KV of a
        position depends only on the layer's input there, so a prompt pass whose MTP outputs nobody reads
        (the prefill worker's) skips the layer's attention, DSA indexer, MoE and LM head. Bit for bit the
        KV ``forward_mtp`` writes."""
        m = self.mtp[k]
        x = self._mtp_input(m, batch, prev_hidden)
        m.block.self_attn.write_kv(m.block.input_layernorm(x), batch, pool, self.rope())
        if batch.on_layer_done is not None:
            batch.on_layer_done(m.block.layer_idx)

    @torch.inference_mode()
    def forward_mtp(self, batch: ForwardBatch, pool: KVPool, prev_hidden: torch.Tensor, k: int = 0,
                    all_logits: bool = False) -> ForwardResult:
        """Run MTP layer ``k``: ``batch.input_ids`` are the *next* tokens t_{i+1}, ``prev_hidden`` [T, H]
        the hidden states h_i at the same positions. Returns logits for t_{i+2} and the layer's
        normed output (fed back as ``prev_hidden`` when chaining drafts)."""
        m = self.mtp[k]
        layers = self._stack_layers([m.block], batch, pool)
        if layers is not None:  # one compiled graph for the whole draft step
            if not prev_hidden.is_inference():  # callers stack hidden states outside inference mode: one
                prev_hidden = prev_hidden.clone()  # kind of tensor, one graph (dispatch keys are guarded)
            mtp = MTPInput(prev_hidden, m.enorm.weight, m.enorm.eps, m.hnorm.weight, m.hnorm.eps, m.eh_proj.weight)
            return self._run_stack(layers, batch, pool, m.shared_head_norm, all_logits, mtp)
        x, _ = m.block(self._mtp_input(m, batch, prev_hidden), batch, pool, self.rope(), None)
        if batch.on_layer_done is not None:
            batch.on_layer_done(m.block.layer_idx)
        hidden = m.shared_head_norm(x)
        sel = hidden if all_logits else hidden.index_select(0, batch.logits_index)
        return ForwardResult(self.logits(sel), hidden)
