"""Decode scheduler: continuous batching fed by an in-process prefill -> decode KV copy."""
import pytest
import torch

from decode.config import DecodeConfig
from decode.scheduler import DecodeScheduler, DecodeTask, TokenEvent
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillTask
from prefill.sink import KVSink, SinkResult, resolved

P = 16


@pytest.fixture(scope="module")
def tiny(tiny_glm5_dir):
    return load_model(tiny_glm5_dir, "float32", "cpu")


class CopySink(KVSink):
    """Copies each shipped layer's rows into pages reserved in another pool (transfer without a wire)."""

    def __init__(self, src, dst, dst_pages):
        self.src, self.dst, self.dst_pages = src, dst, dst_pages

    def _slots(self, pages, s, e):
        j = torch.arange(s, e)
        return torch.tensor(pages)[j // P] * P + j % P

    def start(self, pages, cached_len):
        self.pages = pages
        for layer in range(self.src.layout.num_layers):
            if cached_len:
                self.send(layer, 0, cached_len)

    def send(self, layer, s, e):
        src, dst = self._slots(self.pages, s, e), self._slots(self.dst_pages, s, e)
        for c in self.src.layout.components:
            self.dst.flat(layer, c.name)[dst] = self.src.flat(layer, c.name)[src]

    def finish(self, draft=None):
        self.draft = draft  # the MTP draft state prefill would ship with the KV
        return resolved(SinkResult(0, 0.0))

    def abort(self, reason):
        pass


def pd_generate(tiny, prompts, params, dec_pages=64, max_running=64, spec=None, recompute_chunk=None,
                fallback=True):
    model, cfg = tiny
    layout = KVLayout.for_model(cfg, P, "float32")
    ppool, dpool = KVPool(layout, 64), KVPool(layout, dec_pages)
    pre = PrefillScheduler(model, ppool, PrefillConfig(chunk_size=32, max_batch_tokens=64))
    speculator = None
    if spec:
        from engine.speculative import SpecConfig
        from engine.speculative.worker import MTPSpeculator
        speculator = MTPSpeculator(model, cfg, dpool, SpecConfig.parse(spec))
    dec = DecodeScheduler(model, dpool, cfg.eos_token_ids, DecodeConfig(max_running=max_running, spec_fallback=fallback,
                                                                        recompute_chunk=recompute_chunk or 2048),
                          spec=speculator)
    events = {}
    for i, ids in enumerate(prompts):
        req_id = f"r{i}"
        reserved = dpool.allocator.alloc(dpool.pages_for(len(ids)), req_id)
        firsts = {}
        sink = CopySink(ppool, dpool, reserved)
        pre.add(PrefillTask(req_id, ids, params, on_done=lambda r, req_id=req_id: firsts.__setitem__(req_id, r),
                               sink=sink))
        while req_id not in firsts:
            pre.step()
        events[req_id] = []
        dec.add(DecodeTask(req_id, ids, [firsts[req_id].first_token], params, reserved, len(ids),
                           emit=events[req_id].append, draft_hidden=sink.draft if spec else None))
    for _ in range(500):
        if not dec.step():
            break
    pd_generate.last = dec
    return events, dpool


def tokens(evs, first=None):
    return [t for e in evs for t in e.token_ids]


def test_pd_greedy_equals_engine(tiny):
    model, cfg = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (90, 17, 40)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    events, dpool = pd_generate(tiny, prompts, params)
    ref = Engine(model, cfg, page_size=P, num_pages=64).generate(prompts, params)
    for i, r in enumerate(ref):
        ev = events[f"r{i}"]
        assert ev[-1].finish_reason == "length"
        # the first token came from prefill; decode streams the rest
        assert r.token_ids[1:] == tokens(ev)
    assert dpool.allocator.num_used == 0


def test_stop_token_and_eos(tiny):
    model, cfg = tiny
    prompt = list(range(5, 60))
    full = Engine(model, cfg, page_size=P).generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_tok = full.token_ids[5]
    events, _ = pd_generate(tiny, [prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                          stop_token_ids=(stop_tok,)))
    got = full.token_ids[:1] + tokens(events["r0"])
    assert got == full.token_ids[:full.token_ids.index(stop_tok) + 1] and events["r0"][-1].finish_reason == "stop"


def test_pool_exhausted_mid_generation_ends_cleanly(tiny):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (30,), generator=g).tolist() for _ in range(3)]
    events, dpool = pd_generate(tiny, prompts, SamplingParams(max_tokens=200, ignore_eos=True), dec_pages=10)
    reasons = sorted(events[k][-1].finish_reason for k in events)
    assert "error" in reasons and all(r in ("error", "length") for r in reasons)
    err = next(e for k in events for e in events[k] if e.finish_reason == "error")
    assert "exhausted" in err.message
    assert dpool.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_and_abort_frees(tiny):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    prompt = list(range(3, 50))
    a, _ = pd_generate(tiny, [prompt], params)
    b, _ = pd_generate(tiny, [prompt], params)
    assert tokens(a["r0"]) == tokens(b["r0"])
    c, _ = pd_generate(tiny, [prompt], SamplingParams(max_tokens=20, temperature=0.9, seed=124, ignore_eos=True))
    assert tokens(c["r0"]) != tokens(a["r0"])


def test_failed_local_prefill_ends_its_requests_and_frees_their_pages(tiny, monkeypatch):
    """A local prefill whose forward raises: each of its requests gets an "error" event and its pages
    back (nothing waits forever), and the scheduler keeps serving."""
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 32)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids)
    events = []
    real = dec._local_prefill

    def boom(tasks):
        raise RuntimeError("injected forward failure")
    monkeypatch.setattr(dec, "_local_prefill", boom)
    dec.add_local(DecodeTask("bad", list(range(3, 40)), [], SamplingParams(max_tokens=4), [], 0, emit=events.append))
    dec.step()
    assert [(e.finish_reason, e.message) for e in events] == [("error", "internal error in local prefill")]
    assert pool.allocator.num_used == 0 and not dec.abort("bad")
    monkeypatch.setattr(dec, "_local_prefill", real)
    ok = []
    dec.add_local(DecodeTask("ok", list(range(3, 40)), [], SamplingParams(max_tokens=4, ignore_eos=True), [], 0,
                             emit=ok.append))
    while dec.step():
        pass
    assert ok[-1].finish_reason == "length" and len(tokens(ok)) == 4 and pool.allocator.num_used == 0


@pytest.mark.parametrize("spec", [None, "3/1/4"])
def test_full_pool_preempts_and_recomputes_losslessly(tiny, spec):
    """Three requests that fit one at a time but not together: the youngest are preempted when the pool
    fills, resume once pages free up (KV recomputed from prompt + output, the MTP layer's too), and every
    greedy stream equals an unconstrained run token for token; no error, every page back."""
    model, cfg = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (40, 30, 50)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = Engine(model, cfg, page_size=P, num_pages=64).generate(prompts, params)
    # 13 pages = 208 slots < 3 x ~105 tokens; recompute in chunks of 24 tokens
    events, dpool = pd_generate(tiny, prompts, params, dec_pages=13, spec=spec, recompute_chunk=24)
    dec = pd_generate.last
    assert dec.preemptions >= 1 and dec.num_preempted == 0
    for i, r in enumerate(ref):
        ev = events[f"r{i}"]
        assert ev[-1].finish_reason == "length", ev[-1]
        assert r.token_ids[1:] == tokens(ev)
    assert dpool.allocator.num_used == 0


def test_preempted_request_can_be_aborted(tiny):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 8)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids)
    evs = {k: [] for k in "ab"}
    for k, n in (("a", 40), ("b", 40)):
        dec.add_local(DecodeTask(k, list(range(3, 3 + n)), [], SamplingParams(max_tokens=200, ignore_eos=True), [],
                                 0, emit=evs[k].append))
    while dec.num_preempted == 0:
        assert dec.step()
    victim = dec.preemption.preempted[0].req_id
    assert victim == "b" and dec.abort(victim, "client went away")
    dec.step()
    assert evs[victim][-1].finish_reason == "abort" and dec.num_preempted == 0
    dec.abort("a")
    dec.step()
    assert evs["a"][-1].finish_reason == "abort" and pool.allocator.num_used == 0


@pytest.mark.parametrize("fallback", [True, False])
def test_speculation_that_does_not_pay_falls_back_to_plain_losslessly(tiny, fallback):
    """A random-weight model's MTP layer guesses almost nothing (about 1 token per round) while a round costs
    several plain steps: after ``spec_probe_rounds`` rounds each request decodes plainly. Greedy tokens equal
    the plain engine's either way; with the fallback off every round stays speculative."""
    model, cfg = tiny
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (40, 25)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = Engine(model, cfg, page_size=P, num_pages=64).generate(prompts, params)
    events, dpool = pd_generate(tiny, prompts, params, spec="3/1/4", fallback=fallback)
    dec = pd_generate.last
    for i, r in enumerate(ref):
        assert r.token_ids[1:] == tokens(events[f"r{i}"]) and events[f"r{i}"][-1].finish_reason == "length"
    tasks_rounds = dec.speculation.speculator.metrics.num_verify_steps
    if fallback:
        assert dec.spec_fallbacks == 2 and dec.speculation.round_cost > 1.5
        assert tasks_rounds <= 2 * dec.config.spec_probe_rounds + 2  # speculation stopped after the probe rounds
    else:
        assert dec.spec_fallbacks == 0 and tasks_rounds > 2 * dec.config.spec_probe_rounds + 2
    assert dpool.allocator.num_used == 0


def test_recompute_rebuilds_the_kv_of_both_the_model_and_its_mtp_layer(tiny):
    """A preempted request's recompute (chunked) writes the same KV, MTP layer included, as one pass over
    the sequence: main model over tokens 0..n-1, MTP pairs (token i+1, hidden i)."""
    from engine.batch import BatchRequest, ForwardBatch
    model, cfg = tiny
    assert model.has_mtp
    layout = KVLayout.for_model(cfg, P, "float32")
    seq = torch.randint(2, 500, (90,), generator=torch.Generator().manual_seed(6)).tolist()
    prompt, output, n = seq[:50], seq[50:], len(seq) - 1
    ref_pool, pool = KVPool(layout, 16), KVPool(layout, 16)
    pages = ref_pool.allocator.alloc(ref_pool.pages_for(n + 1), "ref")
    out = model(ForwardBatch.build([BatchRequest(pages, 0, seq[:n])], P), ref_pool)
    model.forward_mtp(ForwardBatch.build([BatchRequest(pages, 0, seq[1:n + 1])], P), ref_pool, out.hidden)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids, DecodeConfig(recompute_chunk=32))  # 3 chunks
    task = DecodeTask("r", prompt, output, SamplingParams(max_tokens=100), pool.allocator.alloc(len(pages), "r"), 0,
                      emit=lambda ev: None)
    assert task.pages == pages
    dec.preemption.recompute(task, n)
    slots = torch.arange(n)
    for layer in range(layout.num_layers):  # the MTP layer is the last one
        for c in layout.components:
            torch.testing.assert_close(pool.flat(layer, c.name)[slots], ref_pool.flat(layer, c.name)[slots],
                                       rtol=1e-5, atol=1e-5, msg=f"layer {layer} {c.name}")


def test_stream_coalesces_events_that_queued_behind_it():
    """The Decode stream sends the events queued while it was behind as one chunk, stopping at the finishing
    event (later ones stay queued), with the finishing reason, the logprobs in order, the newest accept len."""
    import asyncio

    from decode.server import coalesce

    async def run():
        q = asyncio.Queue()
        for ev in (TokenEvent([2], logprobs=[(2, -0.1, [2], [-0.1])], accept_len=1.5),
                   TokenEvent([3, 4], logprobs=[(3, -0.2, [3], [-0.2])], accept_len=2.0),
                   TokenEvent([5], "length", "done", accept_len=2.5), TokenEvent([9])):
            q.put_nowait(ev)
        first = coalesce(await q.get(), q)
        alone = coalesce(TokenEvent([7], "stop"), q)  # a finishing event is never merged with what follows
        return first, alone, q.qsize()

    first, alone, left = asyncio.run(run())
    assert first.token_ids == [2, 3, 4, 5] and first.finish_reason == "length" and first.message == "done"
    assert [lp[0] for lp in first.logprobs] == [2, 3] and first.accept_len == 2.5
    assert alone.token_ids == [7] and left == 1


def local_run(dec, req_id, prompt, params):
    evs = []
    dec.add_local(DecodeTask(req_id, prompt, [], params, [], 0, emit=evs.append))
    return evs


def test_a_running_request_waits_for_pages_that_reservations_hold(tiny):
    """Reservations of incoming transfers hold every free page when the only running request needs its next
    page: it waits (keeping its pages, refusing new reservations) instead of ending with "alone needs more
    than the pool" (issue 25: a 2,112-token request ended so with a 4,096-page pool), then finishes with
    the tokens of an unobstructed run once the reservations are gone; every page back."""
    model, cfg = tiny
    prompt, params = list(range(3, 33)), SamplingParams(max_tokens=20, ignore_eos=True)  # 30 + 20 tokens: 4 pages
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 8)
    free_run = DecodeScheduler(model, pool, cfg.eos_token_ids)
    ref = local_run(free_run, "ref", prompt, params)
    while free_run.step():
        pass
    assert ref[-1].finish_reason == "length" and pool.allocator.num_used == 0

    dec = DecodeScheduler(model, pool, cfg.eos_token_ids)
    evs = local_run(dec, "r", prompt, params)
    dec.step()  # prefilled: 2 pages
    squat = pool.allocator.alloc(pool.allocator.num_free, "kvtransfer:incoming")  # reservations take the rest
    steps = 0
    while dec.step():
        steps += 1
        assert steps < 50
    assert not evs[-1].finish_reason and dec.num_running == 1 and 1 < len(tokens(evs)) < 20
    assert "wait for pages" in dec.refusal(0)
    for _ in range(3):  # still waiting, not spinning, not ended
        assert not dec.step() and not evs[-1].finish_reason
    pool.allocator.decref(squat)
    while dec.step():
        pass
    assert evs[-1].finish_reason == "length" and tokens(evs) == tokens(ref)
    assert pool.allocator.num_used == 0 and dec.refusal(0) == ""


def test_only_a_request_bigger_than_the_whole_pool_ends_for_room(tiny):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 3)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids)
    evs = local_run(dec, "big", list(range(3, 33)), SamplingParams(max_tokens=40, ignore_eos=True))
    while dec.step():
        pass
    assert evs[-1].finish_reason == "error"
    assert "alone needs 4 pages, more than the pool's 3" in evs[-1].message, evs[-1].message
    assert len(tokens(evs)) == 48 - 30 + 1 and pool.allocator.num_used == 0  # it ran while the pool held it


def test_refusal_counts_reservations_as_running(tiny):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, P, "float32"), 16)
    dec = DecodeScheduler(model, pool, cfg.eos_token_ids, DecodeConfig(max_running=2))
    assert dec.refusal(1) == ""
    assert "max_running=2" in dec.refusal(2)
    local_run(dec, "a", list(range(3, 20)), SamplingParams(max_tokens=4))
    assert "max_running=2" in dec.refusal(1) and dec.refusal(0) == ""
    dec.abort("a")
    dec.step()
    assert dec.refusal(1) == "" and pool.allocator.num_used == 0
