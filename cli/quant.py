"""``pdserve quantize``, ``pdserve tune-moe`` and ``pdserve eval-quant`` (registered by cli.main).

    pdserve quantize --model IN_DIR --out OUT_DIR --format mxfp4 [--scale-mode even|floor]
    pdserve tune-moe [--shapes glm5 glm5-s4 tiny peer 6144,2048,256,8 ...] [--tokens 1,16,4096]
    pdserve eval-quant [--model DIR] [--formats mxfp4,mxfp6_e2m3,...] [--text FILE]

torch is imported inside the commands only (the CLI must start fast for the router).
"""
from __future__ import annotations

import argparse
import json

MX_FORMAT_NAMES = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8")


def cmd_quantize(args: argparse.Namespace) -> int:
    from engine.quant.quantize import quantize_checkpoint  # lazy: safetensors, torch, tqdm
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
    from engine.moe.mx_experts import DequantCache  # lazy: torch, triton
    need = shape.mx_weight_bytes()
    avail = DequantCache.default_budget(device) * 2  # half of free memory
    if need > avail:
        return False, (f"MX weights need {need / 2**30:.1f} GiB, more than half the free memory "
                       f"({avail / 2**30:.1f} GiB)")
    return True, ""


def cmd_tune_moe(args: argparse.Namespace) -> int:
    import torch  # lazy: torch

    from engine.load import DTYPES, resolve_device  # lazy: numpy, safetensors, torch
    from engine.moe import tune, tuned_table  # lazy: torch, triton
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
    from engine.defaults import default_model_dir  # lazy: engine (`pdserve bench` runs off-cluster and never imports it)
    from engine.quant.evaluate import evaluate_quant  # lazy: torch
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in MX_FORMAT_NAMES]
    if bad:
        raise ValueError(f"unknown formats {bad}; choose from {list(MX_FORMAT_NAMES)}")
    report = evaluate_quant(args.model or default_model_dir(), formats, args.text, args.num_tokens,
                            args.scale_mode, args.device if args.device != "auto" else "cpu")
    if args.json:
        print(json.dumps({"model": report.model_dir, "token_source": report.token_source,
                          "num_tokens": report.num_tokens,
                          "results": [dict(r._asdict(), ppl_delta=r.ppl_delta) for r in report.results]}))
    else:
        print(report.markdown())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("quantize", help="bf16 HF checkpoint -> AMD Quark MX export layout (routed experts)")
    q.add_argument("--model", required=True, help="input model directory (bf16/fp32 safetensors)")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--format", default="mxfp4", choices=MX_FORMAT_NAMES, help="MX format of the routed experts")
    q.add_argument("--scale-mode", default="even", choices=["even", "floor"],
                   help="E8M0 shared exponent: even (Quark's default) or floor (OCP MX spec)")
    q.add_argument("--act-format", default="none", choices=("none",) + MX_FORMAT_NAMES,
                   help="also quantize expert inputs dynamically at run time (Quark's W+A schemes)")
    q.add_argument("--keep-mtp-experts", action="store_true", help="leave the MTP layer's routed experts bf16")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_quantize)

    t = sub.add_parser("tune-moe", help="benchmark MX MoE strategies per token count; write tuned tables")
    t.add_argument("--shapes", nargs="+", default=["glm5", "glm5-s4", "tiny", "peer"],
                   help="named shapes (glm5, glm5-s4, tiny, peer) or H,N,E,topk")
    t.add_argument("--dtype", default="mxfp4", choices=MX_FORMAT_NAMES, help="weight format")
    t.add_argument("--tokens", default=None, help="comma-separated token counts (default 1..4096, powers of 2)")
    t.add_argument("--impls", default=None, help="comma-separated strategies (default: all)")
    t.add_argument("--device", default="auto", help="torch device: auto (CUDA/ROCm when present, else cpu), cpu, cuda, cuda:1, ...")
    t.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16", "float16"], help="dtype the kernels compute in (default: bfloat16 on a GPU, float32 on a CPU)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads while timing (default: torch's)")
    t.add_argument("--max-run-s", type=float, default=5.0,
                   help="stop growing the token count once the fastest strategy takes longer than this")
    t.add_argument("--out", default=None, help="table directory (default: engine/moe/tuned, shipped)")
    t.add_argument("--verbose-timings", action="store_true", help="print every candidate's timing, not only the winners")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(fn=cmd_tune_moe)

    e = sub.add_parser("eval-quant", help="KL / top-1 / perplexity of MX formats against the bf16 model")
    e.add_argument("--model", default=None, help="model directory (default: the default model)")
    e.add_argument("--formats", default=",".join(MX_FORMAT_NAMES), help="comma-separated MX formats to evaluate")
    e.add_argument("--text", default=None, help="held-out text file (needs tokenizer.json in the model dir)")
    e.add_argument("--num-tokens", type=int, default=512, help="tokens of held-out text to evaluate on")
    e.add_argument("--scale-mode", default="even", choices=["even", "floor"], help="MX scale rounding (even: OCP MX round-to-nearest-even; floor: the spec's floor)")
    e.add_argument("--device", default="cpu", help="torch device to evaluate on")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval_quant)

