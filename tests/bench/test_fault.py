"""``--fault``: flag parsing and the fault report's arithmetic on synthetic records with known answers."""
import pytest

from bench.loadgen.config import BenchConfig
from bench.loadgen.fault import fault_stats, format_fault
from bench.loadgen.runner import OK, RequestRecord


def test_fault_flag_parsing():
    assert BenchConfig(rps=(1,), fault="kill-decode@30s").fault_spec() == ("kill-decode", 30.0)
    assert BenchConfig(rps=(1,), fault="kill-prefill@2.5").fault_spec() == ("kill-prefill", 2.5)
    assert BenchConfig(rps=(1,)).fault_spec() is None
    for bad in ("kill-router@3s", "kill-decode", "kill-decode@-1s", "kill-decode@soon"):
        with pytest.raises(ValueError, match="KIND@SECONDS"):
            BenchConfig(rps=(1,), fault=bad)
    assert BenchConfig(rps=(1,), fault="drop-kv@30s").fault_spec() == ("drop-kv", 30.0)


def rec(t_send, chunks, status=OK, failovers=0, retries=0):
    r = RequestRecord(0, 10, len(chunks), t_send, t_send=t_send, t_first=chunks[0] if chunks else None,
                      t_end=chunks[-1] if chunks else t_send + 1, chunk_times=list(chunks),
                      chunk_tokens=[1] * len(chunks), status=status)
    r.failovers, r.retries = failovers, retries
    return r


def test_fault_stats_counts_and_penalties():
    fault = {"kind": "kill-decode", "planned_at_s": 5.0, "at_s": 5.0, "worker": "decode-1", "address": "a:1"}
    records = [
        rec(0.0, [0.1, 0.2, 0.3]),                           # done before the fault: undisturbed, ITL 0.1
        rec(4.0, [4.2, 4.3, 5.8, 5.9], failovers=1),         # in flight, failed over: 1.5 s gap
        rec(4.5, [4.6, 4.7, 5.2, 5.3], failovers=1),         # in flight, failed over: 0.5 s gap
        rec(4.8, [], status="UNAVAILABLE"),                  # in flight, failed
        rec(6.0, [6.4, 6.5], retries=1),                     # prefill retried: TTFT 0.4
        rec(7.0, [7.2, 7.3]),                                # after: undisturbed, TTFT 0.2, ITL 0.1
    ]
    f = fault_stats(fault, records)
    assert (f["in_flight_at_fault"], f["completed"], f["failed_over"], f["retried_prefill"], f["failed"],
            f["failed_in_flight"]) == (3, 5, 2, 1, 1, 1)
    assert f["ttft_p50_s"]["retried"] == pytest.approx(0.4)
    assert f["ttft_p50_s"]["undisturbed"] == pytest.approx(0.15)
    assert f["itl_s"]["failover_gap_max"] == pytest.approx(1.5)
    assert f["itl_s"]["failover_gap_p50"] == pytest.approx(1.0)
    assert f["itl_s"]["undisturbed_p50"] == pytest.approx(0.1)
    text = format_fault(f)
    assert "killed decode-1" in text and "failed over 2" in text and "failed 1 (1 of those in flight)" in text


def test_fault_not_injected_is_reported_not_hidden():
    f = fault_stats({"kind": "kill-decode", "planned_at_s": 3.0, "error": "no healthy decode worker reports a pid"},
                    [])
    assert "not injected: no healthy decode worker" in format_fault(f)
