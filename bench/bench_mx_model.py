"""Decode and prefill throughput on the medium model: bf16 experts vs MXFP4 fused vs MXFP4 through the
dequantize-then-GEMM path, with peak RSS and resident routed-expert bytes for each.

    flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.bench_mx_model \\
        --model /work/medium-model --mx-model /work/medium-model-mxfp4 [--batches 1,8,32] [--steps 4]

Each variant runs in its own process (so its peak RSS, ``ru_maxrss``, is its own), one after another:
  bf16            the bf16 checkpoint: RoutedExperts' strategies (gather for <= 16 pairs, grouped / sorted above)
  mxfp4-fused     the MXFP4 copy, ``auto``: fused_gather for decode, the untuned fallback (fused_gather /
                  fused_sorted) for prefill: no dense copy of any layer
  mxfp4-dequant   the MXFP4 copy with the fused kernel switched off: the path before issue 29
                  (cached_gather from a DequantCache of whole dense layers for decode where it fits, else
                  mx_gather; mx_sorted for prefill)
All in bf16 activations (the checkpoint's dtype; fp32 dense experts would not fit next to other processes).
Decode: B prompts of 16 random tokens are prefilled, one warm-up decode step, then ``--steps`` timed steps of
the whole batch: tok/s = B * steps / time. Prefill: one warm-up 64-token prompt, then one 2048-token prompt.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from engine.moe import mx_cpu_kernel
from engine.quant.prepare import expert_memory, quantized_experts
from engine.load import load_model
from engine.offline import Engine, Seq
from engine.sampling import SamplerState, SamplingParams

VARIANTS = ("bf16", "mxfp4-fused", "mxfp4-dequant")


def timed_decode(eng: Engine, vocab: int, batch: int, steps: int, seed: int) -> float:
    """Seconds for ``steps`` decode steps of ``batch`` requests (after their prefill and one warm-up step)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    seqs = []
    for i in range(batch):
        ids = torch.randint(2, vocab, (16,), generator=gen).tolist()
        seqs.append(Seq(f"b{batch}-{i}", ids, SamplerState(params, list(ids))))
    try:
        for s in seqs:
            eng._append([s], eng.prefill(s))  # the Engine.generate recipe, with the decode steps timed alone
        eng.decode_step(seqs)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.decode_step(seqs)
        return time.perf_counter() - t0
    finally:
        for s in seqs:
            eng.pool.allocator.free(s.pages)


def ran_impls(model) -> list[str]:
    """The MX strategies the last forward ran (the MTP layer's experts, which did not run, left out)."""
    return sorted({m.last_impl for m in quantized_experts(model).values() if m.last_impl})


def run_variant(variant: str, model_dir: str, batches: list[int], steps: int, prefill_len: int) -> dict:
    if variant == "mxfp4-dequant":
        mx_cpu_kernel.disable("bench_mx_model: the dequantize-then-GEMM path before issue 29")
    t0 = time.perf_counter()
    model, cfg = load_model(model_dir, "bfloat16", "cpu")
    out: dict = {"variant": variant, "model": model_dir, "load_s": round(time.perf_counter() - t0, 1),
                 "threads": torch.get_num_threads()}
    pages = (prefill_len + 64) // 16 + max(batches) * 4 + 16
    eng = Engine(model, cfg, kv_dtype="bfloat16", num_pages=pages)
    gen = torch.Generator().manual_seed(0)
    eng.generate([torch.randint(2, cfg.vocab_size, (64,), generator=gen).tolist()], SamplingParams(max_tokens=1))
    prompt = torch.randint(2, cfg.vocab_size, (prefill_len,), generator=gen).tolist()
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    out[f"prefill_{prefill_len}_tok_s"] = round(prefill_len / (time.perf_counter() - t0), 1)
    out["prefill_impls"] = ran_impls(model)
    for b in batches:
        dt = timed_decode(eng, cfg.vocab_size, b, steps, seed=b)
        out[f"decode_b{b}_tok_s"] = round(b * steps / dt, 2)
    out["decode_impls"] = ran_impls(model)
    mem = expert_memory(model)
    out.update(expert_mx_bytes=mem.mx_bytes, expert_dense_bytes=mem.dense_bytes, expert_cache_bytes=mem.cache_bytes,
               expert_resident_bytes=mem.resident_bytes,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/work/medium-model", help="the bf16 checkpoint")
    p.add_argument("--mx-model", default="/work/medium-model-mxfp4", help="its MXFP4 copy (pdserve quantize)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--out", default=None, help="write the results as JSON here too")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.model if args.variant == "bf16" else args.mx_model, batches,
                                     args.steps, args.prefill_len)), flush=True)
        return 0
    results = []
    for v in args.variants.split(","):
        cmd = [sys.executable, "-m", "bench.bench_mx_model", "--variant", v, "--model", args.model, "--mx-model",
               args.mx_model, "--batches", args.batches, "--steps", str(args.steps), "--prefill-len",
               str(args.prefill_len)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"{v} failed:\n{r.stderr[-3000:]}")
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print_table(results, batches, args.prefill_len)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def print_table(results: list[dict], batches: list[int], prefill_len: int) -> None:
    keys = [f"decode_b{b}_tok_s" for b in batches] + [f"prefill_{prefill_len}_tok_s"]
    print("| variant | " + " | ".join(keys) + " | expert resident MB | peak RSS MB |")
    print("|---" * (len(keys) + 3) + "|")
    for r in results:
        print(f"| {r['variant']} | " + " | ".join(str(r[k]) for k in keys) +
              f" | {r['expert_resident_bytes'] / 1e6:.0f} | {r['peak_rss_bytes'] / 1e6:.0f} |")
    by = {r["variant"]: r for r in results}
    if "bf16" in by and "mxfp4-fused" in by:
        base, fused = by["bf16"], by["mxfp4-fused"]
        ratios = {k: round(fused[k] / base[k], 2) for k in keys}
        ratios["expert_resident_bytes"] = round(fused["expert_resident_bytes"] / base["expert_resident_bytes"], 3)
        print("mxfp4-fused / bf16:", json.dumps(ratios))


if __name__ == "__main__":
    sys.exit(main())
