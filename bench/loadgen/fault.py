"""``pdserve bench --fault KIND@SECONDS``: break something during the first step and report what it cost.

The bench stays a pure gRPC client: it finds the victim through ``Admin.GetClusterStatus`` (workers
report their pid and host), and kills it with SIGKILL only when it runs on this host; ``drop-kv`` asks
the router (``Admin.InjectFault``) to have the busiest prefill worker cut its next KV connection
mid-transfer, which needs a cluster started with ``--fault-injection``. ``kv-slowloris`` attacks the KV
data plane's handshake: it holds ``SLOWLORIS_PER_WORKER`` connections that never authenticate open to every
decode worker's KV port (loopback addresses only) for the rest of the step, re-opening each one the
receiver closes, and closes them all when the step ends; requests must keep succeeding. ``slow-readers``
opens ``SLOW_READER_STREAMS`` ``Generate`` streams to the router that it never reads (``slowreader.py``)
and holds them until the step ends: the router must give their slots back after its
``stream_write_timeout_s`` and keep serving everyone else.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any, Sequence

import grpc

from bench.loadgen.runner import RequestRecord
from bench.loadgen.slowreader import SlowReaders
from bench.loadgen.stats import percentile
from common.net import is_loopback
from common.reasons import Role
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

SLOWLORIS_PER_WORKER = 80
"""kv-slowloris: connections held per KV port (more than the 64 that once locked every sender out)."""
SLOWLORIS_REOPEN_S = 1.0
"""kv-slowloris: pause before re-opening a connection the receiver closed (bounds the attempt rate)."""
SLOW_READER_STREAMS = 256
"""slow-readers: never-read streams (the router's default ``max_inflight``)."""
SLOW_READER_REOPEN_S = 0.02
"""slow-readers: pause before replacing a stream the router ended (refused or finished): the attack keeps
``SLOW_READER_STREAMS`` open (a 256-stream burst alone mostly meets a full prefill queue)."""


class KVSlowloris:
    """``num_per_port`` TCP connections to each of ``addresses`` that send nothing (a handshake that never
    comes), each re-opened ``reopen_s`` after the receiver closes it, until ``close()``."""

    def __init__(self, addresses: Sequence[tuple[str, int]], num_per_port: int, reopen_s: float) -> None:
        bad = [h for h, _ in addresses if not is_loopback(h)]
        if bad:
            raise ValueError(f"kv-slowloris attacks loopback addresses only, got {bad}")
        self.addresses, self.num_per_port, self.reopen_s = list(addresses), num_per_port, reopen_s
        self.num_opened = 0
        self.num_closed_by_receiver = 0
        self.num_connect_errors = 0
        self._tasks: list[asyncio.Task] = []
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._hold(a), name=f"kv-slowloris-{a[0]}:{a[1]}")
                       for a in self.addresses for _ in range(self.num_per_port)]

    async def _hold(self, address: tuple[str, int]) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(*address)
            except OSError:
                self.num_connect_errors += 1
                await asyncio.sleep(self.reopen_s)
                continue
            self.num_opened += 1
            self._writers.add(writer)
            try:
                while await reader.read(4096):  # an ERROR frame, then EOF: the receiver closed it
                    pass
                self.num_closed_by_receiver += 1
            except ConnectionError:
                self.num_closed_by_receiver += 1
            finally:
                self._writers.discard(writer)
                writer.close()
            await asyncio.sleep(self.reopen_s)

    async def close(self) -> dict[str, Any]:
        """Close every connection; what the attack did."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for w in list(self._writers):
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in self._writers), return_exceptions=True)
        self._writers.clear()
        return {"slow_connections_per_port": self.num_per_port, "slow_opened": self.num_opened,
                "slow_closed_by_receiver": self.num_closed_by_receiver,
                "slow_connect_errors": self.num_connect_errors}


class SlowReadersHolder:
    """``slow-readers`` held until the step ends (``close()``, like ``KVSlowloris``)."""

    def __init__(self, slow: SlowReaders) -> None:
        self.slow = slow

    async def close(self) -> dict[str, Any]:
        ended = self.slow.num_ended()  # HTTP/2 streams the router ended (it cannot send behind a full window)
        await asyncio.to_thread(self.slow.close)
        return {"slow_streams_opened": self.slow.num_opened, "slow_streams_ended_by_router": ended}


async def inject(channel: grpc.aio.Channel, metadata, kind: str, at_s: float, clock,
                 holders: list | None = None, target: str = "", api_key: str | None = None) -> dict[str, Any]:
    """Sleep ``at_s`` then SIGKILL the busiest ``kind`` worker (or arm ``drop-kv``, or start ``kv-slowloris``
    or ``slow-readers`` (to ``target``), appended to ``holders``: the caller closes it when the step ends);
    returns what was done (or why not)."""
    await asyncio.sleep(at_s)
    out: dict[str, Any] = {"kind": kind, "planned_at_s": at_s}
    if kind == "kv-slowloris":
        return await _start_slowloris(channel, metadata, out, clock, holders if holders is not None else [])
    if kind == "slow-readers":
        request = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=64))
        request.token_ids.ids.extend([2] * 16)
        slow = SlowReaders(target, SLOW_READER_STREAMS, request, api_key=api_key, reopen_s=SLOW_READER_REOPEN_S)
        try:
            await asyncio.to_thread(slow.start)
        except OSError as e:
            return {**out, "error": f"cannot connect to {target}: {e}"}
        if holders is not None:
            holders.append(SlowReadersHolder(slow))
        return {**out, "at_s": round(clock(), 3), "worker": "router", "address": target,
                "streams": SLOW_READER_STREAMS}
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


async def _start_slowloris(channel: grpc.aio.Channel, metadata, out: dict[str, Any], clock,
                           holders: list[KVSlowloris]) -> dict[str, Any]:
    try:
        st = await generation_pb2_grpc.AdminStub(channel).GetClusterStatus(
            generation_pb2.GetClusterStatusRequest(), metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as e:
        return {**out, "error": f"cluster status: {e.code().name} {e.details()}"}
    decode = [w for w in st.workers if w.role == Role.DECODE and w.kv_address]
    if not decode:
        return {**out, "error": "no decode worker reports a KV address"}
    addresses = []
    for w in decode:
        host, _, port = w.kv_address.rpartition(":")
        addresses.append((host.strip("[]"), int(port)))
    try:
        holder = KVSlowloris(addresses, SLOWLORIS_PER_WORKER, SLOWLORIS_REOPEN_S)
    except ValueError as e:
        return {**out, "error": str(e)}
    holder.start()
    holders.append(holder)
    return {**out, "at_s": round(clock(), 3), "worker": ",".join(w.worker_id for w in decode),
            "address": ",".join(w.kv_address for w in decode)}


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
                      "undisturbed_p50": _p50(itl_calm)},
            "first_ok_sent_after_s": min((r.t_send - t for r in records if r.ok and r.t_send is not None
                                          and r.t_send >= t), default=None)}


def format_fault(f: dict[str, Any] | None) -> str:
    if not f:
        return ""
    if "error" in f:
        return f"fault {f['kind']}@{f['planned_at_s']:g}s not injected: {f['error']}"
    if "completed" not in f:
        return f"fault {f['kind']}@{f['planned_at_s']:g}s: {f.get('note', 'not reached')}"

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f} ms"
    did = {"drop-kv": "armed a KV connection drop on",
           "kv-slowloris": f"held {f.get('slow_connections_per_port', '?')} slow unauthenticated connections "
                           "open to the KV port of",
           "slow-readers": f"opened {f.get('streams')} never-read streams to the"}.get(f["kind"], "killed")
    first_ok = f.get("first_ok_sent_after_s")
    slow = ""
    if "slow_opened" in f:
        slow = (f"\n  slow connections opened {f['slow_opened']}, closed by the receivers "
                f"{f['slow_closed_by_receiver']}, refused at connect {f['slow_connect_errors']}")
    return (f"fault {f['kind']} at {f['at_s']:.1f}s: {did} {f['worker']} ({f['address']}) with "
            f"{f['in_flight_at_fault']} requests in flight; first request sent after it that succeeded: "
            f"{'none' if first_ok is None else f'+{first_ok:.1f}s'}\n"
            f"  completed {f['completed']}, failed over {f['failed_over']}, prefill retried {f['retried_prefill']}, "
            f"failed {f['failed']} ({f['failed_in_flight']} of those in flight)\n"
            f"  TTFT p50: retried {ms(f['ttft_p50_s']['retried'])} vs undisturbed {ms(f['ttft_p50_s']['undisturbed'])}; "
            f"failover gap p50 {ms(f['itl_s']['failover_gap_p50'])} (max {ms(f['itl_s']['failover_gap_max'])}) "
            f"vs ITL p50 {ms(f['itl_s']['undisturbed_p50'])}" + slow)
