"""A burst far beyond the decode pool (issue 46): N requests at once over gRPC against a cluster whose decode pool
holds a few of them; how many are served, how many refused (by status), TTFT and the time each waited in the
router's admission queue (``router.admission``). With ``--serve`` it starts the cluster itself, once per
``--max-queued`` value, so "no queue" (0) and the queue compare in one run on one machine.

    python -m bench.queue_burst --serve "--prefill 1 --decode 1 --num-pages 128 --page-size 16" \\
        --max-queued 0,256 --requests 200
    python -m bench.queue_burst --target 127.0.0.1:50051 --requests 200     # a running router
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from collections import Counter

import grpc
import numpy as np

from bench.serve_proc import serve
from router.client import AsyncGenerationClient


async def burst(target: str, num_requests: int, prompt_len: int, max_tokens: int, vocab: int, timeout_s: float,
                seed: int = 0) -> dict:
    """``num_requests`` at once; every figure in seconds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    client = AsyncGenerationClient(target, timeout_s=timeout_s)

    async def one(p: list[int]) -> tuple[str, float, float]:
        try:
            out = await client.generate(token_ids=p, max_tokens=max_tokens, ignore_eos=True)
        except grpc.aio.AioRpcError as e:
            return e.code().name, 0.0, 0.0
        return ("OK" if len(out.token_ids) == max_tokens else "short"), out.ttft_s, out.metrics.router_queue_s

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r[0] == "OK"]

    def pct(xs: list[float]) -> dict:
        return {q: round(float(np.percentile(xs, q)) * 1e3, 1) for q in (50, 95, 100)} if xs else {}
    return {"requests": num_requests, "served": len(ok), "by_status": dict(Counter(r[0] for r in results)),
            "wall_s": round(wall, 2), "ttft_ms": pct([r[1] for r in ok]),
            "router_queue_ms": pct([r[2] for r in ok]), "num_queued": sum(1 for r in ok if r[2] > 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="", help="a running router (HOST:PORT); else --serve starts one")
    p.add_argument("--serve", default="", help="pdserve serve flags of the cluster to start (one per --max-queued)")
    p.add_argument("--max-queued", default="0,256", help="with --serve: comma list of router --max-queued values")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=37)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--vocab", type=int, default=100, help="prompt ids are drawn from [2, vocab)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="each request's deadline")
    a = p.parse_args()
    runs = []
    if a.target:
        runs.append({"target": a.target, **asyncio.run(burst(a.target, a.requests, a.prompt_len, a.max_tokens,
                                                             a.vocab, a.timeout_s))})
    else:
        for mq in a.max_queued.split(","):
            flags = [*shlex.split(a.serve), "--max-queued", mq]
            with serve(flags) as target:
                res = asyncio.run(burst(target, a.requests, a.prompt_len, a.max_tokens, a.vocab, a.timeout_s))
            runs.append({"serve": " ".join(flags), **res})
    for r in runs:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
