"""Training-time model: transformers' ``GlmMoeDsaForCausalLM`` plus an MTP module, and the losses.

The parameters live in transformers modules (``GlmMoeDsaForCausalLM`` for the main model, a
``GlmMoeDsaDecoderLayer`` for the MTP block), so export is a renaming. The *training* forward is
written here over those modules for speed on CPU: causal attention without the [B, 1, T, T] mask
tensors and without running the DSA indexer under ``no_grad`` every layer (transformers' own
forward stays the reference: ``check_against_transformers`` compares the two).

Losses (per token, mean over the batch):

* main LM: cross-entropy of t_{i+1};
* MTP (DeepSeek-V3 sec. 2.2): step 1 feeds ``[enorm(emb(t_{i+1})); hnorm(h_i)]`` with ``h_i`` the
  main model's *final-normed* hidden state (as the engine does) and predicts t_{i+2}; step 2 chains
  the MTP layer on its own normed output with ``emb(t_{i+2})`` and predicts t_{i+3}, which is how the
  speculative decoder drafts beyond depth 1. Weighted ``mtp_weight * (L1 + chain_weight * L2)``;
* DSA indexer warm-up (DeepSeek-V3.2 sec. 2.1.1): KL(p || softmax(indexer scores)), p = the main
  attention's probabilities summed over heads and L1-normalised; the indexer sees detached inputs,
  so it learns to mimic attention without changing the main model;
* MoE balance: no loss; ``balance_router_biases`` nudges ``e_score_correction_bias`` toward equal
  load after each step (DeepSeek-V3's auxiliary-loss-free strategy).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def glm_config(vocab_size: int, hidden: int = 128, num_layers: int = 4, num_heads: int = 4, q_lora: int = 96,
               kv_lora: int = 64, nope_dim: int = 32, rope_dim: int = 16, v_dim: int = 32, dense_inter: int = 384,
               moe_inter: int = 128, num_experts: int = 8, top_k: int = 2, index_heads: int = 4,
               index_dim: int = 32, index_topk: int = 128, max_positions: int = 4096, bos_id: int = 0,
               eos_id: int = 1):
    """A small ``glm_moe_dsa`` config: MLA, a DSA indexer in every layer, dense layer 0, MoE with a shared
    expert in the others, one MTP layer."""
    from transformers import GlmMoeDsaConfig  # lazy: transformers
    return GlmMoeDsaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=dense_inter, moe_intermediate_size=moe_inter,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        n_shared_experts=1, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=kv_lora, q_lora_rank=q_lora,
        qk_rope_head_dim=rope_dim, v_head_dim=v_dim, qk_nope_head_dim=nope_dim, index_topk=index_topk,
        index_head_dim=index_dim, index_n_heads=index_heads, first_k_dense_replace=1,
        max_position_embeddings=max_positions, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None, tie_word_embeddings=False,
        rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.02, num_nextn_predict_layers=1,
        architectures=["GlmMoeDsaForCausalLM"])


class MTPModule(nn.Module):
    """Checkpoint layout ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}`` + the block."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm  # lazy: transformers
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = GlmMoeDsaRMSNorm(H, eps)
        self.hnorm = GlmMoeDsaRMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        # the last main layer's index: an MoE layer with its own (full) indexer, as GLM's MTP block is
        self.block = GlmMoeDsaDecoderLayer(config, config.num_hidden_layers - 1)
        self.shared_head_norm = GlmMoeDsaRMSNorm(H, eps)


class Losses(NamedTuple):
    total: torch.Tensor
    main: torch.Tensor
    mtp: list[torch.Tensor]       # per chained MTP step
    indexer: torch.Tensor         # mean KL over the indexers of all layers (MTP block included)


def _rope(q_rot, k_rot, cos, sin, unsqueeze_dim):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave  # lazy: transformers
    return apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=unsqueeze_dim)


def indexer_kl(idx, h: torch.Tensor, q_resid: torch.Tensor, cos, sin, target: torch.Tensor,
               causal: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(index scores)) per query, averaged; mirrors ``GlmMoeDsaIndexer.forward``
    with gradients. ``target`` [B, T, T] rows sum to 1 over the causal keys."""
    B, T, _ = h.shape
    q = idx.wq_b(q_resid).view(B, T, idx.n_heads, idx.head_dim)               # [B, T, nI, D]
    q_rot, q_pass = q.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    k = idx.k_norm(idx.wk(h)).unsqueeze(2)                                      # [B, T, 1, D]
    k_rot, k_pass = k.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = _rope(q_rot, k_rot, cos, sin, 2)
    q = torch.cat([q_rot, q_pass], -1)
    k = torch.cat([k_rot, k_pass], -1).squeeze(2)                               # [B, T, D]
    nI = idx.n_heads
    # one [B, T * nI, D] @ [B, D, T] product instead of B * T tiny ones
    scores = F.relu(q.reshape(B, T * nI, -1) @ k.transpose(-1, -2) * idx.softmax_scale).view(B, T, nI, T)
    w = idx.weights_proj(h) * nI ** -0.5                                        # [B, T, nI]
    index_scores = (w.unsqueeze(-1) * scores).sum(2)                            # [B, T, T]
    logq = torch.log_softmax(index_scores.masked_fill(~causal, float("-inf")), -1).masked_fill(~causal, 0.0)
    return (torch.special.xlogy(target, target) - target * logq).sum(-1).mean()


def attention(attn, x: torch.Tensor, cos, sin, causal: torch.Tensor, want_indexer: bool):
    """Dense causal MLA attention of a ``GlmMoeDsaAttention`` (all tokens selected: the DSA top-k covers the
    training window). Returns (output [B, T, H], indexer KL or None)."""
    B, T, _ = x.shape
    nh, nope, rope, vd = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(B, T, nh, nope + rope).transpose(1, 2)     # [B, nh, T, nope + rope]
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_pass)).view(B, T, nh, nope + vd).transpose(1, 2)
    k_nope, v = kv.split([nope, vd], dim=-1)                                   # [B, nh, T, nope], [B, nh, T, vd]
    q_rot, k_rot = _rope(q_rot, k_rot.view(B, 1, T, rope), cos, sin, 1)
    q = torch.cat([q_pass, q_rot], -1)
    k = torch.cat([k_nope, k_rot.expand(B, nh, T, rope)], -1)
    kl = None
    if want_indexer and attn.indexer is not None:
        # explicit probabilities: the indexer's KL target is their sum over heads
        scores = (q @ k.transpose(-1, -2)) * attn.scaling                      # [B, nh, T, T]
        probs = torch.softmax(scores.masked_fill(~causal[:, None], float("-inf")), dim=-1)
        o = probs @ v
        target = probs.detach().sum(1) / nh                                     # [B, T, T], rows sum to 1
        kl = indexer_kl(attn.indexer, x.detach(), q_resid.detach(), cos, sin, target, causal)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, nh * vd)), kl


def moe(mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``GlmMoeDsaMoE`` forward that also returns the per-expert token counts [E]."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, idx = mlp.gate(flat)
    out = mlp.experts(flat, idx, weights) + mlp.shared_experts(flat)
    counts = torch.bincount(idx.flatten(), minlength=mlp.gate.num_experts)
    return out.view_as(x), counts


def decoder_layer(layer, x, cos, sin, causal, want_indexer):
    """(x, indexer KL or None, expert counts or None) for one ``GlmMoeDsaDecoderLayer``."""
    h, kl = attention(layer.self_attn, layer.input_layernorm(x), cos, sin, causal, want_indexer)
    x = x + h
    hn = layer.post_attention_layernorm(x)
    if hasattr(layer.mlp, "gate"):
        m, counts = moe(layer.mlp, hn)
    else:
        m, counts = layer.mlp(hn), None
    return x + m, kl, counts


class TrainModel(nn.Module):
    """``hf`` (a ``GlmMoeDsaForCausalLM``) + ``mtp`` (an ``MTPModule``)."""

    def __init__(self, config, seed: int = 0) -> None:
        super().__init__()
        from transformers import GlmMoeDsaForCausalLM  # lazy: transformers
        torch.manual_seed(seed)
        config._attn_implementation = "eager"
        self.hf = GlmMoeDsaForCausalLM(config)
        self.mtp = MTPModule(config)
        with torch.no_grad():
            for m in self.mtp.modules():  # the standalone block is not covered by post_init
                self.hf._init_weights(m)
                if hasattr(m, "weight") and isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()
            for name, p in self.mtp.named_parameters():
                if name.endswith("norm.weight") or name.endswith(("enorm.weight", "hnorm.weight")):
                    p.fill_(1.0)

    def moe_gates(self) -> list[nn.Module]:
        layers = list(self.hf.model.layers) + [self.mtp.block]
        return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]

    def forward(self, windows: torch.Tensor, mtp_steps: int, mtp_weight: float, chain_weight: float,
                indexer: bool) -> tuple[Losses, list[torch.Tensor]]:
        """``windows`` [B, T + 1 + mtp_steps]. Returns the losses and per-MoE-layer expert counts."""
        B, W = windows.shape
        T = W - 1 - mtp_steps
        hf, mtp = self.hf, self.mtp
        pos = torch.arange(T)[None].expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
        embed = hf.model.embed_tokens
        x = embed(windows[:, :T])
        cos, sin = hf.model.rotary_emb(x, pos)
        kls, counts = [], []
        for layer in hf.model.layers:
            x, kl, c = decoder_layer(layer, x, cos, sin, causal, indexer)
            kls += [kl] if kl is not None else []
            counts += [c] if c is not None else []
        h = hf.model.norm(x)                                                       # final-normed h_i
        vocab = hf.config.vocab_size
        main = F.cross_entropy(hf.lm_head(h).view(-1, vocab), windows[:, 1:T + 1].reshape(-1))
        mtp_losses = []
        for d in range(1, mtp_steps + 1):
            e = mtp.enorm(embed(windows[:, d:T + d]))                               # t_{i+d}
            y = mtp.eh_proj(torch.cat([e, mtp.hnorm(h)], -1))
            y, kl, c = decoder_layer(mtp.block, y, cos, sin, causal, indexer and d == 1)
            kls += [kl] if kl is not None else []
            counts += [c] if c is not None and d == 1 else []
            h = mtp.shared_head_norm(y)                                             # fed to the next chained step
            mtp_losses.append(F.cross_entropy(hf.lm_head(h).view(-1, vocab), windows[:, d + 1:T + d + 1].reshape(-1)))
        kl = torch.stack(kls).mean() if kls else torch.zeros(())
        total = main + kl
        for d, loss in enumerate(mtp_losses):
            total = total + mtp_weight * (1.0 if d == 0 else chain_weight) * loss
        return Losses(total, main, mtp_losses, kl), counts


@torch.no_grad()
def balance_router_biases(gates: list[nn.Module], counts: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): bias += rate * sign(mean load - load)."""
    for gate, c in zip(gates, counts):
        c = c.float()
        gate.e_score_correction_bias += rate * torch.sign(c.mean() - c)


@torch.no_grad()
def check_against_transformers(model: TrainModel, windows: torch.Tensor) -> float:
    """Max |logit difference| between this module's main forward and transformers' own forward."""
    hf = model.hf
    T = windows.shape[1]
    indexers = [layer.self_attn.indexer for layer in hf.model.layers if layer.self_attn.indexer is not None]
    saved = [i.index_topk for i in indexers]
    for i in indexers:  # select every token: training attention is dense
        i.index_topk = max(i.index_topk, T)
    ref = hf(input_ids=windows).logits
    for i, k in zip(indexers, saved):
        i.index_topk = k
    pos = torch.arange(T)[None].expand(windows.shape[0], T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(windows.shape[0], T, T)
    x = hf.model.embed_tokens(windows)
    cos, sin = hf.model.rotary_emb(x, pos)
    for layer in hf.model.layers:
        x, _, _ = decoder_layer(layer, x, cos, sin, causal, False)
    ours = hf.lm_head(hf.model.norm(x))
    return (ours - ref).abs().max().item()
