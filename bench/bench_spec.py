"""Single-stream decode speed with and without MTP speculative decoding, in one run.

    .venv/bin/python -m bench.bench_spec [--model DIR] [--configs 5/1/6,3/1/4,3/2/6] [--max-tokens 128]
                                         [--dtype float32] [--prompt TEXT | --prompt-len 32] [--json]

Decode tok/s excludes prefill: each run is timed at ``max_tokens`` and at 1 token (prefill + first
token), decode rate = (max_tokens - 1) / difference (best of ``--repeats`` rounds, every contender
once per round, interleaved). Greedy, EOS ignored.
Reports, per speculative config, the accept length (tokens per verify step), the acceptance rate
per draft depth and the speed ratio to plain decoding. The default model is
``engine.defaults.default_model_dir()``; a random-weight model's MTP layer guesses almost nothing,
so expect accept length ~1 and a slowdown there (the draft and verify overhead without the gain).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.defaults import default_model_dir, tune_malloc
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine
from engine.tokenizer import Tokenizer


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def prompt_ids(args, model_dir: str, vocab_size: int) -> list[int]:
    tok = Tokenizer.from_model_dir(model_dir)
    if tok is not None:
        ids = tok.encode(args.prompt)
        if ids:
            return ids
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab_size, (args.prompt_len,), generator=g).tolist()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: engine.defaults.default_model_dir())")
    ap.add_argument("--configs", default="5/1/6,3/1/4,3/2/6")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                    help="prompt text (used when the model has a tokenizer.json)")
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt length without a tokenizer")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best of)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-compile", action="store_true",
                    help="decode / verify / draft steps eager (no compiled graphs)")
    args = ap.parse_args(argv)
    tune_malloc()  # both sides of the comparison run with it
    torch.set_num_threads(args.threads)

    model_dir = args.model or default_model_dir()
    model, cfg = load_model(model_dir, args.dtype, "cpu")
    model.compile_decode(not args.no_compile)
    ids = prompt_ids(args, model_dir, cfg.vocab_size)
    pages = (len(ids) + args.max_tokens) // 16 + 16

    def make():
        return Engine(model, cfg, kv_dtype=args.dtype, page_size=16, num_pages=pages)

    def plain(n: int):
        return make().generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))

    specs = [SpecConfig.parse(text) for text in args.configs.split(",")]
    last: dict[str, tuple] = {}

    def speculative(n: int, spec: SpecConfig):
        eng = SpecEngine(make(), spec)
        out = eng.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        last[str(spec)] = (eng, out)
        return out

    runs = {"plain": plain, **{str(sp): (lambda n, sp=sp: speculative(n, sp)) for sp in specs}}
    plain(4)  # warm-up (and the compiled graphs of every shape class)
    for sp in specs:
        speculative(8, sp)
    # interleaved rounds: every contender once per round, best of --repeats; the machine's drift then
    # hits plain decoding and each config alike instead of whichever happened to run during a slow spell
    full = {k: float("inf") for k in runs}
    first = dict(full)
    for _ in range(args.repeats):
        for name, run in runs.items():
            full[name] = min(full[name], best_time(lambda: run(args.max_tokens), 1))
            first[name] = min(first[name], best_time(lambda: run(1), 1))
    rate = {k: (args.max_tokens - 1) / max(full[k] - first[k], 1e-9) for k in runs}
    base = rate["plain"]
    ref = plain(args.max_tokens)[0].token_ids
    report = {"model": model_dir, "dtype": args.dtype, "prompt_tokens": len(ids), "max_tokens": args.max_tokens,
              "plain_tok_s": round(base, 1), "configs": {}}
    rows = [("plain", "-", base, 1.0, "")]
    for spec in specs:
        text = str(spec)
        speculative(args.max_tokens, spec)
        eng, out = last[text]
        m = eng.metrics
        same = out[0].token_ids == ref
        report["configs"][text] = {"decode_tok_s": round(rate[text], 1), "speedup": round(rate[text] / base, 3),
                                   "greedy_equals_plain": same, **m.as_dict(spec.num_steps)}
        rates = " ".join(f"{r:.2f}" for r in m.accept_rate_per_position(spec.num_steps))
        rows.append((text, f"{m.accept_len:.2f}", rate[text], rate[text] / base,
                     rates + ("" if same else "  (!= plain)")))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"model {model_dir} ({args.dtype}), prompt {len(ids)} tokens, {args.max_tokens} generated, "
              f"single stream, decode graphs {'eager' if args.no_compile else 'compiled'}")
        print(f"{'config':>7} | {'accept_len':>10} | {'decode tok/s':>12} | {'vs plain':>8} | accept rate per position (given the depth before)")
        for name, acc, rate, ratio, extra in rows:
            print(f"{name:>7} | {acc:>10} | {rate:>12.1f} | {ratio:>7.2f}x | {extra}")
    return report


if __name__ == "__main__":
    main()
