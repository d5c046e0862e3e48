"""``pdserve scale``: change the worker counts of a launched deployment (``cluster/ray_launcher.py``).

New workers are planned, placed and started exactly like launch's (same spec, kept by the router actor),
counting the workers already on each node. Removed workers (highest index first) are drained: they leave
the router's worker list at once, and are stopped (with their placement groups) once the router has no
calls at them, or after ``drain_timeout_s``.
"""
from __future__ import annotations

import logging
import time

from cluster.ray_launcher import (
    ROLES,
    DeploymentStatus,
    LaunchError,
    actor_names,
    connect,
    start_workers,
    status,
    stop_actors,
    wait_in_rotation,
    wait_started,
    worker_index,
)
from cluster.ray_placement import ROUTER_NAME, remove_groups
from common.reasons import Role

logger = logging.getLogger(__name__)


def scale(address: str, namespace: str = "pdserve", prefill: int | None = None, decode: int | None = None,
          drain_timeout_s: float = 600.0) -> DeploymentStatus:
    """Bring the worker counts to ``prefill`` / ``decode`` (None: unchanged). New workers are placed and
    started like launch's; removed ones (highest index first) are drained, then stopped."""
    import ray  # lazy: ray

    connect(address, namespace)
    if (prefill is not None and prefill < 0) or (decode is not None and decode < 1):
        raise ValueError(f"need at least one decode worker and no negative count of prefill workers, got "
                         f"prefill {prefill}, decode {decode}")
    try:
        router = ray.get_actor(ROUTER_NAME, namespace=namespace)
    except ValueError:
        raise LaunchError(f"no pdserve deployment in namespace {namespace!r}: `pdserve launch` first") from None
    dep = ray.get(router.spec.remote(), timeout=30)
    if prefill is not None and dep.cfg.aggregated != (prefill == 0):
        # the router was started aggregated or not (``--aggregated``) and stays so
        raise ValueError(f"namespace {namespace!r} was launched with {dep.cfg.prefill} prefill workers: it "
                         f"{'takes none' if dep.cfg.aggregated else 'needs at least one'} (`pdserve stop` it and "
                         f"launch again with --prefill {prefill})")
    have = {r: sorted(i for i in (worker_index(n) for n in actor_names(namespace)) if i and i[0] == r)
            for r in ROLES}
    add, remove = [], []
    for role, want in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        idx = [i for _, i in have[role]]
        if want is None:
            continue
        remove += [f"{role}-{i}" for i in idx[want:]]
        free_idx = (i for i in range(len(idx) + want) if i not in idx)
        add += [f"{role}-{next(free_idx)}" for _ in range(max(0, want - len(idx)))]
    if add:
        st = status(address, namespace)
        nodes: dict[str, int] = {}
        for w in st.workers:
            nodes[w["node_id"]] = nodes.get(w["node_id"], 0) + 1
        refs = start_workers(dep, add, nodes)
        try:
            infos = wait_started(refs, dep.cfg.startup_timeout_s)
            wait_in_rotation(router, [i["address"] for i in infos.values()], dep.cfg.startup_timeout_s)
        except LaunchError:
            _remove_workers(namespace, add, grace_s=2.0)
            raise
    if remove:
        _drain(router, namespace, remove, drain_timeout_s)
        _remove_workers(namespace, remove, grace_s=10.0)
    return status(address, namespace)


def _drain(router, namespace: str, names: list[str], timeout_s: float) -> None:
    """Off the router's worker list; wait until the router has taken them out of rotation and has no calls at
    them (or ``timeout_s``). A worker that does not answer (restarting) is not waited for."""
    import ray  # lazy: ray
    handles = [ray.get_actor(n, namespace=namespace) for n in names]
    refs = [h.info.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
    addrs = set()
    for r in ready:
        try:
            addrs.add(ray.get(r)["address"])
        except ray.exceptions.RayError:
            pass
    ray.wait([h.drain.remote() for h in handles], num_returns=len(handles), timeout=10)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = ray.get(router.worker_list.remote(), timeout=30)
        seen = {w["address"]: w for w in ray.get(router.workers_seen.remote(), timeout=30)}
        if not addrs & set(listed["prefill"] + listed["decode"]) and \
                all(a not in seen or (seen[a]["excluded"] and seen[a]["inflight"] == 0) for a in addrs):
            return
        time.sleep(0.2)
    logger.warning("workers %s still had calls after %.0fs of draining: stopping them anyway", names, timeout_s)


def _remove_workers(namespace: str, names: list[str], grace_s: float) -> None:
    import ray  # lazy: ray
    handles = {}
    for n in names:
        try:
            handles[n] = ray.get_actor(n, namespace=namespace)
        except ValueError:
            pass
    stop_actors(handles, grace_s)
    remove_groups(namespace, names)
