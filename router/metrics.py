"""The router's Prometheus metrics (``GET /metrics`` on its HTTP port) and its access log.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``pdserve:time_to_first_token_seconds``) so
dashboards built for vLLM need only the prefix changed. Every public request is counted once, however it
ends: refused before it ran (``RouterMetrics.refused``) or served (``RouterMetrics.start`` -> ``Observed``),
and each served one writes one access-log line (logger ``router.access``) when it ends.

Each ``RouterMetrics`` has its own ``CollectorRegistry``: two routers in one process (tests) never share
counters.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protos.pdserve.v1 import generation_pb2
from router.validate import ValidRequest

access_log = logging.getLogger("router.access")
PREFIX = "pdserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class RouterMetrics:
    """Counters and histograms of every request through this router (gRPC and HTTP alike)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series beside every counter (vLLM turns them off too)
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "requests", "Requests that ended, by gRPC status and front door",
                                ["status", "api"], registry=r)
        self.success = Counter(p + "request_success", "Requests that finished, by finish reason",
                               ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens found in a prefix cache",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens streamed to clients", registry=r)
        self.failovers = Counter(p + "request_failovers", "Decode streams resumed on another worker", registry=r)
        self.retries = Counter(p + "request_retries", "Prefills retried on another worker", registry=r)
        self.kv_bytes = Counter(p + "kv_transfer_bytes", "KV bytes shipped prefill -> decode", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in flight through the router", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Router receive -> first token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between streamed chunks", registry=r,
                             buckets=ITL_BUCKETS)
        self.tpot = Histogram(p + "request_time_per_output_token_seconds", "(E2E - TTFT) / (tokens - 1) of a "
                              "request", registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Router receive -> last token", registry=r,
                             buckets=E2E_BUCKETS)
        self.queue = Histogram(p + "request_queue_time_seconds", "Time in prefill queues", registry=r,
                               buckets=E2E_BUCKETS)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting in the router's admission queue for "
                             "decode room", registry=r)
        self.router_queue = Histogram(p + "router_queue_time_seconds", "Time a request waited in the router's "
                                      "admission queue for decode room (part of its TTFT)", registry=r,
                                      buckets=TTFT_BUCKETS)
        self.rejected_by = Counter(p + "requests_rejected", "Requests refused for load, by reason (queue_full, "
                                   "no_queue, deadline, never_fits, max_inflight)", ["reason"], registry=r)
        self.kv_seconds = Histogram(p + "kv_transfer_seconds", "KV transfer time of a request", registry=r,
                                    buckets=TTFT_BUCKETS)

    def refused(self, req_id: str, code: grpc.StatusCode, api: str, why: str = "") -> None:
        """A request that never ran (invalid, unknown model, over capacity, no workers)."""
        self.requests.labels(code.name, api).inc()
        access_log.info("request %s api=%s status=%s refused before it ran: %s", req_id or "-", api, code.name,
                        why, extra={"fields": {"request_id": req_id, "api": api, "status": code.name,
                                               "error": why}})

    def queue_changed(self, num_waiting: int) -> None:
        """The admission queue's length changed (``router.admission``)."""
        self.waiting.set(num_waiting)

    def rejected(self, reason: str) -> None:
        """A request refused for load (``router.admission.Rejection``)."""
        self.rejected_by.labels(str(reason)).inc()

    def start(self, run: ObservedRun, api: str) -> "Observed":
        return Observed(self, run, api)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ObservedRun(Protocol):
    """What the metrics read of a served request (``router.request.GenerateRun``)."""

    client_req_id: str
    """The id the client gave (or one made up for it): what the access log names."""
    t0: float
    """``time.monotonic()`` when the request arrived."""
    cached_tokens: int
    original: ValidRequest
    metrics: generation_pb2.RequestMetrics


class Observed:
    """One served request: chunk times while it streams, every figure once when it ends."""

    def __init__(self, m: RouterMetrics, run: ObservedRun, api: str) -> None:
        self.m, self.run, self.api = m, run, api
        self.finish = ""
        self.last_chunk: float | None = None
        self.num_tokens = 0
        m.running.inc()

    def chunk(self, resp: generation_pb2.GenerateResponse) -> None:
        now = time.monotonic()
        if resp.token_ids:
            if self.last_chunk is not None:
                self.m.itl.observe(now - self.last_chunk)
            self.last_chunk = now
            self.num_tokens += len(resp.token_ids)
        if resp.finish_reason:
            self.finish = resp.finish_reason

    def end(self, code: grpc.StatusCode) -> None:
        m, run, rm = self.m, self.run, self.run.metrics
        m.running.dec()
        e2e = time.monotonic() - run.t0
        m.requests.labels(code.name, self.api).inc()
        prompt = len(run.original.prompt_ids)
        m.prompt_tokens.inc(prompt)
        m.cached_tokens.inc(run.cached_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.failovers.inc(rm.failovers)
        m.retries.inc(rm.retries)
        m.kv_bytes.inc(rm.kv_transfer_bytes)
        if rm.kv_transfer_bytes:
            m.kv_seconds.observe(rm.kv_transfer_s)
        if rm.ttft_s > 0 or rm.router_queue_s > 0:  # a request that waited and then failed waited too
            m.router_queue.observe(rm.router_queue_s)
        if rm.ttft_s > 0:
            m.ttft.observe(rm.ttft_s)
            m.queue.observe(rm.queue_s)
        if code is grpc.StatusCode.OK:
            m.success.labels(self.finish).inc()
            m.e2e.observe(e2e)
            if self.num_tokens > 1:
                m.tpot.observe((e2e - rm.ttft_s) / (self.num_tokens - 1))
        f = {"request_id": run.client_req_id, "api": self.api, "status": code.name, "finish_reason": self.finish,
             "prompt_tokens": prompt, "cached_tokens": run.cached_tokens, "completion_tokens": self.num_tokens,
             "ttft_ms": round(rm.ttft_s * 1e3, 1), "router_queue_ms": round(rm.router_queue_s * 1e3, 1), "e2e_ms": round(e2e * 1e3, 1), "prefill_worker": rm.prefill_worker,
             "decode_worker": rm.decode_worker, "retries": rm.retries, "failovers": rm.failovers}
        access_log.info(
            "request %s api=%s status=%s finish=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "ttft_ms=%.1f router_queue_ms=%.1f e2e_ms=%.1f prefill=%s decode=%s retries=%d failovers=%d",
            run.client_req_id, self.api, code.name, self.finish or "-", prompt, run.cached_tokens, self.num_tokens,
            rm.ttft_s * 1e3, rm.router_queue_s * 1e3, e2e * 1e3, rm.prefill_worker or "-", rm.decode_worker or "-", rm.retries, rm.failovers,
            extra={"fields": f})
