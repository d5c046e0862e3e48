"""The decode worker's own prefill (``DecodeScheduler.add_local``: conditional disaggregation, aggregated
mode) in chunks: a prompt longer than ``prefill_chunk`` takes several steps, each followed by a decode step of
the running requests, and decodes as the offline engine does; ending it mid-prefill frees every page."""
import time

import pytest
import torch

from decode.config import DecodeConfig
from decode.scheduler import DecodeScheduler, DecodeTask
from engine.kvcache import KVLayout, KVPool
from engine.kvcache.pool import PoolExhausted
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig
from engine.speculative.prefill import PrefillChunk, prefill_forward
from engine.speculative.worker import MTPSpeculator

P = 16
CHUNK = 32


@pytest.fixture(scope="module")
def tiny(tiny_glm5_dir):
    return load_model(tiny_glm5_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def tiny_bf16(tiny_glm5_dir):
    return load_model(tiny_glm5_dir, "bfloat16", "cpu")


def make_sched(tiny, num_pages=64, chunk=CHUNK, budget=CHUNK, spec=None):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), num_pages)
    speculator = None if spec is None else MTPSpeculator(model, cfg, pool, SpecConfig.parse(spec))
    return DecodeScheduler(model, pool, cfg.eos_token_ids, DecodeConfig(prefill_chunk=chunk, prefill_budget=budget),
                           spec=speculator)


def add_local(dec, req_id, prompt, params, deadline=None):
    evs = []
    task = DecodeTask(req_id, prompt, [], params, [], 0, emit=evs.append, deadline=deadline)
    dec.add_local(task)
    return task, evs


def tokens(evs):
    return [t for e in evs for t in e.token_ids]


def prompts(*lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lens]


def test_long_prompt_prefills_over_steps_between_decode_steps_and_equals_the_engine(tiny):
    """A 100-token prompt with 32-token chunks: 4 steps (32, 64, 96, 100 tokens in its KV), the running
    request streams a token in each of them, the first token comes after the last chunk, and both greedy
    outputs equal the offline engine's (one whole-prompt prefill there); every page back."""
    model, cfg = tiny
    short, long_ = prompts(20, 100)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dec = make_sched(tiny)
    _, a_evs = add_local(dec, "a", short, params)
    dec.step()
    assert len(tokens(a_evs)) == 2  # its prefill's first token, then a decode step
    b, b_evs = add_local(dec, "b", long_, params)
    progress = []
    while not b_evs:
        before = len(tokens(a_evs))
        assert dec.step()
        progress.append((b.cached_len, len(tokens(a_evs)) - before))
        assert len(progress) <= 4
    # each step: one prefill chunk of b, one decode step of a (b joins the decode step of its last chunk)
    assert progress == [(32, 1), (64, 1), (96, 1), (100 + 1, 1)]
    assert dec.num_pending == 0 and dec.num_running == 2
    while dec.step():
        pass
    ref = Engine(model, cfg, page_size=P, num_pages=64).generate([short, long_], params)
    assert tokens(a_evs) == ref[0].token_ids and a_evs[-1].finish_reason == "length"
    assert tokens(b_evs) == ref[1].token_ids and b_evs[-1].finish_reason == "length"
    assert dec.pool.allocator.num_used == 0


def test_speculating_worker_prefills_in_chunks_as_one_pass_and_equals_the_engine(tiny):
    """With MTP speculation, a 100-token prompt in 32-token chunks writes the KV of one pass over it, the MTP
    layer's included (an inner chunk's pairs end with the prompt's next token, the last one's with the sampled
    first token), and the same draft state; then greedy output equals the engine's."""
    model, cfg = tiny
    assert model.has_mtp
    prompt = prompts(100)[0]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    dec = make_sched(tiny, spec="3/1/4")
    task, evs = add_local(dec, "r", prompt, params)
    while dec.num_pending:  # the prefill chunks alone, no decode step writing after them
        with dec._cv:
            chunks = dec._schedule_prefill()
        assert len(chunks) == 1 and chunks[0][2] - chunks[0][1] <= CHUNK
        dec._local_prefill(chunks)
    layout = dec.pool.layout
    ref_pool = KVPool(layout, 64)
    pages = ref_pool.allocator.alloc(ref_pool.pages_for(len(prompt) + 1), "ref")
    assert pages == task.pages
    ref = prefill_forward(model, ref_pool, [PrefillChunk(pages, 0, prompt, draft=True)],
                          lambda logits, rows: logits.argmax(-1).tolist())[0]
    assert tokens(evs) == [ref.next_token]
    torch.testing.assert_close(task.draft_hidden, ref.draft_hidden, rtol=1e-5, atol=1e-5)
    slots = torch.arange(len(prompt))
    for layer in range(layout.num_layers):  # the MTP layer is the last one
        for c in layout.components:
            torch.testing.assert_close(dec.pool.flat(layer, c.name)[slots], ref_pool.flat(layer, c.name)[slots],
                                       rtol=1e-5, atol=1e-5, msg=f"layer {layer} {c.name}")
    while dec.step():
        pass
    want = Engine(model, cfg, page_size=P, num_pages=64).generate([prompt], params)[0]
    assert tokens(evs) == want.token_ids and dec.pool.allocator.num_used == 0


def test_budget_spreads_over_prompts_in_arrival_order(tiny):
    """Two long prompts under a 48-token budget with 32-token chunks: the first takes 32, the second the 16
    left; both end with the engine's greedy output."""
    model, cfg = tiny
    p1, p2 = prompts(70, 50)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    dec = make_sched(tiny, chunk=32, budget=48)
    t1, e1 = add_local(dec, "x", p1, params)
    t2, e2 = add_local(dec, "y", p2, params)
    dec.step()
    assert (t1.cached_len, t2.cached_len) == (32, 16) and not e1 and not e2
    while dec.step():
        pass
    ref = Engine(model, cfg, page_size=P, num_pages=64).generate([p1, p2], params)
    assert tokens(e1) == ref[0].token_ids and tokens(e2) == ref[1].token_ids
    assert dec.pool.allocator.num_used == 0


@pytest.mark.parametrize("how", ["abort", "deadline", "shutdown"])
def test_ending_a_request_mid_prefill_frees_every_page(tiny, how):
    """Abort, deadline or shutdown after 2 of a prompt's 4 chunks: it ends (abort, no token), its pages are
    back at once, and a request decoding beside it is unaffected (shutdown ends it too)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short, long_ = prompts(20, 100)
    dec = make_sched(tiny)
    _, a_evs = add_local(dec, "a", short, params)
    dec.step()
    b, b_evs = add_local(dec, "b", long_, params)
    dec.step()
    dec.step()
    assert b.cached_len == 64 and not b_evs and dec.num_pending == 1
    if how == "abort":
        assert dec.abort("b")
        dec.step()
    elif how == "deadline":
        b.deadline = time.monotonic() - 1
        dec.step()
    else:
        dec.stop()
    assert [(e.token_ids, e.finish_reason) for e in b_evs] == [([], "abort")]
    assert b.pages == [] and dec.num_pending == 0
    if how == "shutdown":
        assert a_evs[-1].finish_reason == "abort" and dec.pool.allocator.num_used == 0
        return
    assert not a_evs[-1].finish_reason and not dec.abort("b")
    while dec.step():
        pass
    assert a_evs[-1].finish_reason == "length" and len(tokens(a_evs)) == 40
    assert dec.pool.allocator.num_used == 0


def test_prompt_too_big_for_the_pool_is_refused_up_front(tiny):
    """Pages for the whole prompt are taken at admission: a prompt the pool cannot hold is refused then,
    nothing kept."""
    dec = make_sched(tiny, num_pages=4)
    with pytest.raises(PoolExhausted):
        add_local(dec, "big", prompts(100)[0], SamplingParams(max_tokens=4))
    assert dec.pool.allocator.num_used == 0 and dec.num_pending == 0


def test_prefill_config_is_checked():
    with pytest.raises(ValueError, match="prefill_budget"):
        DecodeConfig(prefill_chunk=64, prefill_budget=32)
    with pytest.raises(ValueError, match="prefill_chunk"):
        DecodeConfig(prefill_chunk=0)


def test_bf16_chunked_local_prefill_equals_the_engine_at_the_same_chunk_size(tiny_bf16):
    """bf16, prompts of 3-6 chunks of 37 tokens: greedy output equals the offline engine's prefilling in the
    same chunks, token for token. (Steps trimmed to row buckets, as the prefill worker's are, broke this for
    exactly these prompts, 3 of the 6 drawn: the local prefill keeps whole chunks.)"""
    model, cfg = tiny_bf16
    drawn = prompts(100, 77, 150, 61, 203, 90, seed=5)
    ps = [drawn[1], drawn[4], drawn[5]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(model, cfg, kv_dtype="bfloat16", page_size=P, num_pages=256, chunk_size=37).generate(ps, params)
    pool = KVPool(KVLayout.for_model(cfg, P, "bfloat16"), 64)
    for p, r in zip(ps, ref):
        dec = DecodeScheduler(model, pool, cfg.eos_token_ids, DecodeConfig(prefill_chunk=37, prefill_budget=37))
        _, evs = add_local(dec, "r", p, params)
        while dec.step():
            pass
        assert tokens(evs) == r.token_ids, len(p)
        assert pool.allocator.num_used == 0


class ThreadSpy:
    """The model, recording torch's intra-op threads and the token count of each forward."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __call__(self, batch, pool):
        self.seen.append((batch.num_tokens, torch.get_num_threads()))
        return self.model(batch, pool)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_prefill_forwards_take_prefill_threads_and_decode_steps_keep_the_process_setting(tiny):
    """``prefill_threads`` 2 in a process at 1 thread: each prompt chunk runs on 2, each decode step on 1, and the
    setting is back to 1 after every step; output unchanged."""
    model, cfg = tiny
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 64)
        spy = ThreadSpy(model)
        dec = DecodeScheduler(spy, pool, cfg.eos_token_ids,
                              DecodeConfig(prefill_chunk=CHUNK, prefill_budget=CHUNK, prefill_threads=2))
        prompt = prompts(70)[0]
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        _, evs = add_local(dec, "r", prompt, params)
        while dec.step():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert [n for n, _ in spy.seen] == [32, 32, 6, 1, 1, 1, 1]
    assert [t for _, t in spy.seen] == [2, 2, 2, 1, 1, 1, 1]
    assert tokens(evs) == Engine(model, cfg, page_size=P, num_pages=64).generate([prompt], params)[0].token_ids
