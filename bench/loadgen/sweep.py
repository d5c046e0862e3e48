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

from bench.loadgen.agentic import AgenticRunner, agentic_stats
from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.fault import fault_stats, format_fault, inject
from bench.loadgen.openai_backend import OpenAIGeneration, connector, server_info
from bench.loadgen.plot import plot_png
from bench.loadgen.report import Result, format_compare, format_table, knee_fields, load_json, run_label, write_json
from bench.loadgen.runner import LoadStep, StepRunner
from bench.loadgen.search import KneeSearch, SearchConfig, StopReason
from bench.loadgen.stats import StepStats, step_stats
from bench.loadgen.tiers import metrics_urls, scrape, tier_delta
from bench.loadgen.vllm_keys import vllm_keys
from bench.loadgen.workload import TraceWorkload, make_workload
from protos import rpc
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

SCHEMA = 2
"""Version of the bench.json layout (2: search, saturation, verdict, knee only where the SLO was crossed)."""
AUTO_START_RPS = 0.5
AUTO_MAX_RPS = 64.0
AUTO_MAX_CONCURRENCY = 256.0
DEMO_MAX_DURATION_S = 100.0
MIN_DRAIN_S = 1.0
"""A step starts under --max-duration only if at least this much drain time is left after its window."""


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
        async with aiohttp.ClientSession(connector=connector()) as session:
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
        lower = "--system-len/--user-len/--output-len/--turns" if cfg.workload == "agentic" else \
            "--input-len/--output-len"
        raise ValueError(f"requests of up to {longest} tokens (input + output) exceed the server's max_context "
                         f"{limit}: lower {lower}")


class _Progress:
    """A tqdm bar per step: seconds of load, with sent/done/failed counts; draining shown past the end."""

    def __init__(self, label: str, total_s: float, enabled: bool) -> None:
        from tqdm import tqdm  # lazy: tqdm
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


class _Steps:
    """Runs sweep steps one after the other on one channel: the request stream continues across steps, the
    fault (if any) goes into the first step, and no step starts that cannot end its window by ``deadline``."""

    def __init__(self, channel, stub, cfg: BenchConfig, metadata, workload, duration_s: float, progress: bool,
                 deadline: float | None, server: dict[str, Any] | None = None) -> None:
        self.channel, self.stub, self.cfg, self.metadata, self.workload = channel, stub, cfg, metadata, workload
        self.metrics_urls = metrics_urls(server or {})
        """The prefill workers' /metrics, scraped around each step for the prefix cache's hit rate by tier."""
        self.duration_s, self.progress, self.deadline = duration_s, progress, deadline
        self.fault_spec, self.fault = cfg.fault_spec(), None
        self.stats: list[StepStats] = []
        self.extra: list[dict[str, Any]] = []
        """Per step: vLLM bench serve's keys (vllm_keys.py), merged into the step's JSON."""
        self.index = 0

    def drain_budget_s(self) -> float | None:
        """How long the next step may drain, or None when it does not fit before the deadline at all."""
        if self.deadline is None:
            return self.cfg.drain_timeout_s
        if self.cfg.workload == "agentic":  # no window: a step runs its sessions until the deadline at most
            return self.cfg.drain_timeout_s if self.deadline - time.perf_counter() >= MIN_DRAIN_S else None
        left = self.deadline - time.perf_counter() - self.cfg.warmup_s - self.duration_s
        return None if left < MIN_DRAIN_S else min(self.cfg.drain_timeout_s, left)

    async def run(self, step: LoadStep, drain_s: float) -> StepStats:
        """One step; returns its StepStats (also appended to ``stats``)."""
        cfg, k = self.cfg, len(self.stats)
        if drain_s < cfg.drain_timeout_s:
            cfg = dataclasses.replace(cfg, drain_timeout_s=drain_s)
        if cfg.workload == "agentic" and self.deadline is not None:  # the step's bound: what is left of the run's
            cfg = dataclasses.replace(cfg, max_duration_s=max(MIN_DRAIN_S, self.deadline - time.perf_counter()))
        bar = _Progress(step.label, cfg.warmup_s + self.duration_s, self.progress and not cfg.quiet)
        injector, holders, held = None, [], []
        before = await scrape(self.metrics_urls) if self.metrics_urls else None
        try:
            runner = (AgenticRunner if cfg.workload == "agentic" else StepRunner)(
                self.stub, self.workload, cfg, self.metadata, first_index=self.index, on_progress=bar)
            if self.fault_spec is not None and k == 0:
                injector = asyncio.create_task(inject(self.channel, self.metadata, *self.fault_spec, runner.now,
                                                      holders, target=cfg.target, api_key=cfg.api_key))
            records = await runner.run(step, cfg.warmup_s, self.duration_s, step_num=k)
        finally:
            bar.close()
            if injector is not None and not injector.done():
                injector.cancel()
                await asyncio.gather(injector, return_exceptions=True)
            held = [await h.close() for h in holders]  # kv-slowloris, slow-readers: until the step ends
        if injector is not None:
            fault_spec = self.fault_spec
            self.fault = ({"kind": fault_spec[0], "planned_at_s": fault_spec[1], "note": "the step ended first"}
                          if injector.cancelled() else fault_stats(injector.result(), records.records))
            self.fault["step"] = step.label
            for h in held:
                self.fault.update(h)
        self.index = runner.next_index
        stats = step_stats(records, cfg)
        extra = vllm_keys(records, cfg.save_detailed)
        if before is not None:
            extra["cache_tiers"] = tier_delta(before, await scrape(self.metrics_urls))
        if cfg.workload == "agentic":
            extra["agentic"] = agentic_stats(records, cfg)
            extra.setdefault("cache_tiers", {"source": None, "note": "no prefill worker lists a metrics_port"})
        self.extra.append(extra)
        if drain_s < self.cfg.drain_timeout_s:
            stats.warnings.append(f"{step.label}: drain cut to {drain_s:.1f}s by --max-duration")
        self.stats.append(stats)
        return stats


async def _run_list(steps: _Steps, cfg: BenchConfig) -> list[str]:
    """The listed steps in order; returns warnings for those the time bound skipped."""
    skipped = []
    for step in _steps(cfg):
        drain_s = steps.drain_budget_s()
        if drain_s is None:
            skipped.append(step.label)
            continue
        await steps.run(step, drain_s)
    return [f"--max-duration {cfg.max_duration_s:g}s skipped {', '.join(skipped)}"] if skipped else []


async def _run_auto(steps: _Steps, cfg: BenchConfig) -> dict[str, Any]:
    """The knee search (search.py); returns its record for bench.json."""
    conc = cfg.auto == "concurrency"
    start = cfg.start_rate or (1.0 if conc else AUTO_START_RPS)
    max_rate = cfg.max_rate or (AUTO_MAX_CONCURRENCY if conc else AUTO_MAX_RPS)
    search = KneeSearch(SearchConfig(cfg.auto, start, max(start, max_rate), cfg.resolution), cfg.resolution_for)
    phases: list[str] = []  # per step: ramp, bisect or saturate
    while (rate := search.next_rate()) is not None:
        drain_s = steps.drain_budget_s()
        if drain_s is None:
            search.stop(StopReason.TIME)
            break
        phases.append(search.phase.value)
        stats = await steps.run(LoadStep(cfg.auto, rate), drain_s)
        search.record(rate, stats.within_slo, empty=stats.num_measured == 0)
    return {"kind": cfg.auto, "start": start, "max_rate": max(start, max_rate), "resolution": cfg.resolution,
            "stopped": search.stop_reason.name.lower(), "stopped_because": search.stop_reason.value,
            "phases": phases}


async def run_sweep_async(cfg: BenchConfig, progress: bool = True) -> Result:
    """Run every step of ``cfg`` (resolved with ``with_defaults()``) and return the JSON-form result."""
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    deadline = None if cfg.max_duration_s is None else t0 + cfg.max_duration_s
    metadata = rpc.auth_metadata(cfg.api_key)
    async with _connect(cfg, metadata) as (channel, stub, server):
        cfg = cfg.with_scale(server.get("max_context"))
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
        steps = _Steps(channel, stub, cfg, metadata, workload, duration, progress, deadline, server)
        warnings = [f"cluster status unavailable ({server['error']})"] if "error" in server else []
        search = None
        if cfg.auto:
            search = await _run_auto(steps, cfg)
        else:
            warnings += await _run_list(steps, cfg)
    result = {
        "schema": SCHEMA, "tool": "pdserve bench", "started_at": started.isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t0, 3), "config": cfg.to_json(),
        "resolved": {"vocab_size": vocab, "duration_s": duration, "text_prompts": cfg.text_prompts},
        "server": server, "steps": [{**_asdict(s), **e} for s, e in zip(steps.stats, steps.extra)],
        "search": search,
        "warnings": warnings, "fault": steps.fault,
    }
    result.update(knee_fields(result))
    return result


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


def new_run_dir(out: str) -> tuple[str, str | None]:
    """Where a run writes: ``out`` itself unless it already holds a run, else a new ``out/<UTC time>``
    subfolder (never an existing one); returns (folder, a note saying so or None). Nothing is overwritten."""
    if not any(os.path.exists(os.path.join(out, f)) for f in ("bench.json", "bench.png")):
        return out, None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(out, stamp), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(out, f"{stamp}-{n}")
    os.makedirs(path)
    return path, f"{out} already holds a run: this one goes to {path}"


def report(result: Result, compare: str | None = None, this_label: str = "this") -> str:
    """The table, plus the side-by-side comparison with a saved run when asked (runs labelled by folder)."""
    text = format_table(result)
    if result.get("fault"):
        text += "\n" + format_fault(result["fault"])
    if compare:
        other_label = run_label(compare)
        if other_label == this_label:
            this_label, other_label = f"{this_label} (this)", f"{other_label} (other)"
        text += "\n\n" + format_compare(result, load_json(compare), this_label, other_label)
    return text


def run_bench(cfg: BenchConfig, progress: bool = True) -> tuple[Result, str]:
    """What ``pdserve bench`` does: run, write bench.json / bench.png under cfg.out (or a timestamped
    subfolder of it when it already holds a run), return (result, report)."""
    cfg = cfg.with_defaults()
    result = run_sweep(cfg, progress)
    out_dir, note = new_run_dir(cfg.out)
    json_path, png_path = write_outputs(result, out_dir)
    text = report(result, cfg.compare, run_label(out_dir)) + f"\nwrote {json_path} and {png_path}"
    if note:
        text += f"\n{note}"
    return result, text


DEMO_SLO = Slo(ttft_s=2.0, min_success=0.99)
"""The demo's SLO: tight enough that the knee sits where a queue starts to build on two cores."""


def run_demo_sweep(target: str, out_dir: str, vocab_size: int, **overrides) -> str:
    """``make demo``'s sweep, sized for a 2-core machine: an auto sweep (``--rps auto``, 25% resolution,
    at most DEMO_MAX_DURATION_S) of 1024-token prompts with a 60% shared prefix (2 prefixes) and 32 output
    tokens, 2 s warm-up + 8 s windows, TTFT p95 SLO 2 s: it ramps 1, 2, 4, ... req/s until the SLO breaks,
    bisects and ends past saturation. Prints and returns the table; bench.json and bench.png go to
    ``out_dir``. ``overrides`` replace BenchConfig fields (an ``rps`` list turns the search off)."""
    kw = dict(target=target, workload="prefill-bound", input_len=1024, output_len=32, cache_hit=0.6,
              num_prefixes=2, auto="rps", start_rate=1.0, max_rate=32.0, resolution="25%",
              max_duration_s=DEMO_MAX_DURATION_S, warmup_s=2.0, duration_s=8.0, drain_timeout_s=15.0,
              request_timeout_s=120.0, out=out_dir, vocab_size=vocab_size, slo=DEMO_SLO)
    if overrides.get("rps") or overrides.get("concurrency"):
        kw["auto"] = kw["max_duration_s"] = None  # a list runs every step, as before the search existed
    _, text = run_bench(BenchConfig(**{**kw, **overrides}), progress=sys.stderr.isatty())
    print(text, flush=True)
    return text
