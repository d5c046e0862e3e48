"""Time engine.quant.mx quantize / dequantize against torchao's emulated MX cast.

    .venv/bin/python -m bench.bench_mx [--size 4096] [--reps 5] [--mode even] [--dtype bf16]

Prints the median wall time of each side for an [size, size] tensor, per format, and the
ratio torchao / ours (> 1: ours is faster). CPU eager on both sides; torch's thread count as set.
Not quite like for like: our quantize also packs fp6 four codes per three bytes and our
dequantize unpacks it, where torchao keeps fp6 one code per byte.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Callable

import torch

from engine.quant.mx import MX_FORMATS, dequantize_mx, quantize_mx

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: caches, allocator
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torchao_fns(x: torch.Tensor, name: str, mode: str):
    """(quantize, dequantize) closures over torchao 0.18's to_mx / to_dtype."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode  # lazy: torchao
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2  # lazy: torchao
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # lazy: torchao

    elem = {
        "mxfp4": torch.float4_e2m1fn_x2,
        "mxfp6_e2m3": DTYPE_FP6_E2M3,
        "mxfp6_e3m2": DTYPE_FP6_E3M2,
        "mxfp8": torch.float8_e4m3fn,
    }[name]
    scaling = {"even": ScaleCalculationMode.EVEN, "floor": ScaleCalculationMode.FLOOR}[mode]
    scale, data = to_mx(x, elem, 32, scaling)
    return (lambda: to_mx(x, elem, 32, scaling)), (lambda: to_dtype(data, scale, elem, 32, x.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mode", choices=["even", "floor"], default="even")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--formats", nargs="+", choices=list(MX_FORMATS), default=list(MX_FORMATS))
    args = parser.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=g).to(DTYPES[args.dtype])
    print(
        f"[{args.size}, {args.size}] {args.dtype}, scale_mode={args.mode}, "
        f"threads={torch.get_num_threads()}, median of {args.reps}"
    )
    print(f"{'format':<11} {'op':<10} {'ours ms':>9} {'torchao ms':>11} {'torchao/ours':>13}")
    for name in args.formats:
        mx = quantize_mx(x, name, args.mode)
        ours = (lambda name=name: quantize_mx(x, name, args.mode)), (lambda mx=mx: dequantize_mx(mx, x.dtype))
        try:
            theirs = torchao_fns(x, name, args.mode)
        except ImportError as exc:
            print(f"{name:<11} torchao unavailable: {exc}")
            theirs = (None, None)
        for op, our_fn, their_fn in zip(("quantize", "dequantize"), ours, theirs):
            t_ours = median_s(our_fn, args.reps)
            if their_fn is None:
                print(f"{name:<11} {op:<10} {t_ours * 1e3:9.1f}")
                continue
            t_theirs = median_s(their_fn, args.reps)
            ratio = t_theirs / t_ours
            print(f"{name:<11} {op:<10} {t_ours * 1e3:9.1f} {t_theirs * 1e3:11.1f} {ratio:12.2f}x")
        del mx, ours


if __name__ == "__main__":
    main()
