"""Tensor / expert parallelism on this machine: step time and tok/s at TP1 vs TP2 (prefill and decode), each
rank's resident weight bytes, and the bytes its collectives move per step.

    .venv/bin/python -m bench.bench_tp [--preset small|tiny] [--model DIR] [--tp 2] [--moe-parallel tp,ep]
                                       [--batch 8] [--prompt-len 256] [--decode-steps 24] [--json]

Every configuration runs in fresh spawned processes (TP1: one process; TP2: two ranks on gloo over 127.0.0.1,
each running the same ``Engine`` steps, SPMD): load the model (this rank's shard), prefill ``--batch`` random
prompts of ``--prompt-len`` tokens one request at a time (chunks of 2048), then ``--decode-steps`` batched
decode steps over all of them (after 3 warm-up steps); times are rank 0's, medians. TP1 runs twice: with one
thread (the same per-process compute as one TP2 rank) and with ``tp`` threads (the same cores as the whole
TP2 group). Eager decode everywhere (TP > 1 does not run the compiled graphs yet), fp32.

Communication per step = this rank's all_reduce payload bytes plus its all_gather output bytes
(``engine.parallel.comm_stats``); a decode step moves 2 all_reduces of [B, hidden] per layer, one for the
embedding and one logits all_gather of [B, vocab].

On a 2-core CPU expect little or no speed-up: the point of TP is capacity (a model larger than one device's
memory), which the weight-bytes column shows.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time

import torch

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.load import load_model
from engine.offline import Engine, Seq
from engine.parallel import ParallelConfig, comm_stats, destroy_tp_group, init_tp_group
from engine.quant.prepare import model_weight_bytes
from engine.sampling import SamplerState, SamplingParams

SMALL = dict(
    TINY_GLM5, vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=32,
    num_experts_per_tok=4, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, index_topk=512, index_head_dim=64, index_n_heads=16, num_nextn_predict_layers=0,
)
"""GLM-5's architecture at ~172 M parameters (0.69 GB fp32): one dense layer, three MoE layers of 32 experts
top-4 + a shared expert, MLA 16 heads, DSA indexer, a 32k vocab (its embedding and LM head are 38% of it)."""
PRESETS = {"small": SMALL, "tiny": TINY_GLM5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model_dir: str, pc: ParallelConfig, batch: int, prompt_len: int, decode_steps: int) -> dict:
    """One rank's run (every rank calls it with the same arguments)."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    prompts = torch.randint(2, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    eng = Engine(model, cfg, kv_dtype="float32", page_size=16,
                 num_pages=batch * ((prompt_len + decode_steps + 8) // 16 + 2))
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    seqs = [Seq(f"r{i}", p, SamplerState(params, p)) for i, p in enumerate(prompts.tolist())]
    stats = comm_stats()
    stats.reset()
    prefill_s = []
    for s in seqs:
        t0 = time.perf_counter()
        eng._append([s], eng.prefill(s))
        prefill_s.append(time.perf_counter() - t0)
    prefill_comm = stats.total_bytes / batch
    for _ in range(3):
        eng.decode_step(seqs)
    stats.reset()
    step_s = []
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        eng.decode_step(seqs)
        step_s.append(time.perf_counter() - t0)
    prefill_med, step_med = statistics.median(prefill_s), statistics.median(step_s)
    return {"weight_bytes": model_weight_bytes(model),
            "prefill_s_per_request": prefill_med, "prefill_tok_s": prompt_len / prefill_med,
            "prefill_comm_bytes_per_request": prefill_comm,
            "decode_ms_per_step": 1000 * step_med, "decode_tok_s": batch / step_med,
            "decode_comm_bytes_per_step": stats.total_bytes / decode_steps,
            "decode_collectives_per_step": (stats.num_all_reduce + stats.num_all_gather) / decode_steps,
            "tokens": [s.output_ids[:8] for s in seqs[:2]]}


def _rank(rank: int, pc_kw: dict, port: int, threads: int, args: tuple, out: mp.Queue) -> None:
    torch.set_num_threads(threads)
    pc = ParallelConfig(tp_rank=rank, **pc_kw)
    init_tp_group(pc, port, "gloo", 120.0)
    try:
        out.put((rank, measure(args[0], pc, *args[1:])))
    finally:
        destroy_tp_group()


def run_config(tp: int, moe: str, threads: int, args: tuple) -> list[dict]:
    """Fresh processes for one configuration -> each rank's measurement."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, dict(tp_size=tp, moe_parallel=moe), port, threads, args, out))
             for r in range(tp)]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return [res[r] for r in range(tp)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None, help="a model directory instead of a random --preset one")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--moe-parallel", default="tp,ep")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        model_dir = a.model or init_random_model(PRESETS[a.preset], os.path.join(tmp, a.preset), seed=0)
        args = (model_dir, a.batch, a.prompt_len, a.decode_steps)
        rows = []
        for label, tp, moe, threads in ([("TP1 1 thread", 1, "tp", 1), (f"TP1 {a.tp} threads", 1, "tp", a.tp)]
                                        + [(f"TP{a.tp} {m} MoE, 1 thread/rank", a.tp, m, 1)
                                           for m in a.moe_parallel.split(",")]):
            ranks = run_config(tp, moe, threads, args)
            if any(r["tokens"] != ranks[0]["tokens"] for r in ranks):
                raise RuntimeError(f"{label}: the ranks generated different tokens")
            rows.append(dict(ranks[0], label=label, weight_bytes_per_rank=[r["weight_bytes"] for r in ranks]))
    base = rows[0]["tokens"]
    print(f"model {a.model or a.preset}, batch {a.batch}, prompt {a.prompt_len}, {a.decode_steps} decode steps, fp32, "
          "eager")
    print(f"{'configuration':34s} {'weights/rank MB':>15s} {'prefill tok/s':>13s} {'decode ms/step':>14s} "
          f"{'decode tok/s':>12s} {'comm KB/decode step':>19s} {'comm MB/prefill req':>19s} same tokens")
    for r in rows:
        print(f"{r['label']:34s} {max(r['weight_bytes_per_rank']) / 1e6:15.1f} {r['prefill_tok_s']:13.0f} "
              f"{r['decode_ms_per_step']:14.1f} {r['decode_tok_s']:12.1f} {r['decode_comm_bytes_per_step'] / 1e3:19.1f} "
              f"{r['prefill_comm_bytes_per_request'] / 1e6:19.2f} {r['tokens'] == base}")
    if a.json:
        print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
