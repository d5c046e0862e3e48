"""Reports of a sweep: the terminal table, the JSON file, the PNG plot and a side-by-side comparison.

Everything here works on the JSON form of a result (``bench.json``), so a saved run can be re-reported
or compared without a server.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from bench.loadgen.stats import Knee, find_knee

Result = dict[str, Any]
"""A sweep result in its JSON form: config, server, steps (StepStats as dicts), knee, warnings."""


MIN_SAMPLES = {"p50": 2, "p95": 20, "p99": 100}
"""A pXX from fewer samples than 1 / (1 - XX) is no better than the sample's maximum: flagged '*'."""
FEW = "*"
CARRIED = "^"


def _f(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _ms(v: float | None) -> str:
    """Seconds as milliseconds: one decimal under 100 ms, none above."""
    return "-" if v is None else f"{v * 1e3:.1f}" if v < 0.1 else f"{v * 1e3:.0f}"


def _q(d: dict, q: str) -> str:
    """One percentile of a Dist in ms, flagged when it comes from too few samples."""
    v = d.get(q)
    return _ms(v) + (FEW if v is not None and d.get("count", 0) < MIN_SAMPLES[q] else "")


def _pair(d: dict) -> str:
    return f"{_q(d, 'p50')} / {_q(d, 'p95')}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _sustained(s: dict) -> str:
    above = s["sustained_rps"] > s["offered_rps"] and s.get("num_carried_in", 0) > 0
    return f"{s['sustained_rps']:.3f}" + (CARRIED if above else "")


# (header, cell) in display order: the reference table's columns first, then ours. Every latency is in ms.
_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("Sustained RPS", _sustained),
    ("Aggregate tok/s/node", lambda s: _f(s["total_tok_s"], ".1f")),
    ("TTFT p50 / p95 ms", lambda s: _pair(s["ttft"])),
    ("Success rate", lambda s: _pct(s["success_rate"])),
    ("Requests", lambda s: str(s["num_measured"])),
    ("Offered RPS", lambda s: f"{s['offered_rps']:.3f}"),
    ("Output tok/s/node", lambda s: _f(s["output_tok_s"], ".1f")),
    ("TTFT p99 ms", lambda s: _q(s["ttft"], "p99")),
    ("Router queue p50 / p95 ms", lambda s: _pair(s.get("router_queue", {}))),  # absent from older results
    ("ITL p50 / p95 ms", lambda s: _pair(s["itl"])),
    ("TPOT p50 / p95 ms", lambda s: _pair(s["tpot"])),
    ("E2E p50 / p95 ms", lambda s: _pair(s["e2e"])),
    ("Stream tok/s", lambda s: _f(s["stream_tok_s"].get("p50"), ".1f")),
    ("Cache hit", lambda s: _pct(s["cache_hit"]) + ("" if "agentic" in s else f" ({s['target_cache_hit'] * 100:.0f}%)")),
    ("KV MB/req", lambda s: _f(s["kv_bytes_per_req"], ".2f", 1e-6)),
    ("KV transfer ms", lambda s: _ms(s["kv_s_per_req"])),
    ("Accept len", lambda s: _f(s["accept_len"], ".2f")),
    ("Goodput rps", lambda s: f"{s['goodput_rps']:.3f} ({_pct(s['goodput_frac'])})"),
]
_COST_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("$/Mtok (out)", lambda s: f"{_f(s['cost_per_mtok'], '.2f')} ({_f(s['cost_per_mtok_output'], '.2f')})"),
]
def _tiers(s: dict) -> str:
    rates = (s.get("cache_tiers") or {}).get("hit_rate") or {}
    return " / ".join(f"{t} {_pct(v)}" for t, v in rates.items()) or "-"


def _sessions(s: dict) -> str:
    a = s["agentic"]
    return f"{a['sessions_completed']}/{a['sessions_started']} ({a['sessions_failed']} failed)"


_AGENTIC_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("Sessions done", _sessions),
    ("Turns/s", lambda s: _f(s["agentic"]["requests_per_s"], ".3f")),
    ("Turn tok/s", lambda s: _f(s["agentic"]["tokens_per_s"], ".1f")),
    ("Hit by tier", _tiers),
    ("KV MB/turn", lambda s: _f(s["agentic"]["kv_bytes_per_turn"], ".2f", 1e-6)),
    ("Decode resident", lambda s: _pct(s["agentic"].get("decode_resident"))),  # absent from older results
    ("Shipped past tail (mean / max tok)", lambda s: _tail(s["agentic"])),
]


def _tail(a: dict) -> str:
    mean, top = a.get("beyond_tail_tokens_mean"), a.get("beyond_tail_tokens_max")
    return "-" if mean is None else f"{mean:.1f} / {top}"
_POWER_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [("tok/J", lambda s: _f(s["tok_per_joule"], ".3f"))]


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)]


def _unit(steps: list[dict]) -> str:
    return "concurrency" if steps and steps[0]["kind"] == "concurrency" else "rps"


def _cond(slo: dict) -> str:
    return f"TTFT p95 <= {slo['ttft_s'] * 1e3:g} ms and success >= {slo['min_success'] * 100:g}%"


def _next(cfg: dict, kind: str, start: float, top: float) -> str:
    """The flags of the next sweep to try, over [start, top]."""
    if kind == "concurrency":
        start, top = max(1, round(start)), max(1, round(top))
        if top == 1:
            return "none lower: the SLO is missed one request at a time"
    if cfg.get("auto"):
        return f"--{kind} auto --start-rate {start:.3g} --max-rate {top:.3g}"
    rates = [start * 2 ** k for k in range(4)]
    return f"--{kind} " + ",".join(f"{r:.3g}" for r in rates if r <= top * 1.001)


def knee_fields(result: Result) -> dict[str, Any]:
    """``knee`` (only where the sweep crossed the SLO), ``saturation`` and ``verdict`` of a result, from its
    steps: one rule for list and auto sweeps, and for results saved by older versions."""
    cfg, steps, search = result["config"], result["steps"], result.get("search") or {}
    judged = [i for i, s in enumerate(steps) if s["num_measured"]]  # an empty window says nothing about the SLO
    if not judged:
        return {"knee": None, "saturation": None,
                "verdict": {"status": "no-steps", "text": "knee: none - no step measured a request"}}
    k = find_knee([steps[i]["rate"] for i in judged], [steps[i]["within_slo"] for i in judged])
    at = lambda j: None if j is None else judged[j]
    knee = Knee(at(k.last_good), at(k.first_bad), tuple(judged[j] for j in k.noise))
    kind, cond = _unit(steps), _cond(cfg["slo"])
    by_rate = sorted((steps[i] for i in judged), key=lambda s: s["rate"])
    noise = "".join(f"; {steps[i]['label']} broke it below a rate that passed: noise (a busy machine, a cold prefix "
                    "cache), not the capacity" for i in knee.noise)
    stopped = search.get("stopped")
    bound = (f" (stopped by --max-duration {cfg['max_duration_s']:g}s)" if stopped == "time" else
             " (stopped: a step measured no request, lengthen --duration)" if stopped == "empty" else "")
    if knee.found:
        good, bad = steps[knee.last_good], steps[knee.first_bad]
        res = f", resolution {cfg['resolution']}" if cfg.get("auto") else ""
        text = (f"knee: {good['label']} - the highest rate with {cond}; {bad['label']} breaks it: capacity under "
                f"this SLO is in [{good['rate']:g}, {bad['rate']:g}) {kind}{res}{bound}{noise}")
        sat = max(steps, key=lambda s: s["sustained_rps"])
        saturation = {"label": sat["label"], "rate": sat["rate"], "sustained_rps": sat["sustained_rps"],
                      "offered_rps": sat["offered_rps"], "success_rate": sat["success_rate"]}
        return {"knee": {"index": knee.last_good, "label": good["label"], "rate": good["rate"],
                         "first_bad_index": knee.first_bad, "first_bad_label": bad["label"],
                         "first_bad_rate": bad["rate"], "noise": [steps[i]["label"] for i in knee.noise]},
                "saturation": saturation, "verdict": {"status": "found", "text": text}}
    if knee.last_good is None:
        low = by_rate[0]["rate"]
        text = (f"knee: none - the lowest rate ({by_rate[0]['label']}) already misses {cond}{bound}; "
                f"next: {_next(cfg, kind, low / 8, low)}")
        return {"knee": None, "saturation": None, "verdict": {"status": "below-range", "text": text}}
    top = steps[knee.last_good]
    text = (f"no knee up to {top['label']}: {'the highest' if noise else 'every'} step met {cond}{bound}; "
            f"next: {_next(cfg, kind, top['rate'], top['rate'] * 8)}{noise}")
    return {"knee": None, "saturation": None, "verdict": {"status": "not-reached", "text": text}}


def format_table(result: Result) -> str:
    """The terminal table in rate order (knee marked), the verdict, saturation, legends, then failures and
    warnings (never hidden)."""
    cfg, steps = result["config"], result["steps"]
    fields = knee_fields(result)
    knee, saturation = fields["knee"], fields["saturation"]
    phases = (result.get("search") or {}).get("phases") or []
    cols = list(_COLUMNS)
    if cfg.get("cost_per_hour"):
        cols += _COST_COLUMNS
    if cfg.get("power_watts"):
        cols += _POWER_COLUMNS
    if steps and all("agentic" in s for s in steps):
        cols += _AGENTIC_COLUMNS
    elif any((s.get("cache_tiers") or {}).get("hit_rate") for s in steps):  # the prefill workers' /metrics
        cols.append(("Hit by tier", _tiers))
    rows = []
    for i in sorted(range(len(steps)), key=lambda i: steps[i]["rate"]):
        s = steps[i]
        mark = " (knee)" if knee is not None and knee["index"] == i else ""
        phase = [phases[i] if i < len(phases) else ""] if phases else []
        rows.append([s["label"] + mark] + phase + [cell(s) for _, cell in cols])
    prefixes = f" ({cfg['num_prefixes']} prefixes)" if cfg["cache_hit"] else ""
    title = (f"pdserve bench: {cfg['workload']} -> {cfg['target']}  input {cfg['input_len']} / output "
             f"{cfg['output_len']} tokens, cache hit {cfg['cache_hit']:g}{prefixes}, {cfg['nodes']} node(s), "
             f"window {_window(cfg, steps)}, warm-up {cfg['warmup_s']:g}s, SLO {_slo(cfg['slo'])}")
    if cfg["workload"] == "agentic":
        title = (f"pdserve bench: agentic -> {cfg['target']}  {cfg['sessions']} sessions x {cfg['turns']} turns, "
                 f"system {cfg['system_len']} + user {cfg['user_len']} / output {cfg['output_len']} tokens a turn, "
                 f"think {cfg['think_time_s']:g}s, {cfg['nodes']} node(s), SLO {_slo(cfg['slo'])}")
    header = ["Step"] + (["Phase"] if phases else []) + [h for h, _ in cols]
    lines = [title, *_grid(header, rows), fields["verdict"]["text"]]
    if saturation is not None:
        lines.append(f"saturation: at most {saturation['sustained_rps']:.3f} req/s sustained ({saturation['label']}, "
                     f"offered {saturation['offered_rps']:.3f}, success {_pct(saturation['success_rate'])})")
    lines += _legends(rows, steps)
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


def _legends(rows: list[list[str]], steps: list[dict]) -> list[str]:
    out = []
    if any(c.endswith(FEW) for r in rows for c in r[1:]):
        need = ", ".join(f"{q}: {n}" for q, n in MIN_SAMPLES.items())
        out.append(f"{FEW} percentile from fewer samples than it needs to differ from the maximum ({need}): noise, "
                   "lengthen --duration")
    carried = [s for s in steps if s["sustained_rps"] > s["offered_rps"] and s.get("num_carried_in", 0) > 0]
    if carried:
        which = ", ".join(f"{s['num_carried_in']} in {s['label']}" for s in carried)
        out.append(f"{CARRIED} sustained above offered: requests scheduled before the window (the warm-up's backlog) "
                   f"finished inside it ({which})")
    return out


def _slo(slo: dict) -> str:
    parts = [f"ttft p95<={slo['ttft_s'] * 1e3:g}ms"]
    if slo.get("tpot_s") is not None:
        parts.append(f"tpot<={slo['tpot_s'] * 1e3:g}ms")
    if slo.get("e2e_s") is not None:
        parts.append(f"e2e<={slo['e2e_s'] * 1e3:g}ms")
    return ",".join(parts) + f",success>={slo.get('min_success', 0.99) * 100:g}%"


def _window(cfg: dict, steps: list[dict]) -> str:
    return f"{steps[0]['window_s']:.3g}s" if steps else f"{cfg.get('duration_s')}s"


def run_label(path: str) -> str:
    """A run's name in comparisons: its folder (``runs/baseline/bench.json`` -> ``baseline``)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path) if os.path.splitext(path)[1] == ".json" else path
    return os.path.basename(folder) or folder


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


def _in_ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


_COMPARED: list[tuple[str, Callable[[dict], float | None], bool]] = [
    # (name, value, higher is better)
    ("Sustained RPS", lambda s: s["sustained_rps"], True),
    ("Aggregate tok/s/node", lambda s: s["total_tok_s"], True),
    ("Output tok/s/node", lambda s: s["output_tok_s"], True),
    ("TTFT p50 ms", lambda s: _in_ms(s["ttft"]["p50"]), False),
    ("TTFT p95 ms", lambda s: _in_ms(s["ttft"]["p95"]), False),
    ("TPOT p50 ms", lambda s: _in_ms(s["tpot"]["p50"]), False),
    ("E2E p50 ms", lambda s: _in_ms(s["e2e"]["p50"]), False),
    ("Success rate", lambda s: s["success_rate"], True),
    ("Cache hit", lambda s: s["cache_hit"], True),
    ("KV MB/req", lambda s: None if s.get("kv_bytes_per_req") is None else s["kv_bytes_per_req"] / 1e6, False),
    # agentic only (decode-side reuse on vs off: two servers, --decode-prefix-cache on / off)
    ("Decode resident", lambda s: (s.get("agentic") or {}).get("decode_resident"), True),
    ("Goodput rps", lambda s: s["goodput_rps"], True),
]


def format_configs(results: dict[str, Result]) -> str:
    """Several runs of one workload against differently configured servers (``bench.serve_compare``), step by step
    (matched by label, in the first run's order): each metric of each run, and its ratio to the first run's."""
    names = list(results)
    base = names[0]
    labels = [s["label"] for s in results[base]["steps"]]
    for n in names[1:]:
        labels += [s["label"] for s in results[n]["steps"] if s["label"] not in labels]
    by_label = {n: {s["label"]: s for s in r["steps"]} for n, r in results.items()}
    header = ["Step", "Metric"] + [h for n in names for h in ([n] if n == base else [n, f"{n}/{base}"])]
    compared = [(name, get) for name, get, _ in _COMPARED] + [("Hit by tier", None)]
    rows = []
    for label in labels:
        b = by_label[base].get(label)
        for k, (metric, get) in enumerate(compared):
            row = [label if k == 0 else "", metric]
            for n in names:
                s = by_label[n].get(label)
                if get is None:  # text, no ratio
                    row += [_tiers(s) if s else "-"] + ([] if n == base else [""])
                    continue
                v = get(s) if s else None
                row.append(_f(v, ".3f"))
                if n != base:
                    w = get(b) if b else None
                    row.append(f"{v / w:.2f}x" if v is not None and w else "-")
            rows.append(row)
    lines = [f"serve compare: {results[base]['config']['workload']} against {len(names)} server configurations "
             f"({', '.join(names)}); ratios to {base}"]
    lines += _grid(header, rows) if rows else ["no steps to compare"]
    lines += [f"knee: {n} {k['label'] if (k := knee_fields(r)['knee']) else 'none'}" for n, r in results.items()]
    return "\n".join(lines)


def format_compare(this: Result, other: Result, this_name: str = "this", other_name: str = "other") -> str:
    """Both runs side by side, step by step (matched by label), with this/other ratios."""
    lines = [f"compare: {this_name} vs {other_name} (workloads {this['config']['workload']} / "
             f"{other['config']['workload']})"]
    others = {s["label"]: s for s in other["steps"]}
    pairs = [(s, others[s["label"]]) for s in this["steps"] if s["label"] in others]
    if not pairs:  # different sweeps (auto searches land on different rates): pair the steps in rate order
        by_rate = lambda r: sorted(r["steps"], key=lambda s: s["rate"])
        pairs = list(zip(by_rate(this), by_rate(other)))
        if pairs:
            lines.append("no step label in common: steps paired in rate order")
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
    knees = [knee_fields(r)["knee"] for r in (this, other)]
    lines.append(f"knee: {this_name} {knees[0]['label'] if knees[0] else 'none'}, "
                 f"{other_name} {knees[1]['label'] if knees[1] else 'none'}")
    return "\n".join(lines)
