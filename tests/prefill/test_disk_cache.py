"""The prefix cache's disk tier without a model: sizes, the page files, restore through all three tiers, a restart
over the same directory, a bad file of every kind recomputed, the writer off the caller's path, and random traffic
(every restored page holds exactly the bytes stored for its prefix; no page, file or fd leaks). Under the real
scheduler and model: test_disk_tier_exact.py."""
import logging
import os
import random

import pytest

import prefill.disk_cache as dc
from engine.kvcache import KVPool
from engine.kvcache.page_file import PageFile
from prefill.disk_cache import DiskCache, plan_disk_cache
from prefill.host_cache import HostCache, HostCachePolicy
from engine.kvcache.radix import RadixCache, prefix_block_hashes
from prefill.config import PrefillWorkerConfig
from prefill.server import build_parser
from test_host_cache import P, compute, finish, make_layout

IDS = list(range(10, 27))  # 4 full pages and a partial one


def make_tiers(directory, pool_pages=24, host_pages=4, disk_pages=16, policy=HostCachePolicy.WRITE_BACK,
               kv_dtype="float32"):
    pool = KVPool(make_layout(kv_dtype), pool_pages)
    host = HostCache(pool, host_pages, policy)
    file_bytes = PageFile(host.store.layout_hash, P, host.store.page_bytes).file_bytes
    disk = DiskCache(str(directory), disk_pages * file_bytes, host.store, pool)
    cache = RadixCache(pool.allocator, P)
    cache.lower, host.lower = host, disk
    return pool, cache, host, disk


def push_to_disk(pool, cache, host, disk, ids):
    """Prefill ``ids``, then evict its pages from the pool and the host tier: they are on disk only."""
    finish(pool, cache, ids, *compute(pool, cache, ids)[:2])
    cache.evict(cache.num_pages)
    host.evict(host.num_pages)
    assert disk.flush() and cache.num_pages == host.num_pages == 0


def files(disk, suffix=".kv"):
    return sorted(f for f in os.listdir(disk.dir) if f.endswith(suffix))


def test_disk_cache_sizes_and_flags(tmp_path):
    assert plan_disk_cache(None, "auto").capacity_bytes == 0 and plan_disk_cache(None, "0").capacity_bytes == 0
    with pytest.raises(ValueError, match="needs --disk-cache-dir"):
        plan_disk_cache(None, "64M")
    assert plan_disk_cache(str(tmp_path), "64M").capacity_bytes == 64_000_000
    assert plan_disk_cache(str(tmp_path), "40G").capacity_bytes == 40 * 10**9
    assert plan_disk_cache(str(tmp_path), "0") == (0, "--disk-cache-bytes 0: off")
    assert plan_disk_cache(str(tmp_path / "new"), "auto").capacity_bytes > 0  # made, half its free space
    for bad in ("12Q", "-5M", ""):
        with pytest.raises(ValueError):
            plan_disk_cache(str(tmp_path), bad)
    args = build_parser().parse_args(["--disk-cache-dir", str(tmp_path), "--disk-cache-bytes", "2G"])
    assert (args.disk_cache_dir, args.disk_cache_bytes) == (str(tmp_path), "2G")
    assert build_parser().parse_args([]).disk_cache_dir is None
    with pytest.raises(ValueError):
        PrefillWorkerConfig(disk_cache_dir=str(tmp_path), disk_cache_bytes="12Q")
    with pytest.raises(ValueError, match="needs --disk-cache-dir"):
        PrefillWorkerConfig(disk_cache_bytes="1G")
    with pytest.raises(ValueError, match="host tier"):
        PrefillWorkerConfig(disk_cache_dir=str(tmp_path), host_cache_bytes="0")


def test_pages_come_back_from_disk_and_after_a_restart(tmp_path):
    pool, cache, host, disk = make_tiers(tmp_path)
    events = []
    disk.on_event = lambda stored, dropped: events.append((stored, dropped))
    h = prefix_block_hashes(IDS, P)
    push_to_disk(pool, cache, host, disk, IDS)
    assert disk.dir == str(tmp_path / f"{pool.layout.layout_hash():016x}")
    assert files(disk) == sorted(f"{x:016x}.kv" for x in h) and not files(disk, ".tmp")
    assert sorted(x for s, _ in events for x in s) == sorted(h) and disk.stored_pages == 4
    m, priv, restored = compute(pool, cache, IDS)  # L1 and L2 miss; all four from disk (bytes checked in compute)
    assert restored == 4 and disk.hit_tokens == 16 and host.hit_tokens == 0 and disk.num_pages == 4
    finish(pool, cache, IDS, m, priv)
    host.close()  # closes the disk tier: its writer and the directory lock
    pool, cache, host, disk = make_tiers(tmp_path)  # a new worker over the same directory
    assert disk.indexed_pages == 4 and sorted(disk.all_hashes()) == sorted(h)
    m, priv, restored = compute(pool, cache, IDS)
    assert restored == 4 and disk.hit_tokens == 16
    finish(pool, cache, IDS, m, priv)
    host.close()


def test_host_and_disk_tiers_continue_each_other(tmp_path):
    pool, cache, host, disk = make_tiers(tmp_path, host_pages=8)
    finish(pool, cache, IDS, *compute(pool, cache, IDS)[:2])
    cache.evict(4)  # all four in the host tier
    assert host.evict(2) == 2 and disk.flush()  # its two LRU pages (the chain's last two) go down to disk
    m, priv, restored = compute(pool, cache, IDS)
    assert restored == 4 and (host.hit_tokens, disk.hit_tokens) == (8, 8)
    finish(pool, cache, IDS, m, priv)
    host.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "missing", "header"])
def test_a_bad_page_file_ends_the_restore_and_is_recomputed(tmp_path, damage):
    pool, cache, host, disk = make_tiers(tmp_path)
    push_to_disk(pool, cache, host, disk, IDS)
    path = os.path.join(disk.dir, f"{prefix_block_hashes(IDS, P)[1]:016x}.kv")
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncate":
        os.truncate(path, disk.file_bytes - 1)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:  # a bit of the payload, or of the header's parent hash
        with open(path, "r+b") as f:
            f.seek(disk.file_bytes // 2 if damage == "flip" else 24)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
    m, priv, restored = compute(pool, cache, IDS)
    assert restored == 1 and disk.corrupt_pages == 1 and disk.num_pages == 3 and not os.path.exists(path)
    finish(pool, cache, IDS, m, priv)  # recomputed: the good bytes go down again on the next evictions
    cache.evict(4)
    host.evict(4)
    assert disk.flush() and disk.num_pages == 4
    assert compute(pool, cache, IDS)[2] == 4
    host.close()


def test_a_page_being_written_is_not_a_hit_and_a_full_queue_drops(tmp_path, monkeypatch):
    monkeypatch.setattr(dc, "QUEUE_BYTES", 0)  # a queue of 4 pages
    pool, cache, host, disk = make_tiers(tmp_path, host_pages=8)
    other = list(range(100, 124))  # 6 pages
    with disk._lock:  # the writer cannot commit meanwhile
        finish(pool, cache, IDS, *compute(pool, cache, IDS)[:2])
        cache.evict(4)
        host.evict(4)
        assert compute(pool, cache, IDS + [1])[2] == 0 and disk.num_pages == 0  # queued, not a hit
        cache.reset()
        finish(pool, cache, other, *compute(pool, cache, other)[:2])
        cache.evict(6)
        host.evict(6)  # 4 queued (one of them taken by the writer), 6 more: at least 5 find the queue full
        assert disk.dropped_pages >= 5
    assert disk.flush() and disk.num_pages + disk.dropped_pages == 10 and disk.num_pages >= 4
    assert compute(pool, cache, IDS + [1])[2] == 4
    host.close()


def test_write_through_writes_to_disk_at_store(tmp_path):
    pool, cache, host, disk = make_tiers(tmp_path, host_pages=8, policy=HostCachePolicy.WRITE_THROUGH)
    finish(pool, cache, IDS, *compute(pool, cache, IDS)[:2])
    compute(pool, cache, [5] * 3)  # the next admission copies the pages to the host tier, which queues them too
    assert disk.flush() and disk.num_pages == 4 and host.num_pages == 4 and cache.num_pages == 4
    host.close()


def test_start_removes_tmp_files_keeps_the_budget_and_ignores_other_layouts(tmp_path, caplog):
    pool, cache, host, disk = make_tiers(tmp_path, pool_pages=32, host_pages=8)
    ids = list(range(40, 64))  # 6 pages
    push_to_disk(pool, cache, host, disk, ids)
    with pytest.raises(RuntimeError, match="in use by another process"):
        DiskCache(str(tmp_path), 10**6, host.store, pool)
    host.close()
    h = prefix_block_hashes(ids, P)
    for i, x in enumerate(h):  # the root page oldest
        os.utime(os.path.join(disk.dir, f"{x:016x}.kv"), ns=(10**18 + i * 10**9,) * 2)
    open(os.path.join(disk.dir, f"{h[0]:016x}.kv.tmp"), "wb").close()  # a write a crash interrupted
    with open(os.path.join(disk.dir, "feedfacefeedface.kv"), "wb") as f:  # not a page of this layout
        f.write(b"x" * disk.file_bytes)
    other = make_tiers(tmp_path / "o", kv_dtype="bfloat16")
    other_ids = list(range(70, 78))
    push_to_disk(*other[:4], other_ids)
    other[2].close()
    os.rename(other[3].dir, os.path.join(tmp_path, os.path.basename(other[3].dir)))
    caplog.set_level(logging.INFO, logger="prefill.disk_cache")
    pool = KVPool(make_layout(), 8)
    disk = DiskCache(str(tmp_path), 4 * disk.file_bytes, HostCache(pool, 1).store, pool)
    assert disk.indexed_pages == 6 and disk.evicted_pages == 2 and disk.num_pages == 4
    assert files(disk) == sorted(f"{x:016x}.kv" for x in h[2:]) and not files(disk, ".tmp")
    assert sum("ignoring 2 pages of 1 other layouts" in r.getMessage() for r in caplog.records) == 1
    disk.close()


@pytest.mark.parametrize("policy", list(HostCachePolicy))
def test_random_traffic_through_three_tiers_restores_exact_bytes_and_leaks_nothing(tmp_path, policy):
    fds = len(os.listdir("/proc/self/fd"))
    pool, cache, host, disk = make_tiers(tmp_path, pool_pages=16, host_pages=6, disk_pages=10, policy=policy)
    rng = random.Random(45)
    prefixes = [[rng.randrange(2, 60) for _ in range(rng.randrange(4, 17))] for _ in range(6)]
    held, restored = [], 0
    for step in range(500):
        if held and (len(held) > 3 or rng.random() < 0.5):  # finish (insert) or cancel one request
            ids, m, priv = held.pop(rng.randrange(len(held)))
            finish(pool, cache, ids, m, priv, insert=rng.random() < 0.7)
        else:
            ids = rng.choice(prefixes) + [rng.randrange(2, 60) for _ in range(rng.randrange(0, 9))]
            got = compute(pool, cache, ids, owner=f"r{step}")
            if got is not None:
                held.append((ids, got[0], got[1]))
                restored += got[2]
        if rng.random() < 0.1:
            cache.evict(rng.randrange(1, 6))
        if rng.random() < 0.05:
            disk.flush()
    for ids, m, priv in held:
        finish(pool, cache, ids, m, priv, insert=False)
    assert disk.flush()
    assert restored > 30 and disk.hit_tokens > 0 and disk.evicted_pages > 0  # all three tiers were used and full
    assert pool.allocator.num_free + cache.num_pages == pool.num_pages and set(pool.allocator.owners()) <= {"radix"}
    assert not any(e.pins for e in host._entries.values()) and not any(e.pins for e in disk._entries.values())
    assert files(disk) == sorted(f"{x:016x}.kv" for x in disk.all_hashes()) and not files(disk, ".tmp")
    assert disk.used_bytes == disk.num_pages * disk.file_bytes <= disk.capacity_bytes
    cache.reset()  # its pages go down (write-back: to the host tier; write-through: queued for the disk too)
    host.reset()
    assert disk.flush()
    disk.reset()
    host.close()
    assert pool.allocator.num_free == pool.num_pages and host.store.allocator.num_free == host.store.num_pages
    assert files(disk) == [] and len(os.listdir("/proc/self/fd")) == fds and not disk._writer.is_alive()
