"""The bodies of ``pdserve quantize``, ``pdserve tune-moe`` and ``pdserve eval-quant`` (``cli.quant`` registers
them and imports this module only when one runs: it loads torch)."""
from __future__ import annotations

import argparse
import json

import torch

from engine.defaults import default_model_dir
from engine.load import DTYPES, resolve_device
from engine.moe import tune, tuned_table
from engine.moe.mx_experts import DequantCache
from engine.quant.evaluate import evaluate_quant
from engine.quant.mx import MX_FORMATS
from engine.quant.quantize import quantize_checkpoint


def cmd_quantize(args: argparse.Namespace) -> int:
    res = quantize_checkpoint(args.model, args.out, args.format, args.scale_mode,
                              quantize_mtp=not args.keep_mtp_experts,
                              act_format=None if args.act_format == "none" else args.act_format,
                              progress=not args.no_progress)
    print(json.dumps({"out_dir": res.out_dir, "format": args.format, "scale_mode": args.scale_mode,
                      "quantized_tensors": res.num_quantized, "kept_tensors": res.num_kept,
                      "excluded_modules": len(res.exclude), "in_bytes": res.in_bytes, "out_bytes": res.out_bytes,
                      "size_ratio": round(res.out_bytes / max(res.in_bytes, 1), 4)}))
    return 0


def _fits(shape, device) -> tuple[bool, str]:
    need = shape.mx_weight_bytes()
    avail = DequantCache.default_budget(device) * 2  # half of free memory
    if need > avail:
        return False, (f"MX weights need {need / 2**30:.1f} GiB, more than half the free memory "
                       f"({avail / 2**30:.1f} GiB)")
    return True, ""


def cmd_tune_moe(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    dtype = DTYPES[args.compute_dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(tune.DEFAULT_TOKEN_COUNTS)
    impls = args.impls.split(",") if args.impls else None
    out_dir = args.out or tuned_table.TUNED_DIR
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    summary = []
    for text in args.shapes:
        shape = tuned_table.parse_shape(text, args.dtype)
        ok, why = _fits(shape, device)
        if not ok:
            print(f"skip {text} ({shape.describe()}): {why}; tune a scaled variant (e.g. glm5-s4) here")
            summary.append({"shape": text, "skipped": why})
            continue
        log = (lambda msg: print("  " + msg, flush=True)) if args.verbose_timings else None
        res = tune.tune_shape(shape, tokens, impls, device, dtype, args.max_run_s, log)
        path = tune.write_table(res, out_dir)
        print(f"{shape.key(res.device)} -> {path}")
        for t, row in res.timings_s.items():
            best = min(row, key=row.get)
            cells = "  ".join(f"{n}={v * 1e3:.2f}ms" for n, v in sorted(row.items(), key=lambda kv: kv[1]))
            print(f"  T={t:<5d} best {best:<14s} {cells}")
        for s in res.skipped:
            print(f"  note: {s}")
        summary.append({"shape": text, "table": path, "best": {str(k): v for k, v in res.best.items()}})
    if args.json:
        print(json.dumps(summary))
    return 0


def cmd_eval_quant(args: argparse.Namespace) -> int:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in MX_FORMATS]
    if bad:
        raise ValueError(f"unknown formats {bad}; choose from {list(MX_FORMATS)}")
    report = evaluate_quant(args.model or default_model_dir(), formats, args.text, args.num_tokens,
                            args.scale_mode, args.device if args.device != "auto" else "cpu")
    if args.json:
        print(json.dumps({"model": report.model_dir, "token_source": report.token_source,
                          "num_tokens": report.num_tokens,
                          "results": [dict(r._asdict(), ppl_delta=r.ppl_delta) for r in report.results]}))
    else:
        print(report.markdown())
    return 0
