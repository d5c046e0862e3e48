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
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field

from cluster.local import ClusterStartError, resolve_decode_weights
from cluster.ray_placement import PLACEMENTS, PlacementError, actor_resources, create_groups, demands_for, list_groups, plan_when_free, remove_groups
from common.flags import DEFAULT_HTTP_PORT
from common.net import check_bind
from common.reasons import Role
from protos import rpc, tls

logger = logging.getLogger(__name__)
ROLES = tuple(Role)


class LaunchError(RuntimeError):
    """A launch or scale that could not complete (the message names the actor and carries its log tail)."""


@dataclass(frozen=True, slots=True)
class RayLaunchConfig:
    address: str = "auto"
    """Ray cluster: auto (this node's) or HOST:PORT (the GCS); ray://HOST:PORT (Ray Client) is untested."""
    namespace: str = "pdserve"
    """Ray namespace of the deployment's actors (one deployment per namespace)."""
    model: str | None = None
    """Model directory, the same path on every node (default: the default model)."""
    prefill: int = 1
    """Prefill workers."""
    decode: int = 1
    """Decode workers."""
    prefill_tp: int = 1
    """Tensor-parallel size of a prefill worker: that many rank processes and bundles, on one node."""
    decode_tp: int = 1
    """Tensor-parallel size of a decode worker (as --prefill-tp)."""
    moe_parallel: str = "tp"
    """Routed experts across a worker's ranks: tp (each expert's intermediate dim split) or ep (experts
    partitioned)."""
    resources_per_worker: str = '{"CPU": 1}'
    """JSON resources of one worker rank, e.g. {"CPU": 8, "GPU": 1} (custom resources allowed)."""
    placement: str = "spread"
    """spread: workers on as many nodes as possible; pack: on as few as possible."""
    host: str = "127.0.0.1"
    """Router bind address, on the launching node (beyond loopback only with --api-key)."""
    port: int = 50051
    """Router port (0: any free port)."""
    http_port: int = DEFAULT_HTTP_PORT
    """Router's OpenAI-compatible HTTP port, on the launching node (0: off, -1: any free port)."""
    log_level: str = "INFO"
    """Log level of the router and every worker."""
    log_format: str = "text"
    """text or json (one object per line) for the router and every worker."""
    api_key: str | None = None
    """Require this bearer token on the router's public port."""
    tls_cert: str | None = None
    """PEM certificate, at a path every node can read: the router's gRPC and HTTP ports and every worker's gRPC
    port serve TLS (protos/tls.py; the KV data plane stays HMAC-authenticated)."""
    tls_key: str | None = None
    """PEM private key of --tls-cert (same path on every node)."""
    tls_ca: str | None = None
    """PEM CA bundle: mutual TLS between the router and the workers (default: trust --tls-cert itself)."""
    routing: str = "cache_aware"
    """Router prefill policy."""
    dtype: str = "auto"
    """Compute dtype of the workers (auto: the checkpoint's where the device computes it fast, else float32)."""
    kv_dtype: str | None = None
    """KV cache dtype (default: the weights dtype)."""
    page_size: int = 16
    """KV page size in tokens."""
    num_pages: int | None = None
    """KV pages per worker (default: sized from memory; at most one of num_pages, kv_cache_memory, mem_fraction)."""
    kv_cache_memory: str | None = None
    """KV pool bytes per worker (8GiB, 512MB, ...)."""
    mem_fraction: float | None = None
    """Fraction of its device's memory each worker may use for weights, activations and its KV pool."""
    speculative: str = "5/1/6"
    """MTP speculation STEPS/TOPK/DRAFT_TOKENS of the decode workers, or off."""
    no_spec_fallback: bool = False
    """Decode workers keep speculating for every request, even when its drafts are rarely accepted (default:
    such a request switches to plain decoding)."""
    compile_decode: bool = False
    """Decode workers run decode / verify steps through compiled graphs (warmed up before they serve)."""
    decode_weights: str | None = None
    """A quantized copy of the model (e.g. `pdserve quantize --format mxfp4` output, or a Quark export) at a path
    every node can read: decode workers load its weights (MXFP4 routed experts). Default: the model's own."""
    threads: int = 0
    """torch threads per worker (0: the CPUs of its bundle)."""
    max_restarts: int = 5
    """How often Ray restarts a dead worker or router actor (-1: forever)."""
    max_failovers: int = 2
    """Router: times a request may resume on another decode worker after its own died mid-stream."""
    decode_stall_timeout_s: float = 30.0
    """Router: a decode stream silent this long fails over like a dead worker."""
    stall_after_s: float = 60.0
    """Workers report themselves unhealthy when their scheduler has work and finished no step for this long."""
    no_shm: bool = False
    """Decode pools in private memory: prefill workers on the same node ship KV over TCP too."""
    startup_timeout_s: float = 300.0
    """How long every actor may take to become ready."""
    placement_timeout_s: float = 30.0
    """How long placement groups may take to be placed before they are removed and reported."""
    log_dir: str = "/tmp/pdserve-ray"
    """Server logs, on each node: LOG_DIR/NAMESPACE/NAME.PID.log."""
    model_hash: str | None = None
    """Expected model hash (default: computed here from the model with engine.loader.model_hash)."""

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least one prefill and one decode worker, got {self.prefill} + {self.decode}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"tp sizes must be >= 1, got {self.prefill_tp} and {self.decode_tp}")
        if self.moe_parallel not in ("tp", "ep"):
            raise ValueError(f"moe_parallel must be tp or ep, got {self.moe_parallel!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        from router.config import ROUTING_POLICIES  # lazy: building the CLI parser must not import router
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.namespace):
            raise ValueError(f"namespace must be letters, digits, '_', '.', '-', got {self.namespace!r}")
        for name in ("startup_timeout_s", "placement_timeout_s", "decode_stall_timeout_s", "stall_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers}")
        self.bundle  # noqa: B018 - the property validates the JSON
        check_bind(self.host, self.api_key, "the router (give --api-key)")
        tls.tls_config(self.tls_cert, self.tls_key, self.tls_ca)  # ValueError for a half-given pair or a bad file

    @property
    def bundle(self) -> dict[str, float]:
        try:
            b = json.loads(self.resources_per_worker)
        except json.JSONDecodeError as e:
            raise ValueError(f"resources_per_worker must be JSON like '{{\"CPU\": 1}}': {e}") from None
        if not isinstance(b, dict) or not b or not all(isinstance(v, (int, float)) and v >= 0 for v in b.values()):
            raise ValueError(f"resources_per_worker must map resource names to numbers >= 0, got {b!r}")
        return {str(k): float(v) for k, v in b.items()}

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == Role.PREFILL else self.decode_tp


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
    from cluster.ray_actors import WORKER_NAME  # lazy: ray
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
    spec = _make_spec(cfg)
    names = [f"{r}-{i}" for r, n in ((Role.PREFILL, cfg.prefill), (Role.DECODE, cfg.decode)) for i in range(n)]
    try:
        refs = start_workers(spec, names, existing_nodes={})
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: ray

        from cluster.ray_actors import ROUTER_NAME, RouterActor  # lazy: ray
        router = RouterActor.options(
            name=ROUTER_NAME, namespace=cfg.namespace, lifetime="detached", max_restarts=cfg.max_restarts,
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                           soft=False),
        ).remote(_router_args(spec), spec["secret"], _log_dir(spec), cfg.startup_timeout_s, spec)
        refs[ROUTER_NAME] = router.info.remote()
        infos = wait_started(refs, cfg.startup_timeout_s)
        wait_in_rotation(router, [infos[n]["address"] for n in names], cfg.startup_timeout_s)
    except BaseException:
        stop(cfg.address, cfg.namespace, grace_s=5.0)
        raise
    st = status(cfg.address, cfg.namespace)
    st.notes += spec["notes"]
    return st


def _make_spec(cfg: RayLaunchConfig) -> dict:
    """Everything a new worker of this deployment needs (kept by the router actor for ``scale``)."""
    from engine.defaults import default_model_dir  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    if cfg.model is None:
        model = default_model_dir()
    else:
        model = os.path.abspath(cfg.model)
    if cfg.model_hash is None:
        from engine.loader import model_hash  # lazy: safetensors, torch
        mhash = model_hash(model)
    else:
        mhash = cfg.model_hash
    decode_weights = None
    if cfg.decode_weights:
        if not os.path.isdir(cfg.decode_weights):
            raise ValueError(f"--decode-weights {cfg.decode_weights!r}: give a directory holding a quantized copy of "
                             f"the model that every node can read (make one with `pdserve quantize`)")
        decode_weights = resolve_decode_weights(model, os.path.abspath(cfg.decode_weights))
    notes: list[str] = []
    tls_paths = {k: os.path.abspath(v) for k in ("tls_cert", "tls_key", "tls_ca") if (v := getattr(cfg, k))}
    return {**dataclasses.asdict(cfg), **tls_paths, "model": model, "model_hash": mhash, "notes": notes,
            "decode_weights": decode_weights,
            "secret": rpc.cluster_secret() or secrets.token_hex(16)}


def _log_dir(spec: dict) -> str:
    return os.path.join(spec["log_dir"], spec["namespace"])


def _worker_args(spec: dict, role: str, name: str) -> list[str]:
    threads = spec["threads"] or max(1, int(json.loads(spec["resources_per_worker"]).get("CPU", 1)))
    args = ["--model", spec["model"], "--port", "0", "--worker-id", name, "--dtype", spec["dtype"],
            "--page-size", str(spec["page_size"]), "--threads", str(threads),
            "--expect-model-hash", spec["model_hash"], "--stall-after", str(spec["stall_after_s"]),
            "--metrics-port", "-1",  # Prometheus /metrics on a free port, listed in GetClusterStatus
            "--log-level", spec.get("log_level", "INFO"), "--log-format", spec.get("log_format", "text")]
    if spec["kv_dtype"]:
        args += ["--kv-dtype", spec["kv_dtype"]]
    if spec["num_pages"]:
        args += ["--num-pages", str(spec["num_pages"])]
    if spec.get("kv_cache_memory"):
        args += ["--kv-cache-memory", spec["kv_cache_memory"]]
    if spec.get("mem_fraction"):
        args += ["--mem-fraction", repr(spec["mem_fraction"])]
    tp = spec["prefill_tp"] if role == Role.PREFILL else spec["decode_tp"]
    if tp > 1:  # rank 0 starts and supervises the other tp - 1 ranks on this node (cluster/ray_actors.py)
        args += ["--tp", str(tp), "--moe-parallel", spec.get("moe_parallel", "tp")]
    if role == Role.DECODE:
        args += ["--kv-port", "0", "--speculative", spec["speculative"] or "off"]
        args += ["--compile"] if spec.get("compile_decode") else []
        args += ["--no-spec-fallback"] if spec.get("no_spec_fallback") else []
        args += ["--quantized-model", spec["decode_weights"]] if spec.get("decode_weights") else []
        args += [] if spec["no_shm"] else ["--shm"]  # used by prefill workers on the same node
    return args + _tls_args(spec)


def _router_args(spec: dict) -> list[str]:
    args = ["--host", spec["host"], "--port", str(spec["port"]), "--http-port", str(spec["http_port"]),
            "--routing", spec["routing"],
            "--model", spec["model"], "--startup-timeout-s", str(spec["startup_timeout_s"]),
            "--max-failovers", str(spec["max_failovers"]),
            "--decode-stall-timeout-s", str(spec["decode_stall_timeout_s"]),
            "--log-level", spec.get("log_level", "INFO"), "--log-format", spec.get("log_format", "text")]
    return args + _tls_args(spec)  # the API key reaches the router through its environment, never argv


def _tls_args(spec: dict) -> list[str]:
    return [a for flag in ("tls_cert", "tls_key", "tls_ca") if spec.get(flag)
            for a in ("--" + flag.replace("_", "-"), spec[flag])]


class _QuietPlacementWarning(logging.Filter):
    """Ray warns that removing a group kills its restartable detached actor: that is how stop works."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


def _quiet_ray_warning() -> None:
    log = logging.getLogger("ray.actor")
    if not any(isinstance(f, _QuietPlacementWarning) for f in log.filters):
        log.addFilter(_QuietPlacementWarning())


def start_workers(spec: dict, names: list[str], existing_nodes: dict[str, int]) -> dict:
    """Plan, place and create the worker actors ``names``; returns name -> ref of its first info()."""
    _quiet_ray_warning()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: ray

    from cluster.ray_actors import RankSlotActor, WorkerActor  # lazy: ray
    cfg = RayLaunchConfig(**{f.name: spec[f.name] for f in dataclasses.fields(RayLaunchConfig)})
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
        ).remote(d.name, role, f"{role}.server", _worker_args(spec, role, d.name), spec["secret"], _log_dir(spec),
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

    from cluster.ray_actors import ROUTER_NAME  # lazy: ray
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


__all__ = ["RayLaunchConfig", "DeploymentStatus", "LaunchError", "PlacementError", "launch", "status", "stop",
           "connect"]
