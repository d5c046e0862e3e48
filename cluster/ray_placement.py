"""Where the Ray launcher puts workers: one placement group per worker, planned up front.

A worker with tensor-parallel size K reserves K bundles (one per rank, each ``resources_per_worker``)
in a STRICT_PACK group: all its ranks on one node. Placement groups do not spread *between* groups, so
the launcher plans the node of every group itself from the cluster's free resources and passes it as
the group's target node:

    spread   each worker goes to the node with the fewest pdserve workers (prefill and decode alike)
    pack     each worker goes to the node with the most pdserve workers that still has room

A request the cluster cannot hold fails before anything is created, saying what is missing; a group
that still does not come up (resources taken meanwhile, a node lost) is removed after
``placement_timeout_s`` and reported, instead of waiting forever.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Mapping

WORKER_NAME = re.compile(r"^(prefill|decode)-(\d+)$")
"""A worker actor's name in the deployment's namespace (``prefill-3``); the launcher and the actors share it."""
ROUTER_NAME = "router"
"""The router actor's name."""

PLACEMENTS = ("spread", "pack")
SCALAR_KEYS = ("CPU", "GPU", "memory")
_IGNORED = ("object_store_memory",)


class PlacementError(RuntimeError):
    """The cluster cannot hold the workers asked for; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class WorkerDemand:
    name: str
    """The worker actor's name (``prefill-0``)."""
    bundle: tuple[tuple[str, float], ...]
    """Resources of one rank (``resources_per_worker``), sorted by name."""
    num_ranks: int = 1
    """Bundles to reserve on one node (the tensor-parallel size)."""

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.num_ranks)]

    @property
    def total(self) -> dict[str, float]:
        return {k: v * self.num_ranks for k, v in self.bundle}


def fits(need: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def fmt(res: Mapping[str, float]) -> str:
    def num(k, v):
        return f"{v / 2**30:.1f}GiB" if k.endswith("memory") else f"{v:g}"
    shown = {k: v for k, v in res.items() if k not in _IGNORED and not k.startswith(("node:", "bundle_group_"))}
    return "{" + ", ".join(f"{k}: {num(k, v)}" for k, v in sorted(shown.items())) + "}"


def plan_placement(demands: list[WorkerDemand], free: Mapping[str, Mapping[str, float]], strategy: str,
                   existing: Mapping[str, int] | None = None,
                   total: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, str]:
    """Node id for every worker (``free``: node id -> free resources; ``existing``: node id -> pdserve
    workers already there). Raises PlacementError naming the first worker that does not fit and why."""
    if strategy not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {strategy!r}")
    left = {n: dict(r) for n, r in free.items()}
    count = {n: (existing or {}).get(n, 0) for n in free}
    plan: dict[str, str] = {}
    for d in demands:
        need = d.total
        nodes = [n for n in sorted(left) if fits(need, left[n])]
        if not nodes:
            raise PlacementError(_why_not(d, demands, free, total))
        if strategy == "spread":
            node = min(nodes, key=lambda n: (count[n], -_room(left[n], need)))
        else:
            node = min(nodes, key=lambda n: (-count[n], -_room(left[n], need)))
        for k, v in need.items():
            left[node][k] = left[node].get(k, 0.0) - v
        count[node] += 1
        plan[d.name] = node
    return plan


def _room(free: Mapping[str, float], need: Mapping[str, float]) -> float:
    """How many more copies of ``need`` fit (ties broken towards emptier nodes)."""
    ratios = [free.get(k, 0.0) / v for k, v in need.items() if v > 0]
    return min(ratios) if ratios else 0.0


def _why_not(d: WorkerDemand, demands: list[WorkerDemand], free: Mapping[str, Mapping[str, float]],
             total: Mapping[str, Mapping[str, float]] | None) -> str:
    want: dict[str, float] = {}
    for x in demands:
        for k, v in x.total.items():
            want[k] = want.get(k, 0.0) + v
    have = {k: sum(r.get(k, 0.0) for r in free.values()) for k in want}
    capacity = {k: sum(r.get(k, 0.0) for r in (total or free).values()) for k in want}
    missing = {k: want[k] - have[k] for k in want if want[k] > have[k] + 1e-9}
    head = (f"cannot place {len(demands)} worker(s) ({', '.join(x.name for x in demands)}), each "
            f"{d.num_ranks} x {fmt(dict(d.bundle))} on one node")
    per_node = "; ".join(f"{n[:8]} {fmt({k: r.get(k, 0.0) for k in want})}" for n, r in sorted(free.items())) \
        or "no alive nodes"
    if missing:
        lack = ", ".join(f"{k} {v:g} (need {want[k]:g}, free {have[k]:g}, cluster total {capacity[k]:g})"
                         for k, v in sorted(missing.items()))
        return f"{head}: missing {lack}. Free per node: {per_node}"
    return (f"{head}: the cluster has enough in total ({fmt(have)} free) but no node has {fmt(d.total)} free for "
            f"{d.name} (a worker's bundles must share one node). Free per node: {per_node}")


def demands_for(names: list[str], bundle: Mapping[str, float], num_ranks: int) -> list[WorkerDemand]:
    b = tuple(sorted((k, float(v)) for k, v in bundle.items()))
    return [WorkerDemand(n, b, num_ranks) for n in names]


def actor_resources(bundle: Mapping[str, float]) -> dict:
    """``.options(...)`` keywords that ask for exactly one bundle."""
    out: dict = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}
    if bundle.get("memory"):
        out["memory"] = bundle["memory"]
    custom = {k: v for k, v in bundle.items() if k not in SCALAR_KEYS}
    if custom:
        out["resources"] = custom
    return out


# -- Ray side ---------------------------------------------------------------------------------------
def group_name(namespace: str, worker: str) -> str:
    return f"pdserve:{namespace}:{worker}"


def cluster_resources() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(free, total) resources of every alive node, by node id."""
    import ray  # lazy: ray
    total = {n["NodeID"]: dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")}
    try:
        from ray._private.state import available_resources_per_node  # lazy: ray
        free = {n: dict(r) for n, r in available_resources_per_node().items() if n in total}
    except Exception:  # not available through Ray Client: plan on totals, pg.ready() still guards
        free = {n: dict(r) for n, r in total.items()}
    for n in total:
        free.setdefault(n, {})
    return free, total


def plan_when_free(demands: list[WorkerDemand], strategy: str, existing: Mapping[str, int],
                   settle_s: float = 5.0) -> dict[str, str]:
    """``plan_placement`` on the cluster's current free resources. A request the cluster could never hold
    fails at once; one that fits the nodes' totals is retried for ``settle_s`` (Ray's view of free
    resources lags a group or actor that was just removed) before its error is raised."""
    free, total = cluster_resources()
    try:
        plan_placement(demands, total, strategy, existing, total)
    except PlacementError:  # impossible even on an idle cluster: fail now, with the free numbers
        return plan_placement(demands, free, strategy, existing, total)
    deadline = time.monotonic() + settle_s
    while True:
        try:
            return plan_placement(demands, free, strategy, existing, total)
        except PlacementError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.25)
        free, total = cluster_resources()


def create_groups(demands: list[WorkerDemand], plan: Mapping[str, str], namespace: str, timeout_s: float) -> dict:
    """One detached STRICT_PACK group per worker on its planned node; waits until all are placed. On timeout
    the groups are removed and PlacementError says which were not placed."""
    import ray  # lazy: ray
    from ray.util import placement_group, remove_placement_group  # lazy: ray
    groups = {d.name: placement_group(d.bundles, strategy="STRICT_PACK", name=group_name(namespace, d.name),
                                      lifetime="detached", _soft_target_node_id=plan[d.name]) for d in demands}
    refs = {g.ready(): name for name, g in groups.items()}
    ready, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if not_ready:
        for g in groups.values():
            remove_placement_group(g)
        free, _ = cluster_resources()
        late = ", ".join(f"{refs[r]} {fmt(next(d.total for d in demands if d.name == refs[r]))}" for r in not_ready)
        raise PlacementError(f"placement groups not placed within {timeout_s:g}s (removed): {late}; free now per "
                             f"node: " + "; ".join(f"{n[:8]} {fmt(r)}" for n, r in sorted(free.items())) +
                             ". Other jobs may hold the resources, or a node was lost.")
    return groups


def list_groups(namespace: str) -> dict[str, dict]:
    """This namespace's live placement groups by worker name (Ray's placement_group_table entries)."""
    import ray  # lazy: ray
    prefix = group_name(namespace, "")
    return {t["name"][len(prefix):]: t for t in ray.util.placement_group_table().values()
            if t.get("name", "").startswith(prefix) and t.get("state") != "REMOVED"}


def get_group(namespace: str, worker: str):
    import ray  # lazy: ray
    return ray.util.get_placement_group(group_name(namespace, worker))


def remove_groups(namespace: str, workers: list[str] | None = None) -> list[str]:
    """Remove this namespace's groups (those of ``workers``, or all); returns the worker names removed."""
    import ray  # lazy: ray
    from ray.util.placement_group import PlacementGroup  # lazy: ray
    removed = []
    for name, t in list_groups(namespace).items():
        if workers is None or name in workers:
            pg_id = ray.PlacementGroupID(bytes.fromhex(t["placement_group_id"]))
            ray.util.remove_placement_group(PlacementGroup(pg_id))
            removed.append(name)
    return removed


def group_nodes(entry: dict) -> list[str]:
    """Node ids of a group's bundles (empty while it is pending)."""
    return sorted(set((entry.get("bundles_to_node_id") or {}).values()))
