"""The report on synthetic steps with known answers: one unit (ms) for every latency, percentiles from too few
requests flagged, sustained above offered explained, knee / no knee / saturation, and a plot of the failures."""
import dataclasses

import matplotlib
import pytest

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.plot import figure
from bench.loadgen.report import format_table, knee_fields
from bench.loadgen.runner import LoadStep, StepRecords
from bench.loadgen.stats import step_stats
from test_stats import make_rec

matplotlib.use("Agg")


def make_step(rate, n, ttft, fail_every=0, carried=0):
    """``n`` requests in a 10 s window (10..20 s), ``carried`` more scheduled in the warm-up that end inside it."""
    recs = [make_rec(i, 10.0 + i * 10.0 / n, ttft, 0.02, 4, status="UNAVAILABLE"
                     if fail_every and i % fail_every == fail_every - 1 else "OK") for i in range(n)]
    recs += [make_rec(n + j, 9.9, 0.2, 0.02, 4) for j in range(carried)]
    cfg = BenchConfig(rps=(rate,), slo=Slo(ttft_s=1.0)).with_defaults()
    return step_stats(StepRecords(LoadStep("rps", rate), 10.0, 20.0, recs), cfg)


def result_of(steps, **cfg):
    c = BenchConfig(rps=tuple(s.rate for s in steps), slo=Slo(ttft_s=1.0), **cfg).with_defaults()
    out = {"config": c.to_json(), "steps": [dataclasses.asdict(s) for s in steps], "warnings": []}
    out.update(knee_fields(out))
    return out


def header_and_rows(text):
    lines = text.splitlines()
    split = lambda line: [c.strip() for c in line.split("|")]
    return split(lines[1]), [split(line) for line in lines[3:] if line.startswith("rps ")]


def test_every_latency_column_is_in_ms():
    res = result_of([make_step(1.0, 30, 0.25)])
    header, rows = header_and_rows(format_table(res))
    latency = [h for h in header if any(k in h for k in ("TTFT", "ITL", "TPOT", "E2E", "KV transfer"))]
    assert len(latency) == 6 and all(h.endswith(" ms") for h in latency), header
    assert not [h for h in header if h.endswith(" s")]
    row = dict(zip(header, rows[0]))
    assert row["TTFT p50 / p95 ms"] == "250 / 250" and row["ITL p50 / p95 ms"] == "20.0 / 20.0"
    assert row["E2E p50 / p95 ms"] == "310 / 310" and row["Requests"] == "30"


def test_percentiles_from_too_few_requests_are_flagged():
    res = result_of([make_step(0.5, 6, 0.25), make_step(2.0, 20, 0.25)])
    text = format_table(res)
    header, rows = header_and_rows(text)
    few, enough = (dict(zip(header, r)) for r in rows)
    assert few["TTFT p50 / p95 ms"] == "250 / 250*" and few["TTFT p99 ms"] == "250*" and few["Requests"] == "6"
    assert enough["TTFT p50 / p95 ms"] == "250 / 250" and enough["TTFT p99 ms"] == "250*"
    assert "* percentile from fewer samples than it needs to differ from the maximum (p50: 2, p95: 20, p99: 100)" \
        in text


def test_sustained_above_offered_is_explained():
    s = make_step(1.0, 10, 0.25, carried=3)
    assert s.sustained_rps == pytest.approx(1.3) and s.offered_rps == pytest.approx(1.0) and s.num_carried_in == 3
    text = format_table(result_of([s]))
    assert "1.300^" in text
    assert "^ sustained above offered: requests scheduled before the window (the warm-up's backlog) finished " \
           "inside it (3 in rps 1)" in text
    assert "^" not in format_table(result_of([make_step(1.0, 10, 0.25)]))


def test_knee_only_where_the_slo_was_crossed():
    good = [make_step(1.0, 10, 0.2), make_step(2.0, 20, 0.5)]
    res = result_of(good + [make_step(4.0, 24, 2.0, fail_every=4)])  # 4 req/s offered, 18 of 24 succeed
    assert res["knee"]["label"] == "rps 2" and res["knee"]["first_bad_label"] == "rps 4"
    assert res["saturation"]["label"] == "rps 2"  # the most finished per second: 18 requests at rps 4
    text = format_table(res)
    assert "rps 2 (knee)" in text and "capacity under this SLO is in [2, 4) rps" in text
    none = result_of(good)
    assert none["knee"] is None and "no knee up to rps 2" in format_table(none)
    assert "next: --rps 2,4,8,16" in format_table(none)
    empty = make_step(8.0, 20, 0.2)
    empty = dataclasses.replace(empty, num_measured=0, num_ok=0, within_slo=False)
    assert result_of(good + [empty])["knee"] is None  # an empty window is no SLO break
    noisy = result_of([make_step(1.0, 10, 3.0)] + good[1:] + [make_step(4.0, 24, 2.0, fail_every=4)])
    assert noisy["knee"]["label"] == "rps 2" and noisy["knee"]["noise"] == ["rps 1"]
    assert "rps 1 broke it below a rate that passed: noise" in noisy["verdict"]["text"]
    low = result_of([make_step(1.0, 20, 3.0)])
    assert low["verdict"]["status"] == "below-range" and "next: --rps 0.125,0.25,0.5,1" in format_table(low)


def test_plot_shows_success_rate_failures_slo_knee_and_saturation():
    import matplotlib.pyplot as plt
    steps = [make_step(1.0, 10, 0.2), make_step(2.0, 20, 0.5), make_step(4.0, 20, 2.0, fail_every=4)]
    fig = figure(result_of(steps), plt)
    lat, rps, ok, fails = fig.axes
    assert ok.get_ylabel() == "success (%)" and fails.get_ylabel() == "failed requests"
    assert [round(b.get_height()) for b in fails.patches] == [0, 0, 5]
    assert list(ok.lines[0].get_ydata()) == [100.0, 100.0, 75.0]
    labels = [line.get_label() for ax in (lat, rps, ok) for line in ax.lines]
    assert "SLO 1000 ms" in labels and "knee (rps 2)" in labels
    assert any(label.startswith("saturation ") for label in labels)
    plt.close(fig)
