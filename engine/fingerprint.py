"""A checkpoint's files and its fingerprint, stdlib only: launchers and the router's side of a cluster compare
models without loading torch (``engine.loader`` re-exports both)."""
from __future__ import annotations

import hashlib
import json
import os


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor, shapes/dtypes and the rule."""


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"no .safetensors files in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


def model_hash(model_dir: str) -> str:
    """Fingerprint of a checkpoint: config.json plus every safetensors header and size (fast: no weights
    are read). Workers compare it at start so a cluster never mixes two different models."""
    h = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))
        h.update(str(os.path.getsize(path)).encode())
    return h.hexdigest()[:16]
