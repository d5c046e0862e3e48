"""Which path each hot CPU op of ours takes in this process, as one line (``kernel_report``) that a worker and
``pdserve run`` log once at start-up (``log_kernel_report``, called by ``engine.load.load_model``):

    kernels: prefill_attention=avx512_bf16, moe=avx512_bf16, mx=avx512, decode_attention=avx512, gemv=avx512_bf16 (isa avx512_bf16, cpu avx512_bf16)

``prefill_attention`` / ``moe``: ``amx`` (AMX brgemm), ``avx512_bf16`` / ``avx512`` / ``avx2`` (their gemm route,
built for that level) or ``torch`` (SDPA / the torch MoE strategies: the ISA level's measured choice, no
compiler, or a failed build: the last two also WARN once). ``mx``: the SIMD of the MX kernel's build (``avx512``,
``avx2``, ``scalar``) or ``torch``. ``decode_attention``: ``avx512`` or ``scalar`` (its only branches), or ``torch``. ``gemv``: the small-M bf16 linear
(``engine.layers.cpu_gemv``): its build's SIMD or ``torch``; ``off`` with ``$PDSERVE_GEMV=0``.
Asking builds every kernel (once per CPU type and level; milliseconds when cached in ``$PDSERVE_HOME``).
"""
from __future__ import annotations

import functools
import logging

from engine import cpu_ext
from engine.layers import cpu_attention, cpu_gemv
from engine.moe import moe_cpu_kernel, mx_cpu_kernel

logger = logging.getLogger(__name__)


def kernel_report() -> str:
    level = cpu_ext.isa()
    return (f"kernels: prefill_attention={cpu_attention.path()}, moe={moe_cpu_kernel.path()}, "
            f"mx={mx_cpu_kernel.path()}, decode_attention={cpu_attention.decode_path()}, gemv={cpu_gemv.path()} "
            f"(isa {level}, cpu {cpu_ext.host_isa()})")


@functools.cache
def log_kernel_report() -> str:
    """``kernel_report()``, logged at INFO the first time only (one line per process)."""
    line = kernel_report()
    logger.info("%s", line)
    return line
