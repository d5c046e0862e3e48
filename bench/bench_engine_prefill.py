"""Prefill throughput: pdserve's engine vs transformers' forward, same model, same process.

    .venv/bin/python -m bench.bench_engine_prefill [--lens 2048,8192] [--dtype bfloat16] [--repeats 3]

Prints tok/s for each and the ratio (engine / transformers). The model weights are random (speed only).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from bench.models import PEER_GLM4MOE, PEER_GLM5
from engine.batch import BatchRequest, ForwardBatch
from engine.checkpoint import init_random_model
from engine.defaults import tune_malloc
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="glm4_moe,glm_moe_dsa")
    args = ap.parse_args()
    tune_malloc()  # both sides of the comparison run with it
    torch.set_num_threads(2)
    import transformers  # lazy: transformers

    dtype = getattr(torch, args.dtype)
    print(f"{'model':>12} | {'tokens':>6} | {'engine tok/s':>12} | {'transformers tok/s':>18} | ratio")
    for name in args.models.split(","):
        cfg_dict = PEER_GLM4MOE if name == "glm4_moe" else PEER_GLM5
        with tempfile.TemporaryDirectory() as d:
            init_random_model(cfg_dict, d)
            model, cfg = load_model(d, args.dtype, "cpu")
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
            for n in [int(x) for x in args.lens.split(",")]:
                ids = torch.randint(2, cfg.vocab_size, (n,))
                pool = KVPool(KVLayout.for_model(cfg, 16, args.dtype), n // 16 + 1)
                pages = list(range(n // 16 + 1))

                def ours():
                    model(ForwardBatch.build([BatchRequest(pages, 0, ids.tolist())], 16), pool)

                def theirs():
                    with torch.no_grad():
                        hf(ids[None], logits_to_keep=1, use_cache=False)

                t_ours, t_hf = best_time(ours, args.repeats), best_time(theirs, args.repeats)
                print(f"{name:>12} | {n:>6} | {n / t_ours:>12.0f} | {n / t_hf:>18.0f} | {t_hf / t_ours:.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
