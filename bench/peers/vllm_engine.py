"""vLLM's offline ``LLM`` on one checkpoint: decode and prefill tok/s, one JSON object per line on stdout.

Runs with the peers' vLLM venv python (``engine_table.py`` starts it; stdlib + vllm only, no pdserve imports):

    VLLM_TARGET_DEVICE=cpu $PEERS/vllm/bin/python bench/peers/vllm_engine.py --model DIR

Decode: B random prompts of ``--prompt-len`` tokens, greedy, ``ignore_eos``; a round's rate is
B * (new - 1) / (t(new tokens) - t(1 token)), the prefill and first token taken out as pdserve's side does.
Prefill: one random prompt of N tokens, one output token, prefix caching off; N / t. Every value is printed
per round (``engine_table.py`` takes the median).
"""
from __future__ import annotations

import argparse
import json
import random
import time

from vllm import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill-lens", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2048, help="prompt ids are drawn below this")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x]
    longest = max(prefill_lens + [args.prompt_len + args.new])
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=longest + 64, enable_prefix_caching=False,
              max_num_batched_tokens=max(longest, 2048), max_num_seqs=max(batches + [1]),
              seed=0)
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(2, args.vocab) for _ in range(length)] for _ in range(n)]

    for b in batches:
        timed(llm, prompts(b, args.prompt_len), 4)  # warm-up at this batch size
        for r in range(args.rounds):
            ps = prompts(b, args.prompt_len)
            d = timed(llm, ps, args.new) - timed(llm, ps, 1)
            print(json.dumps({"kind": "decode", "batch": b, "round": r, "tok_s": b * (args.new - 1) / d}),
                  flush=True)
    for n in prefill_lens:
        timed(llm, prompts(1, n), 1)  # warm-up at this length
        for r in range(args.rounds):
            print(json.dumps({"kind": "prefill", "tokens": n, "round": r,
                              "tok_s": n / timed(llm, prompts(1, n), 1)}), flush=True)


if __name__ == "__main__":
    main()
