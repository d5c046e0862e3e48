"""Every ``PDSERVE_*`` environment variable pdserve reads, read here and nowhere else (stdlib only).

Each is read when its function is called (a test or a launcher may set it after import), never cached.

    PDSERVE_HOME            scratch space for generated models and benchmark output (~/.cache/pdserve)
    PDSERVE_CLUSTER_SECRET  the shared secret of the internal planes (worker gRPC, KV transfer); empty = unset
    PDSERVE_API_KEY         the router's public API key when no flag gives one; empty = unset
    PDSERVE_GC_FREEZE       0 turns off freezing a server's start-up heap out of the garbage collector
    PDSERVE_TUNE_MALLOC     0 turns off a worker's fixed glibc malloc thresholds
    PDSERVE_RANK_CHECK      1: the ranks of a tensor-parallel worker compare their logits after every model
                            call (one small all_gather; a rank whose KV or inputs differ fails the worker)
    PDSERVE_PEERS_DIR       where the peer servers (vLLM, llama.cpp) of the side-by-side benchmarks live
    PDSERVE_CPU_ISA         the ISA level our C++ CPU kernels build for and dispatch on (amx, avx512_bf16, avx512,
                            avx2), at most the CPU's own (``engine.cpu_ext.isa``); empty = unset: the CPU's
    PDSERVE_GEMV            0: eager decode's small-M bf16 linears run ``F.linear``, not our GEMV kernel
                            (``engine.layers.cpu_gemv``, the default)
    PDSERVE_MX_GEMV         0: ``auto`` never picks the MXFP4 experts' in-register kernel ``fused_gemv`` (it runs
                            ``fused_gather``, the same bits, instead)

Launchers hand the secrets to their children through the environment (never argv: ``ps`` shows argv to
every user), under the names ``CLUSTER_SECRET`` and ``API_KEY`` below; ``child_environ`` is the one copy of
this process's environment they start from.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

HOME = "PDSERVE_HOME"
CLUSTER_SECRET = "PDSERVE_CLUSTER_SECRET"
API_KEY = "PDSERVE_API_KEY"
GC_FREEZE = "PDSERVE_GC_FREEZE"
TUNE_MALLOC = "PDSERVE_TUNE_MALLOC"
RANK_CHECK = "PDSERVE_RANK_CHECK"
PEERS_DIR = "PDSERVE_PEERS_DIR"
CPU_ISA = "PDSERVE_CPU_ISA"
GEMV = "PDSERVE_GEMV"
MX_GEMV = "PDSERVE_MX_GEMV"


def cxx() -> str:
    """``$CXX``: the C++ compiler our CPU kernels build with (``engine.cpu_ext``), ``c++`` when unset."""
    return os.environ.get("CXX") or "c++"


def pdserve_home() -> str:
    return os.environ.get(HOME, os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))


def cluster_secret() -> str | None:
    """``$PDSERVE_CLUSTER_SECRET``, or None when unset or empty."""
    return os.environ.get(CLUSTER_SECRET) or None


def api_key() -> str | None:
    """``$PDSERVE_API_KEY``, or None when unset or empty."""
    return os.environ.get(API_KEY) or None


def gc_freeze() -> bool:
    return os.environ.get(GC_FREEZE, "1") != "0"


def rank_check() -> bool:
    return os.environ.get(RANK_CHECK, "0") == "1"


def tune_malloc() -> bool:
    return os.environ.get(TUNE_MALLOC, "1") != "0"


def peers_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """``$PDSERVE_PEERS_DIR`` in ``environ`` (default: this process's), or None when unset or empty."""
    return (os.environ if environ is None else environ).get(PEERS_DIR) or None


def cpu_isa() -> str | None:
    """``$PDSERVE_CPU_ISA`` (stripped, lower case), or None when unset or empty."""
    return os.environ.get(CPU_ISA, "").strip().lower() or None


def gemv_enabled() -> bool:
    """Eager small-M bf16 linears run our GEMV kernel (``engine.layers.cpu_gemv``) unless ``$PDSERVE_GEMV`` is 0."""
    return os.environ.get(GEMV, "").strip() != "0"


def mx_gemv_enabled() -> bool:
    """``auto`` may run the MXFP4 experts' in-register kernel (``fused_gemv``) unless ``$PDSERVE_MX_GEMV`` is 0."""
    return os.environ.get(MX_GEMV, "").strip() != "0"


def child_environ(drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a child process, without the variables named in ``drop`` and with
    ``extra`` set (a launcher drops ``API_KEY`` for every child but the router)."""
    dropped = set(drop)
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}
