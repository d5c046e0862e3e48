"""Served single-stream decode: what a client of ``pdserve serve`` sees, per cluster configuration.

    .venv/bin/python bench/bench_served_decode.py [--configs "default;--no-speculative"] [--requests 4]
                                                  [--max-tokens 200]

For each configuration (``pdserve serve`` flags, ``;``-separated; ``default`` = none) a local cluster is
started, ``--requests`` greedy requests are sent one at a time over gRPC with held-out text as the prompt
(CPython's ``asyncio/events.py``, not in the default model's training split) and the stream rate after the
first token is printed per request, with the decode worker's speculation fallbacks and its own rate while
busy (tokens / scheduler busy time: what the relay to the client costs on top). Configurations run
one after another on the same machine: compare them within one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402

from bench.serve_proc import serve  # noqa: E402
from common.reasons import Role  # noqa: E402
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402


def run(flags: list[str], prompts: list[str], max_tokens: int) -> tuple[list[float], str]:
    with serve(flags) as address, grpc.insecure_channel(address) as ch:
        stub, rates = generation_pb2_grpc.GenerationStub(ch), []
        for text in prompts:
            req = generation_pb2.GenerateRequest(text=text, sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            t0, n = None, 0
            for r in stub.Generate(req, timeout=600):
                if t0 is None:
                    t0 = time.perf_counter()
                else:
                    n += len(r.token_ids)
            rates.append(n / (time.perf_counter() - t0))
        st = generation_pb2_grpc.AdminStub(ch).GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=30)
    dec = [w for w in st.workers if w.role == Role.DECODE]
    fb = ", ".join(f"{w.info.get('spec_fallbacks', '-')} speculation fallbacks, {w.tokens_per_s:.0f} tok/s "
                   f"while its scheduler was busy" for w in dec)
    return rates, fb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="default;--no-speculative")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], "asyncio", "events.py")).read()
    prompts = [text[3000 + 200 * i:4500] for i in range(args.requests)]
    for cfg in args.configs.split(";"):
        flags = [] if cfg.strip() == "default" else cfg.split()
        rates, fb = run(flags, prompts, args.max_tokens)
        print(f"{cfg:<24} tok/s per request after the first token: {', '.join(f'{r:.0f}' for r in rates)}"
              f"  (decode worker: {fb})", flush=True)


if __name__ == "__main__":
    main()
