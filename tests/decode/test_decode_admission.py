"""DecodeAdmission, the decode worker's one page owner: every page it hands a request comes back, on every path."""
import asyncio

import pytest

from decode.admission import DecodeAdmission
from decode.task import DecodeTask, State
from engine.kvcache import KVComponent, KVLayout, KVPool, PoolExhausted
from engine.sampling import SamplingParams
from kvtransfer import TransferResult
from kvtransfer.config import TransportKind
from worker.ranks import RankFailure

PAGE = 4


def make_task(req_id: str, prompt_len: int) -> DecodeTask:
    return DecodeTask(req_id, list(range(prompt_len)), [], SamplingParams(max_tokens=4), [], 0, emit=lambda ev: None)


@pytest.fixture
def admission():
    layout = KVLayout("glm4_moe", 2, PAGE, "float32", (KVComponent("k", (1, 4)), KVComponent("v", (1, 4))))
    return DecodeAdmission(KVPool(layout, 8))


def test_prompt_growth_resume_and_release_give_every_page_back(admission):
    free = admission.num_free
    a, b = make_task("a", 7), make_task("b", 3)
    admission.alloc_prompt(a)  # 7 tokens + the first output token: 2 pages
    assert len(a.pages) == 2
    admission.grow(a, 13)
    assert len(a.pages) == 4
    admission.grow(a, 13)  # already room: nothing more
    assert len(a.pages) == 4
    assert not admission.alloc_resume(b, 3, headroom=4)  # 1 page + 4 of headroom > the 4 free
    assert b.pages == []
    assert admission.alloc_resume(b, 3, headroom=3)
    assert len(b.pages) == 1
    with pytest.raises(PoolExhausted):
        admission.grow(a, 100)
    assert len(a.pages) == 4  # a refused growth keeps what the request had, takes nothing
    admission.release(a)
    admission.release(a)  # idempotent
    admission.release(b)
    assert a.pages == [] and b.pages == [] and admission.num_free == free


def test_without_a_receiver_transfers_are_refused_and_nothing_is_reserved(admission):
    assert admission.num_reserved == 0
    assert admission.cancel("x", "test") is False
    with pytest.raises(RuntimeError, match="no KV receiver"):
        admission.reserve("x", 8)
    assert admission.landing_info() == {}
    assert admission.num_free == admission.pool.num_pages


def test_claim_at_tp1_hands_over_the_received_pages(admission):
    pages = admission.pool.allocator.alloc(2, "kvtransfer:r")  # as the receiver's reservation holds them
    done = TransferResult("r", tuple(pages), 8, 0, TransportKind.TCP, 0.0, 0.0, (0.0, 0.0))
    assert asyncio.run(admission.claim(done)) == pages
    admission.pool.allocator.decref(pages)
    assert admission.num_free == admission.pool.num_pages


class FakeReceiver:
    """The receiver's side of a reservation: pages of its (landing) pool for the tail, handed over complete."""

    def __init__(self, pool):
        self.pool, self.reserved = pool, {}

    def reserve(self, req_id, num_tokens):
        self.reserved[req_id] = self.pool.allocator.alloc(self.pool.pages_for(num_tokens), req_id)
        return num_tokens

    async def wait_complete(self, req_id, timeout_s):
        pages = self.reserved.pop(req_id)
        return TransferResult(req_id, tuple(pages), len(pages) * PAGE, 0, TransportKind.TCP, 0.0, 0.0, (0.0, 0.0))


class FakeRanks:
    """A tensor-parallel worker's rank group: records what it is asked to copy to the followers, or fails."""

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def mirror_pages(self, pool, page_ids):
        self.calls.append(("mirror", list(page_ids)))
        if self.fail:
            raise RankFailure("follower 1 died")

    def scatter_pages(self, landing, src, pool, dst):
        self.calls.append(("scatter", list(src), list(dst)))
        if self.fail:
            raise RankFailure("follower 1 died")


@pytest.mark.parametrize("kv", ["replicated", "split"])
@pytest.mark.parametrize("fail", [False, True])
def test_claim_at_tp2_puts_the_resident_prefix_before_the_received_tail(kv, fail):
    """Decode-side reuse on a tensor-parallel worker: only the received tail goes to the followers (mirrored, or
    scattered from the landing pool under split heads); the resident prefix is in every rank's pool already and
    leads the request's pages. A rank failing mid-claim frees the tail and unpins the prefix: nothing leaks."""
    layout = KVLayout("glm4_moe", 2, PAGE, "float32", (KVComponent("k", (1, 4)), KVComponent("v", (1, 4))))
    pool = KVPool(layout, 16)
    landing = pool if kv == "replicated" else KVPool(layout, 8)
    ranks = FakeRanks(fail)
    adm = DecodeAdmission(pool, FakeReceiver(landing), ranks, prefix_cache=True)
    first = make_task("a", 12)
    adm.alloc_prompt(first)  # turn 1 (a local prefill here): 12 prompt tokens, then it finishes
    first.output_ids, first.cached_len, first.state = [99, 98], 13, State.FINISHED
    cached = first.pages[:3]
    adm.release(first)
    assert adm.num_cached == 3
    res = adm.reserve("b", 20, list(range(12)) + list(range(50, 58)))
    assert res.resident_tokens == 12 and res.ticket == 8  # the prefix stays, the tail ships
    done = asyncio.run(adm.wait_transfer("b", 5.0))
    if fail:
        with pytest.raises(RankFailure):
            asyncio.run(adm.claim(done))
    else:
        pages = asyncio.run(adm.claim(done))
        assert pages[:3] == cached and len(pages) == 5
        b = make_task("b", 20)
        b.pages, b.state = pages, State.ABORTED
        adm.release(b)
    tail = list(done.page_ids)
    assert ranks.calls[0][:2] == ("mirror" if kv == "replicated" else "scatter", tail)
    assert adm.num_free == pool.num_pages and pool.allocator.num_used == adm.num_cached == 3  # back, or cached
    assert landing is pool or landing.allocator.num_used == 0
    assert adm.cache.num_evictable() == adm.num_cached  # the prefix is unpinned
