"""Decode worker process: gRPC ``DecodeWorker`` service over a ``DecodeScheduler`` and a ``KVReceiver``.

    python -m decode.server --model DIR --port 50071 --kv-port 0 [--speculative 5/1/6 | --no-speculative]

``Reserve`` sets pages aside and returns a transfer ticket (RESOURCE_EXHAUSTED when they do not
fit, when ``--max-running`` requests are running or reserved, or while admitted requests wait for
pages: nothing is allocated); with the prefix cache (``--prefix-cache on``, decode-side reuse) it pins the
longest prefix of the prompt this worker still holds from a finished request and answers how many tokens that
is (``resident_tokens``): the ticket covers the rest, which is all the prefill worker ships. ``Decode`` waits for the complete, verified transfer, then joins the
continuous batch and streams tokens; cancelling it frees the request's pages.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import NamedTuple

import grpc
import msgpack
import torch

from common import logs
from common.flags import config_from_args
from common.net import check_bind
from common.reasons import AbortReason, FinishReason, Role
from decode import startup
from decode.admission import DecodeAdmission
from decode.config import DecodeConfig, DecodeWorkerConfig
from decode.scheduler import DecodeScheduler, DecodeTask, TokenEvent
from engine.defaults import default_model_dir
from engine.kvcache import PoolExhausted
from engine.fingerprint import model_hash
from engine.quant.prepare import expert_status, quantized_experts
from engine.speculative.cost import DraftCostModel
from engine.tokenizer import Tokenizer
from kvtransfer import DraftLayout, FailReason, KVReceiver, KVReceiverConfig, TransferError
from kvtransfer.config import TransportConfig, add_transport_args, receiver_mooncake_protocol
from protos import rpc
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from worker import boot, convert, heartbeat, omp, process
from worker.config import PREFIX_CACHE_CHOICES, add_worker_args
from worker.convert import logprob_to_proto, sampling_from_proto, spec_stats_to_proto
from worker.cache_events import CacheEventHub
from worker.metrics import Labelled, Values, serve_metrics
from worker.ranks import RankFailure

logger = logging.getLogger("decode.server")
SERVICE = "pdserve.v1.DecodeWorker"


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, sched: DecodeScheduler, receiver: KVReceiver, cfg, info: dict[str, str], worker_id: str,
                 address: str, mhash: str, speculator=None, model: generation_pb2.ModelInfo | None = None,
                 ranks=None) -> None:
        self.sched, self.receiver, self.cfg = sched, receiver, cfg
        self.admission: DecodeAdmission = sched.admission
        """The owner of every page (``decode.admission``): the servicer reserves, claims and cancels through it."""
        self.ranks = ranks
        """``worker.ranks.RankGroup`` of a tensor-parallel worker (None at tp 1): its failure is ours."""
        self.model = model
        """The model contract (``WorkerStatus.model``)."""
        self.info, self.worker_id, self.address, self.mhash = info, worker_id, address, mhash
        self.speculator = speculator
        """``engine.speculative.worker.MTPSpeculator`` when this worker speculates: its stats go in ``WorkerStatus.spec``."""
        self.loop = asyncio.get_running_loop()
        self.events = CacheEventHub(self.loop, self.snapshot)
        """The router's ``StreamCacheEvents`` subscribers: the prefix cache's stored / evicted pages."""

    async def Reserve(self, request, context):
        if request.num_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_tokens must be >= 1")
        self.admission.sweep_pins()  # prefixes of reservations that expired unclaimed go back to the cache
        refusal = self.sched.refusal(self.admission.num_reserved)
        if refusal:  # before anything is allocated, so before the prefill: the router tries the next worker
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker {self.worker_id} cannot take the "
                                                                        f"request: {refusal}")
        try:  # a refused reservation holds no page (the manager allocates last and frees on any error)
            res = self.admission.reserve(request.request_id, request.num_tokens, request.prompt_ids)
        except TransferError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.reason is FailReason.NO_CAPACITY \
                else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, f"cannot reserve {request.num_tokens} tokens of KV: {e}")
        except ValueError as e:  # a bad id, or one that already holds a reservation
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot reserve KV for this request: {e}")
        host, port = res.ticket.address
        return worker_pb2.ReserveResponse(ticket=worker_pb2.TransferTicket(
            request_id=request.request_id, target=f"{host}:{port}",
            ticket=msgpack.packb(res.ticket.to_dict(), use_bin_type=True), resident_tokens=res.resident_tokens))

    async def Decode(self, request, context):
        req_id = request.request_id
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            self.admission.cancel(req_id, "invalid sampling parameters")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        emit = lambda ev: self.loop.call_soon_threadsafe(queue.put_nowait, ev)  # noqa: E731
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        if request.local_prefill:
            await self._join_local(request, context, params, emit, deadline)
        else:
            await self._join_transfer(request, context, params, emit, deadline)
        try:
            while True:
                ev = coalesce(await queue.get(), queue)
                lost = ev.finish_reason == FinishReason.ERROR and self.rank_problem()
                if ev.token_ids or not lost:
                    yield worker_pb2.DecodeChunk(token_ids=ev.token_ids, finish_reason="" if lost else ev.finish_reason,
                                                 message=ev.message, accept_len=ev.accept_len,
                                                 logprobs=[logprob_to_proto(x) for x in ev.logprobs])
                if lost:  # the worker is lost, not the request: UNAVAILABLE makes the router fail it over
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id}: {lost}")
                if ev.finish_reason:
                    if ev.finish_reason == FinishReason.ERROR:
                        logger.warning("request %s ended with an error: %s", req_id, ev.message)
                    return
        finally:
            self.sched.abort(req_id, AbortReason.STREAM_CLOSED)  # no-op when already finished

    async def _join_local(self, request, context, params, emit, deadline: float | None) -> None:
        """Admit a request that prefills here (conditional disaggregation, aggregated mode)."""
        req_id, prompt = request.request_id, list(request.prompt_ids)
        bad = [t for t in prompt if t >= self.cfg.vocab_size]
        if not prompt or bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "local prefill needs a valid, non-empty prompt")
        if refusal := self.sched.refusal(self.admission.num_reserved):  # as Reserve: router tries the next
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker {self.worker_id}: {refusal}")
        task = DecodeTask(req_id, prompt, [], params, [], 0, emit=emit, deadline=deadline)
        try:
            self.sched.add_local(task)
        except PoolExhausted as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker full: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await context.send_initial_metadata(())  # taken: the router's admission queue moves on now, not
        # after the prompt's prefill (router.request: a refusal above ends the call instead)

    async def _join_transfer(self, request, context, params, emit, deadline: float | None) -> None:
        """Wait for the request's complete, verified KV transfer, claim its pages, and admit it."""
        req_id, prompt = request.request_id, list(request.prompt_ids)
        if not request.output_prefix:
            self.admission.cancel(req_id, "no first token")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "output_prefix must hold the first token")
        try:
            res = await self.admission.wait_transfer(req_id, request.transfer_timeout_s or 60.0)
        except TransferError as e:
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if e.reason is FailReason.TIMEOUT
                    else grpc.StatusCode.UNAVAILABLE)
            await context.abort(code, f"KV transfer for {req_id} failed: {e}")
        try:
            page_ids = await self.admission.claim(res)
        except PoolExhausted as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker full: {e}")
        except RankFailure as e:  # the router fails over
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id}: {e}")
        output = list(request.output_prefix)
        task = DecodeTask(req_id, prompt, output, params, page_ids,
                          cached_len=len(prompt) + len(output) - 1, emit=emit, deadline=deadline,
                          draft_hidden=draft_state(res.draft, self.receiver.config.draft, self.sched.pool.device))
        try:
            self.sched.add(task)
        except PoolExhausted as e:
            self.admission.release(task)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker full: {e}")

    def rank_problem(self) -> str:
        return self.ranks.problem() if self.ranks is not None else ""

    async def Abort(self, request, context):
        found = self.sched.abort(request.request_id, AbortReason.ROUTER)
        found = self.admission.cancel(request.request_id, AbortReason.ROUTER) or found
        return worker_pb2.AbortResponse(found=found)

    async def GetStatus(self, request, context):
        self.admission.sweep_pins()
        return self.status()

    async def StreamCacheEvents(self, request, context):
        async for ev in self.events.stream():
            yield ev

    def publish(self, stored: list[int], evicted: list[int]) -> None:
        """The prefix cache's changes (``RadixCache.on_event``, from the scheduler thread or the loop)."""
        self.events.publish(worker_pb2.CacheEvent(stored=stored, evicted=evicted))

    def snapshot(self) -> worker_pb2.CacheEvent:
        cache = self.admission.cache
        return worker_pb2.CacheEvent(reset=True, stored=cache.all_hashes() if cache is not None else [])

    def status(self) -> generation_pb2.WorkerStatus:
        st = self.sched.pool.stats()
        tps = self.sched.tokens_out / self.sched.busy_s if self.sched.busy_s else 0.0
        host, port = self.receiver.address
        problem = self.sched.health_problem() or self.rank_problem()
        spec = self.speculator
        return generation_pb2.WorkerStatus(
            worker_id=self.worker_id, role=Role.DECODE, address=self.address, kv_address=f"{host}:{port}",
            healthy=not problem, running=self.sched.num_running,
            queued=self.sched.num_pending + self.admission.num_reserved,  # admitted, KV on its way
            pages_total=st.num_pages, pages_free=self.admission.num_free, pages_cached=self.admission.num_cached,
            tokens_per_s=tps, model_hash=self.mhash, model=self.model,
            spec=spec_stats_to_proto(spec.stats(), str(spec.spec)) if spec is not None else None,
            info={**self.info, **self.admission.landing_info(), "preempted": str(self.sched.num_preempted), "preemptions": str(self.sched.preemptions),
                  "spec_fallbacks": str(self.sched.spec_fallbacks), **expert_status(self.sched.model),
                  **({"unhealthy": problem} if problem else {})})


    def counters(self) -> dict[str, tuple[float, str]]:
        """Monotonic totals for /metrics (``worker.metrics``)."""
        s = self.sched
        a = self.admission
        return {"generation_tokens": (s.tokens_out, "Tokens decoded (the first token of a request comes from "
                                      "its prefill)"),
                "prefix_cache_hit_tokens": (Labelled("tier", {"decode": a.reuse_hit_tokens}),
                                            "Prompt tokens found in the prefix cache, by tier (decode: resident on "
                                            "this decode worker at reservation, not shipped)"),
                "prefix_cache_queries": (a.reserved_tokens, "Prompt tokens of the reservations (looked up in the "
                                                            "decode prefix cache)"),
                "kv_received_bytes": (a.received_bytes, "KV bytes received from prefill workers"),
                "num_preemptions": (s.preemptions, "Requests preempted to free KV pages"),
                "spec_decode_fallbacks": (s.spec_fallbacks, "Requests switched from speculation to plain decoding"),
                **cost_model_values(self._cost_model()).counters}

    def _cost_model(self) -> DraftCostModel | None:
        return self.speculator.decoder.cost_model if self.speculator is not None else None

    def gauges(self) -> Values:
        """Current values for /metrics: the draft-length cost model's (none without one)."""
        return cost_model_values(self._cost_model()).gauges


class CostModelValues(NamedTuple):
    counters: Values
    gauges: Values


def cost_model_values(cm: DraftCostModel | None) -> CostModelValues:
    """/metrics of a speculating worker's draft-length cost model (``--spec-cost-model``; empty without one)."""
    if cm is None:
        return CostModelValues({}, {})
    return CostModelValues(
        {"spec_decode_steps_by_draft_tokens": (
            Labelled("num_drafts", {str(k): n for k, n in enumerate(cm.steps_by_drafts)}),
            "Speculative steps by the draft length the cost model chose (0: a plain step)"),
         "spec_decode_draft_length_changes": (cm.num_changes, "Changes of the cost model's best draft length")},
        {"spec_decode_draft_tokens": (cm.num_drafts, "Draft tokens of the last speculative step (cost model)"),
         "spec_decode_draft_accept_rate": (cm.accept_rate, "Per-draft acceptance the cost model uses")})


def draft_state(raw: bytes | None, layout: DraftLayout | None, device: torch.device) -> torch.Tensor | None:
    """The MTP draft state shipped with the KV (``DraftLayout``: verified raw values) as a ``[H]`` tensor."""
    if raw is None or layout is None:
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, layout.dtype)).to(device)


def coalesce(ev: TokenEvent, queue: asyncio.Queue) -> TokenEvent:
    """``ev`` merged with the events queued behind it, up to the last one: when the stream fell behind
    the scheduler, one message carries them all (the finishing event's reason and message, the newest
    accept length)."""
    while not ev.finish_reason and not queue.empty():
        nxt = queue.get_nowait()
        ev = TokenEvent(ev.token_ids + nxt.token_ids, nxt.finish_reason, nxt.message, ev.logprobs + nxt.logprobs,
                        nxt.accept_len)
    return ev


def stop_checker(tok: Tokenizer | None):
    """Stop strings: decode a window of the output big enough to hold the longest stop string."""
    if tok is None:
        return None

    def check(task: DecodeTask) -> str | None:
        window = max(len(s) for s in task.params.stop) + 16
        text = tok.decode(task.output_ids[-window:])
        return FinishReason.STOP if any(s in text for s in task.params.stop) else None
    return check


async def amain(wcfg: DecodeWorkerConfig, transport: TransportConfig) -> None:
    boot.apply_threads(wcfg.threads)
    model_dir = wcfg.model or default_model_dir()
    secret = rpc.cluster_secret(wcfg.cluster_secret)
    check_bind(wcfg.host, secret, "decode worker")
    mhash = model_hash(model_dir)
    if wcfg.expect_model_hash and wcfg.expect_model_hash != mhash:
        raise SystemExit(f"model hash mismatch: {model_dir} is {mhash}, cluster expects {wcfg.expect_model_hash}")
    weights_dir = wcfg.quantized_model or model_dir
    plan = boot.start_plan(wcfg, weights_dir, Role.DECODE)
    ranks = boot.start_ranks(wcfg, weights_dir, plan.dtype.dtype, Role.DECODE)
    # torch's start-up on a thread that then ends: the scheduler thread's OpenMP team stays the only one
    model, local_model, cfg, pool, landing, spec = await omp.in_own_thread(
        startup.load_decode_model, wcfg, weights_dir,
        mhash if weights_dir == model_dir else model_hash(weights_dir), plan, ranks)
    # a speculating worker asks prefill for the MTP draft state with every KV transfer (first round speculates)
    draft = DraftLayout(cfg.hidden_size, str(model.lm_head.weight.dtype).removeprefix("torch.")) if spec else None
    receiver = KVReceiver(landing, KVReceiverConfig(host=wcfg.host, port=wcfg.kv_port, draft=draft,
                                                     cluster_secret=secret.encode() if secret else None,
                                                     mooncake_protocol=receiver_mooncake_protocol(transport),
                                                     tp_size=wcfg.tp))
    await receiver.start()
    prefix_cache = wcfg.prefix_cache == "on"
    sched = DecodeScheduler(model, pool, cfg.eos_token_ids,
                            DecodeConfig(max_running=wcfg.max_running, spec_fallback=not wcfg.no_spec_fallback,
                                         prefill_chunk=wcfg.prefill_chunk, prefill_threads=wcfg.prefill_threads,
                                         prefill_budget=max(wcfg.prefill_chunk, wcfg.prefill_budget)),
                            stop_checker=stop_checker(Tokenizer.from_model_dir(model_dir)), spec=spec,
                            admission=DecodeAdmission(pool, receiver, ranks, prefix_cache=prefix_cache,
                                                      mtp=spec is not None))
    sched.heartbeat = heartbeat.Heartbeat(wcfg.stall_after)
    server = rpc.make_server(secret)
    port = boot.bind(server, wcfg, Role.DECODE)
    address = f"{wcfg.host}:{port}"
    model_info = convert.model_info(cfg, model_dir, wcfg.page_size)
    info = convert.model_info_strings(model_info)
    info.update(dtype=plan.dtype.dtype, kv_pool_bytes=str(plan.pool.pool_bytes), tp=str(wcfg.tp),
                rank_pids=",".join(map(str, ranks.pids)) if ranks is not None else "")
    info["gc_frozen_objects"] = str(process.freeze_startup_heap())  # everything is loaded: full collections skip it
    info["speculative"] = wcfg.speculative if spec is not None else "off"
    info["local_prefill"] = "1"
    info["decode_graphs"] = "compiled" if wcfg.compile else "eager"
    mx = sorted({m.spec.fmt.name for m in quantized_experts(local_model).values()})
    info["routed_experts"] = ",".join(mx) if mx else plan.dtype.dtype
    info["spec_fallback"] = "on" if spec is not None and sched.config.spec_fallback else "off"
    info["prefix_cache"] = "on" if prefix_cache else "off"
    servicer = DecodeServicer(sched, receiver, cfg, info, wcfg.worker_id or f"decode-{port}", address, mhash, spec,
                              model_info, ranks)
    if sched.admission.cache is not None:
        sched.admission.cache.on_event = servicer.publish
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    hs = rpc.add_health_and_reflection(server, [SERVICE])
    if ranks is not None:
        process.exit_on_rank_failure(ranks, wcfg.rank_failure_exit_s, lambda: rpc.set_serving(hs, [SERVICE], False))
    sched.start()
    await server.start()
    await rpc.set_serving(hs, [SERVICE])
    host, kv_port = receiver.address
    logger.info("decode worker %s serving on %s, KV data plane %s:%d", servicer.worker_id, address, host, kv_port)
    if wcfg.metrics_port:
        info["metrics_port"] = str(serve_metrics(wcfg.host, max(wcfg.metrics_port, 0), servicer.status,
                                                 servicer.counters, servicer.gauges))
    print(f"PDSERVE_READY decode {address} kv={host}:{kv_port}", flush=True)

    async def on_stop():
        sched.stop()
        await receiver.stop(grace_s=2.0)
        if ranks is not None:
            ranks.close()
    await process.serve_until_signal(server, on_stop, wcfg.grace_s, servicer.status, info)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of a decode worker: ``DecodeWorkerConfig``'s fields, ``TransportConfig``'s and logging's."""
    p = argparse.ArgumentParser("pdserve decode worker")
    add_worker_args(p, DecodeWorkerConfig, choices={"prefix_cache": PREFIX_CACHE_CHOICES})
    add_transport_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.setup_logging(args.log_level, args.log_format)
    process.run(amain(config_from_args(args, DecodeWorkerConfig), config_from_args(args, TransportConfig)))


if __name__ == "__main__":
    main()
