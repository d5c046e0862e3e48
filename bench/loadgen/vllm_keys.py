"""The figures of vLLM's ``bench serve`` under its own key names, per sweep step, so a bench.json can be read
by the tools (and people) that read vLLM's: ``request_throughput``, ``output_throughput``,
``total_token_throughput``, ``mean/median/std/p99_{ttft,tpot,itl,e2el}_ms``, ``completed``,
``total_input_tokens``, ``total_output_tokens``, ``duration``.

Computed as vLLM computes them (``vllm/benchmarks/serve.py``, ``calculate_metrics``) over the step's
measured successful requests: ``duration`` runs from the first of them sent to the last one finished;
TPOT = (E2E - TTFT) / (output tokens - 1); ITL = every gap between streamed chunks; token counts are the
server's ``usage``. pdserve's own figures (per-window throughput, p95, goodput) stay beside them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from bench.loadgen.runner import StepRecords


def _dist(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def vllm_keys(sr: StepRecords, detailed: bool = False) -> dict[str, Any]:
    measured = sr.measured
    ok = [r for r in measured if r.ok and r.t_first is not None and r.t_end is not None]
    duration = max(r.t_end for r in ok) - min(r.t_send for r in ok) if ok else 0.0
    inp = sum(r.prompt_tokens or r.input_len for r in ok)
    out = sum(r.completion_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    tpots = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itls = [float(g) for r in ok for g in np.diff(r.chunk_times)]
    keys: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(measured) - len(ok),
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out), "total_token_throughput":
            per_s(inp + out),
        **_dist("ttft", [r.ttft_s for r in ok]), **_dist("tpot", tpots), **_dist("itl", itls),
        **_dist("e2el", [r.e2e_s for r in ok])}
    if detailed:
        keys["detailed"] = [
            {"index": r.index, "status": r.status, "input_len": r.prompt_tokens or r.input_len,
             "output_len": r.completion_tokens, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
             "itls_s": [float(g) for g in np.diff(r.chunk_times)], "error": r.detail} for r in measured]
    return keys
