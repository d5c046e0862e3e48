"""Percentiles, per-step figures and the knee on synthetic timings with known answers."""
import pytest

from bench.loadgen.config import BenchConfig, Slo
from bench.loadgen.runner import OK, LoadStep, RequestRecord, StepRecords
from bench.loadgen.stats import Dist, Knee, find_knee, percentile, step_stats


def test_percentile_known_answers():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    xs = list(range(1, 101))  # 1..100: linear interpolation between closest ranks
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 95) == pytest.approx(95.05)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([10.0, 20.0, 30.0, 40.0], 50) == pytest.approx(25.0)
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_dist_ignores_missing_values():
    d = Dist.of([None, 1.0, 2.0, 3.0, float("nan")])
    assert (d.p50, d.mean, d.count) == (2.0, 2.0, 3)
    assert Dist.of([]) == Dist()


def make_rec(i, t_send, ttft, itl, n_out, prompt=100, cached=60, status=OK, chunk=1, **kw) -> RequestRecord:
    """A finished request: first token ttft after t_send, then one chunk of ``chunk`` tokens every itl."""
    r = RequestRecord(index=i, input_len=prompt, output_len=n_out, t_sched=t_send, t_send=t_send)
    if status == OK:
        first = t_send + ttft
        k = n_out // chunk
        r.chunk_times = [first + j * itl for j in range(k)]
        r.chunk_tokens = [chunk] * k
        r.t_first, r.t_end = first, r.chunk_times[-1]
        r.finish_reason, r.prompt_tokens, r.cached_tokens, r.completion_tokens = "length", prompt, cached, n_out
        r.kv_transfer_bytes, r.kv_transfer_s = 4000, 0.002
    else:
        r.t_end = t_send + 0.01
        r.detail = "queue full"
    r.status = status
    for k_, v in kw.items():
        setattr(r, k_, v)
    return r


def make_cfg(**kw) -> BenchConfig:
    return BenchConfig(**{**dict(input_len=100, output_len=11, cache_hit=0.6, rps=(1.0,)), **kw}).with_defaults()


def test_step_stats_known_answers():
    # Window [10, 20). A warm-up request (sent at 9) streams into the window: its tokens after t=10 and its
    # completion count for throughput; its latency and its prompt (first token at 9.5) do not.
    recs = [make_rec(0, 9.0, 0.5, 0.125, 11)]  # tokens at 9.5 + j/8: j = 4..10 land in the window
    # Ten measured successful requests, TTFT 0.1..1.0 s, 11 tokens each at 0.1 s apart (TPOT 0.1 s).
    recs += [make_rec(i, 10.0 + (i - 1) * 0.5, 0.1 * i, 0.1, 11) for i in range(1, 11)]
    recs += [make_rec(11, 15.0, 0, 0, 11, status="RESOURCE_EXHAUSTED"),
             make_rec(12, 16.0, 0, 0, 11, status="finish:error")]
    recs.append(make_rec(13, 25.0, 0.1, 0.1, 11))  # sent after the window (drain): not measured
    sr = StepRecords(LoadStep("rps", 1.0), 10.0, 20.0, recs)
    s = step_stats(sr, make_cfg(nodes=2, slo=Slo(ttft_s=0.55, tpot_s=0.2), cost_per_hour=3.6, power_watts=50))
    assert (s.num_sent, s.num_measured, s.num_ok) == (14, 12, 10)
    assert s.success_rate == pytest.approx(10 / 12)
    assert s.failures == {"RESOURCE_EXHAUSTED": 1, "finish:error": 1}
    assert s.failure_examples["RESOURCE_EXHAUSTED"] == "queue full"
    assert s.ttft.p50 == pytest.approx(0.55) and s.ttft.p95 == pytest.approx(0.955)
    assert s.tpot.p50 == pytest.approx(0.1) and s.itl.p95 == pytest.approx(0.1)
    assert s.itl.count == 10 * 10
    assert s.e2e.p50 == pytest.approx(0.55 + 1.0)
    assert s.stream_tok_s.p50 == pytest.approx(10.0)
    assert s.sustained_rps == pytest.approx(11 / 10)  # ten measured + the warm-up one finish in the window
    assert s.offered_rps == pytest.approx(12 / 10)
    assert s.output_tok_s == pytest.approx((110 + 7) / 10 / 2)
    assert s.input_tok_s == pytest.approx(10 * 100 / 10 / 2)
    assert s.total_tok_s == pytest.approx((1000 + 117) / 10 / 2)
    assert s.cache_hit == pytest.approx(0.6) and s.target_cache_hit == 0.6
    assert s.kv_bytes_per_req == 4000 and s.kv_s_per_req == pytest.approx(0.002)
    assert s.accept_len is None
    assert s.goodput_rps == pytest.approx(5 / 10)  # TTFT <= 0.55: requests 1..5
    assert s.goodput_frac == pytest.approx(5 / 12)
    assert not s.within_slo  # TTFT p95 0.955 > 0.55
    assert s.cost_per_mtok == pytest.approx(3.6 / (55.85 * 3600) * 1e6)
    assert s.cost_per_mtok_output == pytest.approx(3.6 / (5.85 * 3600) * 1e6)
    assert s.tok_per_joule == pytest.approx(55.85 / 50)
    assert s.length_mismatches == 0


def test_within_slo_needs_success():
    recs = [make_rec(i, 10.0 + i, 0.1, 0.01, 5) for i in range(9)]
    recs.append(make_rec(9, 12.0, 0, 0, 5, status="UNAVAILABLE"))
    s = step_stats(StepRecords(LoadStep("rps", 1.0), 10.0, 30.0, recs), make_cfg())
    assert s.ttft.p95 == pytest.approx(0.1) and s.success_rate == pytest.approx(0.9)
    assert not s.within_slo
    s2 = step_stats(StepRecords(LoadStep("rps", 1.0), 10.0, 30.0, recs), make_cfg(slo=Slo(min_success=0.8)))
    assert s2.within_slo


def test_speculative_chunks_and_length_mismatch():
    r = make_rec(0, 0.0, 0.2, 0.03, 12, chunk=3, accept_len=2.5)
    r.completion_tokens = 11
    s = step_stats(StepRecords(LoadStep("concurrency", 1), 0.0, 10.0, [r]), make_cfg())
    assert s.itl.p50 == pytest.approx(0.03)  # one gap per chunk
    assert s.tpot.p50 == pytest.approx(0.03 * 3 / 11)  # 4 chunks over 0.09 s, 11 tokens after the first
    assert s.accept_len == 2.5 and s.length_mismatches == 1
    assert any("different number of tokens" in w for w in s.warnings)


def test_drift_flags_a_growing_queue():
    recs = [make_rec(i, float(i), 0.1 * (1 + i) ** 2, 0.01, 3) for i in range(10)]
    s = step_stats(StepRecords(LoadStep("rps", 3.0), 0.0, 10.0, recs), make_cfg())
    assert s.ttft_drift > 2 and any("queue is building" in w for w in s.warnings)


def test_empty_window_warns():
    s = step_stats(StepRecords(LoadStep("rps", 0.1), 10.0, 20.0, [make_rec(0, 1.0, 0.1, 0.1, 3)]), make_cfg())
    assert s.num_measured == 0 and s.success_rate is None and not s.within_slo
    assert any("lengthen --duration" in w for w in s.warnings)


@pytest.mark.parametrize("rates,within,knee,found", [
    ([0.5, 1.0, 1.5, 2.0], [True, True, True, False], Knee(2, 3), True),
    ([0.5, 1.0, 1.5, 2.0], [True, True, True, True], Knee(3, None), False),  # never crossed: no knee
    ([0.5, 1.0, 1.5, 2.0], [False, True, True, True], Knee(3, None, (0,)), False),
    # a break below a passing rate is noise: the server served more; the knee is under the confirmed break
    ([0.5, 1.0, 1.5, 2.0], [True, False, True, False], Knee(2, 3, (1,)), True),
    ([0.5, 1.0, 1.5, 2.0], [False, True, False, True], Knee(3, None, (0, 2)), False),
    ([2.0, 0.5, 1.0], [False, True, True], Knee(2, 0), True),  # unsorted input: index into the input
    ([2.0, 0.5, 1.0], [False, False, False], Knee(None, 1), False),
    ([], [], Knee(None, None), False),
])
def test_knee(rates, within, knee, found):
    assert find_knee(rates, within) == knee and knee.found == found


def test_knee_from_synthetic_timings():
    """TTFT grows with the rate; SLO 5 s: the knee is the last rate with p95 <= 5 s."""
    cfg = make_cfg(slo=Slo(ttft_s=5.0))
    stats = []
    for rate, ttft in [(0.5, 1.0), (1.0, 2.0), (1.5, 4.9), (2.0, 8.0)]:
        recs = [make_rec(i, 10.0 + i * 0.1, ttft, 0.01, 3) for i in range(20)]
        stats.append(step_stats(StepRecords(LoadStep("rps", rate), 10.0, 20.0, recs), cfg))
    assert find_knee([s.rate for s in stats], [s.within_slo for s in stats]) == Knee(2, 3)
