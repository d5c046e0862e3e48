"""The prefix cache's hit rate by tier, from the prefill workers' ``/metrics`` scraped before and after a step.

Every prefill worker that lists a ``metrics_port`` in ``Admin.GetClusterStatus`` (``pdserve serve`` gives each
one) is scraped at ``http://<its host>:<metrics_port>/metrics``; a step's figures are the differences of:

- ``pdserve:prefix_cache_queries_total``: prompt tokens looked up;
- ``pdserve:prefix_cache_hit_tokens_total{tier=device|host|disk}``: prompt tokens found in each tier (a worker
  without a host tier exports no per-tier counter: its device hits are ``pdserve:prefix_cache_hits_total``).

``hit_rate[tier]`` = hit tokens of that tier / tokens looked up, over every prefill worker: what the cluster
served from each tier, whichever request it was. Other traffic to the same workers during the step counts too.
"""
from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

QUERIES = "pdserve:prefix_cache_queries_total"
HITS = "pdserve:prefix_cache_hits_total"
TIER_HITS = "pdserve:prefix_cache_hit_tokens_total"
SCRAPE_TIMEOUT_S = 5.0


class TierCounts(NamedTuple):
    """Totals over the scraped workers."""
    query_tokens: float
    hit_tokens: dict[str, float]
    """By tier (device, host, disk)."""
    num_workers: int
    errors: list[str]


def metrics_urls(server: dict[str, Any]) -> list[str]:
    """The ``/metrics`` URL of every prefill worker that lists a metrics port (``fetch_cluster``'s form)."""
    urls = []
    for w in server.get("workers", []):
        port, host = w["info"].get("metrics_port", ""), w.get("address", "").rpartition(":")[0]
        if w.get("role") == "prefill" and port.isdigit() and host:
            urls.append(f"http://{host}:{port}/metrics")  # an IPv6 host keeps its brackets
    return urls


def parse_counts(text: str) -> tuple[float, dict[str, float]]:
    """(query tokens, hit tokens by tier) of one worker's exposition text."""
    queries, hits, tier_hits = 0.0, 0.0, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == QUERIES:
                queries += s.value
            elif s.name == HITS:
                hits += s.value
            elif s.name == TIER_HITS and "tier" in s.labels:
                tier_hits[s.labels["tier"]] = tier_hits.get(s.labels["tier"], 0.0) + s.value
    return queries, tier_hits or {"device": hits}


async def scrape(urls: list[str]) -> TierCounts:
    """The workers' counters now; a worker that does not answer is left out and named in ``errors``."""
    async def one(session: aiohttp.ClientSession, url: str) -> tuple[float, dict[str, float]] | str:
        try:
            async with session.get(url) as resp:
                resp.raise_for_status()
                return parse_counts(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return f"{url}: {type(e).__name__} {e}"
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        got = await asyncio.gather(*(one(session, u) for u in urls))
    queries, hits, errors = 0.0, {}, []
    for g in got:
        if isinstance(g, str):
            errors.append(g)
            continue
        queries += g[0]
        for tier, v in g[1].items():
            hits[tier] = hits.get(tier, 0.0) + v
    return TierCounts(queries, hits, len(urls) - len(errors), errors)


def tier_delta(before: TierCounts, after: TierCounts) -> dict[str, Any]:
    """A step's figures (bench.json ``steps[i].cache_tiers``)."""
    queries = after.query_tokens - before.query_tokens
    hits = {t: after.hit_tokens.get(t, 0.0) - before.hit_tokens.get(t, 0.0)
            for t in sorted(set(before.hit_tokens) | set(after.hit_tokens), key=_tier_order)}
    out: dict[str, Any] = {"source": "metrics", "num_workers": after.num_workers, "query_tokens": queries,
                           "hit_tokens": hits,
                           "hit_rate": {t: (v / queries if queries > 0 else None) for t, v in hits.items()}}
    if before.errors or after.errors or before.num_workers != after.num_workers:
        out["errors"] = before.errors + after.errors
    return out


def _tier_order(tier: str) -> tuple[int, str]:
    return ({"device": 0, "host": 1, "disk": 2}.get(tier, 3), tier)
