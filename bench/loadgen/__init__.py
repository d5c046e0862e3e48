"""pdserve's load generator: a gRPC client of the public API (no torch, no engine), so it runs wherever the
server is reachable.

    config.py    BenchConfig (the ``pdserve bench`` flags are generated from it) and the Slo
    workload.py  deterministic request streams: prefill-bound, single-stream, random, trace
    arrivals.py  Poisson arrival schedules
    runner.py    one sweep step: send, stream, record every request (failures by status code)
    stats.py     percentiles, throughput, goodput, the knee
    search.py    the knee search of --rps auto / --concurrency auto (ramp, bisect, one step past)
    report.py    terminal table, verdict and saturation, bench.json, bench.png, side-by-side comparison
    sweep.py     the whole run (list or auto, inside --max-duration); ``run_demo_sweep`` for ``make demo``

See docs/benchmarks.md for the definitions of every figure.
"""
from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.sweep import run_bench, run_demo_sweep, run_sweep

__all__ = ["BenchConfig", "Slo", "run_bench", "run_demo_sweep", "run_sweep"]
