"""``pdserve bench --fault KIND@SECONDS``: break something during the first step and report what it cost.

The bench stays a pure gRPC client: it finds the victim through ``Admin.GetClusterStatus`` (workers
report their pid and host), and kills it with SIGKILL only when it runs on this host; ``drop-kv`` asks
the router (``Admin.InjectFault``) to have the busiest prefill worker cut its next KV connection
mid-transfer, which needs a cluster started with ``--fault-injection``.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any, Sequence

import grpc

from bench.loadgen.runner import RequestRecord
from bench.loadgen.stats import percentile
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc


async def inject(channel: grpc.aio.Channel, metadata, kind: str, at_s: float, clock) -> dict[str, Any]:
    """Sleep ``at_s`` then SIGKILL the busiest ``kind`` worker (or arm ``drop-kv``); returns what was done
    (or why not)."""
    await asyncio.sleep(at_s)
    out: dict[str, Any] = {"kind": kind, "planned_at_s": at_s}
    if kind == "drop-kv":
        try:
            r = await generation_pb2_grpc.AdminStub(channel).InjectFault(
                generation_pb2.InjectFaultRequest(kind=kind, count=1), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as e:
            return {**out, "error": f"InjectFault: {e.code().name} {e.details()}"}
        return {**out, "at_s": round(clock(), 3), "worker": r.worker_id, "address": r.address}
    role = kind.split("-", 1)[1]
    try:
        st = await generation_pb2_grpc.AdminStub(channel).GetClusterStatus(
            generation_pb2.GetClusterStatusRequest(), metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as e:
        return {**out, "error": f"cluster status: {e.code().name} {e.details()}"}
    workers = [w for w in st.workers if w.role == role and w.healthy and w.info.get("pid")]
    if not workers:
        return {**out, "error": f"no healthy {role} worker reports a pid"}
    victim = max(workers, key=lambda w: (w.running, int(w.info.get("router_inflight", "0") or 0)))
    host = socket.gethostname()
    if victim.info.get("host") != host:
        return {**out, "error": f"{victim.worker_id} runs on {victim.info.get('host')!r}, not on this host "
                               f"({host!r}): --fault kills local workers only"}
    os.kill(int(victim.info["pid"]), signal.SIGKILL)
    return {**out, "at_s": round(clock(), 3), "worker": victim.worker_id, "address": victim.address}


def _p50(values: Sequence[float]) -> float | None:
    return percentile(list(values), 50) if values else None


def _max_gap(r: RequestRecord) -> float | None:
    times = r.chunk_times
    return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None


def fault_stats(fault: dict[str, Any], records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Requests completed / failed over / failed around the fault, and the failover's latency penalty:
    TTFT p50 of requests whose prefill was retried vs the others, and the largest gap between chunks of
    the streams that failed over vs the ITL p50 of the undisturbed ones."""
    if "at_s" not in fault:
        return fault
    t = fault["at_s"]
    in_flight = [r for r in records if r.t_send is not None and r.t_send <= t and (r.t_end is None or r.t_end >= t)]
    moved = [r for r in records if r.ok and (r.failovers or r.retries)]
    calm = [r for r in records if r.ok and not (r.failovers or r.retries)]
    itl_calm = [b - a for r in calm for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    gaps = [g for g in (_max_gap(r) for r in moved if r.failovers) if g is not None]
    return {**fault,
            "in_flight_at_fault": len(in_flight),
            "completed": sum(r.ok for r in records),
            "failed_over": sum(bool(r.failovers) for r in moved),
            "retried_prefill": sum(bool(r.retries) for r in moved),
            "failed": sum(not r.ok for r in records),
            "failed_in_flight": sum(not r.ok for r in in_flight),
            "ttft_p50_s": {"retried": _p50([r.ttft_s for r in moved if r.retries and r.ttft_s is not None]),
                           "undisturbed": _p50([r.ttft_s for r in calm if r.ttft_s is not None])},
            "itl_s": {"failover_gap_p50": _p50(gaps), "failover_gap_max": max(gaps) if gaps else None,
                      "undisturbed_p50": _p50(itl_calm)}}


def format_fault(f: dict[str, Any] | None) -> str:
    if not f:
        return ""
    if "error" in f:
        return f"fault {f['kind']}@{f['planned_at_s']:g}s not injected: {f['error']}"
    if "completed" not in f:
        return f"fault {f['kind']}@{f['planned_at_s']:g}s: {f.get('note', 'not reached')}"

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f} ms"
    did = "armed a KV connection drop on" if f["kind"] == "drop-kv" else "killed"
    return (f"fault {f['kind']} at {f['at_s']:.1f}s: {did} {f['worker']} ({f['address']}) with "
            f"{f['in_flight_at_fault']} requests in flight\n"
            f"  completed {f['completed']}, failed over {f['failed_over']}, prefill retried {f['retried_prefill']}, "
            f"failed {f['failed']} ({f['failed_in_flight']} of those in flight)\n"
            f"  TTFT p50: retried {ms(f['ttft_p50_s']['retried'])} vs undisturbed {ms(f['ttft_p50_s']['undisturbed'])}; "
            f"failover gap p50 {ms(f['itl_s']['failover_gap_p50'])} (max {ms(f['itl_s']['failover_gap_max'])}) "
            f"vs ITL p50 {ms(f['itl_s']['undisturbed_p50'])}")
