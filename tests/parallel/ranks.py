"""A pool of rank processes for the tensor-parallel tests: ``RankPool(n)`` starts ``n`` spawned processes
joined by a gloo TP group over 127.0.0.1; ``run(job, **kw)`` runs the same job on every rank (SPMD, as a
TP worker's ranks run the same model calls) and returns each rank's result. Jobs are the functions in
``JOBS``; arguments and results are plain Python values (the queues are local pipes between this test's
own processes, no network)."""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import traceback

import torch
import torch.nn.functional as F

from engine.batch import BatchRequest, ForwardBatch
from engine.checkpoint import TINY_GLM5
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.offline import Engine
from engine.parallel import (
    ParallelConfig,
    all_gather_last,
    check_same_on_all_ranks,
    comm_stats,
    destroy_tp_group,
    init_tp_group,
)
from engine.quant.prepare import model_weight_bytes, quantized_experts
from engine.sampling import SamplerState, SamplingParams, sample
from engine.speculative import run_speculative
from engine.warmup import warm_up_decode

JOB_TIMEOUT_S = 180.0

TINY_DSA_MTP = dict(TINY_GLM5, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                    qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16)
"""GLM-5 architecture with an MTP layer, DSA active past 16 tokens (as tests/engine/test_spec.py's)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_generate(model_dir: str, pc: ParallelConfig, prompts: list[list[int]], max_tokens: int,
                 dtype: str = "float32") -> dict:
    """Greedy tokens of ``prompts`` on the offline engine + the rank's weight bytes and pool accounting."""
    model, cfg = load_model(model_dir, dtype, "cpu", parallel=pc)
    eng = Engine(model, cfg, kv_dtype="float32", page_size=8, num_pages=128, chunk_size=16)
    comm_stats().reset()
    res = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return {"tokens": [r.token_ids for r in res], "weight_bytes": model_weight_bytes(model),
            "pages_used": eng.pool.stats().num_used, "kv_shape": {c.name: list(c.shape) for c in eng.layout.components},
            "comm_bytes": comm_stats().total_bytes,
            "mx_shapes": sorted({(m.shape.hidden, m.shape.inter, m.shape.num_experts, m.shape.topk)
                                 for m in quantized_experts(model).values()})}


def job_spec_generate(model_dir: str, pc: ParallelConfig, prompts: list[list[int]], max_tokens: int,
                      spec: str = "3/1/4") -> dict:
    """Greedy tokens with MTP speculative decoding (the engine's ``run_speculative``)."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    out = run_speculative(model, cfg, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), spec,
                          page_size=8)
    return {"tokens": [r.token_ids for r in out.results], "accept_len": out.metrics.accept_len}


def job_logits(model_dir: str, pc: ParallelConfig, ids: list[int]) -> list[list[float]]:
    """Every position's logits of one prompt (prefill, all_logits)."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32", parallel=pc), 64)
    pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
    batch = ForwardBatch.build([BatchRequest(pages, 0, ids)], pool.page_size)
    return model(batch, pool, all_logits=True).logits.tolist()


def job_padded_vocab(model_dir: str, pc: ParallelConfig, ids: list[int], num_draws: int = 256) -> dict:
    """What the padded vocabulary's rows hold after loading and whether any padded id reaches a consumer:
    the padding's LM-head rows are then set to ``1e3 * h`` (``h`` the prompt's last hidden state), so a padded
    id would win every draw if its logit leaked; ``num_draws`` rows of that position's logits are sampled at
    temperature 1 with the top-20 logprobs. ``leaked_argmax``: the argmax of the same logits gathered WITHOUT
    dropping the padding (the control: a padded id)."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    own, vocab = pc.vocab_split(cfg.vocab_size), cfg.vocab_size
    num_real = max(0, min(own.stop, vocab) - own.start)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    pad_rows_zero = bool((emb[num_real:] == 0).all() and (head[num_real:] == 0).all())
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32", parallel=pc), 16)
    pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
    out = model(ForwardBatch.build([BatchRequest(pages, 0, ids)], pool.page_size), pool)
    h = out.hidden[-1:].expand(num_draws, -1)
    with torch.no_grad():
        head[num_real:] = 1e3 * out.hidden[-1]
        logits = model.logits(h)
        leaked = all_gather_last(F.linear(h[:1], head)).argmax(-1).item()
    states = [SamplerState(SamplingParams(temperature=1.0, logprobs=20, seed=i), ids) for i in range(num_draws)]
    res = sample(logits, states)
    return {"rows": [emb.shape[0], head.shape[0]], "num_pad_rows": head.shape[0] - num_real,
            "pad_rows_zero": pad_rows_zero, "logits_width": [out.logits.shape[-1], logits.shape[-1]],
            "sampled": res.token_ids.tolist(), "top_ids": res.top_ids.tolist(),
            "top_logprobs": res.top_logprobs[0].tolist(), "leaked_argmax": leaked}


JOBS = {"generate": job_generate, "spec_generate": job_spec_generate, "logits": job_logits,
        "padded_vocab": job_padded_vocab}


def _rank_main(rank: int, world: int, port: int, moe_parallel: str, timeout_s: float, jobs: mp.Queue,
               results: mp.Queue) -> None:
    torch.set_num_threads(1)
    init_tp_group(ParallelConfig(world, rank, moe_parallel), port, "gloo", timeout_s)
    try:
        while True:
            item = jobs.get()
            if item is None:
                return
            name, kw = item
            try:
                kw = dict(kw, pc=ParallelConfig(world, rank, kw.pop("moe_parallel", moe_parallel)))
                results.put((rank, "ok", JOBS[name](**kw)))
            except Exception:  # reported to the test, which fails with the rank's traceback
                results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_tp_group()


class RankPool:
    """``n`` rank processes of one TP group, reused across jobs (one start-up per test module)."""

    def __init__(self, n: int = 2, moe_parallel: str = "tp", timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.n = n
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(n)]
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(r, n, port, moe_parallel, timeout_s, self.jobs[r],
                                                         self.results), daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()

    def run(self, job: str, **kw) -> list:
        """Run ``job`` on every rank -> the results in rank order; raises with a rank's traceback."""
        for q in self.jobs:
            q.put((job, kw))
        out: dict[int, object] = {}
        errors = []
        for _ in range(self.n):
            try:
                rank, status, value = self.results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"job {job} did not finish on every rank in {JOB_TIMEOUT_S}s") from None
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            out[rank] = value
        if errors:
            raise RuntimeError(f"job {job} failed:\n" + "\n".join(errors))
        return [out[r] for r in range(self.n)]

    def close(self) -> list[int | None]:
        """Stop every rank and join it -> their exit codes."""
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        return [p.exitcode for p in self.procs]


def job_prefill_kv(model_dir: str, pc: ParallelConfig, ids: list[int]) -> dict:
    """Prefill one prompt; return every KV component of layer 0 at its slots ``{name: [T, ...]}``."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32", parallel=pc), 16)
    pages = pool.allocator.alloc(pool.pages_for(len(ids)), "t")
    batch = ForwardBatch.build([BatchRequest(pages, 0, ids)], pool.page_size)
    model(batch, pool)
    return {c.name: pool.read(0, c.name, batch.out_slots, torch.float32).tolist() for c in pool.layout.components}


def job_compile_decode(model_dir: str, pc: ParallelConfig) -> tuple[bool, int]:
    """``compile_decode()`` on a TP model, then the worker's start-up warm-up (its scratch pool in the rank's
    layout) -> (whether every layer stayed eager, WARNINGs logged)."""
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=pc)
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    log = logging.getLogger("engine.models.glm")
    log.addHandler(handler)
    try:
        model.compile_decode()
    finally:
        log.removeHandler(handler)
    warm_up_decode(model, cfg, "float32", 8, "3/1/4")
    layers = list(model.model.layers) + [m.block for m in model.mtp]
    return not any(layer.graphs.compiled for layer in layers), len(warnings)


def job_check_same(pc: ParallelConfig, values: list[str]) -> str:
    """``check_same_on_all_ranks`` with rank r holding ``values[r]`` -> "same" or the error it raised."""
    try:
        check_same_on_all_ranks("model hash", values[pc.tp_rank])
    except ValueError as e:
        return str(e)
    return "same"


JOBS.update(prefill_kv=job_prefill_kv, compile_decode=job_compile_decode, check_same=job_check_same)


def _dying_rank_main(rank: int, port: int, timeout_s: float, results: mp.Queue) -> None:
    """Rank 1 joins and exits at once; rank 0 then all-reduces and reports how it ended and how long it took."""
    import os
    import time

    from engine.parallel import all_reduce_
    init_tp_group(ParallelConfig(2, rank), port, "gloo", timeout_s)
    if rank == 1:
        os._exit(0)  # a rank that dies without leaving the group (as a SIGKILLed one)
    t0 = time.monotonic()
    try:
        all_reduce_(torch.ones(4))
        all_reduce_(torch.ones(4))
        results.put(("no error", time.monotonic() - t0))
    except Exception as e:  # the expected end: the collective raises
        results.put((type(e).__name__ + ": " + str(e)[:200], time.monotonic() - t0))


def start_dying_pair(timeout_s: float) -> tuple[list, mp.Queue]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dying_rank_main, args=(r, port, timeout_s, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    return procs, results
