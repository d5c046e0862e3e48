"""Speculative decoding with DSA sparse attention active: single-stream decode at a long context, on vs off,
in-process and served, on the default model.

    python -m bench.bench_spec_dsa [--spec 5/1/6] [--context-factor 4] [--max-tokens 128] [--repeats 3]
                                   [--threads 1] [--no-served] [--out FILE.json]

The prompt is held-out CPython source (``asyncio/events.py``: not in the default model's training split),
tokenized and cut to ``context_factor x index_topk`` tokens, so every decode step's indexer keeps
``index_topk`` of at least ``context_factor`` times as many keys.

* in-process: ``Engine`` (plain) against ``SpecEngine``; decode tok/s = (max_tokens - 1) / (time at
  max_tokens - time at 1 token), best of ``--repeats`` interleaved rounds (as ``bench.bench_spec``);
* served: ``pdserve serve --decode-weights model`` (the same weights as in-process) with ``--speculative
  SPEC --no-spec-fallback`` against ``--no-speculative``; one warm-up request, then ``--repeats``
  interleaved pairs of requests of the prompt's token ids (``max_tokens`` and 2), one at a time; decode
  tok/s = (max_tokens - 2) / (latency at max_tokens - latency at 2), best latencies (the stream's own
  timing is not used: chunks can arrive in bursts). Accept length and rates are the decode worker's
  ``WorkerStatus.spec`` counters over the long requests (whose first round after the KV transfer has no
  draft yet).

Speedup = spec-on tok/s / spec-off tok/s of the same path. Per-position rates: ``engine.speculative.metrics``
(the depth-d draft accepted, given verification tried depth d). Greedy, EOS ignored; each path's tokens
are compared with the in-process plain ones. Prints a table and writes JSON (``--out``, default
``$PDSERVE_HOME/bench/spec_dsa.json``), with the machine's load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time

import torch

from bench.bench_spec import best_time
from bench.serve_proc import serve
from common.reasons import Role
from engine.defaults import PDSERVE_HOME, SHIPPED_DEFAULT, tune_malloc
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine
from engine.tokenizer import Tokenizer
from router.client import GenerationClient


def held_out_ids(tok: Tokenizer, num_tokens: int) -> list[int]:
    ids = tok.encode(open(os.path.join(sysconfig.get_paths()["stdlib"], "asyncio", "events.py")).read())
    if len(ids) < num_tokens:
        raise SystemExit(f"asyncio/events.py has only {len(ids)} tokens, {num_tokens} asked for")
    return ids[:num_tokens]


def rates(accepted, tried) -> list[float | None]:
    """``accepted[i] / tried[i]``; None where nothing was tried."""
    return [round(a / r, 4) if r else None for a, r in zip(accepted, tried)]


def in_process(model, cfg, ids: list[int], spec: SpecConfig, args) -> dict:
    pages = (len(ids) + args.max_tokens + spec.num_step_slots) // 16 + 8
    last: dict = {}

    def engine() -> Engine:
        return Engine(model, cfg, kv_dtype=args.dtype, page_size=16, num_pages=pages)

    def plain(n: int) -> list[int]:
        return engine().generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids

    def speculative(n: int) -> list[int]:
        last["eng"] = SpecEngine(engine(), spec)
        return last["eng"].generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids

    runs = {"off": plain, "on": speculative}
    for run in runs.values():
        run(4)  # warm-up
    full = {k: float("inf") for k in runs}
    first = dict(full)
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits both alike
        for name, run in runs.items():
            full[name] = min(full[name], best_time(lambda: run(args.max_tokens), 1))
            first[name] = min(first[name], best_time(lambda: run(1), 1))
    tok_s = {k: (args.max_tokens - 1) / max(full[k] - first[k], 1e-9) for k in runs}
    ref, got = plain(args.max_tokens), speculative(args.max_tokens)
    s = last["eng"].metrics.snapshot(spec.num_steps)
    return {"off": {"tok_s": round(tok_s["off"], 1), "token_ids": ref},
            "on": {"tok_s": round(tok_s["on"], 1), "token_ids": got, "accept_len": round(s.accept_len, 4),
                   "accept_rate_per_position": rates(s.accepted_at_depth, s.reached_at_depth),
                   "accept_rate_at_least": rates(s.accepted_at_depth, s.drafted_at_depth),
                   "verify_steps": s.num_verify_steps, "reached_at_depth": s.reached_at_depth,
                   "accepted_at_depth": s.accepted_at_depth}}


def _decode_spec(client: GenerationClient):
    dec = next(w for w in client.cluster_status().workers if w.role == Role.DECODE)
    return dec.spec if dec.HasField("spec") else None


def served(flags: list[str], ids: list[int], args) -> dict:
    """One ``pdserve serve`` with ``flags``: warm-up, then ``--repeats`` timed single-stream requests."""
    with serve(["--prefill", "1", "--decode", "1", "--decode-weights", "model", "--dtype", args.dtype,
                "--threads-per-worker", str(args.threads), *flags]) as address, \
            GenerationClient(address, timeout_s=600) as client:
        out = timed_requests(client, ids, args)
    out["flags"] = " ".join(flags)
    return out


def timed_requests(client: GenerationClient, ids: list[int], args) -> dict:
    """Interleaved requests of ``max_tokens`` and of 2 tokens (the first from prefill, one decode round),
    best latency of each; the decode worker's speculation counters are summed over the long ones only."""
    def latency(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = client.generate(token_ids=ids, max_tokens=n, ignore_eos=True)
        return time.perf_counter() - t0, out.token_ids

    latency(16)  # warm-up (and the prefill worker's prefix cache: every timed request hits it alike)
    full, short, counts, tokens = float("inf"), float("inf"), {}, []
    for _ in range(args.repeats):
        before = _decode_spec(client)
        t, tokens = latency(args.max_tokens)
        after = _decode_spec(client)
        full, short = min(full, t), min(short, latency(2)[0])
        if after is not None:
            for f in ("verify_steps", "accepted_drafts"):
                counts[f] = counts.get(f, 0) + getattr(after, f) - getattr(before, f)
            for f in ("drafted_at_depth", "reached_at_depth", "accepted_at_depth"):
                delta = [a - b for a, b in zip(getattr(after, f), getattr(before, f))]
                counts[f] = [x + y for x, y in zip(counts.get(f, [0] * len(delta)), delta)]
    out = {"tok_s": round((args.max_tokens - 2) / max(full - short, 1e-9), 1), "token_ids": tokens}
    if counts:
        out.update(accept_len=round(1 + counts["accepted_drafts"] / max(counts["verify_steps"], 1), 4),
                   accept_rate_per_position=rates(counts["accepted_at_depth"], counts["reached_at_depth"]),
                   accept_rate_at_least=rates(counts["accepted_at_depth"], counts["drafted_at_depth"]),
                   verify_steps=counts["verify_steps"], reached_at_depth=counts["reached_at_depth"],
                   accepted_at_depth=counts["accepted_at_depth"])
    return out
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="5/1/6", help="speculative config STEPS/TOPK/DRAFT_TOKENS")
    ap.add_argument("--context-factor", type=float, default=4.0, help="prompt tokens = this x the model's index_topk")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="in-process: interleaved rounds; served: requests (best of)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads in-process and per served worker")
    ap.add_argument("--no-served", action="store_true", help="in-process only")
    ap.add_argument("--out", default=os.path.join(PDSERVE_HOME, "bench", "spec_dsa.json"))
    args = ap.parse_args(argv)
    tune_malloc()
    torch.set_num_threads(args.threads)
    spec = SpecConfig.parse(args.spec)
    model, cfg = load_model(SHIPPED_DEFAULT, args.dtype, "cpu")
    ids = held_out_ids(Tokenizer.from_model_dir(SHIPPED_DEFAULT), int(args.context_factor * cfg.index_topk))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = {"in-process": in_process(model, cfg, ids, spec, args)}
    if not args.no_served:
        res["served"] = {"off": served(["--no-speculative"], ids, args),
                         "on": served(["--speculative", str(spec), "--no-spec-fallback"], ids, args)}
    ref = res["in-process"]["off"]["token_ids"]
    for path in res.values():
        path["speedup"] = round(path["on"]["tok_s"] / path["off"]["tok_s"], 3)
        for side in ("off", "on"):
            path[side]["equals_plain_in_process"] = path[side].pop("token_ids") == ref
    report = {"model": SHIPPED_DEFAULT, "index_topk": cfg.index_topk, "prompt_tokens": len(ids),
              "max_tokens": args.max_tokens, "spec": str(spec), "dtype": args.dtype, "threads": args.threads,
              "repeats": args.repeats, "seconds": round(time.perf_counter() - t0, 1),
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "results": res}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    print(f"JSON: {args.out}")
    return report


def print_table(r: dict) -> None:
    print(f"default model (index_topk {r['index_topk']}), prompt {r['prompt_tokens']} tokens "
          f"({r['prompt_tokens'] / r['index_topk']:.1f}x index_topk), {r['max_tokens']} generated, greedy, single "
          f"stream, eager, {r['threads']} thread(s), {r['dtype']}; load average {r['loadavg_before'][0]} -> "
          f"{r['loadavg_after'][0]}; {r['seconds']} s")
    print(f"{'path':<11}| {'spec':<6}| {'tok/s':>7} | {'speedup':>7} | {'accept_len':>10} | {'== plain':>8} | "
          f"accept rate per position")
    for path, res in r["results"].items():
        for side in ("off", "on"):
            x = res[side]
            name = r["spec"] if side == "on" else "off"
            speed = f"{res['speedup']:.2f}x" if side == "on" else ""
            acc = f"{x['accept_len']:.2f}" if "accept_len" in x else "-"
            per = " ".join("-" if v is None else f"{v:.2f}" for v in x.get("accept_rate_per_position", []))
            print(f"{path:<11}| {name:<6}| {x['tok_s']:>7.1f} | {speed:>7} | {acc:>10} | "
                  f"{str(x['equals_plain_in_process']):>8} | {per}")


if __name__ == "__main__":
    main()
