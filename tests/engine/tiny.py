"""Factories for tiny random GLM checkpoints built and saved with transformers (the reference)."""
from __future__ import annotations

import contextlib

import torch

DSA_CFG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=8,
    first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0, eos_token_id=1, bos_token_id=0,
    pad_token_id=None, tie_word_embeddings=False, rms_norm_eps=1e-5,
)

GQA_CFG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
    max_position_embeddings=4096, rope_theta=10000.0, partial_rotary_factor=0.5, use_qk_norm=True,
    attention_bias=True, eos_token_id=1, bos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
)


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A tiny random transformers model (fp32, eval) with non-trivial router biases."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    if kind == "dsa":
        cfg = GlmMoeDsaConfig(**{**DSA_CFG, **overrides})
        model = GlmMoeDsaForCausalLM(cfg)
    else:
        cfg = Glm4MoeConfig(**{**GQA_CFG, **overrides})
        model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for name, b in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                b.uniform_(0.8, 1.2)
    return model.eval()


def stable_topk(scores, k):
    """The reference rule: sort by score, equal scores in position order (a stable sort), keep k."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


@contextlib.contextmanager
def transformers_ties_by_position():
    """transformers' DSA indexer with equal scores ordered by position, as pdserve orders them."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
    orig_forward, orig_topk = m.GlmMoeDsaIndexer.forward, torch.Tensor.topk

    def topk(t, k, dim=-1, largest=True, sorted=True):
        assert dim == -1 and largest
        idx = stable_topk(t + 0.0, k)
        return torch.return_types.topk((t.gather(-1, idx), idx))

    def forward(self, *args, **kwargs):
        torch.Tensor.topk = topk
        try:
            return orig_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = orig_topk

    m.GlmMoeDsaIndexer.forward = forward
    try:
        yield
    finally:
        m.GlmMoeDsaIndexer.forward = orig_forward
