"""Tensor-parallel pieces of the model: vocab-parallel embedding and LM head, a decoder layer's TP forward,
expert-parallel dispatch.

A decoder layer at tp_size > 1 (``tp_layer_forward``) runs eagerly::

    x = x + all_reduce(o_proj(attention(norm(x))))        this rank's heads; o_proj row-parallel
    x = x + all_reduce(ffn(norm(x)))                      dense MLP / shared experts column -> row parallel,
                                                          plus this rank's routed-expert contributions

so a layer costs two all_reduces of ``[T, hidden]``, and every rank holds the same ``x`` between layers. What
every rank computes identically (replicated weights, identical inputs): the norms, MLA's q_a / kv_a
projections and latent KV, the DSA indexer and its top-k, the MoE router's choice.

Why MLA keeps its latent KV (and the DSA indexer keys) REPLICATED on every rank instead of sharding the page
pool: the latent (kv_lora_rank + rope dims per token) is one vector shared by ALL query heads; each rank's
heads read every token's whole latent. Sharding the pool by tokens or by latent dims would need a gather of
the context's latents (or partial attention scores) every step and layer, i.e. communication growing with
the context length; replicating costs each rank the full KV bytes (the latent is ~1/10 of what per-head K/V
would be, the reason MLA exists) and no communication beyond the layer's two all_reduces. The cost in numbers:
GLM-5's latent + rope key + indexer key are 512 + 64 + 128 values per token per layer, 1408 bytes in bf16, held by
each of the tp ranks (a TP4 worker holds 4 copies of its KV: its pool admits as many tokens per rank as a TP1
worker's would with the same memory left after weights). The indexer is
replicated for the same reason (its keys are per token, its top-k is needed by every rank's heads).
GQA (glm4_moe) instead splits its KV heads: rank r's pool holds heads ``[r*h, (r+1)*h)`` only.

Expert parallelism (``moe_parallel="ep"``): rank r holds experts ``[r*E/tp, (r+1)*E/tp)``. Activations are
replicated after the attention's all_reduce and routing is computed identically on every rank, so a rank
runs only the (token, expert) pairs routed to its experts (``ep_experts``) and the FFN's one all_reduce
combines them: no all-to-all dispatch is needed at these sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.kvcache.pool import KVPool
from engine.layers.mlp import MoE, ffn_tokenwise
from engine.layers.rotary import RotaryTable
from engine.moe.router import Routing
from engine.parallel.config import ParallelConfig
from engine.parallel.group import all_gather_last, all_reduce_


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split over the ranks: rank r holds ids ``pc.vocab_split(V)`` of the vocab
    padded to a multiple of tp_size (the rows past ``V`` are zeros no id looks up: input ids are < V); ids of
    other ranks look up zeros and the all_reduce fills them in (exact: one nonzero term per element)."""

    def __init__(self, vocab_size: int, hidden: int, pc: ParallelConfig) -> None:
        super().__init__()
        own = pc.vocab_split(vocab_size)
        self.first, self.num_rows = own.start, own.stop - own.start
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class VocabParallelHead(nn.Module):
    """The LM head with its (padded) vocab rows split over the ranks as ``VocabParallelEmbedding``'s: each
    computes its logits slice, the all_gather hands every rank the full ``[N, V]`` logits (rank order = vocab
    order) and drops the padding's columns, so no consumer ever sees a padded id."""

    def __init__(self, vocab_size: int, hidden: int, pc: ParallelConfig) -> None:
        super().__init__()
        own = pc.vocab_split(vocab_size)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(own.stop - own.start, hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last(F.linear(hidden, self.weight), self.vocab_size)  # [N, V]


def ep_experts(moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """This rank's experts' share of the routed output ``[T, H]``: each (token, expert) pair whose expert lives
    here runs as one row routed to one local expert (any strategy of the experts module), weighted as routed,
    summed back per token; other pairs contribute nothing (their rank adds them in the all_reduce)."""
    local = routing.ids - moe.expert_offset  # [T, K]
    mine = (local >= 0) & (local < moe.num_local_experts)
    tok, k = mine.nonzero(as_tuple=True)
    out = torch.zeros_like(x)
    if tok.numel() == 0:
        return out
    pairs = Routing(local[tok, k].unsqueeze(1), routing.weights[tok, k].unsqueeze(1))  # [P, 1]
    return out.index_add_(0, tok, moe.experts(x.index_select(0, tok), pairs))


def tp_ffn(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The FFN's partial output on this rank (before the all_reduce): a dense MLP's row-parallel down_proj; an
    MoE block's shared experts (row-parallel) plus its routed experts (``tp``: each expert's intermediate
    slice; ``ep``: whole local experts)."""
    if not isinstance(mlp, MoE):
        return mlp(h)
    shared, routing = ffn_tokenwise(h, mlp.tokenwise_args())
    routed = ep_experts(mlp, h, routing) if mlp.expert_parallel else mlp.experts(h, routing)
    return routed if shared is None else routed + shared


def tp_layer_forward(layer: nn.Module, x: torch.Tensor, batch: ForwardBatch, pool: KVPool, rope: RotaryTable,
                     topk):
    """``DecoderLayer.forward`` at tp_size > 1 (eager): see the module docstring."""
    h, topk = layer.self_attn(layer.input_layernorm(x), batch, pool, rope, topk)
    x = x + all_reduce_(h)
    return x + all_reduce_(tp_ffn(layer.mlp, layer.post_attention_layernorm(x))), topk
