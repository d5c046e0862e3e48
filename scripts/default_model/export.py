"""Write a ``TrainModel`` in the Hugging Face layout GLM-5 checkpoints use.

* main model: transformers' names, except the fused experts (``gate_up_proj [E, 2I, H]``,
  ``down_proj [E, H, I]``) become ``mlp.experts.{e}.{gate,up,down}_proj.weight`` as in GLM checkpoints;
* MTP layer ``model.layers.{N}.*``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the decoder
  block's tensors, and copies of the shared ``embed_tokens`` / ``shared_head.head`` (GLM ships them;
  pdserve and sglang ignore them and use the main model's, transformers ignores the whole layer);
* dtype: bf16, except the router (``mlp.gate.weight``, ``e_score_correction_bias``) and the DSA
  indexer's ``weights_proj`` which stay fp32 (what the engine and transformers keep in fp32).

The directory is written next to ``out_dir`` and renamed into place, so a reader (the default-model
lookup of every ``pdserve`` command) never sees a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch
from safetensors.torch import save_file

from scripts.default_model.data import BOS, EOS

KEEP_FP32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")


def _split_experts(name: str, t: torch.Tensor, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith("mlp.experts.gate_up_proj"):                 # [E, 2I, H]: gate rows first
        base = name[: -len("gate_up_proj")]
        for e in range(t.shape[0]):
            yield f"{base}{e}.gate_proj.weight", t[e, :inter]
            yield f"{base}{e}.up_proj.weight", t[e, inter:]
    elif name.endswith("mlp.experts.down_proj"):                  # [E, H, I]
        base = name[: -len("down_proj")]
        for e in range(t.shape[0]):
            yield f"{base}{e}.down_proj.weight", t[e]
    else:
        yield name, t


def checkpoint_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of ``model`` (a ``TrainModel``)."""
    cfg = model.hf.config
    N, inter = cfg.num_hidden_layers, cfg.moe_intermediate_size
    for name, t in model.hf.state_dict().items():
        yield from _split_experts(name, t, inter)
    prefix = f"model.layers.{N}."
    for name, t in model.mtp.state_dict().items():
        if name.startswith("block."):
            yield from _split_experts(prefix + name[len("block."):], t, inter)
        elif name.startswith("shared_head_norm."):
            yield prefix + "shared_head.norm." + name[len("shared_head_norm."):], t
        else:
            yield prefix + name, t
    yield prefix + "embed_tokens.weight", model.hf.model.embed_tokens.weight
    yield prefix + "shared_head.head.weight", model.hf.lm_head.weight


def config_dict(model, dtype: torch.dtype) -> dict:
    conf = model.hf.config.to_dict()
    for k in ("id2label", "label2id", "problem_type", "_name_or_path", "output_attentions", "output_hidden_states",
              "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "transformers_version"):
        conf.pop(k, None)
    conf["architectures"] = ["GlmMoeDsaForCausalLM"]
    conf["num_nextn_predict_layers"] = 1
    conf["dtype"] = str(dtype).removeprefix("torch.")
    return conf


CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
"""The default model writes Python: a chat is rendered as comments ("# user: ...") and the answer follows
"# assistant:" on a new line (served by ``/v1/chat/completions``, rendered as transformers renders it)."""


def export(model, tokenizer, out_dir: str, dtype: torch.dtype = torch.bfloat16,
           extra_files: dict[str, str] | None = None) -> str:
    """config.json, model.safetensors, tokenizer.json (+ tokenizer_config.json, ``extra_files``) into ``out_dir``."""
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = {}
    for name, t in checkpoint_tensors(model):
        if name in tensors:
            raise RuntimeError(f"duplicate checkpoint tensor {name}")
        keep32 = name.endswith(KEEP_FP32)
        tensors[name] = t.detach().to(torch.float32 if keep32 else dtype).contiguous().clone()
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config_dict(model, dtype), f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "add_bos_token": False, "model_max_length": model.hf.config.max_position_embeddings,
                   "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, f, indent=2)
        f.write("\n")
    for fname, text in (extra_files or {}).items():
        with open(os.path.join(tmp, fname), "w") as f:
            f.write(text)
    old = out_dir.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
