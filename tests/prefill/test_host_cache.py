"""The prefix cache's host tier without a model: sizes, the host page pool, the radix + host tiers' contract, and
both under random traffic (every restored page holds exactly the bytes stored for its prefix; no page of either tier
leaks). The tiers under the real scheduler and model: test_host_tier_exact.py."""
import random
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine.kvcache import KVComponent, KVLayout, KVPool
from engine.kvcache.host_pool import HostPagePool, segments
from prefill.host_cache import AUTO_HOST_FRACTION, HostCache, HostCachePolicy, plan_host_cache
from engine.kvcache.radix import RadixCache, prefix_block_hashes
from prefill.config import PrefillWorkerConfig
from prefill.server import PrefillServicer, build_parser
from protos.pdserve.v1 import generation_pb2
from worker.config import HOST_CACHE_POLICIES
from worker.metrics import Labelled, WorkerCollector

P = 4


def make_layout(kv_dtype="float32", model_type="glm_moe_dsa"):
    if model_type == "glm_moe_dsa":  # latent, rope, DSA index keys; 3 layers = 2 main + the MTP layer
        comps = (KVComponent("latent", (8,)), KVComponent("rope", (4,)), KVComponent("index", (6,)))
    else:
        comps = (KVComponent("k", (2, 4)), KVComponent("v", (2, 4)))
    return KVLayout(model_type, 3, P, kv_dtype, comps)


def page_bytes_of(pool, page):
    """Every byte pool page ``page`` holds (rows and fp8 scales of every layer), as one uint8 tensor."""
    parts = []
    for layer in range(pool.layout.num_layers):
        for c in pool.layout.components:
            parts.append(pool.buffers[layer][c.name][page].reshape(-1).view(torch.uint8))
            if pool.layout.is_fp8:
                parts.append(pool.scales[layer][c.name][page].reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def fill(pool, page, seed):
    """Random bytes in every part of ``page``, a function of ``seed`` (a page's block hash: its expected content)."""
    g = torch.Generator().manual_seed(seed % (2**63))
    for layer in range(pool.layout.num_layers):
        for c in pool.layout.components:
            targets = [pool.buffers[layer][c.name]] + ([pool.scales[layer][c.name]] if pool.layout.is_fp8 else [])
            for t in targets:
                row = t[page].view(torch.uint8)
                row.copy_(torch.randint(0, 256, row.shape, generator=g, dtype=torch.uint8))


def expected_bytes(layout, seed):
    ref = KVPool(layout, 1)
    fill(ref, 0, seed)
    return page_bytes_of(ref, 0)


def make_tiers(pool_pages=24, host_pages=16, policy=HostCachePolicy.WRITE_BACK, kv_dtype="float32"):
    pool = KVPool(make_layout(kv_dtype), pool_pages)
    host = HostCache(pool, host_pages, policy)
    cache = RadixCache(pool.allocator, P)
    cache.lower = host
    return pool, cache, host


def compute(pool, cache, ids, owner="req"):
    """Admit ``ids`` as the scheduler does (L1 match, host match, restore, extend) and 'prefill' the rest: each new
    full page gets the bytes of its block hash. -> (match, private pages, pages restored)."""
    match = cache.match_prefix(ids)
    hm = cache.lower.match_prefix(ids, match)
    n_host = hm.num_pages  # the host tier's pages, then the disk tier's below it
    need = pool.pages_for(len(ids)) - len(match.pages)
    if need > pool.allocator.num_free:
        cache.evict(need - pool.allocator.num_free)
    if need > pool.allocator.num_free:
        cache.lower.release(hm)
        cache.release(match)
        return None
    fresh = pool.allocator.alloc(need, owner)
    restored = cache.lower.restore(hm, fresh[:n_host])
    match, private = cache.extend(match, ids, fresh[:restored]), fresh[restored:]
    hashes = prefix_block_hashes(ids, P)
    for i, page in enumerate(match.pages):
        assert torch.equal(page_bytes_of(pool, page), expected_bytes(pool.layout, hashes[i])), "a wrong page came back"
    for j, page in enumerate(private):
        if len(match.pages) + j < len(hashes):
            fill(pool, page, hashes[len(match.pages) + j])
    return match, private, restored


def finish(pool, cache, ids, match, private, insert=True):
    """The scheduler's release: full pages to the cache, the rest freed; the match unlocked."""
    if insert:
        cache.insert(ids, match.pages + private)
        rest = private[max(0, len(ids) // P - len(match.pages)):]
    else:
        rest = private
    if rest:
        pool.allocator.decref(rest)
    cache.release(match)


def test_host_cache_sizes_and_flags():
    page = 1000
    assert plan_host_cache("64M", page, 0, 0).num_pages == 64_000
    assert plan_host_cache("40G", page, 0, 0).num_pages == 40_000_000
    assert plan_host_cache("8GiB", page, 0, 0).num_pages == (8 << 30) // page
    assert plan_host_cache("0", page, 10**9, 10**12) == (0, "--host-cache-bytes 0: off")
    # auto: twice the pool, capped at a quarter of what the host has available
    assert plan_host_cache("auto", page, 10**6, 10**12).num_pages == 2_000
    assert plan_host_cache("AUTO", page, 10**9, 4 * 10**8).num_pages == int(4 * 10**8 * AUTO_HOST_FRACTION) // page
    for bad in ("12Q", "-5M", "lots", ""):
        with pytest.raises(ValueError):
            plan_host_cache(bad, page, 0, 0)
    with pytest.raises(ValueError, match="holds no page"):
        plan_host_cache("999", page, 0, 0)
    args = build_parser().parse_args(["--host-cache-bytes", "64M", "--host-cache-policy", "write_through"])
    assert (args.host_cache_bytes, args.host_cache_policy) == ("64M", "write_through")
    assert build_parser().parse_args([]).host_cache_bytes == "auto"
    with pytest.raises(ValueError):
        PrefillWorkerConfig(host_cache_bytes="12Q")
    with pytest.raises(ValueError):
        PrefillWorkerConfig(host_cache_policy="write_sideways")
    assert tuple(p.value for p in HostCachePolicy) == HOST_CACHE_POLICIES


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "glm4_moe"])
def test_host_pool_keeps_every_byte_of_a_page(kv_dtype, model_type):
    layout = make_layout(kv_dtype, model_type)
    segs = segments(layout)
    assert sum(s.num_bytes for s in segs) == layout.bytes_per_page()
    assert {(s.layer, s.name, s.scales) for s in segs} == {
        (layer, c.name, sc) for layer in range(layout.num_layers) for c in layout.components
        for sc in ((False, True) if layout.is_fp8 else (False,))}
    src, dst = KVPool(layout, 8), KVPool(layout, 8)
    for page in range(8):
        fill(src, page, 1000 + page)
    host = HostPagePool(layout, 5)
    host.save(src, [6, 1, 3], [4, 0, 2])
    host.load([4, 0, 2], dst, [0, 7, 5])
    for a, b in ((6, 0), (1, 7), (3, 5)):
        assert torch.equal(page_bytes_of(src, a), page_bytes_of(dst, b))
    assert host.checksum(4, 1) != host.checksum(4, 2)
    with pytest.raises(ValueError, match="layout"):
        host.save(KVPool(make_layout("float16", model_type), 2), [0], [1])


def test_layout_hash_tells_layouts_apart():
    hashes = {make_layout(dt, mt).layout_hash() for dt in ("float32", "bfloat16", "fp8_e4m3")
              for mt in ("glm_moe_dsa", "glm4_moe")}
    assert len(hashes) == 6 and make_layout().layout_hash() == make_layout().layout_hash()


def test_write_back_restore_and_extend():
    pool, cache, host = make_tiers()
    ids = list(range(10, 23))  # 3 full pages and a partial one
    m, priv, restored = compute(pool, cache, ids)
    assert restored == 0 and host.num_pages == 0
    finish(pool, cache, ids, m, priv)
    assert cache.num_pages == 3 and host.num_pages == 0  # write-back: nothing copied yet
    assert cache.evict(3) == 3 and host.num_pages == 3 and host.stored_pages == 3
    assert pool.allocator.num_free == pool.num_pages
    m, priv, restored = compute(pool, cache, ids)  # L1 misses, L2 restores all three (bytes checked in compute)
    assert restored == 3 and m.num_tokens == 12 and host.hit_tokens == 12 and cache.num_pages == 3
    assert cache.num_evictable() == 0  # the restored path is locked for the request
    finish(pool, cache, ids, m, priv)
    assert cache.num_evictable() == 3
    cache.evict(3)  # inclusive: the host copies are still there, nothing is copied again
    assert host.stored_pages == 3 and host.num_pages == 3


def test_write_through_copies_at_the_next_admission_and_never_again():
    pool, cache, host = make_tiers(policy=HostCachePolicy.WRITE_THROUGH)
    ids, other = list(range(30, 42)), list(range(70, 78))
    finish(pool, cache, ids, *compute(pool, cache, ids)[:2])
    assert host.num_pending == 3 and host.num_pages == 0  # queued by the thread that finished the request
    m, priv, _ = compute(pool, cache, other)  # the next admission copies them (the scheduler's thread)
    assert host.num_pages == 3 and host.stored_pages == 3 and host.num_pending == 0
    finish(pool, cache, other, m, priv)
    cache.evict(5)  # ids' pages are there already; other's 2 are still queued: evicting stores them once
    assert host.stored_pages == 5 and host.num_pending == 0 and host.num_pages == 5
    assert compute(pool, cache, ids)[2] == 3


def test_corrupt_page_ends_the_restore_and_is_counted():
    pool, cache, host = make_tiers()
    ids = list(range(50, 67))
    finish(pool, cache, ids, *compute(pool, cache, ids)[:2])
    cache.evict(4)
    second = host._entries[prefix_block_hashes(ids, P)[1]]
    host.store.data[second.slot, 5] ^= 0x40
    m, priv, restored = compute(pool, cache, ids)
    assert restored == 1 and host.corrupt_pages == 1 and host.num_pages == 3
    assert host.store.allocator.num_free == host.store.num_pages - 3  # the bad page's slot came back
    finish(pool, cache, ids, m, priv)  # recomputed: the good bytes go back to the host tier on the next eviction
    cache.evict(4)
    m, priv, restored = compute(pool, cache, ids)
    assert restored == 4 and host.corrupt_pages == 1


def test_host_lru_gives_restored_pages_a_second_chance():
    pool, cache, host = make_tiers(pool_pages=8, host_pages=4)
    a, b, c = [list(range(s, s + 8)) for s in (100, 200, 300)]  # 2 pages each
    finish(pool, cache, a, *compute(pool, cache, a)[:2])
    cache.evict(2)
    m, priv, restored = compute(pool, cache, a + [1])  # a is restored once: its pages earn a second chance
    assert restored == 2
    finish(pool, cache, a + [1], m, priv)
    cache.evict(2)
    finish(pool, cache, b, *compute(pool, cache, b)[:2])
    cache.evict(2)  # the host tier is full: a (older, restored once), then b
    finish(pool, cache, c, *compute(pool, cache, c)[:2])
    cache.evict(2)  # c needs room: a is the least recently used but spends its credit; b goes
    hashes = set(host._entries)
    assert set(prefix_block_hashes(a, P)) | set(prefix_block_hashes(c, P)) == hashes and host.evicted_pages == 2


def test_host_tier_publishes_what_it_stores_and_drops():
    pool, cache, host = make_tiers(pool_pages=8, host_pages=2)
    events = []
    host.on_event = lambda stored, dropped: events.append((stored, dropped))
    ids = list(range(10, 22))
    h = prefix_block_hashes(ids, P)  # 3 pages
    finish(pool, cache, ids, *compute(pool, cache, ids)[:2])
    cache.evict(3)  # room for 2: the two nearest the root are kept
    assert events == [([h[1], h[0]], [])] and host.dropped_pages == 1
    snap = PrefillServicer.snapshot(SimpleNamespace(sched=SimpleNamespace(cache=cache, host=host)))
    assert snap.reset and list(snap.stored) == [] and sorted(snap.host_stored) == sorted(h[:2])
    host.store.data[host._entries[h[0]].slot, 0] ^= 1
    assert compute(pool, cache, ids)[2] == 0 and events[-1] == ([], [h[0]])


@pytest.mark.parametrize("policy", list(HostCachePolicy))
def test_random_traffic_restores_exact_bytes_and_leaks_no_page(policy):
    pool, cache, host = make_tiers(pool_pages=20, host_pages=12, policy=policy)
    rng = random.Random(45)
    prefixes = [[rng.randrange(2, 60) for _ in range(rng.randrange(4, 17))] for _ in range(6)]
    held, restored_total = [], 0
    for step in range(1500):
        if held and (len(held) > 3 or rng.random() < 0.5):  # finish (insert) or cancel one request
            ids, m, priv = held.pop(rng.randrange(len(held)))
            finish(pool, cache, ids, m, priv, insert=rng.random() < 0.7)
        else:
            ids = rng.choice(prefixes) + [rng.randrange(2, 60) for _ in range(rng.randrange(0, 9))]
            got = compute(pool, cache, ids, owner=f"r{step}")
            if got is not None:
                held.append((ids, got[0], got[1]))
                restored_total += got[2]
        if rng.random() < 0.05:
            cache.evict(rng.randrange(1, 6))
        assert host.store.allocator.num_free + host.num_pages == host.store.num_pages
    for ids, m, priv in held:
        finish(pool, cache, ids, m, priv, insert=False)
    assert restored_total > 50 and host.evicted_pages > 0  # both tiers were full and evicting
    assert pool.allocator.num_free + cache.num_pages == pool.num_pages and set(pool.allocator.owners()) <= {"radix"}
    assert cache.num_evictable() == cache.num_pages and not any(e.pins for e in host._entries.values())
    cache.reset()
    host.reset()
    assert pool.allocator.num_free == pool.num_pages and host.store.allocator.num_free == host.store.num_pages


def test_tier_metrics_carry_a_tier_label():
    status = generation_pb2.WorkerStatus(worker_id="prefill-0")
    collector = WorkerCollector(lambda: status, lambda: {
        "prefix_cache_hit_tokens": (Labelled("tier", {"device": 96.0, "host": 32.0}), "hits by tier")},
        lambda: {"prefix_cache_bytes": (Labelled("tier", {"device": 10.0, "host": 20.0}), "bytes by tier")})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'pdserve:prefix_cache_hit_tokens_total{tier="host",worker="prefill-0"} 32.0' in text
    assert 'pdserve:prefix_cache_hit_tokens_total{tier="device",worker="prefill-0"} 96.0' in text
    assert 'pdserve:prefix_cache_bytes{tier="host",worker="prefill-0"} 20.0' in text
