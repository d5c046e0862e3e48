"""``make demo``: the main job. Starts a local cluster (router + 1 prefill + 1 decode worker) on the default
model, answers one real request through the public gRPC API, runs a short prefill-bound auto sweep sized for
this machine (``--rps auto``: ramp until the TTFT SLO breaks, bisect, one step past: the knee and saturation)
and prints the benchmark table (JSON and PNG go to the output directory it prints).
"""
from __future__ import annotations

import argparse
import os
import time

from bench.loadgen.sweep import run_demo_sweep
from cluster.local import LocalCluster, LocalClusterConfig
from engine.defaults import PDSERVE_HOME, default_model_dir
from router.client import GenerationClient
from router.config import RouterConfig


def main(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    out_dir = os.path.join(PDSERVE_HOME, "demo", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    cfg = LocalClusterConfig(model=model_dir, router=RouterConfig(port=0), run_dir=os.path.join(out_dir, "logs"))
    print(f"starting a local cluster on {model_dir} (logs: {cfg.run_dir}) ...", flush=True)
    with LocalCluster(cfg) as cluster:
        target = cluster.router_address
        print(f"router listening on {target}", flush=True)
        with GenerationClient(target) as client:
            status = client.cluster_status()
            info = status.workers[0].info
            has_tok = info.get("has_tokenizer") == "1"
            t0 = time.perf_counter()
            if has_tok:
                prompt = "def fibonacci(n):\n"
                res = client.generate(prompt, max_tokens=48, temperature=0.0)
                print(f"\nprompt: {prompt!r}\ncompletion ({time.perf_counter() - t0:.2f}s, "
                      f"TTFT {res.ttft_s * 1000:.0f} ms, finish {res.finish_reason}):\n{res.text}\n", flush=True)
            else:
                res = client.generate(token_ids=[0, 5, 17, 42, 7], max_tokens=24, ignore_eos=True)
                print(f"\ntoken ids [0, 5, 17, 42, 7] -> {res.token_ids} (TTFT {res.ttft_s * 1000:.0f} ms)\n",
                      flush=True)
            vocab = int(info.get("vocab_size", "512"))
        print("prefill-bound auto sweep (1024-token prompts, 60% shared prefix, 32 output tokens; ramps the rate "
              "until TTFT p95 passes 2 s, then bisects; at most 100 s):", flush=True)
        run_demo_sweep(target, out_dir, vocab)
    print(f"\nresults: {out_dir}/bench.json, plot: {out_dir}/bench.png")
    return 0
