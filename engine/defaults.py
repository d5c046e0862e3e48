"""Where the default model lives, and process-wide CPU settings (the environment is read by ``common.env``)."""
from __future__ import annotations

import ctypes
import logging
import os
import sys

from common import env

logger = logging.getLogger(__name__)

PDSERVE_HOME = env.pdserve_home()
"""Scratch space for generated models and benchmark output."""
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_DEFAULT = os.path.join(REPO_ROOT, "models", "glm5-tiny")
"""The trained default model shipped in the repository (once it exists)."""


def default_model_dir() -> str:
    """The shipped default model, or a tiny random GLM-5-architecture model created on first use."""
    if os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")):
        return SHIPPED_DEFAULT
    # lazy: torch, safetensors, numpy (this module is stdlib only: cluster.preflight and the CLI read it without torch)
    from engine.checkpoint import TINY_GLM5, init_random_model
    path = os.path.join(PDSERVE_HOME, "models", "tiny-random-glm5")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        logger.warning("no trained default model shipped yet: creating a tiny random GLM-5 model at %s", path)
        init_random_model(TINY_GLM5, path)
    return path


MALLOC_MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit: CPU tensors up to 32 MB come from the heap."""
MALLOC_TRIM_THRESHOLD = 1 << 30
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep freed CPU tensor memory in the process instead of returning it to the kernel (glibc only).

    glibc serves allocations above its (dynamic) mmap threshold with fresh ``mmap``s and trims the heap
    top on free, so a decode step that allocates ~1 MB temporaries re-faults their pages every step:
    2492 minor faults and 5.9 ms of kernel time per step at 32 requests on the default model (31% of
    the step), none after this call. Fixed thresholds also stop glibc's own adjustment. The cost: the
    process keeps its peak heap (as jemalloc/tcmalloc, which serving stacks preload, do). Idempotent;
    ``PDSERVE_TUNE_MALLOC=0`` disables it. Returns whether the thresholds are set."""
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if not env.tune_malloc() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        logger.info("mallopt unavailable: CPU tensor allocations keep the C library's defaults")
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    _malloc_tuned = bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
    if not _malloc_tuned:
        logger.warning("mallopt refused the malloc thresholds: decode steps may page-fault on every temporary")
    return _malloc_tuned
