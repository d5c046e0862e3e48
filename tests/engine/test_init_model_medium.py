"""``init-model --preset medium``: the streaming writer and the benchmark model's configuration."""
import json
import os

import torch

from engine.checkpoint import MEDIUM_GLM5, TINY_GLM5, hf_tensors, init_random_model_streaming
from engine.config import ModelConfig
from engine.loader import checkpoint_names
from engine.models.glm import GlmForCausalLM
from engine.load import load_model


def test_streaming_writer_shards_per_layer_and_loads(tmp_path):
    stats = init_random_model_streaming(TINY_GLM5, str(tmp_path), seed=3)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    # one shard per decoder layer (3 + the MTP layer) plus embeddings / head / final norm
    assert files == ["model-layer000.safetensors", "model-layer001.safetensors", "model-layer002.safetensors",
                     "model-layer003.safetensors", "model-other.safetensors"]
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(checkpoint_names(str(tmp_path)))
    assert index["metadata"]["total_size"] == stats["num_bytes"]
    model, cfg = load_model(str(tmp_path), "bfloat16", "cpu")  # strict loader: every tensor present, right shape
    assert cfg.num_mtp_layers == 1
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_medium_preset_is_the_documented_size():
    cfg = ModelConfig.from_dict(MEDIUM_GLM5)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.index_topk, cfg.num_mtp_layers) == ("glm_moe_dsa", 2048, 8, 64, 8, 512,
                                                                               2048, 1)
    with torch.device("meta"):
        meta = GlmForCausalLM(cfg, "auto")
    sizes = [(n, t.numel()) for n, t in hf_tensors(meta, cfg)]
    total = sum(n for _, n in sizes)
    experts = sum(n for name, n in sizes if ".mlp.experts." in name)
    assert total == 1_973_149_440 and experts == 1_610_612_736  # 3.95 GB bf16; experts 3.2 GB (docs/performance.md)
