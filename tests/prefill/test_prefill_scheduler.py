"""Prefill scheduler + radix prefix cache on a tiny GLM-5 model with an MTP layer."""
import threading
import time
from concurrent.futures import Future

import grpc
import pytest
import torch

from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.sampling import SamplingParams
import prefill.scheduler as ps
from engine.shapes import bucket_chunks, row_bucket
from common.reasons import AbortReason
from prefill.scheduler import PrefillScheduler
from prefill.server import _status_of
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, PrefillTask, QueueFull, RequestAborted
from prefill.sink import KVSink, SinkResult, TransferFailed, resolved

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tiny_glm5_dir):
    return load_model(tiny_glm5_dir, "float32", "cpu")


class CaptureSink(KVSink):
    """Copies out the KV the request would ship (all layers, all prompt tokens) when it finishes."""

    def __init__(self, pool):
        self.pool, self.sent = pool, []

    def start(self, pages, cached_len):
        self.pages, self.cached_len = pages, cached_len

    def send(self, layer, s, e):
        self.sent.append((layer, s, e))

    def finish(self, draft=None):
        self.draft = draft
        P = self.pool.page_size
        n = max(e for _, _, e in self.sent)
        slots = torch.tensor([self.pages[j // P] * P + j % P for j in range(n)])
        self.kv = {(l, c.name): self.pool.flat(l, c.name)[slots].clone()
                   for l in range(self.pool.layout.num_layers) for c in self.pool.layout.components}
        return resolved(SinkResult(0, 0.0))

    def abort(self, reason):
        self.aborted = reason


def make_sched(tiny, num_pages=64, **kw):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, PAGE, "float32"), num_pages)
    return PrefillScheduler(model, pool, PrefillConfig(**{"chunk_size": 32, "max_batch_tokens": 64, **kw}))


def run_all(sched, tasks, max_steps=200):
    for t in tasks:
        sched.add(t)
    for _ in range(max_steps):
        if not sched.step() and not sched._tasks:
            break


def task(req_id, ids, results, sched=None, **kw):
    return PrefillTask(req_id, ids, SamplingParams(max_tokens=8), on_done=lambda r: results.__setitem__(req_id, r),
                       **kw)


def test_same_prompt_twice_hits_cache_with_identical_kv_and_first_token(tiny):
    sched = make_sched(tiny)
    ids = torch.randint(2, 500, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    res, s1, s2 = {}, CaptureSink(sched.pool), CaptureSink(sched.pool)
    start_free = sched.pool.allocator.num_free
    run_all(sched, [task("a", ids, res, sink=s1)])
    done_tokens = sched.tokens_done
    run_all(sched, [task("b", ids, res, sink=s2)])
    a, b = res["a"], res["b"]
    assert isinstance(a, PrefillResult) and a.cached_tokens == 0
    assert b.cached_tokens == 96 and sched.tokens_done - done_tokens == 4  # only the tail recomputed
    assert a.first_token == b.first_token
    for key in s1.kv:
        assert torch.allclose(s1.kv[key], s2.kv[key], atol=1e-5), key
    # the MTP layer's KV was computed and shipped too
    n_layers = sched.pool.layout.num_layers
    assert any(l == n_layers - 1 for l, _, _ in s1.sent) and s1.kv[(n_layers - 1, "latent")].abs().sum() > 0
    # pages: all either free or held by the cache, none by a request
    assert sched.pool.allocator.num_free + sched.cache.num_pages == start_free
    assert set(sched.pool.allocator.owners()) <= {"radix"}


def test_shared_60pct_prefix_computes_only_the_rest(tiny):
    sched = make_sched(tiny)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, 500, (96,), generator=g).tolist()
    a = prefix + torch.randint(2, 500, (64,), generator=g).tolist()
    b = prefix + torch.randint(2, 500, (64,), generator=g).tolist()
    res = {}
    run_all(sched, [task("a", a, res)])
    before = sched.tokens_done
    run_all(sched, [task("b", b, res)])
    assert res["b"].cached_tokens == 96 and sched.tokens_done - before == 64


def test_cached_first_token_equals_cold(tiny):
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(2, 500, (64,), generator=g).tolist()
    b = prefix + torch.randint(2, 500, (40,), generator=g).tolist()
    warm, cold, res_w, res_c = make_sched(tiny), make_sched(tiny), {}, {}
    run_all(warm, [task("a", prefix + [7] * 30, res_w)])
    run_all(warm, [task("b", b, res_w)])
    run_all(cold, [task("b", b, res_c)])
    assert res_w["b"].cached_tokens == 64 and res_w["b"].first_token == res_c["b"].first_token


def test_eviction_under_pressure_keeps_correctness(tiny):
    sched = make_sched(tiny, num_pages=12)  # 12 pages = 192 tokens: each 100-token prompt needs 7
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (100,), generator=g).tolist() for _ in range(4)]
    res, ref = {}, {}
    for i, p in enumerate(prompts):
        run_all(sched, [task(f"r{i}", p, res)])
    for i, p in enumerate(prompts):
        fresh = make_sched(tiny)
        run_all(fresh, [task(f"r{i}", p, ref)])
        assert res[f"r{i}"].first_token == ref[f"r{i}"].first_token
    assert sched.pool.allocator.num_free + sched.cache.num_pages == 12
    run_all(sched, [task("again", prompts[3], res)])  # the most recent one survived eviction
    assert res["again"].cached_tokens == 96


def test_batched_requests_match_solo(tiny):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (70, 33, 5)]
    sched, res = make_sched(tiny), {}
    run_all(sched, [task(f"r{i}", p, res) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        solo = {}
        run_all(make_sched(tiny), [task("x", p, solo)])
        assert solo["x"].first_token == res[f"r{i}"].first_token


def test_cancel_and_deadline_free_every_page(tiny):
    sched = make_sched(tiny, chunk_size=16, max_batch_tokens=16)
    start = sched.pool.allocator.num_free
    res = {}
    ids = list(range(2, 202))
    sched.add(task("c", ids, res))
    sched.add(task("d", ids[::-1], res, deadline=time.monotonic() + 0.05))
    sched.add(task("q", ids, res))  # still queued when aborted
    sched.step()
    assert sched.pool.allocator.num_used > 0
    assert sched.abort("c") and sched.abort("q")
    time.sleep(0.06)
    for _ in range(30):
        sched.step()
    assert isinstance(res["c"], RequestAborted) and isinstance(res["q"], RequestAborted)
    assert isinstance(res["d"], RequestAborted) and "deadline" in res["d"].reason
    assert sched.pool.allocator.num_free == start and not sched._tasks


def test_full_queue_is_refused(tiny):
    sched = make_sched(tiny, max_queue=2)
    res = {}
    sched.add(task("a", [3, 4, 5], res))
    sched.add(task("b", [3, 4, 5], res))
    with pytest.raises(QueueFull):
        sched.add(task("c", [3, 4, 5], res))


def test_prompt_that_can_never_fit_fails_cleanly(tiny):
    from engine.kvcache import PoolExhausted
    sched, res = make_sched(tiny, num_pages=4), {}
    run_all(sched, [task("big", list(range(2, 200)), res), task("small", [5, 6, 7], res)])
    assert isinstance(res["big"], PoolExhausted) and isinstance(res["small"], PrefillResult)


def test_threaded_loop_serves_concurrent_submissions(tiny):
    sched = make_sched(tiny)
    sched.start()
    done = threading.Event()
    res = {}

    def cb(r, req_id):
        res[req_id] = r
        if len(res) == 3:
            done.set()
    for i in range(3):
        sched.add(PrefillTask(f"t{i}", list(range(2, 40 + i)), SamplingParams(), on_done=lambda r, i=i: cb(r, f"t{i}")))
    assert done.wait(30)
    sched.stop()
    assert all(isinstance(r, PrefillResult) for r in res.values())


def test_a_failure_after_the_transfer_still_answers_the_caller(tiny, monkeypatch):
    """A bug while the finished request's pages go back to the cache must still reach on_done (the
    gRPC call would otherwise wait out its whole deadline)."""
    sched, res = make_sched(tiny), {}

    def broken_insert(*a, **kw):
        raise RuntimeError("injected cache failure")
    monkeypatch.setattr(sched.cache, "insert", broken_insert)
    run_all(sched, [task("r", list(range(2, 60)), res)])
    assert isinstance(res["r"], RuntimeError) and "injected" in str(res["r"]) and not sched._tasks


class GateSink(CaptureSink):
    """Holds the scheduler thread inside its step (in ``start``) until ``gate`` is set."""

    def __init__(self, pool):
        super().__init__(pool)
        self.entered, self.gate = threading.Event(), threading.Event()

    def start(self, pages, cached_len):
        self.entered.set()
        assert self.gate.wait(30)
        super().start(pages, cached_len)


def test_a_cancelled_queued_request_leaves_the_queue_at_once(tiny):
    """Issue 25: a cancelled request kept its queue slot (and its caller waited) until the next step,
    which a long forward can hold off for seconds."""
    sched, res = make_sched(tiny, max_queue=1), {}
    start = sched.pool.allocator.num_free
    sched.start()
    try:
        gate = GateSink(sched.pool)
        sched.add(task("busy", list(range(2, 60)), res, sink=gate))
        assert gate.entered.wait(30)  # the scheduler thread is inside a step now, and stays there
        sched.add(task("queued", list(range(2, 40)), res))
        with pytest.raises(QueueFull):
            sched.add(task("refused", [3, 4, 5], res))
        assert sched.abort("queued", "cancelled by the client")
        assert isinstance(res.get("queued"), RequestAborted) and "cancelled" in res["queued"].reason
        assert sched.num_queued == 0 and "queued" not in sched._tasks
        sched.add(task("next", [3, 4, 5], res))  # the slot is free again
        gate.gate.set()
        deadline = time.monotonic() + 30
        while len(res) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(res["busy"], PrefillResult) and isinstance(res["next"], PrefillResult)
    finally:
        gate.gate.set()
        sched.stop()
    assert sched.pool.allocator.num_free + sched.cache.num_pages == start and not sched._tasks


class HeldSink(CaptureSink):
    """Finishes its transfer only once ``done`` is set (a decode worker slow to acknowledge)."""

    def __init__(self, pool):
        super().__init__(pool)
        self.finishing, self.done = threading.Event(), threading.Event()

    def finish(self, draft=None):
        self.finishing.set()
        res, acked = super().finish(draft).result(), Future()

        def ack():  # the receiver's acknowledgement arrives on another thread, later
            assert self.done.wait(30)
            acked.set_result(res)
        threading.Thread(target=ack, daemon=True).start()
        return acked


def test_a_request_waits_for_the_pages_a_transfer_holds(tiny):
    """Pages held by a request still transferring come back when its transfer ends: a request that needs them
    waits for them, and is not failed as one that can never fit (it was: RESOURCE_EXHAUSTED on a small pool under
    load, when no other request happened to be running)."""
    sched, res = make_sched(tiny, num_pages=8), {}
    held = HeldSink(sched.pool)
    sched.start()
    try:
        sched.add(task("a", list(range(2, 102)), res, sink=held))  # 7 of the 8 pages
        assert held.finishing.wait(30)
        sched.add(task("b", list(range(300, 400)), res))  # 7 pages too: only after a's transfer
        time.sleep(0.3)
        assert "b" not in res and sched.num_queued == 1
        held.done.set()
        deadline = time.monotonic() + 30
        while len(res) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(res["a"], PrefillResult) and isinstance(res["b"], PrefillResult)
    finally:
        held.done.set()
        sched.stop()
    assert sched.pool.allocator.num_free + sched.cache.num_pages == 8


class UnackedSink(CaptureSink):
    """A transfer whose receiver never acknowledges: ``finish``'s future resolves only when the test acks it or the
    scheduler aborts the sink (which fails it, as ``KVSender.cancel`` does)."""

    def __init__(self, pool, timeout_s=None):
        super().__init__(pool)
        self.timeout_s, self.acked, self.aborted = timeout_s, None, None

    def finish(self, draft=None):
        res, self.acked = super().finish(draft).result(), Future()
        self.result = res
        return self.acked

    def ack(self):
        self.acked.set_result(self.result)

    def abort(self, reason):
        self.aborted = reason
        if self.acked is not None and not self.acked.done():
            self.acked.set_exception(TransferFailed(f"cancelled: {reason}"))


def wait_for(pred, timeout_s=30.0):
    until = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < until:
        time.sleep(0.01)
    assert pred()


def test_transfers_awaiting_acks_hold_no_thread_and_are_answered_when_acked(tiny):
    """A finished prefill hands its KV to the sink and the scheduler goes on: 8 transfers wait for their receivers
    at once without a thread each (a pool of 4 finisher threads used to wait on them, so a fifth one's FINISH was
    not even sent before one of the four was acknowledged); each is answered when its ack arrives."""
    sched, res = make_sched(tiny, num_pages=64), {}
    sinks = [UnackedSink(sched.pool) for _ in range(8)]
    sched.start()
    threads = threading.active_count()
    try:
        for i, sink in enumerate(sinks):
            sched.add(task(f"r{i}", list(range(2 + 40 * i, 30 + 40 * i)), res, sink=sink))
        wait_for(lambda: all(s.acked is not None for s in sinks))  # every FINISH out, none acknowledged
        assert not res and threading.active_count() == threads
        for sink in sinks[::-1]:
            sink.ack()
        wait_for(lambda: len(res) == 8)
        assert all(isinstance(r, PrefillResult) for r in res.values()) and not sched._tasks
    finally:
        sched.stop()
    assert sched.pool.allocator.num_free + sched.cache.num_pages == 64


@pytest.mark.parametrize("limit", ["sink timeout", "deadline", "stop"])
def test_a_transfer_never_acknowledged_is_cancelled_and_answered(tiny, limit):
    """No thread waits on a transfer, so its bounds are the scheduler's: past the sink's ``timeout_s`` it fails
    (TransferFailed: UNAVAILABLE, the router retries), past the request's deadline it is aborted as a deadline, and
    ``stop`` cancels it; each time the sink is aborted and every page comes back."""
    sched, res = make_sched(tiny, num_pages=16), {}
    sink = UnackedSink(sched.pool, timeout_s=0.2 if limit == "sink timeout" else None)
    sched.start()
    try:
        deadline = time.monotonic() + 1.0 if limit == "deadline" else None
        sched.add(task("r", list(range(2, 40)), res, sink=sink, deadline=deadline))
        wait_for(lambda: sink.acked is not None)
        if limit == "stop":
            sched.stop()
        wait_for(lambda: "r" in res)
    finally:
        sched.stop()
    if limit == "sink timeout":
        assert isinstance(res["r"], TransferFailed) and sink.aborted == "KV transfer not acknowledged within 0.2s"
    else:
        reason = AbortReason.DEADLINE if limit == "deadline" else AbortReason.SHUTDOWN
        assert isinstance(res["r"], RequestAborted) and res["r"].reason == reason and sink.aborted
    assert not sched._tasks and sched.pool.allocator.num_free + sched.cache.num_pages == 16


@pytest.fixture(scope="module")
def tiny_bf16(tiny_glm5_dir):
    return load_model(tiny_glm5_dir, "bfloat16", "cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_steps_take_bucketed_token_counts(tiny, tiny_bf16, dtype, monkeypatch):
    """A bf16 model on CPU prefills in steps whose token count is a row bucket (``engine.shapes``: each new
    GEMM shape costs a kernel build), trimming the last chunk and carrying the rest to the next step; every
    request still completes its whole prompt and every page comes back. fp32 steps keep their lengths."""
    model, cfg = tiny_bf16 if dtype == "bfloat16" else tiny
    pool = KVPool(KVLayout.for_model(cfg, PAGE, dtype), 64)
    sched = PrefillScheduler(model, pool, PrefillConfig(chunk_size=32, max_batch_tokens=64))
    assert sched.bucketed == (dtype == "bfloat16")
    totals, real = [], ps.prefill_forward

    def spy(model, pool, plan, *a, **k):
        totals.append(sum(len(c.token_ids) for c in plan))
        return real(model, pool, plan, *a, **k)
    monkeypatch.setattr(ps, "prefill_forward", spy)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (37, 50, 23, 45)]
    start, res = pool.allocator.num_free, {}
    run_all(sched, [task(f"r{i}", p, res) for i, p in enumerate(prompts)])
    assert all(isinstance(res[f"r{i}"], PrefillResult) for i in range(len(prompts)))
    assert sum(totals) == sum(map(len, prompts))  # every prompt token computed once
    bucketed = [t == row_bucket(t, torch.device("cpu")) for t in totals]
    if dtype == "bfloat16":
        assert all(bucketed), totals
    else:
        assert not all(bucketed), totals  # the check bites: unbucketed totals occur here
    sched.cache.evict(10 ** 6)  # the prefix cache holds the prompts' pages: give them back
    assert pool.allocator.num_free == start and not sched._tasks


def test_bucket_chunks_trims_from_the_end():
    a, b, c = object(), object(), object()
    assert bucket_chunks([(a, 0, 32), (b, 0, 32)]) == [(a, 0, 32), (b, 0, 32)]  # 64: a bucket
    assert bucket_chunks([(a, 0, 32), (b, 0, 20), (c, 5, 8)]) == [(a, 0, 32), (b, 0, 20)]  # 55 -> 52: c waits
    assert bucket_chunks([(a, 10, 47)]) == [(a, 10, 46)]  # 37 -> 36
    assert bucket_chunks([(a, 0, 5)]) == [(a, 0, 5)]


def test_the_grpc_status_of_each_ending():
    """What the prefill worker answers for each way a request ends: a shutdown is the worker's, not the request's
    (UNAVAILABLE, which the router retries on another worker: queued, running and transferring requests alike)."""
    assert _status_of(RequestAborted("r", AbortReason.SHUTDOWN))[0] is grpc.StatusCode.UNAVAILABLE
    assert _status_of(RequestAborted("r", AbortReason.DEADLINE))[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert _status_of(RequestAborted("r", AbortReason.CLIENT_CANCELLED))[0] is grpc.StatusCode.CANCELLED
    assert _status_of(TransferFailed("x"))[0] is grpc.StatusCode.UNAVAILABLE
