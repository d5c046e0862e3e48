"""Reports of a sweep: the terminal table, the JSON file, the PNG plot and a side-by-side comparison.

Everything here works on the JSON form of a result (``bench.json``), so a saved run can be re-reported
or compared without a server.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

Result = dict[str, Any]
"""A sweep result in its JSON form: config, server, steps (StepStats as dicts), knee, warnings."""


def _f(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _pair(d: dict, spec: str, scale: float = 1.0) -> str:
    return f"{_f(d.get('p50'), spec, scale)} / {_f(d.get('p95'), spec, scale)}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


# (header, cell) in display order: the reference columns first, then the rest.
_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("Sustained RPS", lambda s: _f(s["sustained_rps"], ".3f")),
    ("Aggregate tok/s/node", lambda s: _f(s["total_tok_s"], ".1f")),
    ("TTFT p50 / p95 s", lambda s: _pair(s["ttft"], ".2f")),
    ("Success rate", lambda s: _pct(s["success_rate"])),
    ("Output tok/s/node", lambda s: _f(s["output_tok_s"], ".1f")),
    ("TTFT p99 s", lambda s: _f(s["ttft"].get("p99"), ".2f")),
    ("ITL p50 / p95 ms", lambda s: _pair(s["itl"], ".1f", 1e3)),
    ("TPOT p50 / p95 ms", lambda s: _pair(s["tpot"], ".1f", 1e3)),
    ("E2E p50 / p95 s", lambda s: _pair(s["e2e"], ".2f")),
    ("Stream tok/s", lambda s: _f(s["stream_tok_s"].get("p50"), ".1f")),
    ("Cache hit", lambda s: f"{_pct(s['cache_hit'])} ({s['target_cache_hit'] * 100:.0f}%)"),
    ("KV MB/req", lambda s: _f(s["kv_bytes_per_req"], ".2f", 1e-6)),
    ("KV ms/req", lambda s: _f(s["kv_s_per_req"], ".1f", 1e3)),
    ("Accept len", lambda s: _f(s["accept_len"], ".2f")),
    ("Goodput rps", lambda s: f"{s['goodput_rps']:.3f} ({_pct(s['goodput_frac'])})"),
]
_COST_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("$/Mtok (out)", lambda s: f"{_f(s['cost_per_mtok'], '.2f')} ({_f(s['cost_per_mtok_output'], '.2f')})"),
]
_POWER_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [("tok/J", lambda s: _f(s["tok_per_joule"], ".3f"))]


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(result: Result) -> str:
    """The terminal table, knee marked with '*', then failures and warnings (never hidden)."""
    cfg, steps, knee = result["config"], result["steps"], result.get("knee")
    cols = list(_COLUMNS)
    if cfg.get("cost_per_hour"):
        cols += _COST_COLUMNS
    if cfg.get("power_watts"):
        cols += _POWER_COLUMNS
    rows = []
    for i, s in enumerate(steps):
        mark = " *" if knee is not None and knee["index"] == i else ""
        rows.append([s["label"] + mark] + [cell(s) for _, cell in cols])
    slo = cfg["slo"]
    prefixes = f" ({cfg['num_prefixes']} prefixes)" if cfg["cache_hit"] else ""
    title = (f"pdserve bench: {cfg['workload']} -> {cfg['target']}  input {cfg['input_len']} / output "
             f"{cfg['output_len']} tokens, cache hit {cfg['cache_hit']:g}{prefixes}, {cfg['nodes']} node(s), "
             f"window {_window(cfg, steps)}, warm-up {cfg['warmup_s']:g}s, SLO {_slo(cfg['slo'])}")
    lines = [title, *_grid(["Step"] + [h for h, _ in cols], rows)]
    cond = f"TTFT p95 <= {slo['ttft_s']:g}s and success >= {slo['min_success'] * 100:g}%"
    if knee is not None:
        lines.append(f"* knee: {knee['label']}, the highest swept rate with {cond}")
    elif steps:
        lines.append(f"knee: none - the lowest swept rate already misses {cond}")
    for s in steps:
        if s["failures"]:
            n = sum(s["failures"].values())
            parts = [f"{code} x{k}" + (f" ({s['failure_examples'][code][:100]})"
                                       if s["failure_examples"].get(code) else "")
                     for code, k in s["failures"].items()]
            lines.append(f"failed in {s['label']}: {n} of {s['num_measured']}: " + "; ".join(parts))
    for w in result.get("warnings", []) + [w for s in steps for w in s.get("warnings", [])]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _slo(slo: dict) -> str:
    parts = [f"ttft<={slo['ttft_s']:g}s"]
    if slo.get("tpot_s") is not None:
        parts.append(f"tpot<={slo['tpot_s'] * 1e3:g}ms")
    if slo.get("e2e_s") is not None:
        parts.append(f"e2e<={slo['e2e_s']:g}s")
    return ",".join(parts)


def _window(cfg: dict, steps: list[dict]) -> str:
    return f"{steps[0]['window_s']:.0f}s" if steps else f"{cfg.get('duration_s')}s"


def write_json(result: Result, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False)
        f.write("\n")
    return path


def load_json(path: str) -> Result:
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict) or "steps" not in result or "config" not in result:
        raise ValueError(f"{path} is not a pdserve bench result (no 'steps' / 'config')")
    return result


def plot_png(result: Result, path: str) -> str:
    """TTFT p50/p95 (top) and tok/s per node (bottom) against the swept rate (concurrency sweeps: against
    the sustained RPS), the SLO line and the knee marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, knee, cfg = result["steps"], result.get("knee"), result["config"]
    by_conc = bool(steps) and steps[0]["kind"] == "concurrency"
    xs = [s["sustained_rps"] if by_conc else s["rate"] for s in steps]
    nan = float("nan")
    val = lambda v: nan if v is None else v
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(xs, [val(s["ttft"]["p50"]) for s in steps], "o-", label="TTFT p50")
    top.plot(xs, [val(s["ttft"]["p95"]) for s in steps], "s-", label="TTFT p95")
    top.axhline(cfg["slo"]["ttft_s"], color="grey", ls=":", label=f"SLO {cfg['slo']['ttft_s']:g} s")
    top.set_ylabel("TTFT (s)")
    bottom.plot(xs, [s["total_tok_s"] for s in steps], "o-", label="input + output")
    bottom.plot(xs, [s["output_tok_s"] for s in steps], "s-", label="output")
    bottom.set_ylabel("tok/s per node")
    bottom.set_xlabel("sustained RPS (concurrency sweep)" if by_conc else "offered RPS (Poisson)")
    for ax in (top, bottom):
        if knee is not None:
            ax.axvline(xs[knee["index"]], color="red", ls="--", label=f"knee ({knee['label']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_title(f"pdserve bench: {cfg['workload']}, {cfg['input_len']} in / {cfg['output_len']} out, "
                  f"cache hit {cfg['cache_hit']:g}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_COMPARED: list[tuple[str, Callable[[dict], float | None], bool]] = [
    # (name, value, higher is better)
    ("Sustained RPS", lambda s: s["sustained_rps"], True),
    ("Aggregate tok/s/node", lambda s: s["total_tok_s"], True),
    ("Output tok/s/node", lambda s: s["output_tok_s"], True),
    ("TTFT p50 s", lambda s: s["ttft"]["p50"], False),
    ("TTFT p95 s", lambda s: s["ttft"]["p95"], False),
    ("TPOT p50 ms", lambda s: None if s["tpot"]["p50"] is None else s["tpot"]["p50"] * 1e3, False),
    ("E2E p50 s", lambda s: s["e2e"]["p50"], False),
    ("Success rate", lambda s: s["success_rate"], True),
    ("Cache hit", lambda s: s["cache_hit"], True),
    ("Goodput rps", lambda s: s["goodput_rps"], True),
]


def format_compare(this: Result, other: Result, this_name: str = "this", other_name: str = "other") -> str:
    """Both runs side by side, step by step (matched by label), with this/other ratios."""
    lines = [f"compare: {this_name} ({this['config']['workload']}) vs {other_name} ({other['config']['workload']})"]
    others = {s["label"]: s for s in other["steps"]}
    pairs = [(s, others[s["label"]]) for s in this["steps"] if s["label"] in others]
    if not pairs:  # different sweeps: pair the steps in order
        pairs = list(zip(this["steps"], other["steps"]))
        if pairs:
            lines.append("no step label in common: steps paired in sweep order")
    rows = []
    for s, o in pairs:
        label = s["label"] if s["label"] == o["label"] else f"{s['label']} ~ {o['label']}"
        for k, (name, get, higher) in enumerate(_COMPARED):
            a, b = get(s), get(o)
            ratio = f"{a / b:.2f}x" if a is not None and b else "-"
            if a is not None and b is not None and a != b:
                ratio += " better" if (a > b) == higher else " worse"
            rows.append([label if k == 0 else "", name, _f(a, ".3f"), _f(b, ".3f"), ratio])
    if not rows:
        lines.append("no steps to compare")
    else:
        lines += _grid(["Step", "Metric", this_name, other_name, f"{this_name}/{other_name}"], rows)
    knees = [r.get("knee") for r in (this, other)]
    lines.append(f"knee: {this_name} {knees[0]['label'] if knees[0] else 'none'}, "
                 f"{other_name} {knees[1]['label'] if knees[1] else 'none'}")
    return "\n".join(lines)
