"""The peers' tiny ``glm4_moe`` checkpoint, in the layouts each server loads.

    PYTHONPATH=$PWD .venv/bin/python -m bench.peers.checkpoint OUT_DIR [--gguf]

Writes ``OUT_DIR/hf`` (config.json + bf16 model.safetensors with random weights, ``bench.models.PEER_GLM4MOE``:
hidden 256, 4 layers, 16 experts top-4 + 1 shared, vocabulary 32000) with the default model's byte-level BPE
tokenizer (2048 tokens; ids above it exist in the model only), and with ``--gguf`` ``OUT_DIR/model-bf16.gguf``
converted by llama.cpp's ``convert_hf_to_gguf.py`` in the peers' llama venv (``bench/peers/gguf_convert.py``).
Idempotent: files already there are kept.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess

import torch

from bench.models import PEER_GLM4MOE
from bench.peers.paths import REPO, peer_paths
from common.env import child_environ
from engine.checkpoint import init_random_model

TOKENIZER_SOURCE = os.path.join(REPO, "models", "glm5-tiny")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_hf(out_dir: str) -> str:
    """``out_dir/hf`` (created once; seed 0, so every machine gets the same weights); returns its path."""
    hf = os.path.join(out_dir, "hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        os.makedirs(hf, exist_ok=True)
        init_random_model(PEER_GLM4MOE, hf, seed=0, dtype=torch.bfloat16)
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(TOKENIZER_SOURCE, name), os.path.join(hf, name))
    return hf


def write_gguf(out_dir: str) -> str:
    """``out_dir/model-bf16.gguf`` from ``out_dir/hf`` (needs the llama peer); returns its path."""
    hf, gguf = write_hf(out_dir), os.path.join(out_dir, "model-bf16.gguf")
    if not os.path.exists(gguf):
        peers = peer_paths()
        if not peers.has_llama():
            raise SystemExit(f"llama.cpp peer not set up in {peers.root}: run bench/peers/setup.sh llama")
        env = child_environ(drop=("PYTHONPATH",))
        subprocess.run([peers.llama_python, os.path.join(REPO, "bench", "peers", "gguf_convert.py"),
                        os.path.dirname(os.path.realpath(peers.gguf_converter)), hf, "--outtype", "bf16",
                        "--outfile", gguf + ".part"], check=True, env=env)
        os.replace(gguf + ".part", gguf)
    return gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--gguf", action="store_true", help="also the bf16 GGUF for llama.cpp")
    args = ap.parse_args()
    print(write_hf(args.out_dir))
    if args.gguf:
        print(write_gguf(args.out_dir))


if __name__ == "__main__":
    main()
