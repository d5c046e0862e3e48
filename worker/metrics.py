"""A worker's Prometheus ``/metrics`` on its own port (``--metrics-port``; reported as ``info["metrics_port"]``
in its status, so ``Admin.GetClusterStatus`` lists where to scrape every worker).

Collected at scrape time from what the worker's ``GetStatus`` reports (one source of truth) plus the
worker's own counters, under vLLM's names with the ``pdserve:`` prefix and a ``worker`` label:
requests running / waiting / preempted, KV pool pages (total, free, ``kv_cache_usage_perc``), the prefix
cache (pages, hit and query tokens; with a host tier hit tokens and bytes per tier, ``{tier="device"|"host"}``, and
the lower tiers' load latency histograms),
tokens per second, KV transfers (bytes, seconds), and a speculating decode worker's accept length and
per-position acceptance rates. The scrape runs on prometheus_client's HTTP thread: it reads plain counters,
never waits for the scheduler.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from protos.pdserve.v1 import generation_pb2

logger = logging.getLogger(__name__)
P = "pdserve:"
INFO_GAUGES = {"preempted": ("num_requests_preempted", "Requests preempted and waiting to resume")}
"""WorkerStatus.info keys exported as gauges: key -> (name, help)."""


class Labelled(NamedTuple):
    """A metric's values by the values of one more label: ``Labelled("tier", {"device": 96, "host": 32})``."""
    label: str
    values: dict[str, float]


class Histogram(NamedTuple):
    """A histogram's figures by the values of one more label: ``{value: (cumulative (le, count) buckets, +Inf last;
    sum)}``, e.g. a load latency by tier."""
    label: str
    values: dict[str, tuple[list[tuple[str, float]], float]]


Values = dict[str, tuple["float | Labelled | Histogram", str]]
"""{name: (value, ``Labelled`` values or a ``Histogram``, help)}."""


class WorkerCollector:
    """``status()`` (the worker's WorkerStatus), ``counters()`` (monotonic totals) and ``gauges()`` (current
    values; both ``Values``) as metric families."""

    def __init__(self, status: Callable[[], generation_pb2.WorkerStatus], counters: Callable[[], Values],
                 gauges: Callable[[], Values] | None = None) -> None:
        self.status, self.counters, self.gauges = status, counters, gauges

    def collect(self):
        st = self.status()
        lab = [st.worker_id]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(P + name, doc, labels=["worker"])
            g.add_metric(lab, value)
            return g
        yield gauge("num_requests_running", "Requests running on this worker", st.running)
        yield gauge("num_requests_waiting", "Requests queued on this worker", st.queued)
        for key, (name, doc) in INFO_GAUGES.items():
            if key in st.info:
                yield gauge(name, doc, float(st.info[key]))
        yield gauge("kv_pages_total", "KV pool pages", st.pages_total)
        yield gauge("kv_pages_free", "KV pool pages free", st.pages_free)
        yield gauge("kv_cache_usage_perc", "Fraction of the KV pool in use (1 = full)",
                    1.0 - st.pages_free / st.pages_total if st.pages_total else 0.0)
        yield gauge("prefix_cache_pages", "KV pages held by the prefix cache", st.pages_cached)
        yield gauge("tokens_per_second", "Tokens per busy second since start", st.tokens_per_s)
        yield gauge("healthy", "1 when the worker reports itself healthy", 1.0 if st.healthy else 0.0)
        families = ((CounterMetricFamily, self.counters()), (GaugeMetricFamily, self.gauges() if self.gauges else {}))
        for kind, values in families:
            for name, (value, doc) in values.items():
                if isinstance(value, Histogram):
                    m = HistogramMetricFamily(P + name, doc, labels=["worker", value.label])
                    for key, (buckets, total) in value.values.items():
                        m.add_metric([st.worker_id, key], buckets, total)
                elif isinstance(value, Labelled):
                    m = kind(P + name, doc, labels=["worker", value.label])
                    for key, v in value.values.items():
                        m.add_metric([st.worker_id, key], v)
                else:
                    m = kind(P + name, doc, labels=["worker"])
                    m.add_metric(lab, value)
                yield m
        if st.HasField("spec"):
            yield gauge("spec_decode_accept_length", "Mean tokens per verify step", st.spec.accept_len)
            g = GaugeMetricFamily(P + "spec_decode_acceptance_rate_per_position",
                                  "Accepted / reached at each draft depth", labels=["worker", "position"])
            for i, rate in enumerate(st.spec.accept_rate_per_position):
                g.add_metric([st.worker_id, str(i)], rate)
            yield g


def serve_metrics(host: str, port: int, status, counters, gauges=None) -> int:
    """Start ``/metrics`` on ``host:port`` (0: any free port) in a daemon thread; returns the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(status, counters, gauges))
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
