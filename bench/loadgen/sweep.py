"""A whole benchmark: ask the cluster what it serves, run every sweep step, report.

    cfg = BenchConfig(target="127.0.0.1:50051", rps=(0.5, 1.0), input_len=4096, output_len=200).with_defaults()
    result = run_sweep(cfg)             # the JSON form (report.Result)
    print(format_table(result))
    write_outputs(result, cfg.out)      # bench.json + bench.png

Steps run one after the other on one channel; the request stream continues across steps (indices never
repeat), so every prompt of the sweep is unique while the prefix groups stay the same.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import sys
import time
from typing import Any

import aiohttp
import grpc

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.fault import fault_stats, format_fault, inject
from bench.loadgen.openai_backend import OpenAIGeneration, server_info
from bench.loadgen.report import Result, format_compare, format_table, load_json, plot_png, write_json
from bench.loadgen.runner import LoadStep, StepRunner
from bench.loadgen.stats import find_knee, step_stats
from bench.loadgen.vllm_keys import vllm_keys
from bench.loadgen.workload import TraceWorkload, make_workload
from protos import rpc
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

SCHEMA = 1
"""Version of the bench.json layout."""


async def fetch_cluster(channel: grpc.aio.Channel, metadata, timeout_s: float = 10.0) -> dict[str, Any]:
    """What Admin.GetClusterStatus says (model, workers, vocab_size, max_context), or {'error': ...}."""
    try:
        st = await generation_pb2_grpc.AdminStub(channel).GetClusterStatus(
            generation_pb2.GetClusterStatusRequest(), metadata=metadata, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        return {"error": f"{e.code().name}: {e.details()}"}
    workers = [{"worker_id": w.worker_id, "role": w.role, "address": w.address, "healthy": w.healthy,
                "info": dict(w.info)} for w in st.workers]
    out: dict[str, Any] = {"model": st.model, "workers": workers}
    for key in ("vocab_size", "max_context", "page_size"):
        vals = [int(w["info"][key]) for w in workers if w["info"].get(key, "").isdigit()]
        out[key] = vals[0] if vals else None
    return out


@contextlib.asynccontextmanager
async def _connect(cfg: BenchConfig, metadata):
    """(gRPC channel or None, the Generate stub, what the server says it serves) for ``cfg.backend``."""
    if cfg.backend == "openai":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            server = await server_info(session, cfg.base_url, cfg.api_key, cfg.model)
            yield None, OpenAIGeneration(session, cfg.base_url, server.get("model") or "", cfg.api_key), server
        return
    async with grpc.aio.insecure_channel(cfg.target, options=rpc.CHANNEL_OPTIONS) as channel:
        yield channel, generation_pb2_grpc.GenerationStub(channel), await fetch_cluster(channel, metadata)


def _steps(cfg: BenchConfig) -> list[LoadStep]:
    if cfg.workload == "trace":
        return [LoadStep("trace", cfg.trace_speed)]
    if cfg.rps:
        return [LoadStep("rps", r) for r in cfg.rps]
    return [LoadStep("concurrency", c) for c in cfg.concurrency]


def _check_server(cfg: BenchConfig, server: dict[str, Any]) -> None:
    """Refuse a run every request of which the server would reject anyway."""
    if cfg.text_prompts and server.get("workers") and all(w["info"].get("has_tokenizer") == "0"
                                                           for w in server["workers"]):
        raise ValueError(f"--text-prompts: the server's model ({server.get('model')}) has no tokenizer; "
                         "send token prompts (the default)")
    limit = server.get("max_context")
    if not limit or cfg.workload == "trace":
        return
    longest = (cfg.input_range[1] + cfg.output_range[1]) if cfg.workload == "random" else \
        cfg.input_len + cfg.output_len
    if longest > limit:
        raise ValueError(f"requests of up to {longest} tokens (input + output) exceed the server's max_context "
                         f"{limit}: lower --input-len/--output-len")


class _Progress:
    """A tqdm bar per step: seconds of load, with sent/done/failed counts; draining shown past the end."""

    def __init__(self, label: str, total_s: float, enabled: bool) -> None:
        from tqdm import tqdm
        self.total_s = total_s
        self.bar = tqdm(total=round(total_s, 1), desc=f"{label:>10}", unit="s", disable=not enabled,
                        bar_format="{desc} |{bar}| {n:.0f}/{total:.0f}s{postfix}", leave=True)

    def __call__(self, elapsed_s: float, sent: int, done: int, failed: int) -> None:
        self.bar.n = round(min(elapsed_s, self.total_s), 1)
        phase = " draining" if elapsed_s > self.total_s else ""
        self.bar.set_postfix_str(f"sent {sent} done {done} failed {failed}{phase}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


async def run_sweep_async(cfg: BenchConfig, progress: bool = True) -> Result:
    """Run every step of ``cfg`` (resolved with ``with_defaults()``) and return the JSON-form result."""
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    metadata = rpc.auth_metadata(cfg.api_key)
    async with _connect(cfg, metadata) as (channel, stub, server):
        vocab = cfg.vocab_size or server.get("vocab_size")
        if not cfg.text_prompts and not vocab:
            raise ValueError(f"no vocab_size: the server's status gave none ({server.get('error', 'no worker info')})"
                             "; pass --vocab-size")
        _check_server(cfg, server)
        workload = make_workload(cfg, vocab)
        duration = cfg.duration_s
        if duration is None:  # trace: the window closes 1 ms after the last entry
            duration = workload.span_s + 1e-3 - cfg.warmup_s if isinstance(workload, TraceWorkload) else 60.0
            if duration <= 0:
                raise ValueError(f"the trace spans {workload.span_s:.1f}s, not more than the {cfg.warmup_s:g}s "
                                 "warm-up: lower --warmup")
        stats, extra, index, fault_spec, fault = [], [], 0, cfg.fault_spec(), None
        for k, step in enumerate(_steps(cfg)):
            bar = _Progress(step.label, cfg.warmup_s + duration, progress and not cfg.quiet)
            injector, holders, held = None, [], []
            try:
                runner = StepRunner(stub, workload, cfg, metadata, first_index=index, on_progress=bar)
                if fault_spec is not None and k == 0:
                    injector = asyncio.create_task(inject(channel, metadata, *fault_spec, runner.now, holders,
                                                          target=cfg.target, api_key=cfg.api_key))
                records = await runner.run(step, cfg.warmup_s, duration, step_num=k)
            finally:
                bar.close()
                if injector is not None and not injector.done():
                    injector.cancel()
                    await asyncio.gather(injector, return_exceptions=True)
                held = [await h.close() for h in holders]  # kv-slowloris, slow-readers: until the step ends
            if injector is not None:
                fault = ({"kind": fault_spec[0], "planned_at_s": fault_spec[1], "note": "the step ended first"}
                         if injector.cancelled() else fault_stats(injector.result(), records.records))
                fault["step"] = step.label
                for h in held:
                    fault.update(h)
            index = runner.next_index
            stats.append(step_stats(records, cfg))
            extra.append(vllm_keys(records, cfg.save_detailed))
    steps = [{**_asdict(s), **e} for s, e in zip(stats, extra)]
    knee = find_knee([s["rate"] for s in steps], [s["within_slo"] for s in steps])
    warnings = [f"cluster status unavailable ({server['error']})"] if "error" in server else []
    return {
        "schema": SCHEMA, "tool": "pdserve bench", "started_at": started.isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t0, 3), "config": cfg.to_json(),
        "resolved": {"vocab_size": vocab, "duration_s": duration, "text_prompts": cfg.text_prompts},
        "server": server, "steps": steps,
        "knee": None if knee is None else {"index": knee, "label": steps[knee]["label"], "rate": steps[knee]["rate"]},
        "warnings": warnings, "fault": fault,
    }


def _asdict(obj) -> Any:
    """dataclasses.asdict for slotted frozen dataclasses with nested ones (and no deep copies of records)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _asdict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _asdict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_asdict(v) for v in obj]
    return obj


def run_sweep(cfg: BenchConfig, progress: bool = True) -> Result:
    return asyncio.run(run_sweep_async(cfg, progress))


def write_outputs(result: Result, out_dir: str) -> tuple[str, str]:
    """bench.json and bench.png in ``out_dir``; returns their paths."""
    return (write_json(result, os.path.join(out_dir, "bench.json")),
            plot_png(result, os.path.join(out_dir, "bench.png")))


def report(result: Result, compare: str | None = None) -> str:
    """The table, plus the side-by-side comparison with a saved run when asked."""
    text = format_table(result)
    if result.get("fault"):
        text += "\n" + format_fault(result["fault"])
    if compare:
        text += "\n\n" + format_compare(result, load_json(compare), "this", os.path.basename(compare))
    return text


def run_bench(cfg: BenchConfig, progress: bool = True) -> tuple[Result, str]:
    """What ``pdserve bench`` does: run, write bench.json / bench.png under cfg.out, return (result, report)."""
    cfg = cfg.with_defaults()
    result = run_sweep(cfg, progress)
    json_path, png_path = write_outputs(result, cfg.out)
    text = report(result, cfg.compare) + f"\nwrote {json_path} and {png_path}"
    return result, text


def run_demo_sweep(target: str, out_dir: str, vocab_size: int, **overrides) -> str:
    """A short prefill-bound sweep sized for a 2-core machine (about 1 minute; at most ~2 when the
    server is overloaded and stragglers run into the 30 s drain): 1024-token prompts with a
    60% shared prefix (2 prefixes), 32 output tokens, 0.25 and 0.5 requests/s, 5 s warm-up + 20 s windows.
    Prints and returns the table; bench.json and bench.png go to ``out_dir``. ``overrides`` replace
    BenchConfig fields (tests shorten the windows)."""
    kw = dict(target=target, workload="prefill-bound", input_len=1024, output_len=32, cache_hit=0.6,
              num_prefixes=2, rps=(0.25, 0.5), warmup_s=5.0, duration_s=20.0, drain_timeout_s=30.0,
              request_timeout_s=120.0, out=out_dir, vocab_size=vocab_size, slo=Slo(ttft_s=5.0))
    _, text = run_bench(BenchConfig(**{**kw, **overrides}), progress=sys.stderr.isatty())
    print(text, flush=True)
    return text
