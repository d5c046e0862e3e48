"""``make demo``: answer a real request on the default model and print a small benchmark table.

Grows with the cluster: today it runs in-process (``pdserve run``'s engine); the local cluster and
the prefill-bound sweep replace the in-process numbers once the router exists.
"""
from __future__ import annotations

import argparse
import time

import torch


def main(args: argparse.Namespace) -> int:
    from engine.defaults import default_model_dir
    from engine.runtime import Engine, load_model
    from engine.sampling import SamplingParams
    from engine.tokenizer import Tokenizer

    model_dir = args.model or default_model_dir()
    model, cfg = load_model(model_dir, "float32", "cpu")
    tok = Tokenizer.from_model_dir(model_dir)
    eng = Engine(model, cfg, kv_dtype="float32", num_pages=2048)
    prompt = tok.encode("def fibonacci(n):") if tok else [0, 5, 17, 42, 7]
    t0 = time.perf_counter()
    res = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    print(f"model: {model_dir}")
    print(f"request: prompt {prompt} -> {res.token_ids} ({time.perf_counter() - t0:.2f}s)")
    if tok:
        print("text:", repr(tok.decode(res.token_ids)))
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in (512, 2048):
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
        t0 = time.perf_counter()
        r = eng.generate([ids], SamplingParams(max_tokens=33, ignore_eos=True))[0]
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        eng.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        ttft = time.perf_counter() - t1
        decode_tps = (len(r.token_ids) - 1) / max(total - ttft, 1e-9)
        rows.append((n, ttft, n / ttft, decode_tps))
    print(f"\n{'prompt tokens':>14} | {'TTFT s':>7} | {'prefill tok/s':>13} | {'decode tok/s':>12}")
    print("-" * 56)
    for n, ttft, ptps, dtps in rows:
        print(f"{n:>14} | {ttft:>7.3f} | {ptps:>13.0f} | {dtps:>12.1f}")
    return 0
