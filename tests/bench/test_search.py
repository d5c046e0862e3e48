"""The knee search's rate sequence against servers with a known threshold (no load, no timing)."""
import pytest

from bench.loadgen.config import BenchConfig
from bench.loadgen.search import KneeSearch, Phase, SearchConfig, StopReason


def run(threshold: float, kind="rps", start=0.5, max_rate=64.0, resolution="10%", limit=50, noisy=()):
    """Drive a search against a server that is within the SLO exactly up to ``threshold``, except that the
    first step at a rate in ``noisy`` breaks it anyway."""
    search = KneeSearch(SearchConfig(kind, start, max_rate, resolution), BenchConfig(resolution=resolution)
                        .resolution_for)
    rates, phases = [], []
    while (rate := search.next_rate()) is not None and len(rates) < limit:
        rates.append(rate)
        phases.append(search.phase)
        search.record(rate, rate <= threshold and not (rate in noisy and rates.count(rate) == 1))
    return search, rates, phases


@pytest.mark.parametrize("threshold", [0.7, 1.3, 2.9, 3.1, 17.0])
@pytest.mark.parametrize("resolution", ["10%", "25%", "0.2"])
def test_bisects_to_the_resolution_then_runs_past_it(threshold, resolution):
    search, rates, phases = run(threshold, resolution=resolution)
    good, bad = search.last_good, search.first_bad
    assert good <= threshold < bad  # the true knee is inside the bracket
    assert bad - good <= BenchConfig(resolution=resolution).resolution_for(good) + 1e-12
    assert search.stop_reason is StopReason.RESOLUTION
    assert max(rates) >= 1.5 * good  # one step past the knee: saturation shows
    assert phases[0] is Phase.RAMP and len(set(rates)) == len(rates)  # no rate runs twice
    assert len(rates) <= 16


def test_ramp_doubles_and_caps_at_max_rate_without_a_knee():
    search, rates, _ = run(threshold=100.0, start=0.5, max_rate=6.0)
    assert rates == [0.5, 1.0, 2.0, 4.0, 6.0]
    assert search.stop_reason is StopReason.MAX_RATE and search.first_bad is None


def test_lowest_rate_breaking_stops_at_once():
    search, rates, _ = run(threshold=0.1, start=0.5)
    assert rates == [0.5] and search.stop_reason is StopReason.LOWEST_BREAKS


def test_concurrency_is_integer_and_stops_one_apart():
    search, rates, _ = run(threshold=5, kind="concurrency", start=1, max_rate=256, resolution="10%")
    assert all(r == int(r) for r in rates)
    assert (search.last_good, search.first_bad) == (5, 6)
    assert rates[:4] == [1, 2, 4, 8] and 6 in rates  # ramp to 8, bisect 6 then 5, saturate at 8 (ran)


def test_saturation_step_skipped_when_the_ramp_already_ran_that_high():
    _, rates, phases = run(threshold=3.9, start=1.0, resolution="40%")
    # ramp 1, 2, 4 (bad); bisect 3 (good): bracket [3, 4] is within 40% of 3; 4.5 = 1.5 x 3 > 4: one more step
    assert rates == [1.0, 2.0, 4.0, 3.0, 4.5] and phases[-1] is Phase.SATURATE
    _, rates, _ = run(threshold=2.5, start=1.0, resolution="40%")
    assert rates == [1.0, 2.0, 4.0, 3.0, 2.5]  # 1.5 x 2.5 = 3.75 <= 4 ran already


def test_a_step_without_requests_ends_the_search():
    search = KneeSearch(SearchConfig("rps", 1.0, 64.0, "10%"), BenchConfig().resolution_for)
    search.record(search.next_rate(), True)
    search.record(search.next_rate(), False, empty=True)
    assert search.next_rate() is None and search.stop_reason is StopReason.EMPTY


def test_a_noisy_break_is_overruled_by_the_saturation_step():
    """The first break (rps 1) was noise: the step at 1.5x the bracketed knee passes, the search ramps on from
    there and brackets the real threshold."""
    search, rates, _ = run(threshold=3.0, start=0.5, resolution="10%", noisy=(1.0,))
    assert rates[:2] == [0.5, 1.0] and search.noise == [1.0]
    assert search.last_good <= 3.0 < search.first_bad and search.stop_reason is StopReason.RESOLUTION
    assert search.first_bad - search.last_good <= 0.1 * search.last_good + 1e-12
