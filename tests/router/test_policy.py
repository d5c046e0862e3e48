"""Routing policies as pure functions of worker views and the prefix index."""
import collections

import pytest

from router.config import RouterConfig
from router.policy import POLICIES, Candidate, CacheAwarePolicy, make_policy, order_decode, use_local_prefill
from router.prefix_index import PrefixIndex, PromptHashes, prefix_block_hashes


def cands(*loads, **kw):
    return [Candidate(f"w{i}", load, **kw) for i, load in enumerate(loads)]


def test_every_configured_policy_is_registered():
    assert set(POLICIES) == {"cache_aware", "round_robin", "least_load", "random"}
    for name in POLICIES:
        assert make_policy(RouterConfig(routing=name)).name == name


def test_round_robin_and_random_spread():
    idx = PrefixIndex()
    rr = make_policy(RouterConfig(routing="round_robin"))
    assert [rr.choose(cands(0, 0, 0), None, idx).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2
    rnd = POLICIES["random"](None, seed=1)
    seen = collections.Counter(rnd.choose(cands(0, 0, 0), None, idx).worker_id for _ in range(300))
    assert set(seen) == {"w0", "w1", "w2"} and min(seen.values()) > 60


def test_least_load_picks_lightest_and_rotates_ties():
    ll = make_policy(RouterConfig(routing="least_load"))
    idx = PrefixIndex()
    assert ll.choose(cands(3, 1, 2), None, idx).worker_id == "w1"
    assert {ll.choose(cands(0, 0), None, idx).worker_id for _ in range(4)} == {"w0", "w1"}


def _index_with(worker: str, ids, page=4):
    idx = PrefixIndex()
    idx.apply(worker, stored=prefix_block_hashes(ids, page))
    return idx


def test_cache_aware_prefers_the_worker_holding_the_prefix():
    ids = list(range(40))
    idx = _index_with("w1", ids[:24])
    pol = CacheAwarePolicy(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    c = pol.choose(cands(1, 2, 0), PromptHashes(ids, 4), idx)
    assert c.worker_id == "w1" and c.matched_tokens == 24 and c.reason == "prefix"


def test_cache_aware_falls_back_to_least_load_when_imbalanced():
    ids = list(range(40))
    idx = _index_with("w1", ids)
    pol = CacheAwarePolicy(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    # 9 - 1 > 2 and 9 > 1.5 * 1: imbalanced -> least load even though w1 holds the prefix
    c = pol.choose(cands(1, 9, 4), PromptHashes(ids, 4), idx)
    assert c.worker_id == "w0" and c.reason == "least_load"
    # absolute gap within the threshold: still cache-aware
    assert pol.choose(cands(1, 3, 2), PromptHashes(ids, 4), idx).worker_id == "w1"
    # relative gap within the threshold: still cache-aware
    pol2 = CacheAwarePolicy(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=3.0))
    assert pol2.choose(cands(4, 9), PromptHashes(ids, 4), idx).worker_id == "w1"


def test_cache_aware_cold_prompt_goes_to_lighter_then_emptier_worker():
    idx = _index_with("w0", list(range(100, 140)))
    pol = CacheAwarePolicy(RouterConfig())
    cold = PromptHashes(list(range(40)), 4)
    assert pol.choose(cands(1, 0), cold, idx).worker_id == "w1"
    # equal load: the worker holding fewer blocks (spreads the cache)
    assert {pol.choose(cands(0, 0), cold, idx).worker_id for _ in range(4)} == {"w1"}


def test_decode_order_prefers_room_then_fewer_running():
    cs = [Candidate("full", 0, pages_free=2, pages_total=64), Candidate("busy", 5, pages_free=50, pages_total=64),
          Candidate("idle", 1, pages_free=40, pages_total=64)]
    assert [c.worker_id for c in order_decode(cs, need_pages=10)] == ["idle", "busy", "full"]


@pytest.mark.parametrize("below,supports,n,expect", [(0, True, 5, False), (8, True, 5, True), (8, True, 8, False),
                                                     (8, False, 5, False)])
def test_local_prefill_decision(below, supports, n, expect):
    d = Candidate("d", 0, supports_local_prefill=supports)
    assert use_local_prefill(n, RouterConfig(local_prefill_below=below), d) is expect


def test_cache_aware_scores_a_device_hit_over_a_host_hit_over_nothing():
    ids = list(range(40))
    h = prefix_block_hashes(ids, 4)
    idx = PrefixIndex()
    idx.apply("w0", stored=h[:4])  # 4 blocks in its KV pool
    idx.apply("w1", stored=h[:1], host_stored=h[1:4])  # 1 in the pool, the next 3 in its host tier
    idx.apply("w2", host_stored=h[:4])  # 4 in its host tier
    pol = CacheAwarePolicy(RouterConfig())
    p = PromptHashes(ids, 4)
    assert pol.choose(cands(0, 0, 0, 0), p, idx) == ("w0", 16, "prefix")
    assert pol.choose(cands(9, 0, 0, 0)[1:], p, idx) == ("w1", 16, "prefix")  # 1 + 0.9 x 3 > 0.9 x 4
    assert pol.choose(cands(0, 0, 0, 0)[2:], p, idx) == ("w2", 16, "host_prefix")  # a host hit beats nothing
    idx.apply("w2", host_stored=h[4:8])
    assert pol.choose(cands(0, 0, 0, 0), p, idx).worker_id == "w2"  # 0.9 x 8 blocks > 4 on the device
    assert CacheAwarePolicy(RouterConfig(host_hit_weight=0.0)).choose(cands(0, 0, 0, 0), p, idx).worker_id == "w0"
    with pytest.raises(ValueError, match="host_hit_weight"):
        RouterConfig(host_hit_weight=1.5)


def test_cache_aware_scores_a_host_hit_over_a_disk_hit_over_nothing():
    ids = list(range(40))
    h = prefix_block_hashes(ids, 4)
    idx = PrefixIndex()
    idx.apply("w0", host_stored=h[:4])  # 4 blocks in its host tier
    idx.apply("w1", disk_stored=h[:4])  # 4 on its disk
    pol = CacheAwarePolicy(RouterConfig())
    p = PromptHashes(ids, 4)
    assert pol.choose(cands(0, 0, 0), p, idx) == ("w0", 16, "host_prefix")
    assert pol.choose(cands(0, 0, 0)[1:], p, idx) == ("w1", 16, "disk_prefix")  # a disk hit beats nothing
    idx.apply("w1", disk_stored=h[4:10])
    assert pol.choose(cands(0, 0, 0), p, idx) == ("w1", 40, "disk_prefix")  # 0.6 x 10 blocks > 0.9 x 4
    assert CacheAwarePolicy(RouterConfig(disk_hit_weight=0.0)).choose(cands(0, 0, 0), p, idx).worker_id == "w0"
    with pytest.raises(ValueError, match="disk_hit_weight"):
        RouterConfig(disk_hit_weight=-0.1)
