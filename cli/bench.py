"""``pdserve bench``: load a running cluster through its public gRPC API and report (bench/loadgen)."""
from __future__ import annotations

import argparse
import sys

from bench.loadgen.config import add_config_args, config_from_args
from bench.loadgen.report import load_json, run_label
from bench.loadgen.sweep import report, run_bench
from common.flags import add_api_key_file_arg
from protos import rpc


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running router: sweep request rates, report TTFT/ITL/tok/s",
                       description="Sweep Poisson request rates (--rps LIST) or concurrencies against a running "
                                   "router, or search the knee (--rps auto: ramp until the SLO breaks, bisect to "
                                   "--resolution, one step past it), and report throughput, latency "
                                   "percentiles, cache hits, goodput, the knee and saturation. Writes "
                                   "OUT/bench.json and OUT/bench.png (into a new OUT/<time> folder when OUT "
                                   "already holds a run). See docs/benchmarks.md.")
    add_config_args(p)
    add_api_key_file_arg(p)
    p.add_argument("--from-json", default=None, metavar="BENCH_JSON",
                   help="re-report a saved bench.json (with --compare: compare two saved runs); sends nothing")
    p.set_defaults(fn=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.from_json:
        print(report(load_json(args.from_json), args.compare, run_label(args.from_json)))
        return 0
    try:
        cfg = config_from_args(args, api_key=rpc.api_key_from_args(args))
    except (ValueError, OSError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    try:
        result, text = run_bench(cfg, progress=sys.stderr.isatty())
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130
    print(text)
    return 0 if any(s["num_ok"] for s in result["steps"]) else 1
