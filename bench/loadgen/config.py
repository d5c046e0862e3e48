# over 400 lines: one frozen dataclass whose field docstrings are every `pdserve bench` flag's help, with the checks and per-workload defaults that belong to it; the flag generation is below it.
"""Load-generator configuration: one frozen dataclass; the ``pdserve bench`` flags are generated from its fields.

A field ``foo_bar`` becomes ``--foo-bar``; a trailing ``_s`` (seconds) is dropped from the flag, so
``duration_s`` is ``--duration``. Fields left ``None`` take the workload's defaults in ``with_defaults()``
(``WORKLOAD_DEFAULTS``): the JSON report records the resolved values, never ``None`` placeholders.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from common.flags import field_docs

WORKLOADS = ("prefill-bound", "reference", "single-stream", "random", "trace", "agentic")
BACKENDS = ("pdserve", "openai")
FAULT_KINDS = ("kill-decode", "kill-prefill", "drop-kv", "kv-slowloris", "slow-readers")
AUTO_KINDS = ("rps", "concurrency")
REFERENCE_SHAPE = (20_000, 1_000)
"""The reference workload's (input_len, output_len) at ``--scale 1``."""
REFERENCE_SCALES = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)
"""``--workload reference`` without ``--scale`` takes the largest of these whose requests fit the server."""
AUTO_MAX_DURATION_S = 1200.0
"""Default total time bound of an auto sweep."""

WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    # The reference workload: long prompts that mostly hit the prefix cache, modest outputs.
    "prefill-bound": dict(input_len=20_000, output_len=1_000, cache_hit=0.6),
    # The same shape scaled by --scale, swept with --rps auto to saturation (lengths set in with_defaults).
    "reference": dict(input_len=None, output_len=None, cache_hit=0.6),
    # One request at a time; what public leaderboards call "output speed".
    "single-stream": dict(input_len=10_000, output_len=1_500, cache_hit=0.0, concurrency=(1,)),
    "random": dict(input_len=1_024, output_len=128, cache_hit=0.0),
    # Lengths come from the trace; the shared prefix covers cache_hit of each prompt in a prefix group.
    "trace": dict(input_len=0, output_len=0, cache_hit=0.6),
    # Multi-turn sessions over one shared system + tools prefix (input_len: the last turn's prompt, derived).
    "agentic": dict(input_len=None, output_len=64, cache_hit=0.0),
}
AGENTIC_DEFAULTS = dict(system_len=4096, user_len=256)
"""agentic: the shared system + tools prefix and the user chunk of every turn, in tokens."""


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objective: what a request must meet to count towards goodput.

    Parsed from ``ttft=5s,tpot=50ms[,e2e=30s][,success=0.99]``; units ``s`` or ``ms`` (bare numbers are seconds).
    """
    ttft_s: float = 5.0
    """Time to first token, client side."""
    tpot_s: float | None = None
    """Mean time per output token after the first (None: not part of the SLO)."""
    e2e_s: float | None = None
    """End-to-end time (None: not part of the SLO)."""
    min_success: float = 0.99
    """A step is within the SLO only if at least this fraction of its requests succeeded (the knee needs it)."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be > 0, got {v}")
        if not 0.0 <= self.min_success <= 1.0:
            raise ValueError(f"SLO success must be in [0, 1], got {self.min_success}")

    @classmethod
    def parse(cls, text: str) -> "Slo":
        kw: dict[str, float] = {}
        keys = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "success": "min_success"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key.strip() not in keys:
                raise ValueError(f"SLO terms are ttft=, tpot=, e2e=, success=; got {part!r} in {text!r}")
            kw[keys[key.strip()]] = float(val) if key.strip() == "success" else parse_seconds(val)
        return cls(**kw)


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*", text)
    if m is None:
        raise ValueError(f"expected a duration like 5s, 50ms or 0.2, got {text!r}")
    return float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: str = "127.0.0.1:50051"
    """Router address HOST:PORT (the public Generation/Admin gRPC API)."""
    backend: str = "pdserve"
    """pdserve: the router's gRPC API at --target; openai: any OpenAI-compatible server at --base-url
    (pdserve's HTTP port, vLLM, SGLang, llama.cpp's server) through streaming /v1/completions."""
    base_url: str | None = None
    """openai backend: the API's base URL, e.g. http://127.0.0.1:8000/v1."""
    model: str | None = None
    """openai backend: the model name to send (default: the first one /v1/models lists)."""
    save_detailed: bool = False
    """Add every measured request (input/output lengths, TTFT, ITLs, E2E, status) to each step in bench.json,
    as vLLM's bench serve --save-detailed does."""
    workload: str = "prefill-bound"
    """prefill-bound, reference (prefill-bound's shape scaled by --scale, --rps auto), single-stream, random,
    trace or agentic (multi-turn sessions over a shared prefix, closed loop: see --sessions)."""
    input_len: int | None = None
    """Prompt tokens per request (default per workload: 20000 prefill-bound, 10000 single-stream, 1024 random;
    agentic: derived, the last turn's prompt)."""
    output_len: int | None = None
    """Output tokens per request, exact: sent as max_tokens with ignore_eos (default 1000 / 1500 / 128)."""
    cache_hit: float | None = None
    """Fraction of every prompt covered by a prefix shared with its prefix group (default 0.6 prefill-bound)."""
    num_prefixes: int = 8
    """Distinct shared prefixes; each request belongs to one, drawn with the seed."""
    input_range: tuple[int, ...] = ()
    """random: LO,HI prompt lengths, inclusive (default input_len/2 .. input_len*3/2)."""
    output_range: tuple[int, ...] = ()
    """random: LO,HI output lengths, inclusive (default output_len/2 .. output_len*3/2)."""
    sessions: int = 16
    """agentic: sessions per step; each opens with the shared --system-len prefix and a user chunk, and sends
    its next turn when the last one ends: that prompt + the tokens the server returned + a new user chunk.
    --concurrency sets the sessions in flight."""
    turns: int = 4
    """agentic: turns per session."""
    system_len: int | None = None
    """agentic: the system + tools prefix every session shares, tokens (default 4096)."""
    user_len: int | None = None
    """agentic: the user chunk each turn appends, tokens (default 256); --output-len is the assistant's."""
    think_time_s: float = 0.0
    """agentic: seconds a session waits between a turn's end and its next turn."""
    trace: str | None = None
    """trace: JSONL file, one {"timestamp", "input_len", "output_len", "prefix_group"} object per line."""
    trace_speed: float = 1.0
    """trace: replay this many times faster than recorded."""
    rps: tuple[float, ...] = ()
    """Poisson arrival rates to sweep, requests/s, comma separated (e.g. 0.5,1,1.5,2), or 'auto': ramp the rate
    until the SLO breaks, then bisect to --resolution (see --start-rate, --max-rate, --max-duration)."""
    concurrency: tuple[int, ...] = ()
    """Fixed numbers of requests in flight to sweep instead of --rps, comma separated, or 'auto' (as --rps auto)."""
    auto: str | None = None
    """'rps' or 'concurrency': search for the knee instead of sweeping a list (what --rps auto sets)."""
    resolution: str = "10%"
    """auto: stop bisecting when first-bad minus last-good rate is at most this: a share of the last good
    rate (10%) or an absolute rate (0.25)."""
    start_rate: float | None = None
    """auto: the first rate of the ramp, which doubles from there (default 0.5 rps / concurrency 1)."""
    max_rate: float | None = None
    """auto: the ramp's highest rate; reaching it within the SLO ends the run with "no knee up to" it
    (default 64 rps / concurrency 256)."""
    max_duration_s: float | None = None
    """Total time bound of the run, seconds: no step starts that cannot end its window in time, and the
    drain of the last one is cut short (default 1200 for auto sweeps, unbounded for lists)."""
    scale: float | None = None
    """reference: multiply the reference 20000 in / 1000 out by this (default: the largest of 1, 0.5, 0.2,
    0.1, 0.05, 0.02, 0.01 whose requests fit the server's max_context)."""
    duration_s: float | None = None
    """Measured window of every step, seconds, after the warm-up (default 60; trace: to the end of the trace)."""
    warmup_s: float = 10.0
    """Seconds of load before each step's measured window; requests sent then are excluded."""
    drain_timeout_s: float = 120.0
    """After sending stops, how long in-flight requests get before they are cancelled (and counted failed)."""
    request_timeout_s: float = 600.0
    """gRPC deadline of one request (a request past it fails with DEADLINE_EXCEEDED)."""
    out: str = "bench-results"
    """Directory for bench.json and bench.png."""
    api_key: str | None = None
    """Sent as 'authorization: Bearer KEY'."""
    seed: int = 0
    """Seeds prompts, prefix groups, lengths and arrivals: two runs with one seed send the same requests."""
    vocab_size: int | None = None
    """Token ids are drawn in [2, vocab_size) (default: the workers' vocab_size from Admin.GetClusterStatus)."""
    text_prompts: bool = False
    """Send text prompts (words, lengths approximate) instead of token ids; the server needs a tokenizer."""
    nodes: int = 1
    """Nodes the cluster spans: tok/s, cost and power figures are per node."""
    slo: Slo = Slo()
    """SLO for goodput and the knee, e.g. ttft=5s,tpot=50ms (optionally e2e=, success=)."""
    cost_per_hour: float | None = None
    """USD per node-hour: adds cost per million tokens."""
    power_watts: float | None = None
    """Watts per node: adds tokens per joule."""
    compare: str | None = None
    """A previous bench.json: print both runs side by side with ratios."""
    quiet: bool = False
    """No progress bar."""
    fault: str | None = None
    """Inject a fault during the run: KIND@SECONDS after the first step's start. kill-decode / kill-prefill:
    SIGKILL to the busiest worker of that role (it must run on this host). drop-kv: the busiest prefill
    worker cuts its next KV connection mid-transfer (``Admin.InjectFault``; the cluster must run with
    ``--fault-injection``). kv-slowloris: connections that never authenticate held open to every decode
    worker's KV port (loopback only) for the rest of the step. slow-readers: 256 ``Generate`` streams to
    the router that are never read (one HTTP/2 connection with a zero flow-control window, held to the end
    of the step; a stream the router ends is replaced). The report adds requests completed / failed over / retried / failed, the TTFT and ITL
    penalty, and how long after the fault the first request sent succeeded."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        host, _, port = self.target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"target must be HOST:PORT, got {self.target!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "openai" and not (self.base_url or "").startswith(("http://", "https://")):
            raise ValueError(f"--backend openai needs --base-url http(s)://HOST:PORT/v1, got {self.base_url!r}")
        if self.backend == "openai" and self.fault is not None:
            raise ValueError("--fault needs the pdserve backend (it talks to the router's Admin gRPC API)")
        if self.rps and self.concurrency:
            raise ValueError("give --rps or --concurrency, not both")
        self._check_auto()
        if any(not r > 0 for r in self.rps) or any(c < 1 for c in self.concurrency):
            raise ValueError(f"rates must be > 0 and concurrencies >= 1, got rps={self.rps} "
                             f"concurrency={self.concurrency}")
        for name in ("input_len", "output_len"):
            v = getattr(self, name)
            if v is not None and v < (0 if self.workload == "trace" else 1):
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.cache_hit is not None and not 0.0 <= self.cache_hit < 1.0:
            raise ValueError(f"cache_hit must be in [0, 1), got {self.cache_hit}")
        for name in ("input_range", "output_range"):
            r = getattr(self, name)
            if r and (len(r) != 2 or not 1 <= r[0] <= r[1]):
                raise ValueError(f"{name} must be LO,HI with 1 <= LO <= HI, got {r}")
        if self.num_prefixes < 1 or self.nodes < 1:
            raise ValueError(f"num_prefixes and nodes must be >= 1, got {self.num_prefixes} and {self.nodes}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        for name in ("warmup_s",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "request_timeout_s", "trace_speed"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (ids are drawn in [2, vocab)), got {self.vocab_size}")
        if self.workload == "trace" and not self.trace:
            raise ValueError("the trace workload needs --trace FILE")
        self._check_agentic()
        self.fault_spec()
        for name in ("cost_per_hour", "power_watts"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")

    def _check_agentic(self) -> None:
        for name in ("sessions", "turns", "system_len", "user_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.think_time_s < 0:
            raise ValueError(f"think_time must be >= 0, got {self.think_time_s}")
        if self.workload != "agentic":
            return
        if self.backend != "pdserve" or self.text_prompts:
            raise ValueError("agentic sends back the token ids the server returned: it needs the pdserve backend "
                             "and token prompts")
        if self.rps or self.auto:
            raise ValueError("agentic sessions run closed loop: give --concurrency LIST (sessions in flight), "
                             "not --rps or auto")

    def _check_auto(self) -> None:
        if self.auto is not None:
            if self.auto not in AUTO_KINDS:
                raise ValueError(f"auto must be one of {AUTO_KINDS}, got {self.auto!r}")
            if self.rps or self.concurrency:
                raise ValueError(f"--{self.auto} auto searches the rates itself: drop the rate list "
                                 f"(rps={self.rps} concurrency={self.concurrency})")
        self.resolution_for(1.0)
        for name in ("start_rate", "max_rate", "max_duration_s", "scale"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.start_rate and self.max_rate and self.start_rate > self.max_rate:
            raise ValueError(f"start_rate {self.start_rate} is above max_rate {self.max_rate}")

    def resolution_for(self, rate: float) -> float:
        """The bracket width at which bisection stops, around a last good ``rate``."""
        text = self.resolution.strip()
        try:
            value = float(text[:-1]) / 100 * rate if text.endswith("%") else float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"resolution must be a share like 10% or a rate like 0.25, got {self.resolution!r}")
        return value

    def fault_spec(self) -> tuple[str, float] | None:
        """``(kind, seconds)`` of ``--fault``, or None."""
        if self.fault is None:
            return None
        kind, _, at = self.fault.partition("@")
        try:
            at_s = float(at.rstrip("s"))
        except ValueError:
            at_s = -1.0
        if kind not in FAULT_KINDS or not at_s >= 0:
            raise ValueError(f"--fault must be KIND@SECONDS with KIND in {FAULT_KINDS}, got {self.fault!r}")
        return kind, at_s

    def with_defaults(self) -> "BenchConfig":
        """The workload's defaults filled in; raises ValueError when the load shape is missing or contradictory."""
        d = WORKLOAD_DEFAULTS[self.workload]
        kw: dict[str, Any] = {k: d[k] for k in ("input_len", "output_len", "cache_hit") if getattr(self, k) is None}
        if self.workload == "reference":
            scale = self.scale or (self.input_len / REFERENCE_SHAPE[0] if self.input_len else None)
            if scale is not None:  # else the sweep picks the scale that fits the server (with_scale)
                kw["scale"] = scale
                kw.update({k: max(1, round(n * scale)) for k, n in zip(("input_len", "output_len"), REFERENCE_SHAPE)
                           if getattr(self, k) is None})
            if not (self.rps or self.concurrency or self.auto):
                kw["auto"] = "rps"  # the reference sweeps the rate to saturation
        if self.workload == "single-stream":
            if self.rps or self.concurrency not in ((), (1,)):
                raise ValueError("single-stream sends one request at a time: drop --rps/--concurrency")
            kw["concurrency"] = (1,)
        elif self.workload == "trace":
            if self.rps or self.concurrency:
                raise ValueError("trace replays the file's timestamps: drop --rps/--concurrency")
        elif self.workload == "agentic":
            kw.update({k: v for k, v in AGENTIC_DEFAULTS.items() if getattr(self, k) is None})
            system, user = kw.get("system_len", self.system_len), kw.get("user_len", self.user_len)
            out = kw.get("output_len", self.output_len)
            kw["input_len"] = system + self.turns * user + (self.turns - 1) * out  # the last turn's prompt
            kw.setdefault("concurrency", self.concurrency or (self.sessions,))
            kw["warmup_s"] = 0.0  # every turn is measured: the window is the whole step
        elif not (self.rps or self.concurrency or self.auto or kw.get("auto")):
            raise ValueError(f"{self.workload} needs --rps LIST|auto or --concurrency LIST|auto")
        if self.workload in ("single-stream", "trace") and self.auto:
            raise ValueError(f"{self.workload} has no rate to search: drop --rps/--concurrency auto")
        if self.auto or kw.get("auto"):
            kw.setdefault("max_duration_s", self.max_duration_s or AUTO_MAX_DURATION_S)
        if self.duration_s is None and self.workload != "trace":
            kw["duration_s"] = 60.0
        cfg = dataclasses.replace(self, **kw)
        if cfg.workload == "random":
            lo_in, lo_out = max(1, cfg.input_len // 2), max(1, cfg.output_len // 2)
            kw2 = {}
            if not cfg.input_range:
                kw2["input_range"] = (lo_in, max(lo_in, cfg.input_len * 3 // 2))
            if not cfg.output_range:
                kw2["output_range"] = (lo_out, max(lo_out, cfg.output_len * 3 // 2))
            cfg = dataclasses.replace(cfg, **kw2)
        return cfg

    def with_scale(self, max_context: int | None) -> "BenchConfig":
        """reference without --scale: the largest REFERENCE_SCALES entry whose requests fit ``max_context``
        (1 when the server did not say), resolved; any other config is returned as it is."""
        if self.workload != "reference" or self.scale is not None:
            return self
        total = sum(REFERENCE_SHAPE)
        scale = next((s for s in REFERENCE_SCALES if not max_context or total * s <= max_context),
                     REFERENCE_SCALES[-1])
        return dataclasses.replace(self, scale=scale).with_defaults()

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["slo"] = dataclasses.asdict(self.slo)
        out.pop("api_key")  # a secret never lands in a results file
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# -- flags generated from the fields -------------------------------------------------------------------

def flag_name(field_name: str) -> str:
    name = field_name[:-2] if field_name.endswith("_s") else field_name
    return "--" + name.replace("_", "-")


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def float_list(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _or_auto(parse):
    def parse_or_auto(text: str):
        return "auto" if text.strip() == "auto" else parse(text)
    return parse_or_auto


def _parser_for(type_name: str):
    if type_name.startswith("tuple[int"):
        return int_list
    if type_name.startswith("tuple[float"):
        return float_list
    if type_name == "Slo":
        return Slo.parse
    for prefix, kind in (("int", int), ("float", float)):
        if type_name.startswith(prefix):
            return kind
    return str


def add_config_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per ``BenchConfig`` field; bools are switches; argparse defaults stay None so that
    ``config_from_args`` can tell an explicit flag from the dataclass default."""
    docs = field_docs(BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        if f.name in skip or f.name == "auto":  # --rps auto / --concurrency auto set it
            continue
        flag, help_ = flag_name(f.name), docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if str(f.type) == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_)
        else:
            choices = {"workload": WORKLOADS, "backend": BACKENDS}.get(f.name)
            metavar = "SECONDS" if f.name.endswith("_s") else "LIST" if str(f.type).startswith("tuple") else None
            parse = _parser_for(str(f.type))
            p.add_argument(flag, dest=f.name, type=_or_auto(parse) if f.name in AUTO_KINDS else parse,
                           default=None, choices=choices,
                           metavar=metavar, help=help_)


def config_from_args(args: argparse.Namespace, **overrides) -> BenchConfig:
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names and v is not None}
    for kind in AUTO_KINDS:
        if kw.get(kind) == "auto":
            kw[kind], kw["auto"] = (), kind
    return BenchConfig(**{**kw, **overrides})
