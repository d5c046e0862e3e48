"""Decode-side prefix reuse (issue 45), over the real pieces in one process: a prefill scheduler shipping through a
real ``KVSender`` / ``TransferSink`` over loopback TCP into a ``KVReceiver``, the decode worker's page owner
(``DecodeAdmission`` with its prefix cache) and its scheduler, speculating with the MTP layer on the tiny GLM-5.

A session's turns: turn t + 1's prompt is turn t's prompt + every token it returned + a new user chunk. With reuse
the decode worker keeps each finished turn's final full pages; the next reservation pins them and prefill ships
only the tail. The greedy tokens are the same as with reuse off, and the bytes shipped are the tail's."""
from __future__ import annotations

import random

import pytest
import torch

from decode.admission import DecodeAdmission
from decode.scheduler import DecodeConfig, DecodeScheduler, DecodeTask
from decode.server import draft_state
from engine.checkpoint import init_random_model
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig
from engine.speculative.worker import MTPSpeculator
from kvtransfer import DraftLayout, FailReason, KVReceiver, KVReceiverConfig, KVSender, KVSenderConfig, LoopThread, TransferError
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, PrefillTask
from prefill.transfer import TransferSink
from shared_helpers import TINY_GQA_MTP

P = 16
SECRET = b"test-cluster-secret-0123456789"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread: prefill, decode and the data plane's threads share this process, and a second OpenMP
    team in it throttles every step (``worker.omp``: 60x slower here); a worker process has one team."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["glm_moe_dsa+mtp", "glm4_moe"])
def tiny(request, tiny_glm5_dir, tmp_path_factory):
    """(model, cfg, speculation) - the tiny GLM-5 speculating with its MTP layer; a tiny glm4_moe decoding plainly."""
    if request.param == "glm_moe_dsa+mtp":
        model, cfg = load_model(tiny_glm5_dir, "float32", "cpu")
        return model, cfg, "3/1/4"
    d = init_random_model(TINY_GQA_MTP, str(tmp_path_factory.mktemp("tiny_gqa")), seed=2)
    model, cfg = load_model(d, "float32", "cpu")
    return model, cfg, None


class Cluster:
    """One prefill scheduler, one decode worker's admission + scheduler, the KV data plane between them; the test
    is the router (``serve`` runs one request the way ``router.request`` does: Reserve, Prefill, Decode)."""

    def __init__(self, tiny, reuse: bool, decode_pages: int = 64, **rx) -> None:
        model, cfg, spec = tiny
        layout = KVLayout.for_model(cfg, P, "float32")
        self.ppool, self.dpool = KVPool(layout, 64), KVPool(layout, decode_pages)
        self.pre = PrefillScheduler(model, self.ppool, PrefillConfig(chunk_size=32, max_batch_tokens=64))
        self.sender = KVSender(self.ppool, KVSenderConfig(cluster_secret=SECRET))
        self.lt = LoopThread("test-decode-rx")
        self.draft = DraftLayout(cfg.hidden_size, "float32") if spec else None
        self.rx = KVReceiver(self.dpool, KVReceiverConfig(cluster_secret=SECRET, draft=self.draft, **rx))
        self.lt.run(self.rx.start())
        self.admission = DecodeAdmission(self.dpool, self.rx, prefix_cache=reuse, mtp=spec is not None)
        speculator = MTPSpeculator(model, cfg, self.dpool, SpecConfig.parse(spec)) if spec else None
        self.dec = DecodeScheduler(model, self.dpool, cfg.eos_token_ids, DecodeConfig(spec_fallback=False),
                                   spec=speculator, admission=self.admission)
        self.vocab = cfg.vocab_size
        self.accept: list[float] = []
        """Per request: its speculative accept length (tokens per round; 0 without speculation)."""
        self.shipped: list[tuple[int, int, int]] = []
        """Per request: (prompt tokens, resident tokens, KV bytes received)."""

    def reserve(self, req_id: str, ids: list[int]):
        async def on_loop():  # the servicer's Reserve runs on the receiver's loop
            self.admission.sweep_pins()
            return self.admission.reserve(req_id, len(ids), ids)
        return self.lt.run(on_loop())

    def cancel(self, req_id: str) -> bool:
        async def on_loop():  # as the servicer's Abort
            return self.admission.cancel(req_id, "test")
        return self.lt.run(on_loop())

    def prefill(self, req_id: str, ids: list[int], r) -> PrefillResult:
        out = {}
        sink = TransferSink(self.sender, r.ticket, self.ppool.layout.num_layers, 30.0, r.resident_tokens)
        self.pre.add(PrefillTask(req_id, ids, SamplingParams(max_tokens=1), sink=sink,
                                    on_done=lambda res: out.__setitem__("r", res)))
        while "r" not in out:
            self.pre.step()
        return out["r"]

    def serve(self, req_id: str, ids: list[int], max_tokens: int = 12) -> list[int]:
        """One request through the cluster -> the tokens it returned (the first one included)."""
        r = self.reserve(req_id, ids)
        first = self.prefill(req_id, ids, r)
        assert isinstance(first, PrefillResult), first
        res = self.lt.run(self.admission.wait_transfer(req_id, 30.0))
        pages = self.lt.run(self.admission.claim(res))
        self.shipped.append((len(ids), r.resident_tokens, res.num_bytes))
        events = []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.dec.add(DecodeTask(req_id, ids, [first.first_token], params, pages, len(ids), emit=events.append,
                                draft_hidden=draft_state(res.draft, self.draft, self.dpool.device)))
        for _ in range(200):
            if events and events[-1].finish_reason:
                break
            self.dec.step()
        assert events[-1].finish_reason == "length", events[-1]
        self.accept.append(events[-1].accept_len)
        return [first.first_token] + [t for e in events for t in e.token_ids]

    def session(self, name: str, turns: int, seed: int, system: list[int] | None = None, user_len: int = 21,
                evict_before: set[int] = frozenset()) -> list[list[int]]:
        """A session's turns -> the tokens each returned; before the turns in ``evict_before`` the decode prefix
        cache is emptied (what eviction for other requests does)."""
        g = random.Random(seed)
        ids, outs = list(system or []), []
        for t in range(turns):
            if t in evict_before:
                self.admission.cache.reset()
            ids = ids + [g.randrange(2, self.vocab) for _ in range(user_len)]
            out = self.serve(f"{name}-{t}", ids)
            outs.append(out)
            ids = ids + out
        return outs

    def assert_no_page_leaked(self) -> None:
        """Every decode page is free once the cache lets its pages go; nothing is pinned."""
        assert not self.admission._pinned and not self.admission._held
        if self.admission.cache is not None:
            self.admission.cache.reset()
            assert self.admission.num_cached == 0
        assert self.dpool.allocator.num_used == 0, self.dpool.allocator.owners()
        assert self.rx.stats().num_active == 0

    def close(self) -> None:
        self.sender.close()
        self.lt.run(self.rx.stop(grace_s=0.5))
        self.lt.stop()
        self.pre.stop()


@pytest.fixture
def cluster(tiny):
    made = []

    def make(reuse: bool, **kw) -> Cluster:
        made.append(Cluster(tiny, reuse, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def test_multi_turn_sessions_same_tokens_and_only_the_tail_shipped(cluster):
    """Two sessions x 3 turns, interleaved, sharing a system prefix: the same greedy tokens with reuse on and off;
    with reuse, every later turn finds the previous turn's final pages resident and is shipped only the rest:
    at most the new user chunk + the last returned token + one page, and exactly the tokens not resident."""
    system = list(range(2, 2 + 3 * P))
    off, on = cluster(False), cluster(True)
    want = [off.session("a", 3, seed=1, system=system), off.session("b", 3, seed=2, system=system)]
    got = [on.session("a", 3, seed=1, system=system), on.session("b", 3, seed=2, system=system)]
    assert got == want
    assert on.accept == off.accept  # the reused MTP KV drafts as the shipped one did
    per_token = off.shipped[0][2] / off.shipped[0][0]
    assert per_token > 0 and all(b == n * per_token for n, _, b in off.shipped)
    assert [r for _, r, _ in off.shipped] == [0] * 6
    prev_len = {}
    for i, (n, resident, num_bytes) in enumerate(on.shipped):
        assert num_bytes == (n - resident) * per_token, "exactly the tokens not resident are shipped"
        turn = i % 3
        if turn == 0:
            # a session's first turn: the other session's system prompt may be resident (session b), no more
            assert resident <= len(system)
        else:
            # the previous turn's prompt + output, less the last output token, in full pages
            assert resident == (prev_len[i // 3] - 1) // P * P
            assert n - resident <= 21 + 1 + P
        prev_len[i // 3] = n + 12
    assert on.admission.reuse_hit_tokens == sum(r for _, r, _ in on.shipped) > 0
    off.assert_no_page_leaked()
    on.assert_no_page_leaked()


def test_evicted_before_reserve_ships_everything_and_answers_the_same(cluster):
    """The decode worker lost the session's pages before the next turn's reservation (evicted for room): the
    answer is 0 resident tokens, the whole prompt is shipped and the tokens are right."""
    off, on = cluster(False), cluster(True)
    want = off.session("s", 2, seed=3)
    assert on.session("s", 2, seed=3, evict_before={1}) == want
    assert [r for _, r, _ in on.shipped] == [0, 0] and on.shipped == off.shipped
    on.assert_no_page_leaked()


def test_mtp_pair_of_a_page_boundary_is_not_reused_after_another_token(cluster, tiny):
    """With MTP, a cached page's last MTP pair was written with the token after the page: a prompt that matches
    the page but goes on with another token does not reuse it (the pair would be another sequence's). A worker
    that never reads the MTP layer (glm4_moe here, not speculating) reuses the page whatever follows."""
    c = cluster(True)
    ids = [random.Random(5).randrange(2, c.vocab) for _ in range(2 * P + 5)]
    out = c.serve("x", ids)
    seq = ids + out
    assert c.serve("same", seq[:2 * P] + [seq[2 * P]] + [3] * 4) and c.shipped[-1][1] == 2 * P
    other = (seq[2 * P] + 1) % c.vocab or 2
    assert c.serve("diverge", seq[:2 * P] + [other] + [3] * 4)
    assert c.shipped[-1][1] == (P if tiny[2] else 2 * P)
    c.assert_no_page_leaked()


def test_random_cancels_leak_no_decode_page(cluster):
    """Sessions whose turns are cancelled at random points (reserved and never prefilled, cancelled after the
    transfer, aborted while decoding, left to expire): no decode page is leaked, nothing stays pinned, and the
    turns that ran returned the tokens they would have without reuse."""
    c = cluster(True, decode_pages=24)
    g = random.Random(7)
    ids = list(range(2, 2 + 2 * P))
    for i in range(24):
        if g.random() < 0.3:
            ids = list(range(2, 2 + 2 * P))  # a new session over the same system prompt
        ids = ids + [g.randrange(2, c.vocab) for _ in range(g.randrange(1, 9))]
        req_id, fate = f"q{i}", g.choice(["run", "run", "cancel_reserved", "cancel_transferred", "abort_decoding",
                                         "expire"])
        if fate == "run":
            ids = ids + c.serve(req_id, ids, max_tokens=4)
            continue
        try:
            r = c.reserve(req_id, ids)
        except TransferError:
            continue  # no room: nothing held
        if fate == "cancel_reserved":
            c.cancel(req_id)
        elif fate == "expire":  # as the receiver's reaper does (ticket_ttl_s); the next Reserve unpins its prefix
            c.lt.run(_expire(c, req_id))
        elif fate == "cancel_transferred":
            assert isinstance(c.prefill(req_id, ids, r), PrefillResult)
            c.cancel(req_id)
        else:
            first = c.prefill(req_id, ids, r)
            res = c.lt.run(c.admission.wait_transfer(req_id, 30.0))
            pages = c.lt.run(c.admission.claim(res))
            c.dec.add(DecodeTask(req_id, ids, [first.first_token], SamplingParams(max_tokens=50, ignore_eos=True),
                                 pages, len(ids), emit=lambda ev: None,
                                 draft_hidden=draft_state(res.draft, c.draft, c.dpool.device)))
            c.dec.step()
            c.dec.abort(req_id)
            c.dec.step()
    c.lt.run(_sweep(c))
    assert c.admission.reuse_hit_tokens > 0
    c.assert_no_page_leaked()


async def _expire(c: Cluster, req_id: str) -> None:
    c.rx.fail(c.rx.manager.get(req_id), TransferError(FailReason.EXPIRED, "test: no frame in time", req_id))


async def _sweep(c: Cluster) -> int:
    return c.admission.sweep_pins()


def test_decode_worker_pages_count_cached_pages_as_free(cluster):
    """Cached pages never block admission: they count as free, and a reservation larger than the free pages
    evicts them (LRU) instead of being refused."""
    c = cluster(True, decode_pages=8)
    ids = [random.Random(9).randrange(2, c.vocab) for _ in range(3 * P + 3)]
    c.serve("w", ids, max_tokens=4)
    assert c.admission.num_cached == 3 and c.admission.num_free == 8
    fresh = [random.Random(10).randrange(2, c.vocab) for _ in range(7 * P)]
    r = c.reserve("big", fresh)
    assert r.resident_tokens == 0 and c.admission.num_cached <= 1
    c.cancel("big")
    c.assert_no_page_leaked()


def local_session(tiny, reuse: bool, turns: int = 3, seed: int = 11) -> tuple[list[list[int]], list[int], list]:
    """A session prefilled on the decode worker itself (aggregated mode) -> (tokens per turn, resident tokens per
    turn, accept lengths)."""
    model, cfg, spec = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 64)
    admission = DecodeAdmission(pool, prefix_cache=reuse, mtp=spec is not None)
    speculator = MTPSpeculator(model, cfg, pool, SpecConfig.parse(spec)) if spec else None
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids, DecodeConfig(spec_fallback=False, prefill_chunk=32,
                                                                       prefill_budget=32),
                          spec=speculator, admission=admission)
    g, ids, outs, resident, accept = random.Random(seed), [], [], [], []
    for t in range(turns):
        ids = ids + [g.randrange(2, cfg.vocab_size) for _ in range(21)]
        events = []
        task = DecodeTask(f"l{t}", ids, [], SamplingParams(max_tokens=12, ignore_eos=True), [], 0, emit=events.append)
        dec.add_local(task)
        resident.append(task.cached_len)
        while not (events and events[-1].finish_reason):
            dec.step()
        outs.append([tok for e in events for tok in e.token_ids])
        accept.append(events[-1].accept_len)
        ids = ids + outs[-1]
    if admission.cache is not None:
        admission.cache.reset()
    assert pool.allocator.num_used == 0 and not admission._held
    return outs, resident, accept


def test_local_prefill_computes_only_what_is_not_resident(tiny):
    """Aggregated mode: a decode worker prefilling a session's next turn itself starts after the prefix it still
    holds (the previous turn's final pages) and answers the same greedy tokens and accept lengths as without."""
    off, on = local_session(tiny, False), local_session(tiny, True)
    assert on[0] == off[0] and on[2] == off[2]
    assert off[1] == [0, 0, 0] and on[1] == [0, (21 + 12 - 1) // P * P, (2 * 33 - 1) // P * P]
