"""A prefix restored from the disk tier is exactly a computed prefix, under the real prefill scheduler, for the tiny
GLM-5 (glm_moe_dsa) and glm4_moe, each with an MTP layer (``test_host_tier_exact``'s models and checks: bit-identical
first-token logits, KV rows of every layer and component, pages' bytes and MTP draft state, so the same decoded
tokens and speculative acceptance), also after a restart: a new scheduler, pool and host tier over the same
directory."""
import os
from types import SimpleNamespace

from engine.kvcache import KVLayout, KVPool
from engine.kvcache.page_file import PageFile
from prefill.disk_cache import DiskCache
from prefill.host_cache import HostCache
from engine.kvcache.radix import prefix_block_hashes
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillResult
from prefill.server import PrefillServicer
import test_host_tier_exact as host_exact
from test_host_tier_exact import PAGE, assert_no_page_leaked, assert_same_state, make_sched, prefill_once, prompt, \
    random_sessions

tiny = host_exact.tiny  # the host tier tests' fixtures: the same two tiny models with an MTP layer
logits_seen = host_exact.logits_seen


def make_disk_sched(tiny, directory, num_pages=64, host_pages=8, disk_pages=32):
    model, cfg = tiny
    pool = KVPool(KVLayout.for_model(cfg, PAGE, "float32"), num_pages)
    host = HostCache(pool, host_pages)
    file_bytes = PageFile(host.store.layout_hash, PAGE, host.store.page_bytes).file_bytes
    host.lower = DiskCache(str(directory), disk_pages * file_bytes, host.store, pool)
    return PrefillScheduler(model, pool, PrefillConfig(chunk_size=32, max_batch_tokens=64), host_cache=host)


def to_disk(sched):
    """Evict everything from the pool and the host tier: what they held is on disk only."""
    sched.cache.evict(sched.cache.num_pages)
    sched.host.evict(sched.host.num_pages)
    assert sched.host.lower.flush() and sched.cache.num_pages == sched.host.num_pages == 0


def test_restore_from_disk_equals_cold_prefill_also_after_a_restart(tiny, tmp_path, logits_seen):
    ids = prompt(tiny[1], 100, seed=7)
    cold = prefill_once(make_sched(tiny), ids, "cold", logits_seen)
    sched = make_disk_sched(tiny, tmp_path)
    prefill_once(sched, ids, "a", logits_seen)
    to_disk(sched)
    assert sched.host.lower.num_pages == 6
    warm_from_disk(sched, ids, "b", cold, logits_seen)
    sched.host.close()
    again = make_disk_sched(tiny, tmp_path)  # a restarted worker: fresh pool and host tier, the same directory
    assert again.host.lower.indexed_pages == 6
    warm_from_disk(again, ids, "c", cold, logits_seen)
    again.host.close()


def warm_from_disk(sched, ids, name, cold, logits_seen):
    """Prefill ``ids`` (100 tokens) again: 96 come from the disk tier, 4 are computed, the state is ``cold``'s."""
    computed = sched.tokens_done
    warm = prefill_once(sched, ids, name, logits_seen)
    assert warm[0].cached_tokens == 96 and sched.host.lower.hit_tokens == 96 and sched.tokens_done - computed == 4
    assert_same_state(warm, cold)


def test_corrupt_disk_page_is_recomputed_with_identical_output(tiny, tmp_path, logits_seen):
    ids = prompt(tiny[1], 100, seed=8)
    cold = prefill_once(make_sched(tiny), ids, "cold", logits_seen)
    sched = make_disk_sched(tiny, tmp_path)
    prefill_once(sched, ids, "a", logits_seen)
    to_disk(sched)
    disk = sched.host.lower
    with open(os.path.join(disk.dir, f"{prefix_block_hashes(ids, PAGE)[2]:016x}.kv"), "r+b") as f:
        f.seek(disk.file_bytes // 2)  # one bit of the third page's bytes
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    computed = sched.tokens_done
    warm = prefill_once(sched, ids, "b", logits_seen)
    assert warm[0].cached_tokens == 32 and sched.tokens_done - computed == 68  # pages 0-1 restored, 2.. recomputed
    assert disk.corrupt_pages == 1
    assert_same_state(warm, cold)
    servicer = SimpleNamespace(sched=sched, kv_transfers=0, kv_bytes=0, kv_seconds=0.0)
    counters = PrefillServicer.counters(servicer)
    assert counters["prefix_cache_recomputed_pages"][0].values == {"host": 0, "disk": 1}
    assert counters["prefix_cache_hit_tokens"][0].values["disk"] == 32
    assert counters["prefix_cache_disk_stored_pages"][0] == 6
    tiers = PrefillServicer.gauges(servicer)["prefix_cache_bytes"][0].values
    assert tiers["disk"] == disk.num_pages * disk.file_bytes > 0
    sched.host.close()


def test_random_sessions_with_cancels_leak_no_page_file_or_fd(tiny, tmp_path):
    """Sessions through a pool, a host tier and a disk tier all too small for them (every tier evicts), with
    cancels; then no pool page, host slot, disk pin, file or file descriptor is left over."""
    fds = len(os.listdir("/proc/self/fd"))
    sched = make_disk_sched(tiny, tmp_path, num_pages=16, host_pages=4, disk_pages=12)
    res = random_sessions(sched, tiny[1], num_requests=12, num_sessions=6)
    disk = sched.host.lower
    assert disk.flush()
    assert sum(isinstance(r, PrefillResult) for r in res.values()) >= 5 and disk.hit_tokens > 0
    assert disk.evicted_pages > 0
    assert_no_page_leaked(sched)
    assert not any(e.pins for e in disk._entries.values()) and disk.used_bytes <= disk.capacity_bytes
    assert sorted(f for f in os.listdir(disk.dir) if f != ".lock") == sorted(f"{h:016x}.kv" for h in disk.all_hashes())
    sched.stop()
    sched.host.close()
    assert len(os.listdir("/proc/self/fd")) == fds and not disk._writer.is_alive()
