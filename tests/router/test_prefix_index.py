"""The router's block hashes equal the prefill worker's, and the index matches the prefix a worker really holds."""
from hypothesis import given, settings, strategies as st

from engine.kvcache import radix
from router.prefix_index import PrefixIndex, PromptHashes, block_hash, prefix_block_hashes


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), page=st.sampled_from([1, 2, 4, 16]))
def test_block_hashes_equal_prefill_radix(ids, page):
    assert prefix_block_hashes(ids, page) == radix.prefix_block_hashes(ids, page)
    if len(ids) >= page:
        assert block_hash(7, ids[:page]) == radix.block_hash(7, ids[:page])


def test_prompt_hashes_are_lazy_and_memoised():
    ids = list(range(100))
    p = PromptHashes(ids, 16)
    assert p.num_blocks == 6 and p._hashes == []
    assert p[2] == prefix_block_hashes(ids, 16)[2] and len(p._hashes) == 3


def test_longest_prefix_per_worker():
    ids = list(range(64))
    h = prefix_block_hashes(ids, 16)  # 4 blocks
    idx = PrefixIndex()
    idx.apply("a", stored=h[:3])
    idx.apply("b", stored=h[:1])
    idx.apply("c", stored=h[1:])  # no root block: holds nothing usable for this prompt
    assert idx.match(PromptHashes(ids, 16), ["a", "b", "c", "d"]) == {"a": 3, "b": 1, "c": 0, "d": 0}
    # a diverging prompt shares only the first block
    other = ids[:16] + [999] * 48
    assert idx.match(PromptHashes(other, 16), ["a", "b"]) == {"a": 1, "b": 1}


def test_evict_reset_and_drop():
    ids = list(range(48))
    h = prefix_block_hashes(ids, 16)
    idx = PrefixIndex()
    idx.apply("a", stored=h)
    idx.apply("b", stored=h)
    idx.apply("a", evicted=[h[2]])
    p = PromptHashes(ids, 16)
    assert idx.match(p, ["a", "b"]) == {"a": 2, "b": 3}
    idx.apply("b", stored=h[:1], reset=True)  # snapshot after a resync
    assert idx.match(p, ["a", "b"]) == {"a": 2, "b": 1} and idx.num_blocks("b") == 1
    idx.drop("a")
    assert idx.match(p, ["a", "b"]) == {"a": 0, "b": 1}
    idx.drop("b")
    assert idx._holders == {}


def test_match_with_radix_cache_events():
    """Events published by a real RadixCache drive the index to the same answer as the cache itself."""
    from engine.kvcache.pool import PageAllocator
    events = []
    cache = radix.RadixCache(PageAllocator(64), 4, on_event=lambda s, e: events.append((s, e)))
    alloc = cache.allocator
    a = list(range(20))
    cache.insert(a, alloc.alloc(5, "req"))
    cache.insert(a[:8] + [50] * 8, alloc.alloc(4, "req"))
    idx = PrefixIndex()
    for evict in (0, 2, 3):
        cache.evict(evict)
        for stored, evicted in events:
            idx.apply("w", stored, evicted)
        events.clear()
        for q in (a, a[:8] + [50] * 12, [3] * 12):
            m = cache.match_prefix(q)
            cache.release(m)
            assert idx.match(PromptHashes(q, 4), ["w"])["w"] * 4 == m.num_tokens
        assert sorted(idx._by_worker["w"]) == sorted(cache.all_hashes())


def test_host_tier_continues_where_the_device_match_ends():
    ids = list(range(64))
    h = prefix_block_hashes(ids, 16)
    idx = PrefixIndex()
    idx.apply("a", stored=h[:1], host_stored=h[1:3])
    idx.apply("b", host_stored=h[1:])  # no first block anywhere: nothing usable
    idx.apply("c", stored=h[:2], host_stored=h[:4])  # inclusive host tier: counted after the device run only
    p = PromptHashes(ids, 16)
    assert idx.match_tiers(p, ["a", "b", "c", "d"]) == {"a": (1, 2, 0), "b": (0, 0, 0), "c": (2, 2, 0),
                                                        "d": (0, 0, 0)}
    assert idx.match(p, ["a", "c"]) == {"a": 1, "c": 2} and idx.num_host_blocks("c") == 4
    idx.apply("a", host_evicted=[h[2]])
    idx.apply("c", stored=h[:1], host_stored=h[:1], reset=True)
    assert idx.match_tiers(p, ["a", "c"]) == {"a": (1, 1, 0), "c": (1, 0, 0)}
    idx.drop("a")
    assert idx.match_tiers(p, ["a"]) == {"a": (0, 0, 0)} and idx.num_host_blocks("a") == 0


def test_disk_tier_continues_where_the_host_match_ends():
    ids = list(range(96))
    h = prefix_block_hashes(ids, 16)  # 6 blocks
    idx = PrefixIndex()
    idx.apply("a", stored=h[:1], host_stored=h[1:2], disk_stored=h[:5])  # inclusive disk: after the host run only
    idx.apply("b", disk_stored=h[:3])  # only on disk: still usable, from the root
    idx.apply("c", stored=h[:2], disk_stored=h[3:])  # a gap (block 2 nowhere): the disk run never starts
    p = PromptHashes(ids, 16)
    assert idx.match_tiers(p, ["a", "b", "c"]) == {"a": (1, 1, 3), "b": (0, 0, 3), "c": (2, 0, 0)}
    idx.apply("a", disk_evicted=[h[3]])
    assert idx.match_tiers(p, ["a"])["a"] == (1, 1, 1) and idx.num_disk_blocks("a") == 4
    idx.apply("b", reset=True, stored=h[:1])
    assert idx.match_tiers(p, ["b"])["b"] == (1, 0, 0) and idx.num_disk_blocks("b") == 0
    idx.drop("a")
    assert idx.num_disk_blocks("a") == 0


def test_match_tiers_with_radix_and_host_cache_events():
    """Events published by a real RadixCache and its HostCache drive the index to the worker's own two-tier
    lookup: the pool's match, then the host tier's continuation."""
    from engine.kvcache import KVComponent, KVLayout, KVPool
    from prefill.host_cache import HostCache
    pool = KVPool(KVLayout("glm_moe_dsa", 1, 4, "float32", (KVComponent("latent", (4,)),)), 16)
    idx = PrefixIndex()
    cache = radix.RadixCache(pool.allocator, 4, on_event=lambda s, e: idx.apply("w", s, e))
    host = HostCache(pool, 5)
    host.on_event = lambda s, e: idx.apply("w", host_stored=s, host_evicted=e)
    cache.lower = host
    prompts = [list(range(20)), list(range(8)) + [50] * 12, [3] * 16, [7] * 12]
    for q in prompts:
        cache.insert(q, pool.allocator.alloc(len(q) // 4, "req"))
    for evict in (2, 3, 4, 6):
        cache.evict(evict)  # pages move down to the host tier (5 pages: it evicts too)
        for q in prompts + [list(range(16)) + [1] * 4]:
            m = cache.match_prefix(q)
            hm = host.match_prefix(q, m)
            host.release(hm)
            cache.release(m)
            assert idx.match_tiers(PromptHashes(q, 4), ["w"])["w"] == (len(m.pages), len(hm.entries), 0)
        assert sorted(idx._host_by_worker["w"]) == sorted(host.all_hashes())
