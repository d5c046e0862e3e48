"""Our C++ CPU kernels (``engine/**/csrc/*.cpp``): built at first use for one ISA level, cached, or one loud WARNING.

ISA levels, lowest first (``ISA_LEVELS``): ``avx2`` (AVX2 + FMA: older EPYC), ``avx512`` (AVX-512 F/BW/VL/DQ),
``avx512_bf16`` (and AVX512-BF16: EPYC Zen 4), ``amx`` (and AMX-BF16 tiles: Xeon Sapphire Rapids on). The process
runs at ONE level (``isa``): the CPU's own (``host_isa``, from ``/proc/cpuinfo``), or a lower one forced with
``$PDSERVE_CPU_ISA`` (read once; a level above the CPU's is a ValueError). The level decides

* the compile flags (``ISA_CFLAGS``): ``avx2`` builds for x86-64-v3, so no AVX-512 instruction is emitted even on an
  AVX-512 host (the kernels' ``#if defined(__AVX512F__)`` branches fall to their AVX2 / scalar ones); ``avx512``
  builds native minus BF16 / FP16 / AMX; and it is part of the build name, so each level has its own build;
* which GEMM route a bf16 kernel takes at run time: oneDNN's AMX brgemm on VNNI-packed operands only at ``amx``
  (where ``cpublas::could_pack(bf16)`` also holds), ``cpublas::gemm`` on the unpacked operands below it.

A CPU with none of the levels (no AVX2 + FMA: not x86-64-v3) is ``generic``: it builds ``-march=native`` and the
kernels' scalar code (it cannot be forced).

A kernel registers its functions as operators (``engine/csrc/ops.h``: ``TORCH_LIBRARY`` in a namespace named after
the build) and ``build`` returns that namespace, ``torch.ops.<build name>``: ``k.rms_norm(x, w, eps)`` calls the
operator. No pybind11 module and no ``<torch/extension.h>``: its headers were ~80% of a build's time.

``torch.utils.cpp_extension.load`` compiles into ``$PDSERVE_HOME/torch_extensions/<name>`` where the name hashes the
source, the flags, the CPU's flags and torch's version, so a shared home directory holds one build per CPU type and
level and a changed source rebuilds. A build takes ~10-25 s on 2 cores the first time, milliseconds after. Without a
working C++ compiler (or when the build fails) ``build`` logs ONE WARNING naming what runs instead and returns None.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from typing import Callable, Iterator

import torch

from common.env import CPU_ISA, cpu_isa, cxx, pdserve_home
from engine.precision import cpu_flags

logger = logging.getLogger(__name__)

Kernel = torch._ops._OpNamespace
"""What ``build`` returns: ``torch.ops.<build name>``, whose attributes are the kernel's operators."""

ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
"""The levels ``$PDSERVE_CPU_ISA`` accepts, lowest first."""
ISA_NEEDS = {"avx2": {"avx2", "fma", "f16c", "bmi2"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
             "avx512_bf16": {"avx512_bf16"}, "amx": {"amx_tile", "amx_bf16"}}
"""``/proc/cpuinfo`` flags each level adds to the one below it."""
GENERIC = "generic"
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_CFLAGS = {
    "amx": ["-march=native"],
    "avx512_bf16": ["-march=native", *NO_AMX],
    "avx512": ["-march=native", "-mno-avx512bf16", "-mno-avx512fp16", *NO_AMX],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    GENERIC: ["-march=native"],
}
"""``-march`` per level (gcc 12 / clang 15 accept each). ``avx2``: x86-64-v3 is AVX2 + FMA + F16C + BMI2, what every
AVX2 EPYC and Xeon has (Haswell, Zen 1 on)."""
SHARED_INCLUDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
"""Headers every kernel may include (``bf16_gemm.h``, ``bf16_scalar.h``, ``ops.h``)."""
BASE_CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
"""-fopenmp: ATen's ``parallel_for`` is inline in its header (an OpenMP pragma): built without it, every
``at::parallel_for`` of a kernel ran on one thread."""


def host_isa(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags (and every lower level's) this CPU has; ``generic`` for none."""
    have = cpu_flags() if flags is None else flags
    level = GENERIC
    for name in ISA_LEVELS:
        if not ISA_NEEDS[name] <= have:
            break
        level = name
    return level


def resolve_isa(forced: str | None, host: str) -> str:
    """``forced`` (a ``$PDSERVE_CPU_ISA`` value) checked against the CPU's level ``host``, or ``host`` when None."""
    if forced is None:
        return host
    if forced not in ISA_LEVELS:
        raise ValueError(f"{CPU_ISA}={forced!r} is not an ISA level; known: {', '.join(ISA_LEVELS)}")
    if host == GENERIC or ISA_LEVELS.index(forced) > ISA_LEVELS.index(host):
        raise ValueError(f"{CPU_ISA}={forced} is above this CPU's level {host}: it cannot run {forced} code")
    return forced


@functools.cache
def isa() -> str:
    """This process's level: ``$PDSERVE_CPU_ISA`` or the CPU's, read once (the builds and routes follow it)."""
    return resolve_isa(cpu_isa(), host_isa())


def levels_up_to(level: str) -> list[str]:
    """``level`` and the levels below it (what a test forces on a host of ``level``)."""
    return [] if level == GENERIC else list(ISA_LEVELS[:ISA_LEVELS.index(level) + 1])


def cflags(level: str) -> list[str]:
    return [BASE_CFLAGS[0], *ISA_CFLAGS[level], *BASE_CFLAGS[1:]]


def headers(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".h"))


def build_name(prefix: str, source: str, level: str) -> str:
    """Extension name: ``prefix``, the level, and a hash of the source (and the ``.h`` files beside it and in
    ``SHARED_INCLUDE``), the compiler flags, the CPU flags and torch's version."""
    h = hashlib.sha256()
    for path in [source, *headers(os.path.dirname(source)), *headers(SHARED_INCLUDE)]:
        with open(path, "rb") as f:  # the source and the headers it may include
            h.update(f.read())
    h.update(" ".join(cflags(level)).encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    h.update(torch.__version__.encode())
    return f"{prefix}_{level}_{h.hexdigest()[:12]}"


def build(prefix: str, source: str, instead: str, level: str | None = None) -> Kernel | None:
    """The operators of ``source`` built for ``level`` (default: ``isa()``; a test passes a lower one), or None
    after one WARNING saying that ``instead`` runs (no compiler, or the build failed). Callers cache the result
    (``functools.cache``)."""
    from torch.utils import cpp_extension  # heavy optional import: only when a kernel is wanted
    level = level or isa()
    if level != GENERIC:
        resolve_isa(level, host_isa())  # a level above the CPU's: the ValueError, not an illegal instruction
    compiler = cxx()
    if shutil.which(compiler) is None:
        logger.warning("CPU kernel %s unavailable: no C++ compiler (%r not on PATH); %s", prefix, compiler, instead)
        return None
    name = build_name(prefix, source, level)
    build_dir = os.path.join(pdserve_home(), "torch_extensions", name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        with build_lock(build_dir):
            cpp_extension.load(name=name, sources=[source], build_directory=build_dir, extra_cflags=cflags(level),
                               extra_include_paths=[SHARED_INCLUDE], extra_ldflags=["-fopenmp"], verbose=False,
                               is_python_module=False)  # loads the library: its TORCH_LIBRARY registers the ops
        return getattr(torch.ops, name)
    except Exception as e:  # noqa: BLE001 - any build/load failure: one loud fallback, never a crash
        logger.warning("CPU kernel %s (%s) unavailable: building %s failed (%s); %s", prefix, level, source, e,
                       instead)
        return None


TORCH_BATON = "lock"
"""The file ``torch.utils.cpp_extension`` creates in a build directory while it builds and removes after. A build
killed meanwhile (a timeout, SIGKILL) leaves it behind, and every later ``load`` of that directory waits for it
forever, even when the library is built and up to date."""


@contextlib.contextmanager
def build_lock(build_dir: str) -> Iterator[None]:
    """Hold ``build_dir``'s exclusive ``fcntl`` lock (``pdserve.flock``: released by the kernel when its process
    dies, however it dies) around a ``cpp_extension.load``: builders of one directory take turns, so torch's own
    baton file there is never another live builder's, and one that is present was left by a killed build. It is
    removed, with one WARNING, instead of waited for forever."""
    fd = os.open(os.path.join(build_dir, "pdserve.flock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        baton = os.path.join(build_dir, TORCH_BATON)
        if os.path.exists(baton):
            logger.warning("CPU kernel build %s: removing the build lock a killed build left behind (%s)",
                           os.path.basename(build_dir), baton)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(baton)
        yield
    finally:
        os.close(fd)  # releases the flock


def build_routed(what: str, prefix: str, source: str, instead: str, level: str,
                 has_gemm: Callable[[Kernel], bool]) -> Kernel | None:
    """A kernel with two GEMM routes (AMX brgemm, or a bf16 gemm called at run time), built for ``level``: the
    extension, or None where neither route can run here (one WARNING, saying ``instead`` runs). At ``amx`` a torch
    whose cpublas cannot pack bf16 takes the gemm route, with one WARNING; ``has_gemm(k)`` says whether this torch
    exports the gemm route's bf16 GEMM."""
    k = build(prefix, source, instead, level)
    if k is None or (level == "amx" and k.could_pack()):
        return k
    if level == "amx":
        logger.warning("%s: this CPU has AMX but torch's cpublas cannot pack bf16 for brgemm; the kernel's gemm "
                       "route runs instead", what)
    if not has_gemm(k):
        logger.warning("%s at ISA level %s: this torch exports no bf16 GEMM (cblas_gemm_bf16bf16f32) for the "
                       "kernel's gemm route; %s", what, level, instead)
        return None
    return k


def has_amx() -> bool:
    """This CPU multiplies bf16 tiles in AMX (what ``at::native::cpublas::brgemm`` needs for bf16)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags()
