"""Prefill worker throughput and TTFT against prompt length, prefix-cache speed-up, and the ratio to
transformers' forward — all on the same model, in one process.

    .venv/bin/python -m bench.bench_prefill [--model DIR] [--lens 1024,2048,5120,10240,20480] [--hf-lens 2048,5120]

TTFT here is the prefill scheduler's submit -> first token (chunked prefill + MTP pass + sampling),
without network; the cached run shares 60% of its prompt with a previous request.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.defaults import default_model_dir, tune_malloc
from engine.kvcache import KVLayout, KVPool
from engine.layers.attention import DSAIndexer
from engine.load import load_model
from engine.sampling import SamplingParams
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillTask


class IndexerClock:
    """Wall time spent in the DSA indexer's selection (query-key scores + top-k: the work that grows with
    queries x context) while active; ``take()`` returns and resets it."""

    def __enter__(self) -> "IndexerClock":
        self.cls, self.orig, self.spent = DSAIndexer, DSAIndexer.select, 0.0
        clock = self

        def select(indexer, *a, **k):
            t0 = time.perf_counter()
            try:
                return clock.orig(indexer, *a, **k)
            finally:
                clock.spent += time.perf_counter() - t0
        DSAIndexer.select = select
        return self

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def __exit__(self, *exc) -> None:
        self.cls.select = self.orig


def indexer_bound(hits: list[tuple[float, float]], colds: list[tuple[float, float]], goal: float) -> str:
    """What the hit / cold ratio could reach if only the indexer got faster: with hit = Lh + Qh / f and
    cold = Lc + Qc / f (L the rest, Q the indexer), hit / cold <= goal needs f >= (Qh - goal Qc) / (goal Lc - Lh)."""
    (th, qh), (tc, qc) = (tuple(statistics.median(x[i] for x in runs) for i in (0, 1)) for runs in (hits, colds))
    lh, lc = th - qh, tc - qc
    head = (f"DSA indexer (scores + top-k): {qc:.2f} of {tc:.2f}s cold ({qc / tc:.0%}), {qh:.2f} of {th:.2f}s hit "
            f"({qh / th:.0%}); the rest {lh:.2f} vs {lc:.2f}s ({lh / lc:.2f}x)")
    if goal * lc <= lh:
        return head + f"; hit / cold <= {goal}x is out of reach at any indexer speed"
    need = (qh - goal * qc) / (goal * lc - lh)
    return head + f"; hit / cold <= {goal}x needs the indexer {need:.1f}x faster, all else equal"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lens", default="1024,2048,5120,10240,20480")
    ap.add_argument("--hf-lens", default="2048,5120")
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--cache-hit", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved pairs behind each ratio (medians)")
    args = ap.parse_args()
    tune_malloc()  # both sides of the comparison run with it
    torch.set_num_threads(args.threads)

    model_dir = args.model or default_model_dir()
    model, cfg = load_model(model_dir, "float32", "cpu")
    lens = [int(x) for x in args.lens.split(",")]
    page = 16
    pool = KVPool(KVLayout.for_model(cfg, page, "float32"), (max(lens) * 2) // page + 16)
    sched = PrefillScheduler(model, pool, PrefillConfig(chunk_size=args.chunk_size,
                                                        max_batch_tokens=args.chunk_size))
    g = torch.Generator().manual_seed(0)

    def ttft(ids: list[int]) -> float:
        out = {}
        t0 = time.perf_counter()
        sched.add(PrefillTask(f"r{time.perf_counter_ns()}", ids, SamplingParams(), on_done=lambda r: out.update(r=r)))
        while "r" not in out:
            sched.step()
            time.sleep(0)
        el = time.perf_counter() - t0
        if isinstance(out["r"], BaseException):
            raise out["r"]
        return el

    ttft(torch.randint(2, cfg.vocab_size, (256,), generator=g).tolist())  # warm-up
    print(f"model: {model_dir} ({cfg.model_type}, {cfg.num_hidden_layers} layers + {cfg.num_mtp_layers} MTP)")
    print(f"{'prompt':>7} | {'TTFT s':>7} | {'prefill tok/s':>13}")
    cold = {}
    for n in lens:
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
        sched.cache.reset()
        t = ttft(ids)
        cold[n] = (ids, t)
        print(f"{n:>7} | {t:>7.2f} | {n / t:>13.0f}", flush=True)
    n = max(lens)
    ids = cold[n][0]
    shared = int(n * args.cache_hit)
    hits, colds = [], []
    with IndexerClock() as clock:
        for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
            sched.cache.reset()
            ttft(ids[:shared] + torch.randint(2, cfg.vocab_size, (n - shared,), generator=g).tolist())  # fills the cache
            clock.take()  # (not part of either side)
            fresh_tail = torch.randint(2, cfg.vocab_size, (n - shared,), generator=g).tolist()
            hits.append((ttft(ids[:shared] + fresh_tail), clock.take()))
            sched.cache.reset()
            colds.append((ttft(ids[:shared] + fresh_tail), clock.take()))
    ratios = [h / c for (h, _), (c, _) in zip(hits, colds)]  # per adjacent pair: robust to the machine's drift
    print(f"\n{n}-token prompt, {args.cache_hit:.0%} cached: TTFT {statistics.median(h for h, _ in hits):.2f}s vs cold "
          f"{statistics.median(c for c, _ in colds):.2f}s; hit / cold {statistics.median(ratios):.2f}x (goal <= 0.45x; "
          f"median of {args.repeats} adjacent pairs: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(indexer_bound(hits, colds, 0.45))

    import transformers  # lazy: transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(f"\n{'prompt':>7} | {'pdserve tok/s':>13} | {'transformers tok/s':>18} | ratio (goal >= 2x)")
    for n in [int(x) for x in args.hf_lens.split(",")]:
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
        ours, theirs = [], []
        with torch.no_grad():
            hf(torch.tensor([ids[:256]]), logits_to_keep=1, use_cache=False)
            for _ in range(args.repeats):  # interleaved
                sched.cache.reset()
                ours.append(ttft(ids))
                t0 = time.perf_counter()
                hf(torch.tensor([ids]), logits_to_keep=1, use_cache=False)
                theirs.append(time.perf_counter() - t0)
        t_ours, t_hf = statistics.median(ours), statistics.median(theirs)
        print(f"{n:>7} | {n / t_ours:>13.0f} | {n / t_hf:>18.0f} | {t_hf / t_ours:.2f}x", flush=True)
    sched.stop()


if __name__ == "__main__":
    main()
