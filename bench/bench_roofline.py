"""Decode against the memory-bandwidth roofline (issue 44): where the time of a batch-B decode step goes, and
what share of the roofline (bytes the step must read / the bandwidth this run measures) it reaches.

    flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.bench_roofline \\
        --model /tmp/medium-glm4moe [--mx-model /tmp/medium-glm4moe-mxfp4] [--batches 1,8] [--steps 8]

The model: ``bench.models.MEDIUM_GLM4MOE`` (1.68 G parameters), written by
``engine.checkpoint.init_random_model_streaming`` and quantized by ``pdserve quantize --format mxfp4``.

* Bandwidth: the best of 5 sums of a 2 GiB bf16 tensor at the run's thread count (what a GEMV can at most read),
  probed by the parent and again by each model's process (the best of the two: a shared host only lowers it).
* Bytes a step must read, from the model's own tensors: every bf16 weight of the attention projections, the dense
  MLP, the shared experts and lm_head, the router (fp32), and per MoE layer the routed experts a batch of B
  uniformly routed tokens touches in expectation (E (1 - (1 - k / E)^B); k at B 1), at their stored bytes (bf16, or
  MX codes + scales); the KV cache of the prompt (16 tokens) is counted too; the embedding rows are not (B rows).
* Time per step, split: each group of ops run alone at batch B on the model's weights (the same calls the step
  makes): ``dense`` (every bf16 linear), ``experts`` (the routed experts' module on a router's real routing),
  ``router`` (its logits and top-k), and ``rest`` = the step minus those (attention over the KV cache, norms, RoPE,
  residuals, sampling, Python and dispatch).
Each model runs in its own process, every weight paged in first, its variants interleaved, the best of 2 rounds
each: same run, same host. Variants: the GEMV kernel off (``F.linear``, oneDNN) and on (``engine.layers.cpu_gemv``,
the default); an MXFP4 model also on with its in-register expert kernel off (``fused_gather``, the tile kernel) and
on (``fused_gemv``, the default): ``experts`` names the strategy its MoE layers ran. ``experts`` at batch
B > 1 reads a different routing than the step's (so ``rest`` may be off by the difference).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from bench.bench_mx_model import timed_decode
from engine.layers import cpu_gemv
from engine.layers.mlp import MoE
from engine.load import load_model
from engine.moe import mx_fused
from engine.moe.router import route
from engine.offline import Engine
from engine.quant.prepare import expert_memory, expert_status
from engine.sampling import SamplingParams

PROMPT_LEN = 16


def bandwidth_gbs(num_bytes: int = 2 << 30, reps: int = 5) -> float:
    """Read bandwidth, GB/s: the best of ``reps`` sums of a ``num_bytes`` bf16 tensor."""
    a = torch.ones(num_bytes // 2, dtype=torch.bfloat16)
    a.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def dense_calls(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every bf16 linear a decode step runs, in order (attention, FFN / shared experts, head)."""
    calls = []
    for layer in model.model.layers:
        a = layer.self_attn
        w, b, _ = a._fused_qkv.weight([(m.weight, m.bias) for m in (a.q_proj, a.k_proj, a.v_proj)])
        calls += [(w, b), (a.o_proj.weight, a.o_proj.bias)]
        f = layer.mlp.tokenwise_args()
        calls += [(f.w_x, None), (f.w_down, None)]
    return calls + [(model.lm_head.weight, None)]


def step_bytes(model, cfg, batch: int) -> dict:
    """Bytes a batch-``batch`` decode step must read, by group."""
    dense = sum(nbytes(w) + nbytes(b) for w, b in dense_calls(model))
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    router = sum(nbytes(m.gate.weight) for m in moe)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    mem = expert_memory(model)
    per_expert = (mem.mx_bytes + mem.dense_bytes) / (len(moe) * E)
    touched = k if batch == 1 else E * (1 - (1 - k / E) ** batch)
    experts = int(len(moe) * touched * per_expert)
    kv = batch * (PROMPT_LEN + 1) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return {"dense": dense, "router": router, "experts": experts, "kv": kv, "total": dense + router + experts + kv}


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def split_times(model, cfg, batch: int, reps: int) -> dict:
    """Seconds per step of each op group run alone at batch ``batch`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(batch)
    H = cfg.hidden_size
    calls = dense_calls(model)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], generator=gen).bfloat16() for w, _ in calls}
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    h = torch.randn(batch, H, generator=gen).bfloat16()

    def run_router() -> list:
        out = []
        for m in moe:
            f = m.tokenwise_args()
            out.append(route(F.linear(h.float(), f.w_router), f.bias, *f.route_consts))
        return out

    routings = run_router()
    with torch.inference_mode():
        return {
            "dense": timed(lambda: [cpu_gemv.linear(xs[w.shape[1]], w, b) for w, b in calls], reps),
            "router": timed(run_router, reps),
            "experts": timed(lambda: [m.experts(h, r) for m, r in zip(moe, routings)], reps),
        }


def run_model(model_dir: str, batches: list[int], steps: int, bw: float, rounds: int = 2) -> list[dict]:
    model, cfg = load_model(model_dir, "bfloat16", "cpu")
    with torch.inference_mode():  # every weight paged in before timing (a checkpoint may be mapped lazily)
        for t in list(model.parameters()) + list(model.buffers()):
            t.float().sum() if t.dtype.is_floating_point else t.sum()
    eng = Engine(model, cfg, kv_dtype="bfloat16", num_pages=max(batches) * 4 + 16)
    eng.generate([list(range(2, 2 + PROMPT_LEN))], SamplingParams(max_tokens=2))
    bw = max(bw, bandwidth_gbs())  # the host is shared: the best of the parent's probe and this one
    variants = [(False, True), (True, False), (True, True)] if expert_memory(model).mx_bytes else [(False, True),
                                                                                                   (True, True)]
    best: dict[tuple[bool, bool, int], float] = {}
    ran: dict[tuple[bool, bool], str] = {}
    for _ in range(rounds):  # the variants interleaved, the best of ``rounds`` per cell
        for b in batches:
            for gemv, mx_gemv in variants:
                cpu_gemv.enable(gemv)
                mx_fused.enable_gemv(mx_gemv)
                dt = timed_decode(eng, cfg.vocab_size, b, steps, seed=b) / steps
                best[gemv, mx_gemv, b] = min(best.get((gemv, mx_gemv, b), dt), dt)
                ran[gemv, mx_gemv] = expert_status(model)["moe_impls"] or "bf16"
    rows = []
    for gemv, mx_gemv in variants:
        cpu_gemv.enable(gemv)
        mx_fused.enable_gemv(mx_gemv)
        for b in batches:
            dt = best[gemv, mx_gemv, b]
            need = step_bytes(model, cfg, b)
            parts = split_times(model, cfg, b, reps=max(2, steps // 2))
            roof_s = need["total"] / (bw * 1e9)
            row = {"model": model_dir, "gemv": cpu_gemv.path() if gemv else "off", "experts": ran[gemv, mx_gemv],
                   "batch": b, "bw_gbs": round(bw, 1), "tok_s": round(b / dt, 2), "roofline_tok_s": round(b / roof_s, 2),
                   "roofline_pct": round(100 * roof_s / dt, 1), "step_ms": round(dt * 1e3, 2),
                   "bytes_mb": {k: round(v / 1e6, 1) for k, v in need.items()}}
            for k, t in parts.items():  # each group: its ms, and its bytes' time at bandwidth as % of its time
                row[f"{k}_ms"] = round(t * 1e3, 2)
                row[f"{k}_roof_pct"] = round(100 * need[k] / (bw * 1e9) / t, 1)
            row["rest_ms"] = round((dt - sum(parts.values())) * 1e3, 2)
            rows.append(row)
    return rows


def print_table(rows: list[dict], bw: float) -> None:
    print(f"bandwidth {max([bw] + [r['bw_gbs'] for r in rows]):.1f} GB/s at best ({torch.get_num_threads()} threads, "
          "2 GiB bf16 sum; each row's roofline uses its own process's best)")
    print("| model | gemv | experts | batch | tok/s | roofline tok/s | % roofline | step ms | dense ms (% bw) | "
          "experts ms (% bw) | router ms | rest ms | MB/step |")
    print("|---" * 13 + "|")
    for r in rows:
        print(f"| {r['model']} | {r['gemv']} | {r['experts']} | {r['batch']} | {r['tok_s']} | {r['roofline_tok_s']} | "
              f"{r['roofline_pct']}% | {r['step_ms']} | {r['dense_ms']} ({r['dense_roof_pct']}%) | "
              f"{r['experts_ms']} ({r['experts_roof_pct']}%) | {r['router_ms']} | {r['rest_ms']} | "
              f"{r['bytes_mb']['total']} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/tmp/medium-glm4moe", help="the bf16 checkpoint")
    p.add_argument("--mx-model", default=None, help="its MXFP4 copy (pdserve quantize), run after it")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one model in this process: model:bw
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        model_dir, bw = args.one.rsplit(":", 1)
        print(json.dumps(run_model(model_dir, batches, args.steps, float(bw))), flush=True)
        return 0
    bw = bandwidth_gbs()
    rows = []
    for model_dir in [args.model] + ([args.mx_model] if args.mx_model else []):
        cmd = [sys.executable, "-m", "bench.bench_roofline", "--one", f"{model_dir}:{bw}", "--batches", args.batches,
               "--steps", str(args.steps)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"{model_dir} failed:\n{r.stderr[-3000:]}")
        rows += json.loads(r.stdout.strip().splitlines()[-1])
    print_table(rows, bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth_gbs": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
