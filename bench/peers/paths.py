"""Where the peers live (``bench/peers/setup.sh`` puts them there): one place for every peer script."""
from __future__ import annotations

import os
from typing import NamedTuple

from common.env import child_environ, peers_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PeerPaths(NamedTuple):
    """The files of a set-up peers directory."""

    root: str
    """``$PDSERVE_PEERS_DIR`` (default ``.peers/`` at the repository root)."""

    @property
    def vllm_python(self) -> str:
        return os.path.join(self.root, "vllm", "bin", "python")

    @property
    def vllm(self) -> str:
        return os.path.join(self.root, "vllm", "bin", "vllm")

    @property
    def llama_server(self) -> str:
        return os.path.join(self.root, "llama", "bin", "llama-server")

    @property
    def llama_bench(self) -> str:
        return os.path.join(self.root, "llama", "bin", "llama-bench")

    @property
    def llama_batched_bench(self) -> str:
        return os.path.join(self.root, "llama", "bin", "llama-batched-bench")

    @property
    def llama_python(self) -> str:
        return os.path.join(self.root, "llama", "venv", "bin", "python")

    @property
    def gguf_converter(self) -> str:
        return os.path.join(self.root, "llama", "convert_hf_to_gguf.py")

    def has_vllm(self) -> bool:
        return os.path.exists(os.path.join(self.root, "vllm", ".done"))

    def has_llama(self) -> bool:
        return os.path.exists(os.path.join(self.root, "llama", ".done"))


def peer_paths(env: dict[str, str] | None = None) -> PeerPaths:
    """The peers directory named by ``PDSERVE_PEERS_DIR`` in ``env`` (default: os.environ), else ``.peers/``."""
    return PeerPaths(os.path.abspath(peers_dir(env) or os.path.join(REPO, ".peers")))


def default_cores(threads: int) -> str:
    """vLLM's OpenMP binding for ``threads`` threads: cores 0..threads-1 (``0`` for one)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def vllm_env(threads: int, cores: str, kv_space_gib: int = 2) -> dict[str, str]:
    """The environment vLLM's CPU backend runs with here: its OpenMP threads bound to ``cores`` (both cores,
    not vLLM's default of leaving one for the front end), ``kv_space_gib`` GiB of KV cache."""
    # pdserve's packages (engine, router, ...) must not shadow the peer's imports
    env = child_environ(drop=("PYTHONPATH",))
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
               OMP_NUM_THREADS=str(threads), VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env
