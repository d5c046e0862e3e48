"""Poisson arrival schedules: mean inter-arrival 1/rate within tolerance, deterministic per seed."""
import numpy as np
import pytest

from bench.loadgen.arrivals import poisson_arrivals


@pytest.mark.parametrize("rate", [0.5, 2.0, 10.0])
def test_mean_inter_arrival_within_tolerance(rate):
    horizon = 4000.0 / rate  # ~4000 arrivals: the sample mean's relative std is ~1/sqrt(4000) = 1.6%
    ts = poisson_arrivals(rate, horizon, seed=1234)
    gaps = np.diff(np.concatenate([[0.0], ts]))
    assert abs(gaps.mean() * rate - 1.0) < 0.05
    assert abs(len(ts) / horizon / rate - 1.0) < 0.05
    # exponential gaps: std equals the mean (coefficient of variation 1)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08


def test_sorted_within_horizon_and_deterministic():
    a = poisson_arrivals(3.0, 100.0, seed=7)
    assert np.all(np.diff(a) > 0) and a[0] >= 0 and a[-1] < 100.0
    np.testing.assert_array_equal(a, poisson_arrivals(3.0, 100.0, seed=7))
    assert not np.array_equal(a[:10], poisson_arrivals(3.0, 100.0, seed=8)[:10])
    assert not np.array_equal(a[:10], poisson_arrivals(3.0, 100.0, seed=7, step=1)[:10])


def test_edge_cases():
    assert len(poisson_arrivals(1.0, 0.0, seed=0)) == 0
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, seed=0)
