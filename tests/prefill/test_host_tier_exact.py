"""A prefix restored from the host tier is exactly a computed prefix, under the real prefill scheduler, for the tiny
GLM-5 (glm_moe_dsa: MLA latent + rope, DSA indexer keys, an MTP layer) and a tiny glm4_moe with an MTP layer.

"Exactly": the first token's logits are bit-identical to a cold prefill of the same prompt with the same chunk
boundaries, and so are every KV row of every layer (the MTP layer and the indexer keys included; fp8 scales too)
and the MTP draft state shipped to the decode side. A decode worker given bit-identical KV, first token and draft
state produces the same greedy tokens and the same speculative acceptance, so those follow."""
import random
import time
from types import SimpleNamespace

import pytest
import torch

import prefill.scheduler as ps
from engine.checkpoint import init_random_model
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from prefill.host_cache import HostCache, HostCachePolicy
from engine.kvcache.radix import prefix_block_hashes
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, RequestAborted
from prefill.server import PrefillServicer
from shared_helpers import TINY_GQA_MTP
from test_prefill_scheduler import CaptureSink, run_all, task

PAGE = 16


@pytest.fixture(scope="module", params=["glm_moe_dsa", "glm4_moe"])
def tiny(request, tiny_glm5_dir, tmp_path_factory):
    if request.param == "glm_moe_dsa":
        model_dir = tiny_glm5_dir
    else:
        model_dir = init_random_model(TINY_GQA_MTP, str(tmp_path_factory.mktemp("tiny_gqa_mtp")), seed=2)
    model, cfg = load_model(model_dir, "float32", "cpu")
    assert cfg.model_type == request.param and model.has_mtp
    return model, cfg


def make_sched(tiny, num_pages=64, host_pages=0, kv_dtype="float32", policy=HostCachePolicy.WRITE_BACK, **kw):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, PAGE, kv_dtype), num_pages)
    host = HostCache(pool, host_pages, policy) if host_pages else None
    return PrefillScheduler(model, pool, PrefillConfig(**{"chunk_size": 32, "max_batch_tokens": 64, **kw}),
                            host_cache=host)


@pytest.fixture
def logits_seen(monkeypatch):
    """The logits every first token is sampled from, in order."""
    seen, real = [], ps.sample

    def sample(logits, states):
        seen.append(logits.detach().clone())
        return real(logits, states)
    monkeypatch.setattr(ps, "sample", sample)
    return seen


def prompt(cfg, n, seed):
    return torch.randint(2, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_bytes(pool, pages):
    """The bytes of ``pages`` in every layer and component of ``pool``, fp8 scales included."""
    idx = torch.tensor(pages, dtype=torch.long)
    out = [b[name].view(torch.uint8).index_select(0, idx) for b in pool.buffers for name in b]
    return out + [s[name].view(torch.uint8).index_select(0, idx) for s in pool.scales for name in s]


def prefill_once(sched, ids, req_id, logits_seen):
    """-> (result, capture sink, first-token logits, bytes of the request's full pages) of one request run alone."""
    res, sink, before = {}, CaptureSink(sched.pool), len(logits_seen)
    run_all(sched, [task(req_id, ids, res, sink=sink)])
    assert isinstance(res[req_id], PrefillResult) and len(logits_seen) == before + 1
    return res[req_id], sink, logits_seen[-1], pool_bytes(sched.pool, sink.pages[:len(ids) // PAGE])


def assert_same_state(warm, cold):
    """The same first token from bit-identical logits; bit-identical KV rows of every layer and component for every
    prompt token, pages' bytes (fp8 scales too) and draft state."""
    (res_w, sink_w, logits_w, bytes_w), (res_c, sink_c, logits_c, bytes_c) = warm, cold
    assert res_w.first_token == res_c.first_token
    assert torch.equal(logits_w, logits_c), (logits_w - logits_c).abs().max()
    assert sink_w.kv.keys() == sink_c.kv.keys()
    for key in sink_c.kv:
        assert torch.equal(sink_w.kv[key].view(torch.uint8), sink_c.kv[key].view(torch.uint8)), key
    assert len(bytes_w) == len(bytes_c) and all(torch.equal(a, b) for a, b in zip(bytes_w, bytes_c))
    assert torch.equal(sink_w.draft, sink_c.draft)


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_restore_from_host_equals_cold_prefill(tiny, kv_dtype, logits_seen):
    ids = prompt(tiny[1], 100, seed=7)
    cold = prefill_once(make_sched(tiny, kv_dtype=kv_dtype), ids, "cold", logits_seen)
    sched = make_sched(tiny, kv_dtype=kv_dtype, host_pages=32)
    first = prefill_once(sched, ids, "a", logits_seen)
    assert sched.cache.evict(sched.cache.num_pages) == 6 and sched.host.num_pages == 6
    assert sched.pool.allocator.num_free == sched.pool.num_pages  # the device tier is empty: only the host has it
    computed = sched.tokens_done
    warm = prefill_once(sched, ids, "b", logits_seen)
    assert warm[0].cached_tokens == 96 and sched.host.hit_tokens == 96 and sched.tokens_done - computed == 4
    assert_same_state(first, cold)
    assert_same_state(warm, cold)
    if kv_dtype == "fp8_e4m3":
        assert sched.pool.scales and any((s[name] != 1).any() for s in sched.pool.scales for name in s)


def test_corrupt_host_page_is_recomputed_with_identical_output(tiny, logits_seen):
    ids = prompt(tiny[1], 100, seed=8)
    cold = prefill_once(make_sched(tiny), ids, "cold", logits_seen)
    sched = make_sched(tiny, host_pages=32)
    prefill_once(sched, ids, "a", logits_seen)
    sched.cache.evict(sched.cache.num_pages)
    bad = sched.host._entries[prefix_block_hashes(ids, PAGE)[2]]
    sched.host.store.data[bad.slot, sched.host.store.page_bytes // 2] ^= 0x01  # one bit of the third page
    computed = sched.tokens_done
    warm = prefill_once(sched, ids, "b", logits_seen)
    assert warm[0].cached_tokens == 32 and sched.tokens_done - computed == 68  # pages 0-1 restored, 2.. recomputed
    assert sched.host.corrupt_pages == 1
    assert_same_state(warm, cold)
    servicer = SimpleNamespace(sched=sched, kv_transfers=0, kv_bytes=0, kv_seconds=0.0)
    counters = PrefillServicer.counters(servicer)
    assert counters["prefix_cache_recomputed_pages"][0].values == {"host": 1}
    assert counters["prefix_cache_hit_tokens"][0].values["host"] == 32
    tiers = PrefillServicer.gauges(servicer)["prefix_cache_bytes"][0].values
    assert tiers["host"] == sched.host.num_pages * sched.pool.layout.bytes_per_page() > 0 and tiers["device"] > 0


def test_write_through_serves_the_same_prefix(tiny, logits_seen):
    ids = prompt(tiny[1], 80, seed=9)
    cold = prefill_once(make_sched(tiny), ids, "cold", logits_seen)
    sched = make_sched(tiny, host_pages=32, policy=HostCachePolicy.WRITE_THROUGH)
    prefill_once(sched, ids, "a", logits_seen)
    assert sched.host.num_pending == 5
    prefill_once(sched, prompt(tiny[1], 20, seed=11), "other", logits_seen)  # its admission copies a's pages
    assert sched.host.num_pages == 5 and sched.host.stored_pages == 5 and sched.host.num_pending == 1
    sched.cache.evict(sched.cache.num_pages)
    assert sched.host.stored_pages == 6  # a's pages are not copied again; other's one page is, once
    warm = prefill_once(sched, ids, "b", logits_seen)
    assert warm[0].cached_tokens == 64  # a full match recomputes its last page to produce logits
    assert_same_state(warm, cold)


def random_sessions(sched, cfg, num_requests=16, num_sessions=4, seed=45):
    """Sessions sharing a system prefix take turns, with requests cancelled queued, mid-prefill and by deadline;
    -> every request's answer (each one answered, by a result or an abort)."""
    rng = random.Random(seed)
    system = prompt(cfg, 32, seed=10)
    sessions = [system + prompt(cfg, 64, seed=20 + s) for s in range(num_sessions)]  # 6 pages each
    res, live = {}, []
    for i in range(num_requests):
        ids = sessions[i % len(sessions)] + prompt(cfg, rng.randrange(1, 12), seed=100 + i)
        sched.add(task(f"r{i}", ids, res, deadline=None if rng.random() < 0.9 else 0.0))
        live.append(f"r{i}")
        for _ in range(rng.randrange(0, 3)):
            sched.step()
        if rng.random() < 0.25:
            sched.abort(rng.choice(live))
    # a queued request waits for pages a finishing transfer (another thread) still holds: drive the steps until
    # every request has its answer, not for a fixed count of steps (idle steps spin fast on a loaded host)
    until = time.monotonic() + 120
    while (sched._tasks or len(res) < num_requests) and time.monotonic() < until:
        if not sched.step():
            time.sleep(0.002)
    odd = {k: r for k, r in res.items() if not isinstance(r, (PrefillResult, RequestAborted))}
    assert len(res) == num_requests and not odd, odd
    return res


def assert_no_page_leaked(sched):
    """Every pool page free or cached (and unlocked), every host slot free or an unpinned entry."""
    pool, host = sched.pool, sched.host
    assert pool.allocator.num_free + sched.cache.num_pages == pool.num_pages
    assert set(pool.allocator.owners()) <= {"radix"} and sched.cache.num_evictable() == sched.cache.num_pages
    assert host.store.allocator.num_free + host.num_pages == host.store.num_pages
    assert not any(e.pins for e in host._entries.values())
    assert set(host.store.allocator.owners()) <= {"host"}


def test_random_sessions_with_cancels_leak_no_page_of_either_tier(tiny):
    """Four sessions through a pool and a host tier both too small for all of them (so returning turns hit the host
    tier)."""
    sched = make_sched(tiny, num_pages=16, host_pages=8)
    res = random_sessions(sched, tiny[1])
    done = [r for r in res.values() if isinstance(r, PrefillResult)]
    assert len(done) >= 8 and sched.host.hit_tokens > 0 and sched.host.evicted_pages > 0
    assert_no_page_leaked(sched)
