"""DecodeAdmission, the decode worker's one page owner: every page it hands a request comes back, on every path."""
import asyncio

import pytest

from decode.admission import DecodeAdmission
from decode.task import DecodeTask
from engine.kvcache import KVComponent, KVLayout, KVPool, PoolExhausted
from engine.sampling import SamplingParams
from kvtransfer import TransferResult
from kvtransfer.config import TransportKind

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
