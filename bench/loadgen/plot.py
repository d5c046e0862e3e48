"""The plot of one ``pdserve bench`` result (OUT/bench.png): matplotlib, imported only when a PNG is drawn."""
from __future__ import annotations

import os

from bench.loadgen.report import MIN_SAMPLES, Result, knee_fields


def plot_png(result: Result, path: str) -> str:
    """Three panels against the swept rate: TTFT p50/p95 in ms with the SLO (hollow: p95 from too few
    requests), sustained vs offered RPS with the saturation level, success rate with the failures per step;
    the knee and the first rate that breaks the SLO marked on each."""
    import matplotlib  # heavy optional dependency: only the PNG needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    fig = figure(result, plt)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=PNG_DPI)
    plt.close(fig)
    return path


PNG_DPI = 80
"""Keeps a plot under ~100 KB (docs/img holds some)."""


def _headline(fields: dict) -> str:
    knee, sat, status = fields["knee"], fields["saturation"], fields["verdict"]["status"]
    if status == "found":
        return (f"knee {knee['label']} (breaks at {knee['first_bad_label']}), "
                f"saturation {sat['sustained_rps']:.2f} req/s sustained")
    return fields["verdict"]["text"].split(";")[0]


def figure(result: Result, plt):
    """The figure of ``plot_png`` (``plt``: matplotlib.pyplot, Agg backend)."""
    cfg, fields = result["config"], knee_fields(result)
    steps = sorted(result["steps"], key=lambda s: s["rate"])
    knee, sat = fields["knee"], fields["saturation"]
    xs = [s["rate"] for s in steps]
    nan = float("nan")
    ms = lambda v: nan if v is None else v * 1e3
    fig, (lat, rps, ok) = plt.subplots(3, 1, figsize=(7, 8.5), sharex=True)
    lat.plot(xs, [ms(s["ttft"]["p50"]) for s in steps], "o-", label="TTFT p50")
    lat.plot(xs, [ms(s["ttft"]["p95"]) for s in steps], "s-", label="TTFT p95")
    few = [s for s in steps if s["ttft"]["p95"] is not None and s["ttft"]["count"] < MIN_SAMPLES["p95"]]
    if few:
        lat.plot([s["rate"] for s in few], [ms(s["ttft"]["p95"]) for s in few], "s", mfc="white", color="C1",
                 label=f"p95 from < {MIN_SAMPLES['p95']} requests")
    lat.axhline(cfg["slo"]["ttft_s"] * 1e3, color="grey", ls=":", label=f"SLO {cfg['slo']['ttft_s'] * 1e3:g} ms")
    lat.set_yscale("log")
    lat.set_ylabel("TTFT (ms)")
    rps.plot(xs, [s["sustained_rps"] for s in steps], "o-", label="sustained")
    rps.plot(xs, [s["offered_rps"] for s in steps], "x--", color="grey", label="offered (in the window)")
    if sat is not None:
        rps.axhline(sat["sustained_rps"], color="purple", ls="-.", label=f"saturation {sat['sustained_rps']:.2f} rps")
    rps.set_ylabel("requests/s")
    ok.plot(xs, [nan if s["success_rate"] is None else s["success_rate"] * 100 for s in steps], "o-", color="green",
            label="success rate")
    ok.axhline(cfg["slo"]["min_success"] * 100, color="grey", ls=":", label="SLO success")
    ok.set_ylabel("success (%)")
    ok.set_ylim(-5, 105)
    fails = ok.twinx()
    width = 0.02 * ((max(xs) - min(xs)) or max(xs) or 1.0)
    failed = [sum(s["failures"].values()) for s in steps]
    fails.bar(xs, failed, width=width, color="red", alpha=0.5, label="failed requests")
    fails.set_ylabel("failed requests")
    fails.set_ylim(0, max(1, *failed) * 1.1)  # a run without failures still shows an axis of whole requests
    ok.set_xlabel("concurrency" if steps and steps[0]["kind"] == "concurrency" else
                  "offered rate, requests/s (Poisson)")
    for ax in (lat, rps, ok):
        if knee is not None:
            ax.axvline(knee["rate"], color="red", ls="--", label=f"knee ({knee['label']})")
            ax.axvspan(knee["rate"], knee["first_bad_rate"], color="red", alpha=0.08)
        ax.grid(alpha=0.3)
    for ax in (lat, rps):
        ax.legend(fontsize=7)
    handles = [h for a in (ok, fails) for h in a.get_legend_handles_labels()[0]]
    ok.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    lat.set_title(f"pdserve bench: {cfg['workload']}, {cfg['input_len']} in / {cfg['output_len']} out, "
                  f"cache hit {cfg['cache_hit']:g}\n{_headline(fields)}", fontsize=9)
    fig.tight_layout()
    return fig
