"""Our C++ CPU kernels (``engine/**/csrc/*.cpp``): built at first use, cached, or one loud WARNING.

``torch.utils.cpp_extension.load`` compiles a source with ``-O3 -march=native`` into
``$PDSERVE_HOME/torch_extensions/<name>`` where the name hashes the source, the CPU's flags and torch's
version, so a shared home directory holds one build per CPU type and a changed source rebuilds. A build
takes ~40 s on 2 cores the first time, milliseconds after. Without a working C++ compiler (or when the
build fails) ``build`` logs ONE WARNING naming what runs instead and returns None.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from types import ModuleType

import torch

from common.env import cxx, pdserve_home
from engine.precision import cpu_flags

logger = logging.getLogger(__name__)


CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]
"""-fopenmp: ATen's ``parallel_for`` is inline in its header (an OpenMP pragma): built without it, every
``at::parallel_for`` of a kernel ran on one thread."""


def build_name(prefix: str, source: str) -> str:
    """Extension name: ``prefix`` and a hash of the source (and the ``.h`` files beside it), the compiler flags,
    the CPU flags and torch's version."""
    h = hashlib.sha256()
    here = os.path.dirname(source)
    for path in [source] + sorted(os.path.join(here, n) for n in os.listdir(here) if n.endswith(".h")):
        with open(path, "rb") as f:  # the source and the headers beside it that it may include
            h.update(f.read())
    h.update(" ".join(CFLAGS).encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    h.update(torch.__version__.encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def build(prefix: str, source: str, instead: str) -> ModuleType | None:
    """The compiled extension of ``source``, or None after one WARNING saying that ``instead`` runs
    (no compiler, or the build failed). Callers cache the result (``functools.cache``)."""
    from torch.utils import cpp_extension  # heavy optional import: only when a kernel is wanted
    compiler = cxx()
    if shutil.which(compiler) is None:
        logger.warning("CPU kernel %s unavailable: no C++ compiler (%r not on PATH); %s", prefix, compiler, instead)
        return None
    name = build_name(prefix, source)
    build_dir = os.path.join(pdserve_home(), "torch_extensions", name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        return cpp_extension.load(name=name, sources=[source], build_directory=build_dir, extra_cflags=CFLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build/load failure: one loud fallback, never a crash
        logger.warning("CPU kernel %s unavailable: building %s failed (%s); %s", prefix, source, e, instead)
        return None


def has_amx() -> bool:
    """This CPU multiplies bf16 tiles in AMX (what ``at::native::cpublas::brgemm`` needs for bf16)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags()
