"""Prefill worker process: gRPC ``PrefillWorker`` service over a ``PrefillScheduler``.

    python -m prefill.server --model DIR --port 50061 [--chunk-size 2048] [--max-queue 64] ...

``Prefill`` adds a task and awaits its result (first token, cached tokens, timings) while the
scheduler thread computes the KV and ``kvtransfer`` streams it to the decode worker named in the
ticket. Client cancellation and deadlines abort the task, which frees its pages at once.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc
import msgpack

from common import logs
from common.flags import config_from_args
from common.net import check_bind
from common.reasons import AbortReason, Role
from engine.defaults import default_model_dir
from engine.kvcache import KVPool, PoolExhausted
from engine.fingerprint import model_hash
from engine.memory import host_memory
from kvtransfer import KVSender, KVSenderConfig, TransferTicket, TransportKind
from kvtransfer.config import TransportConfig, add_transport_args
from prefill.disk_cache import DiskCache, plan_disk_cache
from prefill.host_cache import HostCache, HostCachePolicy, plan_host_cache
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig, PrefillWorkerConfig
from prefill.task import PrefillResult, PrefillTask, QueueFull, RequestAborted
from prefill.gather_sink import GatherSink
from prefill.sink import LocalSink, TransferFailed
from prefill.tier_metrics import tier_counters, tier_gauges, tier_info
from prefill.transfer import TransferSink
from protos import rpc
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from worker import boot, convert, heartbeat, omp, process
from worker.cache_events import CacheEventHub
from worker.config import HOST_CACHE_POLICIES, add_worker_args
from worker.convert import sampling_from_proto
from worker.metrics import Values, serve_metrics
from worker.model_proxy import load_rank_model

logger = logging.getLogger("prefill.server")
SERVICE = "pdserve.v1.PrefillWorker"
MAX_FAULTS = 1000
"""Most faults one InjectFault call may arm."""


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, sched: PrefillScheduler, sender: KVSender, cfg, info: dict[str, str], worker_id: str,
                 address: str, mhash: str, fault_injection: bool = False,
                 model: generation_pb2.ModelInfo | None = None, ranks=None) -> None:
        self.sched, self.sender, self.cfg, self.fault_injection = sched, sender, cfg, fault_injection
        self.ranks = ranks
        """``worker.ranks.RankGroup`` of a tensor-parallel worker (None at tp 1): its failure is ours."""
        self.model = model
        """The model contract (``WorkerStatus.model``)."""
        self.info, self.worker_id, self.address, self.mhash = info, worker_id, address, mhash
        self.loop = asyncio.get_running_loop()
        self.events = CacheEventHub(self.loop, self.snapshot)
        """The router's ``StreamCacheEvents`` subscribers."""
        self.kv_transfers, self.kv_bytes, self.kv_seconds = 0, 0, 0.0
        """KV transfers completed since start, their bytes and seconds (the /metrics counters)."""

    # called from scheduler threads
    def publish(self, stored: list[int], evicted: list[int]) -> None:
        self._publish(worker_pb2.CacheEvent(stored=stored, evicted=evicted))

    def publish_host(self, stored: list[int], evicted: list[int]) -> None:
        """The host tier's changes (``HostCache.on_event``)."""
        self._publish(worker_pb2.CacheEvent(host_stored=stored, host_evicted=evicted))

    def publish_disk(self, stored: list[int], evicted: list[int]) -> None:
        """The disk tier's changes (``DiskCache.on_event``, from its writer thread too)."""
        self._publish(worker_pb2.CacheEvent(disk_stored=stored, disk_evicted=evicted))

    def _publish(self, ev: worker_pb2.CacheEvent) -> None:
        self.events.publish(ev)

    def snapshot(self) -> worker_pb2.CacheEvent:
        """Everything every tier holds, as a reset event (a new subscriber's first, or after an overflow)."""
        host = self.sched.host
        disk = host.lower if host is not None else None
        return worker_pb2.CacheEvent(reset=True, stored=self.sched.cache.all_hashes(),
                                     host_stored=host.all_hashes() if host is not None else [],
                                     disk_stored=disk.all_hashes() if disk is not None else [])

    async def Prefill(self, request, context):
        ids = list(request.token_ids) + list(request.output_prefix)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        bad = [t for t in ids if t >= self.cfg.vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token id {bad[0]} outside the vocabulary (size {self.cfg.vocab_size})")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sink = LocalSink()
        remaining = context.time_remaining()
        if request.ticket.ticket:
            try:
                ticket = TransferTicket.from_dict(msgpack.unpackb(request.ticket.ticket, raw=False))
            except Exception as e:  # noqa: BLE001 - any malformed ticket is the caller's error
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed transfer ticket: {e}")
            # the receiver's DONE is awaited at most finish_timeout_s, and never past the request's deadline
            wait_s = self.sender.config.finish_timeout_s if remaining is None else \
                max(0.001, min(self.sender.config.finish_timeout_s, remaining))
            skip = request.ticket.resident_tokens  # the decode worker holds these already: only the rest ships
            if skip and (skip % self.sched.pool.page_size or ticket.num_tokens != len(ids) - skip):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the ticket's {ticket.num_tokens} tokens after {skip} resident ones (page "
                                    f"{self.sched.pool.page_size}) do not cover the {len(ids)}-token prompt")
            if self.sender.pool is not self.sched.pool:  # split KV heads: gathered whole at the end (GatherSink)
                sink = GatherSink(TransferSink(self.sender, ticket, self.sched.pool.layout.num_layers, wait_s),
                                  lambda pages, staged: self.ranks.gather_pages(
                                      self.sched.pool, pages, self.sender.pool, staged), self.sender.pool,
                                  self.sched.pool.layout.num_layers, len(ids) - skip, request.request_id, skip)
            else:
                sink = TransferSink(self.sender, ticket, self.sched.pool.layout.num_layers, wait_s, skip)
        fut = self.loop.create_future()
        task = PrefillTask(request.request_id, ids, params, sink=sink, priority=request.priority,
                           deadline=time.monotonic() + remaining if remaining is not None else None,
                           on_done=lambda r: self.loop.call_soon_threadsafe(_set, fut, r))
        try:
            self.sched.add(task)
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            res = await fut
        except asyncio.CancelledError:
            self.sched.abort(request.request_id, AbortReason.CLIENT_CANCELLED)
            raise
        if isinstance(res, PrefillResult):
            if res.transfer_bytes:
                self.kv_transfers += 1
                self.kv_bytes += res.transfer_bytes
                self.kv_seconds += res.transfer_s
            lp = generation_pb2.TokenLogprob(token_id=res.first_token, logprob=res.first_logprob or 0.0,
                                             top_ids=res.first_top[0], top_logprobs=res.first_top[1])
            return worker_pb2.PrefillResponse(
                request_id=res.req_id, first_token=res.first_token, cached_tokens=res.cached_tokens,
                queue_s=res.queue_s, prefill_s=res.prefill_s, transfer_s=res.transfer_s,
                transfer_bytes=res.transfer_bytes, first_logprob=lp)
        code, msg = _status_of(res)
        if self.rank_problem():  # the worker is lost, not the request: UNAVAILABLE makes the router retry
            code, msg = grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.worker_id}: {self.rank_problem()}"
        await context.abort(code, msg)

    def rank_problem(self) -> str:
        return self.ranks.problem() if self.ranks is not None else ""

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.sched.abort(request.request_id, AbortReason.ROUTER))

    async def GetStatus(self, request, context):
        return self.status()

    def status(self) -> generation_pb2.WorkerStatus:
        st = self.sched.pool.stats()
        c = self.sched.cache
        rate = c.hit_tokens / c.query_tokens if c.query_tokens else 0.0
        tps = self.sched.tokens_done / self.sched.busy_s if self.sched.busy_s else 0.0
        problem = self.sched.health_problem() or self.rank_problem()
        return generation_pb2.WorkerStatus(
            worker_id=self.worker_id, role=Role.PREFILL, address=self.address, healthy=not problem,
            running=self.sched.num_running, queued=self.sched.num_queued, pages_total=st.num_pages,
            pages_free=st.num_free, pages_cached=c.num_pages, cache_hit_rate=rate, tokens_per_s=tps,
            model_hash=self.mhash, model=self.model,
            info={**self.info, "pages_owned_by_requests": str(st.num_used - c.num_pages),
                  **({} if self.sender.pool is self.sched.pool else
                     {"kv_staging_pages_used": str(self.sender.pool.allocator.num_used)}),
                  "kv_drops_armed": str(self.sender.drops_armed), "kv_drops_fired": str(self.sender.drops_fired),
                  **tier_info(self.sched.host),
                  **({"unhealthy": problem} if problem else {})})

    def counters(self) -> Values:
        """Monotonic totals for /metrics (``worker.metrics``)."""
        c = self.sched.cache
        return {"prefix_cache_queries": (c.query_tokens, "Prompt tokens looked up in the prefix cache"),
                "prefix_cache_hits": (c.hit_tokens, "Prompt tokens found in the prefix cache (device tier)"),
                **tier_counters(c, self.sched.host),
                "prefill_tokens_computed": (self.sched.tokens_done, "Prompt tokens prefilled (cache misses)"),
                "kv_transfers": (self.kv_transfers, "KV transfers to decode workers"),
                "kv_transfer_bytes": (self.kv_bytes, "KV bytes shipped to decode workers"),
                "kv_transfer_seconds": (self.kv_seconds, "Seconds spent shipping KV")}

    def gauges(self) -> Values:
        """Current values for /metrics: the prefix cache's bytes per tier."""
        return tier_gauges(self.sched.cache, self.sched.host, self.sched.pool.layout.bytes_per_page())

    async def InjectFault(self, request, context):
        """``drop-kv``: cut the KV connection of each of the next ``count`` transfers mid-transfer."""
        if not self.fault_injection:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"fault injection is off on {self.worker_id}: start it with --fault-injection")
        if request.kind != "drop-kv":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a prefill worker injects 'drop-kv' only, not {request.kind!r}")
        count = request.count or 1
        if count > MAX_FAULTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count {count} > {MAX_FAULTS}")
        armed = self.sender.inject_drop(count)
        logger.warning("fault injection: the next %d KV transfers lose their connection (%d pending)", count, armed)
        return generation_pb2.InjectFaultResponse(worker_id=self.worker_id, address=self.address, armed=armed,
                                                  fired=self.sender.drops_fired)

    async def StreamCacheEvents(self, request, context):
        async for ev in self.events.stream():
            yield ev


def _set(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RequestAborted):
        if exc.reason == AbortReason.DEADLINE:
            return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
        if exc.reason == AbortReason.SHUTDOWN:  # the worker, not the request: the router retries it elsewhere
            return grpc.StatusCode.UNAVAILABLE, f"prefill worker shutting down: {exc}"
        return grpc.StatusCode.CANCELLED, str(exc)
    if isinstance(exc, PoolExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt does not fit the prefill KV pool: {exc}"
    if isinstance(exc, TransferFailed):
        return grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}"
    return grpc.StatusCode.INTERNAL, f"prefill failed: {exc}"


async def amain(wcfg: PrefillWorkerConfig, transport: TransportConfig) -> None:
    boot.apply_threads(wcfg.threads)
    model_dir = wcfg.model or default_model_dir()
    secret = rpc.cluster_secret(wcfg.cluster_secret)
    check_bind(wcfg.host, secret, "prefill worker")
    mhash = model_hash(model_dir)
    if wcfg.expect_model_hash and wcfg.expect_model_hash != mhash:
        raise SystemExit(f"model hash mismatch: {model_dir} is {mhash}, cluster expects {wcfg.expect_model_hash}")
    plan = boot.start_plan(wcfg, model_dir, Role.PREFILL)
    ranks = boot.start_ranks(wcfg, model_dir, plan.dtype.dtype, Role.PREFILL)
    # torch's start-up on a thread that then ends: the scheduler thread's OpenMP team stays the only one
    model, cfg, pool, staging = await omp.in_own_thread(load_prefill_model, wcfg, model_dir, mhash, plan, ranks)
    sender = KVSender(staging, KVSenderConfig(cluster_secret=secret.encode() if secret else None,
                                              transport=TransportKind(transport.kv_transport),
                                              mooncake_protocol=transport.mooncake_protocol, tp_size=wcfg.tp))
    sched = PrefillScheduler(model, pool, PrefillConfig(chunk_size=wcfg.chunk_size,
                                                        max_batch_tokens=max(wcfg.chunk_size, wcfg.max_batch_tokens),
                                                        max_queue=wcfg.max_queue, load_timeout_s=wcfg.load_timeout_s),
                             host_cache=build_host_cache(wcfg, pool, plan.pool.pool_bytes))
    server = rpc.make_server(secret)
    port = boot.bind(server, wcfg, Role.PREFILL)
    address = f"{wcfg.host}:{port}"
    model_info = convert.model_info(cfg, model_dir, wcfg.page_size)
    info = convert.model_info_strings(model_info)
    info.update(dtype=plan.dtype.dtype, kv_pool_bytes=str(plan.pool.pool_bytes), tp=str(wcfg.tp),
                rank_pids=",".join(map(str, ranks.pids)) if ranks is not None else "")
    info["gc_frozen_objects"] = str(process.freeze_startup_heap())  # everything is loaded: full collections skip it
    servicer = PrefillServicer(sched, sender, cfg, info,
                               wcfg.worker_id or f"prefill-{port}", address, mhash, wcfg.fault_injection, model_info,
                               ranks)
    sched.cache.on_event = servicer.publish
    if sched.host is not None:
        sched.host.on_event = servicer.publish_host
    if sched.host is not None and sched.host.lower is not None:
        sched.host.lower.on_event = servicer.publish_disk
    sched.heartbeat = heartbeat.Heartbeat(wcfg.stall_after)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    hs = rpc.add_health_and_reflection(server, [SERVICE])
    if ranks is not None:
        process.exit_on_rank_failure(ranks, wcfg.rank_failure_exit_s, lambda: rpc.set_serving(hs, [SERVICE], False))
    sched.start()
    await server.start()
    await rpc.set_serving(hs, [SERVICE])
    logger.info("prefill worker %s serving on %s (model %s, hash %s)", servicer.worker_id, address, model_dir, mhash)
    if wcfg.metrics_port:
        info["metrics_port"] = str(serve_metrics(wcfg.host, max(wcfg.metrics_port, 0), servicer.status,
                                                 servicer.counters, servicer.gauges))
    print(f"PDSERVE_READY prefill {address}", flush=True)

    async def on_stop():
        sched.stop()
        if sched.host is not None:
            sched.host.close()  # the disk tier's writer finishes what is queued
        sender.close(grace_s=2.0)
        if ranks is not None:
            ranks.close()
    await process.serve_until_signal(server, on_stop, wcfg.grace_s, servicer.status, info)


def load_prefill_model(wcfg: PrefillWorkerConfig, model_dir: str, mhash: str, plan, ranks):
    """A prefill worker's torch start-up -> (model, config, KV pool, staging pool). ``amain`` runs it on a thread of
    its own (``worker.omp``)."""
    model, _, cfg, layout = load_rank_model(model_dir, plan.dtype.dtype, wcfg.device, plan.layout, ranks, mhash)
    pool = KVPool(layout, plan.pool.num_pages, model.lm_head.weight.device)
    # split KV heads (GQA under TP): KV leaves whole, gathered from every rank into a full-layout staging pool
    staging = pool if ranks is None or not ranks.kv_split else \
        KVPool(plan.layout, max(1, plan.pool.num_pages // wcfg.tp), model.lm_head.weight.device)
    return model, cfg, pool, staging


def build_host_cache(wcfg: PrefillWorkerConfig, pool: KVPool, pool_bytes: int) -> HostCache | None:
    """The prefix cache's host tier as ``--host-cache-bytes`` sizes it (None: off)."""
    size = plan_host_cache(wcfg.host_cache_bytes, pool.layout.bytes_per_page(), pool_bytes,
                           host_memory().available_bytes)
    if size.num_pages and wcfg.tp > 1:  # each rank holds its own pool: a restore would have to reach every rank
        logger.warning("host prefix cache off: not implemented for --tp %d (%s)", wcfg.tp, size.reason)
        return None
    logger.info("host prefix cache: %d pages, %s (%s)", size.num_pages, size.reason, wcfg.host_cache_policy)
    disk = plan_disk_cache(wcfg.disk_cache_dir, wcfg.disk_cache_bytes)
    if not size.num_pages:
        if disk.capacity_bytes:
            logger.warning("disk prefix cache off: it sits below the host tier, which is off")
        return None
    host = HostCache(pool, size.num_pages, HostCachePolicy(wcfg.host_cache_policy))
    if disk.capacity_bytes:
        logger.info("disk prefix cache: %s, %s", wcfg.disk_cache_dir, disk.reason)
        host.lower = DiskCache(wcfg.disk_cache_dir, disk.capacity_bytes, host.store, pool)
    return host


def build_parser() -> argparse.ArgumentParser:
    """Every flag of a prefill worker: ``PrefillWorkerConfig``'s fields, ``TransportConfig``'s and logging's."""
    p = argparse.ArgumentParser("pdserve prefill worker")
    add_worker_args(p, PrefillWorkerConfig, choices={"host_cache_policy": HOST_CACHE_POLICIES})
    add_transport_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.setup_logging(args.log_level, args.log_format)
    process.run(amain(config_from_args(args, PrefillWorkerConfig), config_from_args(args, TransportConfig)))


if __name__ == "__main__":
    main()
