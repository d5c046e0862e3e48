"""Our bf16 CPU kernels against torch at this process's ISA level: prefill attention vs torch's SDPA, and the fused
MoE vs the torch strategies.

    PDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python -m bench.bench_cpu_kernels [--threads 1] [--tokens 64,256,1024,4096] [--what attention moe]

Forcing a lower level (``PDSERVE_CPU_ISA``) builds and routes our kernels for it; the other three variables hold
torch, MKL and oneDNN to AVX2 as well, so both sides compare as on an AVX2-only CPU (each is read once at start-up:
one process per level). Prints one line per shape: microseconds, best of a few repeats within ~0.3 s (a shared CPU
only ever adds time), torch / ours.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine import cpu_ext
from engine.layers import cpu_attention
from engine.moe import moe_cpu_kernel
from engine.moe.experts import MOE_IMPLS, moe_fused_cpu
from engine.moe.router import Routing

ATTENTION_SHAPES = {"gqa": (4, 2, 64, 64), "mla": (16, 16, 192, 128)}
"""(heads, kv heads, head_dim, v head_dim): the 4 / 2 / 64 GQA test shape; GLM-5-like MLA prefill (q/k nope + rope
192, v 128; heads / 4)."""
MOE_SHAPE = (16, 256, 128, 4)
"""(experts, hidden, intermediate, top-k): glm4_moe's test layer (engine/moe/experts.py's figures)."""


def best_us(fn, budget_s: float = 0.3, most: int = 20) -> float:
    fn()
    best, spent, n = float("inf"), 0.0, 0
    while n < most and (spent < budget_s or n < 3):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best * 1e6


def sdpa(q, k, v, scale):
    H, Hk = q.shape[1], k.shape[1]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, scale=scale, enable_gqa=Hk != H)[0].transpose(0, 1)


def bench_attention(tokens: list[int], shape: str) -> None:
    H, Hk, D, Dv = ATTENTION_SHAPES[shape]
    for T in tokens:
        q, k, v = torch.randn(T, H, D).bfloat16(), torch.randn(T, Hk, D).bfloat16(), torch.randn(T, Hk, Dv).bfloat16()
        theirs = best_us(lambda: sdpa(q, k, v, D ** -0.5))
        ours = best_us(lambda: cpu_attention.causal_attention(q, k, v, D ** -0.5)) if cpu_attention.kernel() else 0
        print(f"attention {shape} T={T}: torch {theirs:,.0f} us, ours ({cpu_attention.path()}) {ours:,.0f} us, "
              f"torch/ours {theirs / ours if ours else 0:.2f}", flush=True)


def bench_moe(tokens: list[int]) -> None:
    E, H, I, K = MOE_SHAPE
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    packed = moe_cpu_kernel.pack(w13, w2) if moe_cpu_kernel.kernel() else None
    for T in tokens:
        x = torch.randn(T, H, generator=g).bfloat16()
        r = Routing(torch.rand(T, E, generator=g).topk(K, dim=1).indices, torch.rand(T, K, generator=g))
        times = {name: best_us(lambda n=name: MOE_IMPLS[n](x, w13, w2, r)) for name in ("sorted", "grouped")}
        if packed is not None:
            times[f"fused_cpu ({moe_cpu_kernel.path()})"] = best_us(lambda: moe_fused_cpu(x, w13, w2, r, packed))
        print(f"moe E={E} H={H} I={I} top{K} T={T}: " + ", ".join(f"{n} {t:,.0f} us" for n, t in times.items()),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="64,128,256,512,1024,4096")
    ap.add_argument("--what", nargs="+", default=["attention", "moe"], choices=["attention", "mla", "moe"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"isa {cpu_ext.isa()} (cpu {cpu_ext.host_isa()}), torch {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s)", flush=True)
    if "attention" in args.what:
        bench_attention(tokens, "gqa")
    if "mla" in args.what:
        bench_attention(tokens, "mla")
    if "moe" in args.what:
        bench_moe(tokens)


if __name__ == "__main__":
    main()
