"""The workers the router sends requests to: channels, health, load, and cache contents.

Every worker is polled with ``GetStatus`` every ``health_interval_s`` (timeout ``health_timeout_s``). A worker enters
the rotation on its first good answer and leaves after ``unhealthy_after`` failed polls, or at once when a request
call to it fails and a quick probe confirms it is gone; the next good poll puts it back. A worker serving a different
model (hash) than the first one seen stays out.

Each prefill worker's ``StreamCacheEvents`` feeds the shared ``PrefixIndex``, each decode worker's ``decode_index``
(decode-side reuse); when the stream breaks the worker's blocks are dropped (nothing stale is trusted) and the stream
is reopened with backoff; its first event after (re)connecting is a snapshot.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

import grpc

from common.reasons import Role
from protos import rpc, tls
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.policy import Candidate
from router.prefix_index import PrefixIndex
from router.validate import ModelInfo

logger = logging.getLogger(__name__)
DRAINING = "draining: removed from the cluster"
"""``Worker.excluded`` of a worker on its way out (live discovery removed it)."""
WORKER_CHANNEL_OPTIONS = rpc.CHANNEL_OPTIONS + [
    # reconnect within ~a second of a restarted worker coming back (gRPC's default backoff grows to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000)]


class Call(Protocol):
    """What ``Worker.track`` needs of a call: to be told when it ends (``grpc.aio.Call``, ``Span``)."""

    def add_done_callback(self, callback: Callable[..., object], /) -> None: ...


C = TypeVar("C", bound=Call)


class Span:
    """One call to a worker made of several RPCs, for ``Worker.track``: a request's stay at a decode worker
    runs from its Reserve through the prefill elsewhere to the end of its Decode stream. ``end()`` runs the
    done callbacks at once (so the count is down before the next routing decision), and only the first time."""

    __slots__ = ("_callbacks", "ended")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Span], object]] = []
        self.ended = False

    def add_done_callback(self, callback: Callable[[Span], object], /) -> None:
        if self.ended:
            callback(self)
        else:
            self._callbacks.append(callback)

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


@dataclass(eq=False)
class Worker:
    role: str
    """``Role.PREFILL`` or ``Role.DECODE``."""
    address: str
    """gRPC host:port (one process may serve both roles on one port)."""
    channel: grpc.aio.Channel
    stub: object
    healthy: bool = False
    failures: int = 0
    status: generation_pb2.WorkerStatus | None = None
    inflight: int = 0
    """Calls this router has outstanding at the worker (prefill: Prefill calls; decode: requests from their
    reservation to the end of their stream). Only ever changed through ``track()``."""
    last_error: str = ""
    last_ok_s: float = 0.0
    excluded: str = ""
    """Why the worker is kept out of rotation whatever its health (model mismatch), or ""."""
    live_calls: set = field(default_factory=set)
    """Request calls in flight there that should end when the worker leaves the rotation (it stopped
    answering polls or says it cannot serve): they are cancelled then, not left to their deadline."""
    dropped_calls: set = field(default_factory=set)
    """The ones cancelled that way (their owner turns the cancellation into UNAVAILABLE and retries)."""
    refused_at: float = 0.0
    """time.monotonic() of its last refusal of a request for room (decode: a full Reserve or local prefill); the
    next status poll after it wakes the admission queue (room freed out of this router's sight)."""
    suspended_until: float = 0.0
    """time.monotonic() until which new requests avoid the worker if another one is healthy (one of its
    streams stalled: its health poll may still answer while its scheduler is stuck)."""

    @property
    def key(self) -> str:
        """The worker's key in the router (stable, unique): role/host:port."""
        return f"{self.role}/{self.address}"

    def track(self, call: C) -> C:
        """Count ``call`` as one call of this router in flight at the worker until it ends; returns it.

        ``call`` is anything that reports its end to ``add_done_callback``: a gRPC call, or a ``Span`` of
        several (a request's stay at a decode worker, ``GenerateRun._stay_at``). The count is taken now and
        released by that callback, which gRPC runs however the call ends: a response, an error, a deadline, a
        cancellation by the client or by the router (``end()`` for a span). No path between the count and the
        call can leak it: a leaked count skews routing for good."""
        self.inflight += 1
        call.add_done_callback(self._call_ended)
        return call

    def _call_ended(self, _call: object) -> None:
        self.inflight -= 1

    @property
    def name(self) -> str:
        return self.status.worker_id if self.status is not None and self.status.worker_id else self.address

    def candidate(self) -> Candidate:
        st = self.status
        polled = (st.running + st.queued) if st is not None else 0
        return Candidate(self.key, max(self.inflight, polled),
                         st.pages_free if st is not None else 0, st.pages_total if st is not None else 0,
                         st is not None and st.info.get("local_prefill", "1") != "0")


@dataclass
class Registry:
    cfg: RouterConfig
    secret: str | None = None
    on_change: Callable[[], None] | None = None
    """Called (on the loop) whenever a worker enters or leaves the rotation."""
    on_room: Callable[[], None] | None = None
    """Called (on the loop) when a decode worker may have room it did not have: its status shows more free pages or
    fewer requests than the last one, or it is the first since the worker refused a request for room (what freed it may
    be out of this router's sight), or it entered or left the rotation (the admission queue's wake-up)."""
    index: PrefixIndex = field(default_factory=PrefixIndex)
    decode_index: PrefixIndex = field(default_factory=PrefixIndex)  # decode workers' prefix caches
    workers: dict[str, Worker] = field(default_factory=dict)
    model_hash: str = ""
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _first_poll: dict[str, asyncio.Event] = field(default_factory=dict)
    _info_src: generation_pb2.WorkerStatus | None = None
    _info: ModelInfo | None = None
    _info_warned: set[str] = field(default_factory=set)
    _member_tasks: dict[str, list[asyncio.Task]] = field(default_factory=dict)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return rpc.auth_metadata(self.secret)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        for role, addrs, stub_cls in ((Role.PREFILL, self.cfg.prefill, worker_pb2_grpc.PrefillWorkerStub),
                                      (Role.DECODE, self.cfg.decode, worker_pb2_grpc.DecodeWorkerStub)):
            for addr in addrs:
                ch = tls.channel(addr, self.cfg.tls, WORKER_CHANNEL_OPTIONS)
                w = Worker(role, addr, ch, stub_cls(ch))
                if w.key in self.workers:
                    raise ValueError(f"{role} worker {addr} listed twice")
                self.workers[w.key] = w
                self._first_poll[w.key] = asyncio.Event()
                self._spawn(self._poll_loop(w), f"poll {addr}")
                self._spawn(self._events_loop(w), f"cache events {addr}")

    async def wait_first_poll(self, timeout_s: float) -> list[str]:
        """Wait until every worker answered once (or failed to); returns the keys of those that never did."""
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._first_poll.values())), timeout_s)
        except asyncio.TimeoutError:
            pass
        return [w.key for w in self.workers.values() if not w.healthy]

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for w in self.workers.values():
            await w.channel.close(grace=None)

    def _spawn(self, coro, name: str) -> None:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- membership (live discovery) ---------------------------------------------------------------
    def add_worker(self, role: str, address: str) -> Worker:
        """Start polling a worker that joined after start (it enters the rotation on its first good poll).
        Adding a worker that is being removed takes it back."""
        key = f"{role}/{address}"
        w = self.workers.get(key)
        if w is not None:
            if w.excluded == DRAINING:
                w.excluded = ""
                logger.info("%s worker %s is back: no longer draining", role, address)
            return w
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == Role.PREFILL else worker_pb2_grpc.DecodeWorkerStub
        ch = tls.channel(address, self.cfg.tls, WORKER_CHANNEL_OPTIONS)
        w = Worker(role, address, ch, stub_cls(ch))
        self.workers[key] = w
        self._first_poll[key] = asyncio.Event()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._poll_loop(w), name=f"poll {address}")]
        tasks.append(loop.create_task(self._events_loop(w), name=f"cache events {address}"))
        for t in tasks:
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        self._member_tasks[key] = tasks
        logger.info("%s worker %s added", role, address)
        return w

    def remove_worker(self, key: str, drain_timeout_s: float) -> None:
        """Take a worker out of the rotation now; forget it once the calls this router has at it ended
        (or ``drain_timeout_s`` passed), and not before ``rpc_timeout_s`` (a request may hold its key)."""
        w = self.workers.get(key)
        if w is None or w.excluded == DRAINING:
            return
        w.excluded = DRAINING
        logger.info("%s worker %s (%s) is draining (%d calls in flight)", w.role, w.name, w.address, w.inflight)
        if self.on_change is not None:
            self.on_change()
        self._spawn(self._forget_when_drained(w, drain_timeout_s), f"drain {w.address}")

    async def _forget_when_drained(self, w: Worker, drain_timeout_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < min(self.cfg.rpc_timeout_s, drain_timeout_s) or \
                (w.inflight > 0 and time.monotonic() - t0 < drain_timeout_s):
            await asyncio.sleep(0.1)
            if w.excluded != DRAINING:  # added back meanwhile
                return
        for t in self._member_tasks.pop(w.key, []):
            t.cancel()
        self.workers.pop(w.key, None)
        self._first_poll.pop(w.key, None)
        self.index_of(w).drop(w.key)
        await w.channel.close(grace=None)
        logger.info("%s worker %s removed", w.role, w.address)

    # -- queries -----------------------------------------------------------------------------------
    def healthy(self, role: str) -> list[Worker]:
        """Workers of ``role`` that take new requests (a draining one finishes its own, takes no new ones)."""
        return [w for w in self.workers.values() if w.role == role and w.healthy and not w.excluded and
                not (w.status is not None and w.status.info.get("draining") == "1")]

    def model_info(self) -> ModelInfo | None:
        """From the first healthy worker that reports it (prefill preferred: its page size is the index's).
        Parsed once per status poll of that worker (this runs several times per request)."""
        for role in (Role.PREFILL, Role.DECODE):
            for w in self.healthy(role):
                if self._info_src is w.status:
                    return self._info
                try:
                    info = ModelInfo.from_status(w.status)
                except ValueError as e:
                    if w.key not in self._info_warned:
                        self._info_warned.add(w.key)
                        logger.warning("worker %s: %s", w.address, e)
                    continue
                self._info_src, self._info = w.status, info
                return info
        return None

    async def wait_model_info(self, timeout_s: float) -> ModelInfo | None:
        """``model_info()`` once a worker reported it, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (info := self.model_info()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return info

    def serving(self) -> bool:
        """A healthy decode worker and a healthy prefill worker (unless ``aggregated``: decode workers prefill)."""
        return (self.cfg.aggregated or bool(self.healthy(Role.PREFILL))) and bool(self.healthy(Role.DECODE))

    # -- health ------------------------------------------------------------------------------------
    async def poll_once(self, w: Worker, timeout_s: float | None = None) -> bool:
        try:
            st = await w.stub.GetStatus(worker_pb2.StatusRequest(), metadata=self.metadata,
                                        timeout=timeout_s or self.cfg.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._set_failed(w, f"{e.code().name}: {e.details()}", immediate=False)
            return False
        before, last_ok, w.status, w.last_ok_s = w.status, w.last_ok_s, st, time.monotonic()
        if w.role == Role.DECODE and before is not None and self.on_room is not None and \
                (st.pages_free > before.pages_free or st.running + st.queued < before.running + before.queued or
                 w.refused_at > last_ok):
            self.on_room()
        self._check_model(w, st.model_hash)
        if not st.healthy:  # it answers, but says it cannot serve (scheduler dead or stalled)
            self._set_failed(w, "reports unhealthy: " + (st.info.get("unhealthy") or "no reason given"),
                             immediate=True)
            return False
        w.failures, w.last_error = 0, ""
        self._set_healthy(w, True)
        return True

    def _check_model(self, w: Worker, mhash: str) -> None:
        if not mhash:
            return
        if not self.model_hash:
            self.model_hash = mhash
        if mhash != self.model_hash and not w.excluded:
            w.excluded = f"serves model {mhash}, the cluster serves {self.model_hash}"
            logger.error("worker %s left out of rotation: %s", w.address, w.excluded)

    def suspend(self, w: Worker, why: str, seconds: float) -> None:
        """Route new requests away from ``w`` for ``seconds`` while another worker of its role is healthy
        (it stalled a stream; its health polls may still pass)."""
        w.suspended_until = time.monotonic() + seconds
        w.last_error = why
        logger.warning("%s worker %s (%s) avoided for %.0fs: %s", w.role, w.name, w.address, seconds, why)

    async def confirm_failure(self, w: Worker, err: str) -> None:
        """A request call failed as if the worker were gone: probe at once and take it out if so."""
        if not await self.poll_once(w, timeout_s=min(1.0, self.cfg.health_timeout_s)):
            self._set_failed(w, err, immediate=True)

    def _set_failed(self, w: Worker, err: str, immediate: bool) -> None:
        w.failures += 1
        w.last_error = err
        if immediate or w.failures >= self.cfg.unhealthy_after:
            self._set_healthy(w, False)

    def _set_healthy(self, w: Worker, healthy: bool) -> None:
        first = self._first_poll.get(w.key)
        if first is not None and (healthy or w.failures >= self.cfg.unhealthy_after):
            first.set()
        if w.healthy == healthy:
            return
        w.healthy = healthy
        if healthy:
            logger.info("%s worker %s (%s) is in rotation", w.role, w.name, w.address)
        else:
            logger.warning("%s worker %s (%s) is out of rotation: %s", w.role, w.name, w.address, w.last_error)
            for call in list(w.live_calls):
                w.dropped_calls.add(call)
                call.cancel()
        if self.on_change is not None:
            self.on_change()
        if w.role == Role.DECODE and self.on_room is not None:
            self.on_room()

    async def _poll_loop(self, w: Worker) -> None:
        while True:
            t0 = time.monotonic()
            await self.poll_once(w)
            await asyncio.sleep(max(0.0, self.cfg.health_interval_s - (time.monotonic() - t0)))

    # -- cache events ------------------------------------------------------------------------------
    def index_of(self, w: Worker) -> PrefixIndex:
        return self.index if w.role == Role.PREFILL else self.decode_index

    async def _events_loop(self, w: Worker) -> None:
        backoff, index = 0.1, self.index_of(w)
        while True:
            call = w.stub.StreamCacheEvents(worker_pb2.CacheEventsRequest(), metadata=self.metadata)
            try:
                async for ev in call:
                    index.apply(w.key, ev.stored, ev.evicted, ev.reset, ev.host_stored, ev.host_evicted,
                                ev.disk_stored, ev.disk_evicted)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                logger.debug("cache event stream of %s broke: %s", w.address, e.code().name)
            finally:
                call.cancel()
            index.drop(w.key)
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    # -- admin -------------------------------------------------------------------------------------
    async def live_status(self, timeout_s: float = 2.0) -> list[generation_pb2.WorkerStatus]:
        """Every worker's status, asked now (last known, marked unhealthy, when it does not answer)."""
        async def one(w: Worker) -> generation_pb2.WorkerStatus:
            ok = await self.poll_once(w, timeout_s)
            st = generation_pb2.WorkerStatus()
            if w.status is not None:
                st.CopyFrom(w.status)
            st.address = w.address
            st.role = st.role or w.role
            st.worker_id = st.worker_id or w.address
            st.healthy = ok and w.healthy and not w.excluded
            st.info["router_inflight"] = str(w.inflight)
            st.info["router_cached_blocks"] = str(self.index_of(w).num_blocks(w.key))
            if w.last_error:
                st.info["router_last_error"] = w.last_error
            if w.excluded:
                st.info["router_excluded"] = w.excluded
            return st
        return list(await asyncio.gather(*(one(w) for w in self.workers.values())))
