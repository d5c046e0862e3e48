# over 400 lines: the Ray launcher: its config, placement, start, status and stop.
"""Run pdserve on a running Ray cluster: the router and the workers as named, detached Ray actors.

    launch(RayLaunchConfig(address="auto", prefill=2, decode=1))   # -> DeploymentStatus (router address)
    status("auto")                                                  # what runs in the namespace, where
    scale("auto", prefill=3, decode=2)                              # cluster/ray_scale.py
    stop("auto")                                                    # every pdserve actor and group, gone

Lifecycle of a deployment (namespace ``pdserve`` by default; ``cluster/ray_actors.py`` has the actors):

1. launch checks the cluster can hold the workers (per-node free resources) and fails with what is
   missing, computes the model hash (every worker refuses another model: the same model path must be
   readable on every node) and a cluster secret, and plans a node for every worker (``ray_placement``).
2. One detached STRICT_PACK placement group per worker (K bundles for tensor-parallel size K), then the
   worker actors in them and the router actor on the launching node (its public port is there).
3. The router follows the worker actors live; launch returns once every actor is up and the router is
   SERVING. A worker actor whose server dies exits, Ray restarts it (``max_restarts``) in its group, the
   router drops the old address and adds the new one.
4. scale adds workers like launch, or drains the highest-numbered ones (out of the router's list first,
   stopped once the router has no calls at them); stop removes every actor and placement group.

The servers' command lines come from ``cluster.spec.ClusterSpec``, as ``pdserve serve``'s do: ``--prefill 0``
is aggregated here too (the decode workers prefill their own prompts, the router runs ``--aggregated``), and
``--kv-transport`` / ``--mooncake-protocol`` reach both worker kinds (Mooncake's engine on every node).
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field

from cluster.local import ClusterStartError
from cluster.ray_placement import PLACEMENTS, ROUTER_NAME, WORKER_NAME, PlacementError, actor_resources, create_groups, demands_for, list_groups, plan_when_free, remove_groups
from cluster.spec import ClusterSpec, WorkerSlot
from common.reasons import Role
from protos import rpc

logger = logging.getLogger(__name__)
ROLES = tuple(Role)


class LaunchError(RuntimeError):
    """A launch or scale that could not complete (the message names the actor and carries its log tail)."""


@dataclass(frozen=True, slots=True)
class RayLaunchConfig(ClusterSpec):
    """``pdserve launch``: the cluster (``ClusterSpec``, the options of ``pdserve serve`` too) and Ray's own."""

    address: str = "auto"
    """Ray cluster: auto (this node's) or HOST:PORT (the GCS); ray://HOST:PORT (Ray Client) is untested."""
    namespace: str = "pdserve"
    """Ray namespace of the deployment's actors (one deployment per namespace)."""
    resources_per_worker: str = '{"CPU": 1}'
    """JSON resources of one worker rank, e.g. {"CPU": 8, "GPU": 1} (custom resources allowed)."""
    placement: str = "spread"
    """spread: workers on as many nodes as possible; pack: on as few as possible."""
    placement_timeout_s: float = 30.0
    """How long placement groups may take to be placed before they are removed and reported."""
    log_dir: str = "/tmp/pdserve-ray"
    """Server logs, on each node: LOG_DIR/NAMESPACE/NAME.PID.log (alias --run-dir)."""
    decode_weights: str = "model"
    """Decode workers' routed experts: model (the checkpoint's own) or a quantized copy of the model (e.g.
    `pdserve quantize --format mxfp4` output, or a Quark export) at a path every node can read."""
    model_hash: str | None = None
    """Expected model hash (default: computed here from the model with engine.loader.model_hash)."""

    def __post_init__(self) -> None:
        ClusterSpec.__post_init__(self)  # (zero-argument super() fails in a slots dataclass)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.namespace):
            raise ValueError(f"namespace must be letters, digits, '_', '.', '-', got {self.namespace!r}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        self.bundle  # noqa: B018 - the property validates the JSON

    @property
    def bundle(self) -> dict[str, float]:
        try:
            b = json.loads(self.resources_per_worker)
        except json.JSONDecodeError as e:
            raise ValueError(f"resources_per_worker must be JSON like '{{\"CPU\": 1}}': {e}") from None
        if not isinstance(b, dict) or not b or not all(isinstance(v, (int, float)) and v >= 0 for v in b.values()):
            raise ValueError(f"resources_per_worker must map resource names to numbers >= 0, got {b!r}")
        return {str(k): float(v) for k, v in b.items()}

    @property
    def log_path(self) -> str:
        """Where this deployment's servers log, on each node."""
        return os.path.join(self.log_dir, self.namespace)


@dataclass(frozen=True, slots=True)
class Deployment:
    """What every server of a launched deployment is started from (kept by the router actor, for ``scale``)."""

    cfg: RayLaunchConfig
    """The launch config, resolved (``ClusterSpec.resolved``): absolute model, decode weights and TLS paths."""
    model_hash: str
    """Every worker refuses another model (``--expect-model-hash``)."""
    secret: str = field(repr=False)
    """The internal plane's cluster secret (to the servers through their environment, never argv)."""

    def worker_args(self, role: str, name: str) -> list[str]:
        """``python -m ROLE.server`` flags of worker ``name`` (its actor adds ``--host`` with its node's IP)."""
        threads = self.cfg.threads_per_worker or max(1, int(self.cfg.bundle.get("CPU", 1)))
        return self.cfg.worker_argv(role, WorkerSlot(name, threads, mem_fraction=self.cfg.mem_fraction,
                                                     model_hash=self.model_hash))


@dataclass
class DeploymentStatus:
    namespace: str
    router: dict | None = None
    """The router actor's info() (address, node, ...), or None."""
    workers: list[dict] = field(default_factory=list)
    """Every worker actor's info(), by name."""
    groups: dict[str, dict] = field(default_factory=dict)
    """Placement group table entries by worker name."""
    errors: dict[str, str] = field(default_factory=dict)
    """Actors that did not answer, and why."""
    notes: list[str] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    """The rank slots of tensor-parallel workers (bundles 1..K-1): worker, rank, node, GPUs."""

    @property
    def router_address(self) -> str:
        return self.router["address"] if self.router else ""


# -- connecting -------------------------------------------------------------------------------------
def connect(address: str, namespace: str) -> None:
    """Join the Ray cluster as a driver (no-op when this process already did, e.g. in tests)."""
    import ray  # lazy: ray
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)


def actor_names(namespace: str) -> list[str]:
    import ray  # lazy: ray
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


def worker_index(name: str) -> tuple[str, int] | None:
    m = WORKER_NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


# -- launch -----------------------------------------------------------------------------------------
def launch(cfg: RayLaunchConfig) -> DeploymentStatus:
    """Place and start the deployment (see the module docstring); on any failure, remove what was created."""
    import ray  # lazy: ray
    connect(cfg.address, cfg.namespace)
    existing = actor_names(cfg.namespace)
    if existing:
        raise LaunchError(f"namespace {cfg.namespace!r} already runs pdserve actors ({', '.join(existing)}): "
                          f"`pdserve scale` it, or `pdserve stop` it first")
    dep = _make_deployment(cfg)
    names = [f"{r}-{i}" for r, n in ((Role.PREFILL, cfg.prefill), (Role.DECODE, cfg.decode)) for i in range(n)]
    try:
        refs = start_workers(dep, names, existing_nodes={})
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: ray

        from cluster.ray_actors import RouterActor  # lazy: ray (the actor classes are ray.remote)
        router = RouterActor.options(
            name=ROUTER_NAME, namespace=cfg.namespace, lifetime="detached", max_restarts=cfg.max_restarts,
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                           soft=False),
        ).remote(dep.cfg.router_argv(), dep.secret, cfg.log_path, cfg.startup_timeout_s, dep)
        refs[ROUTER_NAME] = router.info.remote()
        infos = wait_started(refs, cfg.startup_timeout_s)
        wait_in_rotation(router, [infos[n]["address"] for n in names], cfg.startup_timeout_s)
    except BaseException:
        stop(cfg.address, cfg.namespace, grace_s=5.0)
        raise
    return status(cfg.address, cfg.namespace)


def _make_deployment(cfg: RayLaunchConfig) -> Deployment:
    """Everything a new server of this deployment needs (kept by the router actor for ``scale``)."""
    from engine.defaults import default_model_dir  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    model = cfg.model or default_model_dir()
    if cfg.model_hash is None:
        from engine.fingerprint import model_hash  # lazy: engine (as above)
        mhash = model_hash(model)
    else:
        mhash = cfg.model_hash
    decode_weights = None
    if cfg.decode_weights != "model":
        if not os.path.isdir(cfg.decode_weights):
            raise ValueError(f"--decode-weights {cfg.decode_weights!r}: give 'model' or a directory holding a "
                             f"quantized copy of the model that every node can read (make one with `pdserve "
                             f"quantize`)")
        # heavy: torch (engine.quant); `pdserve --help` imports this module through cli.launch
        from cluster.weights import resolve_decode_weights
        decode_weights = resolve_decode_weights(model, os.path.abspath(cfg.decode_weights))
    return Deployment(cfg.resolved(model, decode_weights), mhash, rpc.cluster_secret() or secrets.token_hex(16))


class _QuietPlacementWarning(logging.Filter):
    """Ray warns that removing a group kills its restartable detached actor: that is how stop works."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


def _quiet_ray_warning() -> None:
    log = logging.getLogger("ray.actor")
    if not any(isinstance(f, _QuietPlacementWarning) for f in log.filters):
        log.addFilter(_QuietPlacementWarning())


def start_workers(dep: Deployment, names: list[str], existing_nodes: dict[str, int]) -> dict:
    """Plan, place and create the worker actors ``names``; returns name -> ref of its first info()."""
    _quiet_ray_warning()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: ray

    from cluster.ray_actors import RankSlotActor, WorkerActor  # lazy: ray (the actor classes are ray.remote)
    cfg = dep.cfg
    demands = [d for role in ROLES for d in demands_for([n for n in names if n.startswith(role + "-")],
                                                        cfg.bundle, cfg.tp(role))]
    plan = plan_when_free(demands, cfg.placement, existing_nodes)
    groups = create_groups(demands, plan, cfg.namespace, cfg.placement_timeout_s)
    refs = {}
    for d in demands:
        role = d.name.split("-")[0]
        slots = [RankSlotActor.options(  # bundles 1..K-1: the followers' share, held for them
            name=f"{d.name}-rank{r}", namespace=cfg.namespace, lifetime="detached", max_restarts=cfg.max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(groups[d.name], placement_group_bundle_index=r),
            **actor_resources(cfg.bundle)).remote(d.name, r) for r in range(1, d.num_ranks)]
        actor = WorkerActor.options(
            name=d.name, namespace=cfg.namespace, lifetime="detached", max_restarts=cfg.max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(groups[d.name], placement_group_bundle_index=0),
            **actor_resources(cfg.bundle),
        ).remote(d.name, role, f"{role}.server", dep.worker_args(role, d.name), dep.secret, cfg.log_path,
                 cfg.startup_timeout_s, rank_slots=slots)
        refs[d.name] = actor.info.remote()
    return refs


def wait_started(refs: dict, timeout_s: float) -> dict[str, dict]:
    """Every actor's first info(), by name; raises LaunchError naming each actor that failed (with its log tail)."""
    import ray  # lazy: ray
    by_ref = {r: n for n, r in refs.items()}
    ready, late = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
    infos, errors = {}, []
    for r in ready:
        try:
            infos[by_ref[r]] = ray.get(r)
        except ray.exceptions.RayError as e:
            errors.append(_short(_server_error(e)) or f"{by_ref[r]}: {_short(e)}")
    errors += [f"{by_ref[r]}: not ready within {timeout_s:g}s" for r in late]
    if errors:
        raise LaunchError("actors failed to start:\n" + "\n".join(errors))
    return infos


def _server_error(e: BaseException) -> str:
    """The server's own start-up error (name, exit code, log tail) out of Ray's wrapping traceback, or ""."""
    marker = f"{ClusterStartError.__name__}: "
    s = str(e)
    return s[s.rindex(marker) + len(marker):].strip() if marker in s else ""


def _short(e: BaseException | str, num_chars: int = 3000) -> str:
    s = str(e)
    return s if len(s) <= num_chars else "..." + s[-num_chars:]


def wait_in_rotation(router, addresses: list[str], timeout_s: float) -> None:
    """Until the router has every one of ``addresses`` in rotation (its own health polls say so)."""
    import ray  # lazy: ray
    deadline = time.monotonic() + timeout_s
    seen: list[dict] = []
    while True:
        try:
            seen = ray.get(router.workers_seen.remote(), timeout=30)
        except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:
            logger.debug("router status not available yet: %s", e)
        healthy = {w["address"] for w in seen if w["healthy"]}
        if healthy >= set(addresses):
            return
        if time.monotonic() > deadline:
            raise LaunchError(f"the router did not take {sorted(set(addresses) - healthy)} into rotation within "
                              f"{timeout_s:g}s; it sees {seen}")
        time.sleep(0.2)


# -- status / stop ----------------------------------------------------------------------------------
def status(address: str, namespace: str = "pdserve", timeout_s: float = 5.0) -> DeploymentStatus:
    import ray  # lazy: ray

    connect(address, namespace)
    st = DeploymentStatus(namespace, groups=list_groups(namespace))
    refs = {}
    for name in actor_names(namespace):
        try:
            refs[name] = ray.get_actor(name, namespace=namespace).info.remote()
        except ValueError:
            continue
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for name, r in refs.items():
        if r not in ready:
            st.errors[name] = f"not answering within {timeout_s:g}s (starting or restarting)"
            continue
        try:
            info = ray.get(r)
        except ray.exceptions.ActorUnavailableError:
            st.errors[name] = "restarting (Ray is restarting the actor)"
            continue
        except ray.exceptions.RayError as e:
            st.errors[name] = _short(e, 500)
            continue
        if name == ROUTER_NAME:
            st.router = info
        elif info.get("role") == "rank":
            st.ranks.append(info)
        else:
            st.workers.append(info)
    return st


def stop(address: str, namespace: str = "pdserve", grace_s: float = 10.0) -> list[str]:
    """Stop every pdserve actor of the namespace (its server gets SIGTERM first) and remove every placement
    group; returns the actor names stopped. Safe to repeat."""
    import ray  # lazy: ray
    connect(address, namespace)
    names = actor_names(namespace)
    handles = {}
    for n in names:
        try:
            handles[n] = ray.get_actor(n, namespace=namespace)
        except ValueError:
            pass
    stop_actors(handles, grace_s)
    remove_groups(namespace)
    deadline = time.monotonic() + 30
    while actor_names(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    return names


def stop_actors(handles: dict, grace_s: float) -> None:
    import ray  # lazy: ray
    refs = [h.stop.remote(grace_s) for h in handles.values()]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=grace_s + 5)
    for h in handles.values():
        ray.kill(h, no_restart=True)


__all__ = ["RayLaunchConfig", "Deployment", "DeploymentStatus", "LaunchError", "PlacementError", "launch", "status", "stop",
           "connect"]
