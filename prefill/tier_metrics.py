"""The prefix cache's figures per tier (device, host, disk) for a prefill worker's status and /metrics
(``worker.metrics``): ``tier_info`` for ``WorkerStatus.info``, ``tier_counters`` (the load latency histograms too)
and ``tier_gauges`` for the Prometheus collector. A tier that is off reports nothing."""
from __future__ import annotations

from prefill.host_cache import HostCache
from engine.kvcache.radix import RadixCache
from worker.metrics import Histogram, Labelled, Values


def tier_info(host: HostCache | None) -> dict[str, str]:
    """The host and disk tiers' figures for ``WorkerStatus.info``."""
    if host is None:
        return {}
    st = host.stats()
    out = {"host_cache_pages": str(st.cached_pages), "host_cache_capacity_pages": str(st.capacity_pages),
           "host_cache_hit_tokens": str(st.hit_tokens), "host_cache_corrupt_pages": str(st.corrupt_pages)}
    if host.lower is not None:
        d = host.lower.stats()
        out.update(disk_cache_dir=host.lower.dir, disk_cache_pages=str(d.cached_pages),
                   disk_cache_capacity_bytes=str(d.capacity_bytes), disk_cache_hit_tokens=str(d.hit_tokens),
                   disk_cache_corrupt_pages=str(d.corrupt_pages), disk_cache_indexed_pages=str(d.indexed_pages))
    return out


def tier_counters(cache: RadixCache, host: HostCache | None) -> Values:
    """Monotonic totals of the tiers below the device (hit tokens by tier, pages stored, evicted, recomputed)."""
    if host is None:
        return {}
    d = host.lower
    disk = {} if d is None else {
        "prefix_cache_disk_stored_pages": (d.stored_pages, "KV pages written to the disk tier"),
        "prefix_cache_disk_evicted_pages": (d.evicted_pages, "KV pages evicted from the disk tier"),
        "prefix_cache_disk_dropped_pages": (d.dropped_pages, "KV pages not written to the disk tier (its queue "
                                                             "full, no room or a failed write)")}
    hits = {"device": cache.hit_tokens, "host": host.hit_tokens, **({"disk": d.hit_tokens} if d is not None else {})}
    bad = {"host": host.corrupt_pages, **({"disk": d.corrupt_pages} if d is not None else {})}
    late = {"host": host.late_pages, **({"disk": d.late_pages} if d is not None else {})}
    loads = {"host": host.load_times, **({"disk": d.load_times} if d is not None else {})}
    return {"prefix_cache_hit_tokens": (Labelled("tier", hits), "Prompt tokens found in the prefix cache, by tier"),
            "prefix_cache_host_stored_pages": (host.stored_pages, "KV pages copied into the host tier"),
            "prefix_cache_host_evicted_pages": (host.evicted_pages, "KV pages evicted from the host tier"),
            "prefix_cache_recomputed_pages": (Labelled("tier", bad),
                                              "Cached KV pages that failed their checksum and were recomputed"),
            "prefix_cache_late_pages": (Labelled("tier", late), "Cached KV pages not loaded within the load timeout "
                                                                "(the request went on and recomputed them)"),
            "prefix_cache_load_seconds": (Histogram("tier", {k: (t.buckets(), t.sum_s) for k, t in loads.items()}),
                                          "Seconds a request's pages from a tier took to load (read, verified, copied "
                                          "into the KV pool) on a loader thread"),
            **disk}


def tier_gauges(cache: RadixCache, host: HostCache | None, page_bytes: int) -> Values:
    """The prefix cache's bytes per tier now."""
    tiers = {"device": cache.num_pages * page_bytes}
    if host is not None:
        tiers["host"] = host.stats().cached_bytes
    if host is not None and host.lower is not None:
        tiers["disk"] = host.lower.used_bytes
    return {"prefix_cache_bytes": (Labelled("tier", tiers), "KV bytes held by the prefix cache, by tier")}
