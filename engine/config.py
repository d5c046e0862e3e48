"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen dataclass covers both served architectures:

* ``glm_moe_dsa`` (GLM-5): MLA attention + DSA sparse indexer + MoE, MTP layer(s).
* ``glm4_moe`` (GLM-4.5/4.6): GQA attention with partial rotary + MoE, MTP layer(s).

Only the fields the runtime reads are kept; unknown fields are ignored, unsupported
values (a RoPE scaling type we do not implement, an activation other than SiLU) raise.
"""
from __future__ import annotations

import json

import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "glm4_moe")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    """``glm_moe_dsa`` or ``glm4_moe``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the dense MLP layers (the first ``first_k_dense_replace``)."""
    moe_intermediate_size: int
    """Width of one routed expert; the shared expert is ``n_shared_experts`` times this."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """GQA head dim (glm4_moe). For MLA this is ``qk_rope_head_dim`` as in transformers."""
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    """glm4_moe: fraction of ``head_dim`` that is rotated (rotate-half layout)."""
    rope_mscale: float
    """Softmax-scale multiplier from YaRN's ``mscale_all_dim`` (1.0 without YaRN)."""
    attention_bias: bool
    use_qk_norm: bool
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    """Per layer ``dense`` or ``sparse`` (MoE)."""
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_position_embeddings: int
    num_mtp_layers: int
    """MTP layers stored as ``model.layers.{num_hidden_layers + k}.*``."""
    # MLA / DSA (glm_moe_dsa only; zero otherwise)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = field(default_factory=tuple)
    """Per layer ``full`` (runs its indexer) or ``shared`` (reuses the previous top-k)."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The parsed config.json, kept for writing checkpoints back."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.is_mla and self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a shared layer needs a previous top-k")

    @property
    def is_mla(self) -> bool:
        return self.model_type == "glm_moe_dsa"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dims per head."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        base = self.qk_head_dim ** -0.5 if self.is_mla else self.head_dim ** -0.5
        return base * self.rope_mscale * self.rope_mscale

    @property
    def num_layers_total(self) -> int:
        """Main layers plus MTP layers: the KV pool holds one slot per layer of both."""
        return self.num_hidden_layers + self.num_mtp_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        if layer_idx >= self.num_hidden_layers:  # MTP blocks are MoE in GLM checkpoints
            return self.n_routed_experts > 0 and self.mlp_layer_types[-1] == "sparse"
        return self.mlp_layer_types[layer_idx] == "sparse"

    def indexer_type(self, layer_idx: int) -> str:
        if layer_idx >= self.num_hidden_layers:  # the MTP block always runs its own indexer
            return "full"
        return self.indexer_types[layer_idx]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        n_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        mscale = 1.0
        if rope_type != "default":
            if rope_type != "yarn":
                raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
            raise ValueError("YaRN RoPE scaling is not implemented yet; refusing to serve with wrong positions")
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                                   0.5 if model_type == "glm4_moe" else 1.0)))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu')")
        first_dense = int(cfg.get("first_k_dense_replace", 1 if model_type == "glm4_moe" else 3))
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(first_dense, n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_mtp = int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)
        kwargs: dict = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rope_mscale=mscale,
            attention_bias=bool(cfg.get("attention_bias", False)),
            use_qk_norm=bool(cfg.get("use_qk_norm", False)),
            n_routed_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0)) or 0),
            n_shared_experts=int(cfg.get("n_shared_experts", 0) or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            n_group=int(cfg.get("n_group", 1) or 1),
            topk_group=int(cfg.get("topk_group", 1) or 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            mlp_layer_types=tuple(mlp_types),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            num_mtp_layers=num_mtp,
            raw=dict(cfg),
        )
        if model_type == "glm_moe_dsa":
            indexer_types = cfg.get("indexer_types") or ["full"] * n_layers
            kwargs.update(
                q_lora_rank=int(cfg["q_lora_rank"]),
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"]),
                index_topk=int(cfg.get("index_topk", 2048)),
                index_head_dim=int(cfg.get("index_head_dim", 128)),
                index_n_heads=int(cfg.get("index_n_heads", 32)),
                indexer_types=tuple(indexer_types),
                head_dim=int(cfg["qk_rope_head_dim"]),
            )
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


