"""Tuning the MoE implementation tables (``pdserve tune-moe``, ``bench.bench_moe``): time every routed-expert
strategy per token count for a shape and write the winners where ``engine.moe.tuned_table`` finds them.

Off the serving path: no worker imports this module (the run-time lookup is ``engine.moe.tuned_table``).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from engine.moe.mx_experts import AUTO_IMPLS, MX_MOE_IMPLS, DequantCache, MXRoutedExperts
from engine.moe.router import Routing
from engine.moe.tuned_table import TUNED_DIR, MoEShape, TableMeta, _read_table, device_name, table_json
from engine.quant.mx import MXSpec, get_mx_format

DROP_FACTOR = 20.0
"""tune_shape stops timing a strategy at larger token counts once it is this many times the best."""
DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ShapeTuneResult(NamedTuple):
    shape: MoEShape
    device: str
    timings_s: dict[int, dict[str, float]]
    """num_tokens -> impl -> best-of-reps seconds per forward."""
    skipped: list[str]
    """Why token counts or impls were left out (time limit, memory)."""
    device_type: str = "cpu"

    @property
    def best(self) -> dict[int, str]:
        return {t: min(row, key=row.get) for t, row in self.timings_s.items() if row}


def best_time_s(fn: Callable[[], object], min_reps: int = 3, target_s: float = 0.3, max_reps: int = 20) -> float:
    """Fastest wall time of ``fn`` after one warm-up, repeated until ``target_s`` or ``max_reps``.

    The minimum, not the median: on a shared CPU other processes only ever add time.
    """
    fn()
    times: list[float] = []
    while len(times) < min_reps or (sum(times) < target_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def random_routing(num_tokens: int, num_experts: int, topk: int, device: torch.device | str = "cpu",
                   seed: int = 0):
    """Uniform random top-k routing (each token's experts distinct) with softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=-1)[1]
    weights = torch.rand(num_tokens, topk, generator=gen).softmax(-1)
    return Routing(ids.to(device), weights.to(device))


def tune_shape(shape: MoEShape, token_counts: Iterable[int] = DEFAULT_TOKEN_COUNTS, impls: Sequence[str] | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, max_run_s: float = 5.0,
               progress: Callable[[str], None] | None = None) -> ShapeTuneResult:
    """Time every MX strategy at every token count; stop growing the token count once a run
    exceeds ``max_run_s`` (the larger counts fall back to the nearest key that was measured)."""
    dev = torch.device(device)
    dname = device_name(dev)
    skipped: list[str] = []
    # by default the strategies ``auto`` may run (cached_* hold a dense layer: only timed when named)
    names = [n for n in (impls or AUTO_IMPLS) if n in MX_MOE_IMPLS]
    cache = DequantCache(DequantCache.default_budget(dev)) if any(n.startswith("cached_") for n in names) else None
    module = MXRoutedExperts.random(shape, MXSpec(get_mx_format(shape.dtype)), device=dev, cache=cache)
    timings: dict[int, dict[str, float]] = {}
    dropped: set[str] = set()
    x_all = torch.randn(max(token_counts), shape.hidden, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    for t in sorted(set(token_counts)):
        routing = random_routing(t, shape.num_experts, shape.topk, dev, seed=t)
        x = x_all[:t]
        row: dict[str, float] = {}
        for name in names:
            if name in dropped:
                continue
            if not module.can_run(name, dtype, t):
                skipped.append(f"T={t} {name}: cannot run here (its dense weights exceed the memory budget, or its "
                               f"kernel needs another device / did not build)")
                continue
            fn = functools.partial(MX_MOE_IMPLS[name], module, x, routing)
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            row[name] = first if first > max_run_s else best_time_s(fn, min_reps=1 if first > 0.5 else 3)
            if progress:
                progress(f"{shape.key(dname)} T={t} {name}: {row[name] * 1e3:.2f} ms")
        timings[t] = row
        module.clear_cache()
        for name, v in row.items():  # hopeless at this size: do not time it at larger ones
            if row and v > DROP_FACTOR * min(row.values()) and v > 0.05 and name not in dropped:
                dropped.add(name)
                skipped.append(f"T>{t} {name}: {v / min(row.values()):.0f}x the best at T={t}, not timed further")
        if row and min(row.values()) > max_run_s:
            rest = [c for c in token_counts if c > t]
            if rest:
                skipped.append(f"T>{t}: fastest run took {min(row.values()):.1f}s > max_run_s={max_run_s}")
            break
    return ShapeTuneResult(shape, dname, timings, skipped, dev.type)


def write_table(result: ShapeTuneResult, out_dir: str = TUNED_DIR) -> str:
    """Write ``{num_tokens: best impl}`` as the shape's table file; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, result.shape.file_name(result.device))
    with open(path, "w") as f:
        f.write(table_json(TableMeta.here(list(MX_MOE_IMPLS), result.device_type), result.best))
    _read_table.cache_clear()
    return path
