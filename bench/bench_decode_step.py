"""Decode-step cost of the engine: time, minor page faults and torch ops per step, per batch size.

    .venv/bin/python bench/bench_decode_step.py [--model DIR] [--batches 1,8,32] [--threads 1] [--scheduler] [--compile]

Each batch runs ``Engine.generate``'s decode iteration (prompts of 256 random tokens, greedy) for 5 warm-up
steps, then 7 x 20 timed steps; reported: the best of the 7 (ms per step, the machines are noisy), minor
page faults per step, and the top-level torch ops of one step. ``--scheduler`` times the decode worker's
``DecodeScheduler`` instead (one request, 400-token prompt; tok/s). To compare two source trees, run the
script from each with ``PYTHONPATH`` set to it, alternately; ``PDSERVE_TUNE_MALLOC=0`` shows the cost of
glibc's default malloc thresholds.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.environ.get("PYTHONPATH") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import engine  # noqa: E402
from decode.scheduler import DecodeScheduler, DecodeTask  # noqa: E402
from engine.defaults import default_model_dir, tune_malloc  # noqa: E402
from engine.kvcache import KVLayout, KVPool  # noqa: E402
from engine.load import load_model  # noqa: E402
from engine.offline import Engine, Seq  # noqa: E402
from engine.sampling import SamplerState, SamplingParams  # noqa: E402


def engine_steps(model, cfg, batch: int):
    prompts = torch.randint(2, cfg.vocab_size, (batch, 256), generator=torch.Generator().manual_seed(0)).tolist()
    eng = Engine(model, cfg, page_size=16, num_pages=batch * 40 + 8)
    seqs = [Seq(f"r{i}", p, SamplerState(SamplingParams(max_tokens=1000, ignore_eos=True), p))
            for i, p in enumerate(prompts)]
    for s in seqs:
        eng._append([s], eng.prefill(s))

    return lambda: eng.decode_step(seqs)


def count_ops(step) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    return sum(1 for e in p.events() if e.cpu_parent is None and e.name.startswith("aten::"))


def scheduler_rate(model, cfg) -> float:
    pool = KVPool(KVLayout.for_model(cfg, 16, "float32"), 4096)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids)
    ids = torch.randint(2, cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    dec.add_local(DecodeTask("a", ids, [], SamplingParams(max_tokens=300, ignore_eos=True), [], 0,
                             emit=lambda ev: None))
    dec.step(), dec.step()
    t0, n0 = time.perf_counter(), dec.tokens_out
    for _ in range(150):
        dec.step()
    return (dec.tokens_out - n0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scheduler", action="store_true")
    ap.add_argument("--compile", action="store_true", help="through the compiled decode graphs (compile_decode)")
    args = ap.parse_args()
    tuned = tune_malloc()
    torch.set_num_threads(args.threads)
    model, cfg = load_model(args.model or default_model_dir(), "float32", "cpu")
    if args.compile:
        model.compile_decode()
    print(f"source {os.path.dirname(os.path.dirname(engine.__file__))}, model {args.model or default_model_dir()}, "
          f"{args.threads} thread(s), malloc tuned: {tuned}, decode graphs {'compiled' if args.compile else 'eager'}")
    if args.scheduler:
        print(f"DecodeScheduler, 1 request, 400-token prompt: {scheduler_rate(model, cfg):.0f} tok/s")
        return
    for b in (int(x) for x in args.batches.split(",")):
        step = engine_steps(model, cfg, b)
        for _ in range(5):
            step()
        best, f0 = float("inf"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            best = min(best, (time.perf_counter() - t0) / 20)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 140
        print(f"batch {b:>3}: {best * 1e3:6.2f} ms/step, {faults:7.1f} minor faults/step, {count_ops(step)} torch ops",
              flush=True)


if __name__ == "__main__":
    main()
