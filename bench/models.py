"""Benchmark models: the peers' reference tiny Glm4Moe and a GLM-5-architecture equivalent."""
from __future__ import annotations

PEER_GLM4MOE = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=32000, hidden_size=256,
    intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=32768, partial_rotary_factor=0.5,
    rope_theta=10000.0, use_qk_norm=False, attention_bias=True, eos_token_id=1, bos_token_id=0,
    tie_word_embeddings=False, rms_norm_eps=1e-5, hidden_act="silu", norm_topk_prob=True,
    routed_scaling_factor=1.0,
)
"""REFERENCE.md's peer model: hidden 256, 4 layers (layer 0 dense), 4 heads / 2 KV heads, head_dim 64,
16 experts top-4 + 1 shared, moe_inter 128."""

PEER_GLM5 = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=32000, hidden_size=256,
    intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
    v_head_dim=64, qk_nope_head_dim=64, index_topk=2048, index_head_dim=64, index_n_heads=4,
    first_k_dense_replace=1, max_position_embeddings=32768, rope_parameters={"rope_theta": 10000.0,
    "rope_type": "default"}, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-5,
    hidden_act="silu", norm_topk_prob=True,
)
"""The same scale in the GLM-5 architecture (MLA + DSA with index_topk 2048)."""

MEDIUM_GLM4MOE = dict(
    PEER_GLM4MOE, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, head_dim=128, n_routed_experts=64, num_experts_per_tok=8,
)
"""Issue 44's bandwidth-bound model: the peers' glm4_moe at hidden 2048, 8 layers (layer 0 dense, width 5632),
16 heads / 4 KV heads of 128, 64 experts top-8 of width 512 + 1 shared, vocab 32000: 1.68 G parameters (3.4 GB
bf16); a batch-1 token reads ~509 MB with MXFP4 routed experts (``bench.bench_roofline`` counts them)."""
