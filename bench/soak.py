"""Soak: a steady load below the knee for a long time, then check that nothing leaked.

    .venv/bin/python -m bench.soak --target 127.0.0.1:50051 [--minutes 10] [--rps 0.5] [--input-len 1024]
                                   [--output-len 64] [--cache-hit 0.6] [--out soak-results]
                                   [--chaos [--chaos-every-s 3] [--seed 0]]

Not a CI test (it takes minutes by design). After a warm-up, and again after the load, it reads every
worker's page accounting (Admin.GetClusterStatus) and, for workers on this host (they report pid and
host), resident memory and open file descriptors from /proc. Passes (exit 0) when no request failed,
free + prefix-cached pages are back to their start value with no page owned by a request, and RSS / fds
grew by less than the stated slack; prints the start/end figures. ``--chaos`` interleaves attacks and
random client cancellations with the measured load (``bench.chaos``): every one must end with a status its
input allows, and the steady load must still lose no request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time

import grpc

from bench.chaos import Chaos
from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.sweep import report, run_sweep_async
from common.flags import add_api_key_file_arg
from protos import rpc
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

RSS_SLACK = 1.10
"""RSS may grow 10% (allocator caches, warm-up) before it counts as a leak."""
FD_SLACK = 8


def proc_figures(pid: int) -> dict[str, int]:
    """RSS (kB) and open fds of a local process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def snapshot_status(target: str, api_key: str | None) -> generation_pb2.ClusterStatus:
    async with grpc.aio.insecure_channel(target, options=rpc.CHANNEL_OPTIONS) as ch:
        return await generation_pb2_grpc.AdminStub(ch).GetClusterStatus(
            generation_pb2.GetClusterStatusRequest(), metadata=rpc.auth_metadata(api_key), timeout=10)


async def snapshot(target: str, api_key: str | None) -> dict[str, dict]:
    st = await snapshot_status(target, api_key)
    host, out = socket.gethostname(), {}
    for w in st.workers:
        fig = {"role": w.role, "healthy": w.healthy, "pages_free": w.pages_free, "pages_total": w.pages_total,
               "pages_cached": w.pages_cached, "pages_owned_by_requests": w.info.get("pages_owned_by_requests")}
        if w.info.get("host") == host and w.info.get("pid", "").isdigit():
            try:
                fig.update(proc_figures(int(w.info["pid"])))
            except OSError:
                pass
        out[w.worker_id] = fig
    return out


def leaks(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    found = []
    for wid, a in before.items():
        b = after.get(wid)
        if b is None or not b["healthy"]:
            found.append(f"{wid}: gone or unhealthy after the soak")
            continue
        # free + prefix-cached (evictable) pages: the cache legitimately grows, requests must not hold any
        if b["pages_free"] + b["pages_cached"] != a["pages_free"] + a["pages_cached"]:
            found.append(f"{wid}: free + cached pages {a['pages_free'] + a['pages_cached']} -> "
                         f"{b['pages_free'] + b['pages_cached']}")
        if b["pages_owned_by_requests"] not in (None, "", "0"):
            found.append(f"{wid}: {b['pages_owned_by_requests']} pages still owned by requests")
        if "rss_kb" in a and "rss_kb" in b and b["rss_kb"] > a["rss_kb"] * RSS_SLACK:
            found.append(f"{wid}: RSS {a['rss_kb']} -> {b['rss_kb']} kB (> {RSS_SLACK:.0%})")
        if "fds" in a and "fds" in b and b["fds"] > a["fds"] + FD_SLACK:
            found.append(f"{wid}: open fds {a['fds']} -> {b['fds']}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rps", type=float, default=0.5, help="steady Poisson rate (pick one below the knee)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cache-hit", type=float, default=0.6)
    ap.add_argument("--api-key", default=None, help="every user sees it in ps: prefer --api-key-file or "
                    "$PDSERVE_API_KEY")
    add_api_key_file_arg(ap)
    ap.add_argument("--out", default="soak-results")
    ap.add_argument("--chaos", action="store_true", help="interleave attacks and random cancellations (bench.chaos)")
    ap.add_argument("--chaos-every-s", type=float, default=3.0, help="seconds between two chaos actions")
    ap.add_argument("--seed", type=int, default=0, help="the chaos actions' order and timing")
    args = ap.parse_args()
    args.api_key = rpc.api_key_from_args(args)
    chaos_summary: dict = {}

    def load(seconds: float, chaos: bool = False) -> dict:
        cfg = BenchConfig(target=args.target, workload="prefill-bound", input_len=args.input_len,
                          output_len=args.output_len, cache_hit=args.cache_hit, num_prefixes=4, rps=(args.rps,),
                          warmup_s=0.0, duration_s=seconds, api_key=args.api_key, out=args.out,
                          slo=Slo(ttft_s=5.0)).with_defaults()

        async def both() -> dict:
            st = await snapshot_status(args.target, args.api_key)
            vocab = int(next(w.info["vocab_size"] for w in st.workers if "vocab_size" in w.info))
            actions = Chaos(args.target, args.api_key, vocab, args.chaos_every_s, args.seed)
            stop = asyncio.Event()
            task = asyncio.create_task(actions.run(stop))
            try:
                return await run_sweep_async(cfg, progress=sys.stderr.isatty())
            finally:
                stop.set()
                await task
                chaos_summary.update(actions.summary())

        return asyncio.run(both() if chaos else run_sweep_async(cfg, progress=sys.stderr.isatty()))

    # Warm-up first (a tenth of the time, at least 30 s): the KV pools are allocated up front but their
    # pages reach RSS on first touch, and the prefix cache fills; the baseline is taken after it.
    load(max(30.0, args.minutes * 6))
    time.sleep(2.0)
    before = asyncio.run(snapshot(args.target, args.api_key))
    t0 = time.monotonic()
    result = load(args.minutes * 60, chaos=args.chaos)
    time.sleep(2.0)  # let the workers settle (aborts, cache bookkeeping)
    after = asyncio.run(snapshot(args.target, args.api_key))
    step = result["steps"][0]
    failed = step["num_measured"] - step["num_ok"]
    problems = leaks(before, after) + ([f"{failed} failed requests: {step['failures']}"] if failed else [])
    problems += [f"chaos action ended unexpectedly: {u}" for u in chaos_summary.get("unexpected", [])]
    print(report(result))
    if chaos_summary:
        print("\nchaos actions (outcome counts):")
        for action, counts in chaos_summary["outcomes"].items():
            print(f"  {action:>15}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"\nsoak: {time.monotonic() - t0:.0f} s at {args.rps:g} req/s, {step['num_measured']} requests, "
          f"{failed} failed")
    print(f"{'worker':>12} | {'free+cached start/end':>21} | {'RSS MB start/end':>17} | fds start/end")
    for wid, a in before.items():
        b = after.get(wid, {})
        rss = (f"{a['rss_kb'] / 1024:.0f} / {b.get('rss_kb', 0) / 1024:.0f}" if "rss_kb" in a else "-")
        fds = f"{a['fds']} / {b.get('fds', '-')}" if "fds" in a else "-"
        pa, pb = a["pages_free"] + a["pages_cached"], b.get("pages_free", 0) + b.get("pages_cached", 0)
        print(f"{wid:>12} | {pa:>10} / {pb:<8} | {rss:>17} | {fds}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"before": before, "after": after, "problems": problems, "chaos": chaos_summary, "bench": result},
                  f, indent=1)
    print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
