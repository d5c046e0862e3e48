"""The W13 GEMM of one medium-model decode step (H 2048, 2I 1024, 64 experts, 8 or 41 selected, one token each):
the C++ MX kernel vs a torch.compile-generated LUT decode + multiply-sum from the same codes.

    flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.bench_mx_kernel
"""
import torch
from engine.moe import mx_cpu_kernel as k
from engine.moe.tune import best_time_s
from engine.quant.mx import MXFP4, code_values
torch.set_num_threads(2)
E, N, K = 64, 1024, 2048
g = torch.Generator().manual_seed(0)
codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
scales = torch.randint(118, 123, (E, N, K // 32), dtype=torch.uint8, generator=g)
lut = code_values(MXFP4)

@torch.compile(dynamic=False)
def compiled(x, codes, scales, experts):
    c = codes[experts].to(torch.int32)                     # [n, N, K/2]
    w = torch.stack([lut[c & 15], lut[c >> 4]], -1)       # [n, N, K/2, 2]
    s = torch.exp2(scales[experts].to(torch.float32) - 127)  # [n, N, K/32]
    w = w.reshape(*c.shape[:2], K // 32, 32) * s[..., None]
    return (w.reshape(*c.shape[:2], K) * x[:, None, :]).sum(-1)  # [n, N]

for n in (8, 41):
    experts = torch.randperm(E, generator=g)[:n]
    x = torch.randn(n, K)
    gs = torch.arange(n + 1)
    ref = k.grouped_gemm(x, None, experts, gs, codes, scales, MXFP4, 32)
    got = compiled(x, codes, scales, experts)
    err = (ref - got).abs().max().item()
    tc = best_time_s(lambda: k.grouped_gemm(x, None, experts, gs, codes, scales, MXFP4, 32))
    tt = best_time_s(lambda: compiled(x, codes, scales, experts))
    print(f"experts {n}: C++ {tc*1e3:.2f} ms, torch.compile {tt*1e3:.2f} ms, ratio {tt/tc:.2f}x, max diff {err:.2e}")
