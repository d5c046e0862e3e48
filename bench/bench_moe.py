"""MXFP4 routed-expert layer vs the unquantized (bf16-weight) layer, and the tuned pick vs the untuned fallback.

    .venv/bin/python -m bench.bench_moe [--shapes tiny glm5-s4] [--tokens 1,16,4096] [--dtype float32] [--json]

For each shape and token count, one run prints:
  * dense   RoutedExperts (weights = the MX weights dequantized, i.e. the bf16 checkpoint served
            unquantized) in the compute dtype, its own auto strategy;
  * tuned   MXRoutedExperts ``auto``: the strategy the shipped table picks (engine/moe/tuned);
  * fallback  the untuned fallback strategy (what runs for a shape with no table);
and the ratios mxfp4/dense and tuned/fallback, plus the weight memory ratio (MX codes + scales vs
bf16). Times are the best of several runs (a shared CPU only ever adds time). Compute dtype:
float32 on CPU (what ``pdserve run`` serves with; bf16 GEMMs have no hardware path on AVX2 CPUs),
bfloat16 on GPU, or ``--dtype``. Shapes: ``tiny`` = the default model (TINY_GLM5), ``glm5-s4`` =
GLM-5's expert shape with dims and experts / 4; ``glm5`` (full) only where it fits.
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from engine.checkpoint import TINY_GLM5
from engine.config import ModelConfig
from engine.moe import tune, tuned_table
from engine.moe.experts import RoutedExperts
from engine.moe.mx_experts import MX_MOE_IMPLS, DequantCache, MXRoutedExperts
from engine.quant.mx import MXSpec, get_mx_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dense_twin(mx: MXRoutedExperts, dtype: torch.dtype) -> RoutedExperts:
    """RoutedExperts holding ``mx``'s dequantized weights (bf16-exact), computing in ``dtype``."""
    cfg = ModelConfig.from_dict({**TINY_GLM5, "hidden_size": mx.hidden, "moe_intermediate_size": mx.inter,
                                 "n_routed_experts": mx.num_experts, "num_experts_per_tok": mx.topk})
    dense = RoutedExperts(cfg)
    dense.w13 = torch.nn.Parameter(mx.dequant("w13", None, dtype), requires_grad=False)
    dense.w2 = torch.nn.Parameter(mx.dequant("w2", None, dtype), requires_grad=False)
    return dense


def bench_shape(name: str, shape: tuned_table.MoEShape, token_counts: list[int], dtype: torch.dtype,
                device: torch.device) -> list[dict]:
    mx = MXRoutedExperts.random(shape, MXSpec(get_mx_format(shape.dtype)), device=device,
                                cache=DequantCache(DequantCache.default_budget(device)))
    dense = dense_twin(mx, dtype)
    mem_ratio = mx.weight_bytes() / mx.dense_bytes(torch.bfloat16)
    rows = []
    for t in token_counts:
        x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(t)).to(device, dtype)
        routing = tune.random_routing(t, shape.num_experts, shape.topk, device, seed=t)
        with torch.inference_mode():
            t_dense = tune.best_time_s(lambda: dense(x, routing))
            t_tuned = tune.best_time_s(lambda: mx(x, routing))
            tuned = mx.last_impl
            fallback = tuned_table.fallback_impl(t * shape.topk)
            if not mx.can_run(fallback, dtype, t):
                fallback = "mx_sorted"
            t_fb = t_tuned if fallback == tuned else tune.best_time_s(lambda: MX_MOE_IMPLS[fallback](mx, x, routing))
        rows.append({"shape": name, "key": shape.key(tuned_table.device_name(device)), "tokens": t,
                     "dense_ms": t_dense * 1e3, "dense_impl": dense.last_impl, "mx_tuned_ms": t_tuned * 1e3,
                     "tuned_impl": tuned, "table": mx._table is not None, "fallback_ms": t_fb * 1e3,
                     "fallback_impl": fallback, "mx_vs_dense": t_tuned / t_dense, "tuned_vs_fallback": t_tuned / t_fb,
                     "weight_mem_ratio": mem_ratio})
        mx.clear_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "glm5-s4"])
    parser.add_argument("--tokens", default="1,16,4096")
    parser.add_argument("--format", default="mxfp4")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"device {tuned_table.device_name(device)}, torch threads {torch.get_num_threads()}, compute dtype "
          f"{str(dtype).removeprefix('torch.')}, weights {args.format}")
    rows = []
    for name in args.shapes:
        shape = tuned_table.parse_shape(name, args.format)
        rows += bench_shape(name, shape, tokens, dtype, device)
    if args.json:
        print(json.dumps(rows))
        return
    print("| shape | tokens | dense (bf16 weights) ms | MX tuned ms (impl) | MX/dense | untuned fallback ms (impl) "
          "| tuned/fallback | MX weight bytes / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tab = "" if r["table"] else ", no table"
        print(f"| {r['shape']} | {r['tokens']} | {r['dense_ms']:.2f} ({r['dense_impl']}) | {r['mx_tuned_ms']:.2f} "
              f"({r['tuned_impl']}{tab}) | {r['mx_vs_dense']:.2f}x | {r['fallback_ms']:.2f} ({r['fallback_impl']}) | "
              f"{r['tuned_vs_fallback']:.2f}x | {r['weight_mem_ratio']:.3f} |")


if __name__ == "__main__":
    main()
