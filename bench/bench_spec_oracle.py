"""Speculation at a controlled acceptance vs plain decode, by batch size (issue 44: speculation that pays on an MoE).

    .venv/bin/python -m bench.bench_spec_oracle [--preset peer-glm4moe | --model DIR] [--spec 5/1/6]
        [--accept-len 3.61] [--batches 1,4,16] [--max-tokens 48] [--dtype bfloat16] [--cost-model] [--json]

Oracle-draft mode (``engine.speculative.oracle``): the real MTP layer runs every draft forward, but the
drafted tokens are the target's own greedy continuation (plain greedy of the same prompts, run first), each
corrupted at the rate that makes a chain of ``num_steps`` drafts accept ``--accept-len`` tokens per step on
average. So the speed-up measured is what that acceptance buys on this model: its draft, verify (an MoE
verify reads the union of the experts of its k + 1 tokens) and extend costs are all real. ``--cost-model``
adds a row per batch with the draft-length cost model on (``engine.speculative.cost``), which may draft
less or not at all. Decode tok/s excludes prefill: each run is timed at ``max_tokens`` and at 1 token, rate =
batch * (max_tokens - 1) / difference, best of ``--repeats`` interleaved rounds. Greedy, EOS ignored; each
speculative output is checked equal to plain greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from bench.models import MEDIUM_GLM4MOE, PEER_GLM4MOE
from engine.checkpoint import init_random_model, init_random_model_streaming
from engine.defaults import tune_malloc
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine
from engine.speculative.cost import DraftCostConfig, DraftCostModel
from engine.speculative.oracle import OracleDrafts, greedy_references, rate_for_accept_len

PRESETS = {"peer-glm4moe": PEER_GLM4MOE, "medium-glm4moe": MEDIUM_GLM4MOE}
"""Random-weight models with one MTP layer added (``bench.models``)."""


def preset_dir(name: str, root: str) -> str:
    """A random-weight checkpoint of a preset (MTP layer included) under ``root``, written once."""
    out = os.path.join(root, f"{name}-mtp")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    conf = dict(PRESETS[name], num_nextn_predict_layers=1)
    if name.startswith("medium"):
        init_random_model_streaming(conf, out)
    else:
        init_random_model(conf, out, dtype=torch.bfloat16)
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_batch(model, cfg, args, spec: SpecConfig, batch: int, rate: float) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(2, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
    pages = batch * ((args.prompt_len + args.max_tokens + spec.num_step_slots) // 16 + 2) + 8

    def make():
        return Engine(model, cfg, kv_dtype=args.dtype, page_size=16, num_pages=pages)

    refs = greedy_references(make(), prompts, args.max_tokens + spec.num_steps)
    runs: dict[str, object] = {}

    def plain(n: int):
        return make().generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

    def speculative(n: int, cost: bool):
        eng = SpecEngine(make(), spec, oracle=OracleDrafts(refs, cfg.vocab_size, rate, seed=0),
                         cost_model=DraftCostModel(DraftCostConfig(spec.num_steps)) if cost else None)
        out = eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        runs["cost" if cost else "oracle"] = (eng, out)

    contenders = {"plain": plain, "oracle": lambda n: speculative(n, False)}
    if args.cost_model:
        contenders["cost"] = lambda n: speculative(n, True)
    for run in contenders.values():  # warm-up
        run(4)
    full = {k: float("inf") for k in contenders}
    first = dict(full)
    for _ in range(args.repeats):
        for name, run in contenders.items():
            full[name] = min(full[name], timed(lambda run=run: run(args.max_tokens)))
            first[name] = min(first[name], timed(lambda run=run: run(1)))
    tok_s = {k: batch * (args.max_tokens - 1) / max(full[k] - first[k], 1e-9) for k in contenders}
    contenders["oracle"](args.max_tokens)  # the outputs and metrics of a full run (the last timed one was 1 token)
    if args.cost_model:
        contenders["cost"](args.max_tokens)
    row = {"batch": batch, "plain_tok_s": round(tok_s["plain"], 2)}
    for name in contenders:
        if name == "plain":
            continue
        eng, out = runs[name]
        row[name] = {"tok_s": round(tok_s[name], 2), "vs_plain": round(tok_s[name] / tok_s["plain"], 3),
                     "accept_len": round(eng.metrics.accept_len, 3),
                     "equals_plain": [o.token_ids for o in out] == [refs[tuple(p)][:args.max_tokens] for p in prompts]}
        cm = eng.decoder.cost_model
        if cm is not None:
            row[name]["steps_by_drafts"] = list(cm.steps_by_drafts)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory with an MTP layer (default: --preset)")
    ap.add_argument("--preset", default="peer-glm4moe", choices=sorted(PRESETS))
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "pdserve-bench-models"),
                    help="where preset checkpoints are written (once)")
    ap.add_argument("--spec", default="5/1/6", help="a chain STEPS/1/STEPS+1")
    ap.add_argument("--accept-len", type=float, default=3.61, help="mean tokens per verify step to hold")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (best of)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-model", action="store_true", help="also run with the draft-length cost model")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = SpecConfig.parse(args.spec)
    if not spec.is_chain:
        raise SystemExit(f"oracle drafts need a chain, got {spec}")
    tune_malloc()
    torch.set_num_threads(args.threads)
    model_dir = args.model or preset_dir(args.preset, args.root)
    model, cfg = load_model(model_dir, args.dtype, "cpu")
    rate = rate_for_accept_len(args.accept_len, spec.num_steps)
    rows = [bench_batch(model, cfg, args, spec, int(b), rate) for b in args.batches.split(",")]
    report = {"model": model_dir, "dtype": args.dtype, "spec": str(spec), "target_accept_len": args.accept_len,
              "corrupt_rate": round(rate, 4), "max_tokens": args.max_tokens, "threads": args.threads, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return report
    print(f"model {model_dir} ({args.dtype}), spec {spec}, oracle drafts at accept length {args.accept_len} "
          f"(corrupt rate {rate:.3f}), {args.max_tokens} tokens, {args.threads} threads")
    print(f"{'batch':>5} | {'plain tok/s':>11} | {'mode':>6} | {'accept_len':>10} | {'tok/s':>8} | {'vs plain':>8}")
    for r in rows:
        for name in ("oracle", "cost"):
            if name in r:
                m = r[name]
                extra = f"  drafts by step {m['steps_by_drafts']}" if "steps_by_drafts" in m else ""
                print(f"{r['batch']:>5} | {r['plain_tok_s']:>11.1f} | {name:>6} | {m['accept_len']:>10.2f} | "
                      f"{m['tok_s']:>8.1f} | {m['vs_plain']:>7.2f}x{'' if m['equals_plain'] else '  (!= plain)'}{extra}")
    return report


if __name__ == "__main__":
    main()
