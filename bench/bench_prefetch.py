"""TTFT of a request whose prefix is on the disk tier, and of a request that arrives with it, with the prefix loaded
synchronously on the prefill scheduler's thread at admission (``PrefillConfig(prefetch=False)``, the behaviour
before prefetch) vs prefetched on a loader thread from arrival (the default), in one process, interleaved.

    flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.bench_prefetch [--prefix-len 3072] [--disk-mbps 0,200]

Each round, per mode: a fresh scheduler (its thread running) over a fresh disk directory; one request fills the
cache, whose pages are then evicted from the pool and the host tier to disk and dropped from the OS page cache
(fsync + POSIX_FADV_DONTNEED per file: the reads go to the device); then A (the cached prefix + a new tail) and B (a
fresh prompt, no cache hit) are submitted back to back. TTFT is submit -> first token (no network). Also per round:
B alone (its TTFT with nothing else), A with its prefix in the pool (the tail's prefill alone) and the load split
(files read + verified vs the copy into the pool) that bounds what a layer-wise overlap could hide.
``--disk-mbps`` adds a sleep per page read to model a slower device (0: the device as it is).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

from engine.defaults import default_model_dir, tune_malloc
from engine.kvcache import KVLayout, KVPool
from engine.kvcache.page_file import PageFile
from engine.load import load_model
from engine.sampling import SamplingParams
from prefill.disk_cache import DiskCache
from prefill.host_cache import HostCache
from prefill.scheduler import PrefillScheduler
from prefill.config import PrefillConfig
from prefill.task import PrefillResult, PrefillTask
from worker.omp import serial_here

PAGE = 16


class Timed:
    """Wraps ``obj.name`` to add up the seconds spent in it (any thread)."""

    def __init__(self, obj, name: str, delay_s: float = 0.0) -> None:
        self.spent, real = 0.0, getattr(obj, name)

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            if delay_s:
                time.sleep(delay_s)
            try:
                return real(*a, **k)
            finally:
                self.spent += time.perf_counter() - t0
        setattr(obj, name, wrapped)


def drop_page_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for f in files:
            if f.endswith(".kv"):
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def submit(sched: PrefillScheduler, req_id: str, ids: list[int]) -> threading.Event:
    """-> an event set at the answer; ``ev.ttft`` submit -> first token, ``ev.result``."""
    ev = threading.Event()
    t0 = time.perf_counter()

    def done(r) -> None:
        ev.ttft, ev.result = time.perf_counter() - t0, r
        ev.set()
    sched.add(PrefillTask(req_id, ids, SamplingParams(), on_done=done))
    return ev


def wait(ev: threading.Event) -> float:
    if not ev.wait(600) or not isinstance(ev.result, PrefillResult):
        raise RuntimeError(f"request failed: {getattr(ev, 'result', 'no answer')}")
    return ev.ttft


def one_round(model, cfg, args, prefetch: bool, directory: str, rng: torch.Generator, prefix: list[int]) -> dict:
    rand = lambda n: torch.randint(2, cfg.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    shutil.rmtree(directory, ignore_errors=True)
    n_pages = 2 * (args.prefix_len + args.tail_len + args.other_len) // PAGE + 64
    pool = KVPool(KVLayout.for_model(cfg, PAGE, "float32"), n_pages)
    host = HostCache(pool, 16)
    fmt = PageFile(host.store.layout_hash, PAGE, host.store.page_bytes)
    host.lower = disk = DiskCache(directory, 4 * n_pages * fmt.file_bytes, host.store, pool)
    delay = fmt.file_bytes / (args.disk_mbps * 1e6) if args.disk_mbps else 0.0
    reads = Timed(disk.format, "read", delay)
    copies = Timed(host.store, "load_rows")
    sched = PrefillScheduler(model, pool, PrefillConfig(chunk_size=args.chunk_size, max_batch_tokens=args.chunk_size,
                                                        prefetch=prefetch, load_timeout_s=600), host_cache=host)
    sched.start()
    try:
        wait(submit(sched, "fill", prefix + rand(args.tail_len)))
        l1 = wait(submit(sched, "l1", prefix + rand(args.tail_len)))  # the prefix in the pool: the tail alone
        with sched._cv:
            sched.cache.evict(sched.cache.num_pages)
            host.evict(host.num_pages)
        assert disk.flush() and disk.num_pages >= args.prefix_len // PAGE
        drop_page_cache(directory)
        reads.spent = copies.spent = 0.0
        a, b = submit(sched, "a", prefix + rand(args.tail_len)), submit(sched, "b", rand(args.other_len))
        out = {"a": wait(a), "b": wait(b), "l1": l1, "read": reads.spent, "copy": copies.spent,
               "cached": a.result.cached_tokens}
        out["b_alone"] = wait(submit(sched, "b2", rand(args.other_len)))
        return out
    finally:
        sched.stop()
        host.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-len", type=int, default=3072)
    ap.add_argument("--tail-len", type=int, default=64)
    ap.add_argument("--other-len", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--disk-mbps", default="0,200", help="simulated device speeds, MB/s (0: as it is)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the disk tiers go (default: a temporary directory)")
    args = ap.parse_args()
    tune_malloc()
    torch.set_num_threads(args.threads)
    serial_here()  # this thread's torch ops on one thread: the scheduler thread's OpenMP team stays the only one
    model_dir = args.model or default_model_dir()
    model, cfg = load_model(model_dir, "float32", "cpu")
    root = args.dir or tempfile.mkdtemp(prefix="bench-prefetch-")
    rng = torch.Generator().manual_seed(0)
    print(f"model: {model_dir} ({cfg.model_type}), prefix {args.prefix_len} + tail {args.tail_len} tokens (A), "
          f"{args.other_len} fresh tokens (B), chunk {args.chunk_size}, {args.threads} threads, {args.repeats} rounds")
    try:
        for mbps in [float(x) for x in args.disk_mbps.split(",")]:
            args.disk_mbps = mbps
            runs = {True: [], False: []}
            for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
                prefix = torch.randint(2, cfg.vocab_size, (args.prefix_len,), generator=rng).tolist()
                for prefetch in (False, True):
                    runs[prefetch].append(one_round(model, cfg, args, prefetch, os.path.join(root, "disk"), rng,
                                                    prefix))
            report(runs, mbps)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def report(runs: dict, mbps: float) -> None:
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    s, p = med[False], med[True]
    print(f"\ndisk {'as it is (page cache dropped)' if not mbps else f'at {mbps:g} MB/s (simulated)'}; medians, ms:")
    print(f"{'mode':>9} | {'A TTFT':>7} | {'B TTFT':>7} | {'B alone':>7} | {'A, prefix in pool':>17} | "
          f"{'load: read+verify':>17} | {'copy':>5} | cached")
    for name, m in (("sync", s), ("prefetch", p)):
        print(f"{name:>9} | {m['a'] * 1e3:>7.1f} | {m['b'] * 1e3:>7.1f} | {m['b_alone'] * 1e3:>7.1f} | "
              f"{m['l1'] * 1e3:>17.1f} | {m['read'] * 1e3:>17.1f} | {m['copy'] * 1e3:>5.1f} | {m['cached']:.0f}")
    ratio = lambda f: statistics.median(b[f] / a[f] for a, b in zip(runs[False], runs[True]))  # noqa: E731
    print(f"prefetch / sync (median of adjacent pairs): A TTFT {ratio('a'):.2f}x, B TTFT {ratio('b'):.2f}x")


if __name__ == "__main__":
    main()
