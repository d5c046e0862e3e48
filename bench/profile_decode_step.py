"""Where a batch-1 decode step's time goes (issue 28): ms per step, torch ops, and the top ops by CPU time.

    PYTHONPATH=$PWD .venv/bin/python -m bench.profile_decode_step [--model DIR] [--dtypes float32,bfloat16]
        [--modes eager,compiled] [--threads 1] [--steps 200] [--prompt-len 64]

For each (dtype, mode): ``Engine.decode_step`` of one request (``--prompt-len`` prompt, greedy), warmed up, then the
median of 5 x ``--steps`` timed steps; then one profiled batch of 20 steps (``torch.profiler``): top-level
aten ops per step, the share of the step inside them ("kernels"; the rest is Python, dynamo's guards and the
engine's own bookkeeping), and the ops with the most self CPU time. The configurations alternate round by
round so their ratios come from the same minutes. Last, the floor: one call of an empty compiled function
(``torch.compile`` with the C++ wrapper, as the decode graphs are) and one eager ``aten::add`` of two scalars.
A mode ending in ``-gather`` (``eager-gather``, ``compiled-gather``) runs a GQA model's decode attention as before
the paged kernel (``GQAAttention.paged_kernel`` off: the context gathered, then SDPA / bmm), for a same-run ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.defaults import default_model_dir, tune_malloc
from engine.layers.attention import GQAAttention
from engine.load import load_model
from engine.offline import Engine, Seq
from engine.sampling import SamplerState, SamplingParams


def make_step(model_dir: str, dtype: str, mode: str, prompt_len: int):
    model, cfg = load_model(model_dir, dtype, "cpu")
    model.compile_decode(mode.startswith("compiled"))
    gather = mode.endswith("-gather")
    prompt = torch.randint(2, min(cfg.vocab_size, 2048), (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    eng = Engine(model, cfg, kv_dtype=dtype, page_size=16, num_pages=(prompt_len + 600) // 16 + 8)
    seq = Seq("r0", prompt, SamplerState(SamplingParams(max_tokens=100_000, ignore_eos=True), prompt))
    eng._append([seq], eng.prefill(seq))
    state = {"n": 0}

    def step() -> None:
        if state["n"] >= 600:  # keep the context short and bounded: restart the sequence's decode
            seq.output_ids[1:] = []
            seq.cached_len = len(prompt)
            state["n"] = 0
        if gather:
            paged = vars(GQAAttention)["paged_kernel"]  # the staticmethod itself, to put back as it was
            GQAAttention.paged_kernel = staticmethod(lambda pool: False)
            try:
                eng.decode_step([seq])
            finally:
                GQAAttention.paged_kernel = paged
        else:
            eng.decode_step([seq])
        state["n"] += 1
    return step


def time_steps(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def profile_steps(step, n: int = 20) -> tuple[float, float, list[tuple[str, float, int]]]:
    """(top-level aten ops per step, their share of the wall time, [(op, us per step, calls per step)])."""
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = time.perf_counter() - t0
    top = [e for e in p.events() if e.cpu_parent is None]
    aten = [e for e in top if e.name.startswith("aten::") or e.name.startswith("Torch-Compiled")
            or "CompiledFunction" in e.name or e.name.startswith("cpp_fused") or e.name.startswith("mkldnn")]
    inside = sum(e.time_range.elapsed_us() for e in top) / 1e6
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in p.events():
        self_us[e.name] += e.self_cpu_time_total
        calls[e.name] += 1
    rows = sorted(((k, v / n, calls[k] // n) for k, v in self_us.items()), key=lambda r: -r[1])[:12]
    return len(aten) / n, inside / wall, rows


def floor_us() -> tuple[float, float]:
    """(one call of an empty compiled graph, one eager scalar add) in us."""
    fn = torch.compile(lambda x: x + 1, fullgraph=True, options={"cpp_wrapper": True})
    x = torch.zeros(1)
    for _ in range(3):
        fn(x)
    t_graph = min(time_steps(lambda: fn(x), 2000) for _ in range(3))
    t_add = min(time_steps(lambda: torch.add(x, x), 5000) for _ in range(3))
    return t_graph * 1e6, t_add * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=64, help="the request's prompt (its context grows from there)")
    args = ap.parse_args()
    tune_malloc()
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    configs = [(d, m) for d in args.dtypes.split(",") for m in args.modes.split(",")]
    steps = {c: make_step(model_dir, c[0], c[1], args.prompt_len) for c in configs}
    for s in steps.values():
        time_steps(s, 30)
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for _ in range(5):  # interleaved rounds
        for c, s in steps.items():
            times[c].append(time_steps(s, args.steps))
    print(f"model {model_dir}, {args.threads} thread(s), batch 1, {args.prompt_len}-token prompt")
    for c in configs:
        med = statistics.median(times[c])
        print(f"{c[0]:>9} {c[1]:>8}: {med * 1e6:7.0f} us/step ({1 / med:6.0f} tok/s), rounds "
              + " ".join(f"{t * 1e6:.0f}" for t in times[c]))
    if not args.no_profile:
        for c, s in steps.items():
            ops, share, rows = profile_steps(s)
            print(f"\n{c[0]} {c[1]}: {ops:.0f} top-level ops/step, {share:.0%} of the step inside top-level ops")
            for name, us, n in rows:
                print(f"  {us:8.1f} us/step  {n:4d} calls  {name[:90]}")
    g, a = floor_us()
    print(f"\nfloor: empty compiled graph call {g:.1f} us, eager scalar aten::add {a:.1f} us")


if __name__ == "__main__":
    main()
