"""Helpers more than one test directory needs, in one home (``tests/`` is on ``sys.path``: pytest puts the
directory of ``tests/conftest.py`` there, and spawned test processes inherit it)."""
from __future__ import annotations

import time

TINY_GQA_MTP = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=128, hidden_size=64,
                    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
                    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0,
                    partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, eos_token_id=1,
                    bos_token_id=0, tie_word_embeddings=False, num_nextn_predict_layers=1)
"""GLM-4.5 architecture (GQA, 2 KV heads: one per rank at TP2) with an MTP layer."""

TINY_MOE = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=128, hidden_size=64,
                intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4,
                n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                max_position_embeddings=4096, rope_theta=10000.0, partial_rotary_factor=0.5, use_qk_norm=True,
                attention_bias=True, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
"""GLM-4.5 architecture, 3 layers (one dense), 8 experts top-4, no MTP: the CPU kernels' model tests."""


def wait_until(cond, timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.1):
    """``cond()``'s first truthy value, polled every ``interval_s``; AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
