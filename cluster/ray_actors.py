"""The Ray actors of a launched pdserve deployment (see ``cluster/ray_launcher.py``).

Each actor owns one ordinary pdserve server process, the same ``python -m prefill.server`` /
``decode.server`` / ``router.discovery`` that ``pdserve serve`` starts:

    __init__      spawn the child (cluster secret in its environment, never argv), wait for its
                  ``PDSERVE_READY`` line (a child that exits first fails the actor's creation, with its
                  log tail: a bad model or a model-hash mismatch is reported, not retried forever)
    running       ``info()`` says where the child listens; a monitor thread ``os._exit``\\ s the actor
                  when the child dies, so Ray's supervision (``max_restarts``) restarts the actor, which
                  starts a fresh child on a new port
    stop()        SIGTERM the child and wait (the launcher then ``ray.kill``\\ s the actor)

The child gets ``PR_SET_PDEATHSIG``: when Ray kills the actor process, the child is told to exit too.

A tensor-parallel worker (``--prefill-tp`` / ``--decode-tp`` K) has K bundles in its placement group: its
``WorkerActor`` sits in bundle 0 and one ``RankSlotActor`` holds each of bundles 1..K-1 (Ray's accounting:
their CPUs and GPUs are the followers'). The worker child is rank 0 and starts its followers itself
(``worker.ranks``), on this node; before it starts, ``CUDA_VISIBLE_DEVICES`` is set to the GPUs of all K
bundles in rank order (rank r then uses ``cuda:r``, the GPU of bundle r). A dead follower makes rank 0 exit,
the actor exits with it and Ray restarts it: a fresh rank 0 with fresh followers, the group as a unit.
KV bytes never go through Ray: workers bind the node's IP and talk to each other directly.

The router actor also publishes the worker list its router child follows (``router/discovery.py``): a
thread asks every named worker actor of the namespace for ``info()`` and rewrites the list when an
address appears, changes (a restarted worker) or goes (a dead, stopped or draining worker).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.local import Child, ClusterStartError
from cluster.ray_placement import ROUTER_NAME, WORKER_NAME
from common.env import API_KEY, CLUSTER_SECRET, child_environ
from common.reasons import Role
from router.client import GenerationClient
from router.discovery import WorkerList, ensure_private_dir, write_worker_list

logger = logging.getLogger(__name__)


class ServerProcess:
    """One pdserve server child supervised by the enclosing actor (see the module docstring)."""

    def __init__(self, name: str, role: str, module: str, args: list[str], secret: str, log_dir: str,
                 startup_timeout_s: float, bind_node_ip: bool = True, api_key: str | None = None,
                 rank_slots: list | None = None) -> None:
        self.name, self.role = name, role
        self.draining = False
        self._stopping = False
        # Built here, on the node: this node's Python and IP (the internal plane is reachable from other
        # nodes; it requires the cluster secret, and refuses a non-loopback bind without one).
        cmd = [sys.executable, "-m", module, *args]
        if bind_node_ip:
            cmd += ["--host", ray.util.get_node_ip_address()]
        ensure_private_dir(log_dir)  # beside the worker list, which says where the secret may be sent
        log_path = os.path.join(log_dir, f"{name}.{os.getpid()}.log")
        # secrets through the environment, never argv (ps shows argv to every user); the API key to the router only
        self.rank_devices = rank_devices(rank_slots or [])
        """GPU ids of every rank's bundle, rank order (empty on CPU bundles)."""
        gpus = {"CUDA_VISIBLE_DEVICES": ",".join(self.rank_devices)} if self.rank_devices else {}
        child_env = child_environ(drop=(API_KEY,), **{CLUSTER_SECRET: secret, "PYTHONUNBUFFERED": "1",
                                                          **({API_KEY: api_key} if api_key else {}), **gpus})
        self.child = Child(name, cmd, child_env, log_path)
        self.started_s = time.time()
        try:
            deadline = time.monotonic() + startup_timeout_s
            while not self.child.poll_ready():
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"{name} not ready within {startup_timeout_s:.0f}s; log {log_path}:\n"
                                            f"{self.child.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self._stop_child(grace_s=2.0)
            raise
        threading.Thread(target=self._monitor, name=f"monitor {name}", daemon=True).start()

    def _monitor(self) -> None:
        code = self.child.proc.wait()
        if self._stopping:
            return
        # Exit the whole actor: Ray restarts it (a fresh child) within max_restarts.
        print(f"pdserve: {self.name} child (pid {self.child.pid}) exited with code {code}; restarting the actor:\n"
              f"{self.child.log_tail(2000)}", file=sys.stderr, flush=True)
        os._exit(1)

    def _stop_child(self, grace_s: float) -> int | None:
        self._stopping = True
        self.child.terminate()
        try:
            self.child.proc.wait(grace_s)
        except Exception:
            self.child.proc.kill()
            self.child.proc.wait(5)
        self.child.close()
        return self.child.proc.returncode

    # -- remote methods ----------------------------------------------------------------------------
    def info(self) -> dict:
        """Where this server listens and how it is doing (plain types: crosses Ray)."""
        ctx = ray.get_runtime_context()
        return {"name": self.name, "role": self.role, "address": self.child.address,
                "http_address": self.child.http_address or "", "pid": self.child.pid,
                "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "restarted": ctx.was_current_actor_reconstructed, "draining": self.draining,
                "alive": self.child.proc.poll() is None, "log_path": self.child.log_path,
                "started_s": self.started_s, "rank_devices": list(getattr(self, "rank_devices", []))}

    def log_tail(self, num_bytes: int = 4000) -> str:
        return self.child.log_tail(num_bytes)

    def drain(self) -> bool:
        """Leave the router's worker list (scale down); the launcher stops the actor once drained."""
        self.draining = True
        return True

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the child, SIGKILL it after ``grace_s``; returns its exit code."""
        return self._stop_child(grace_s)


@ray.remote
class WorkerActor(ServerProcess):
    """A prefill or decode worker (created by the launcher in bundle 0 of the worker's placement group)."""


def rank_devices(rank_slots: list) -> list[str]:
    """The GPU ids of this actor's bundle then of each ``RankSlotActor``'s (rank order); [] without GPUs."""
    own = [str(int(g)) for g in ray.get_gpu_ids()]
    if not own:
        return []
    return own + [d for ids in ray.get([s.devices.remote() for s in rank_slots]) for d in ids]


@ray.remote
class RankSlotActor:
    """Holds bundle r > 0 of a tensor-parallel worker's placement group for follower rank r (started by rank
    0 on this node); reports the GPUs Ray gave the bundle. It runs nothing else."""

    def __init__(self, worker: str, rank: int) -> None:
        self.worker, self.rank = worker, rank

    def devices(self) -> list[str]:
        return [str(int(g)) for g in ray.get_gpu_ids()]

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"name": f"{self.worker}-rank{self.rank}", "role": "rank", "worker": self.worker, "rank": self.rank,
                "node_id": ctx.get_node_id(), "devices": self.devices(), "alive": True}

    def stop(self, grace_s: float = 10.0) -> None:
        return None


@ray.remote
class RouterActor(ServerProcess):
    """The router, plus the thread that publishes the worker list it follows. Holds the launch spec that
    ``pdserve scale`` reuses for new workers."""

    def __init__(self, args: list[str], secret: str, log_dir: str, startup_timeout_s: float, spec,
                 poll_interval_s: float = 0.5) -> None:
        self.spec_ = spec
        ensure_private_dir(log_dir)
        self.list_path = list_path = os.path.join(log_dir, "workers.json")
        args = [*args, "--discovery", f"file:{list_path}", "--discovery-interval-s", str(poll_interval_s)]
        self.published = WorkerList((), ())
        write_worker_list(list_path, self.published)
        # the deployment's namespace, not the job's: a driver already connected elsewhere may have launched it
        self._publisher = WorkerListPublisher(spec.cfg.namespace, poll_interval_s)
        threading.Thread(target=self._publish_loop, name="publish workers", daemon=True).start()
        ServerProcess.__init__(self, ROUTER_NAME, "router", "router.discovery", args, secret, log_dir,
                               startup_timeout_s, bind_node_ip=False, api_key=spec.cfg.api_key)

    def _publish_loop(self) -> None:
        while True:
            try:
                workers = self._publisher.poll()
                if workers != self.published:
                    write_worker_list(self.list_path, workers)
                    self.published = workers
            except Exception:  # keep publishing: a transient GCS error must not freeze the list forever
                logger.exception("publishing the worker list failed")
            time.sleep(self._publisher.interval_s)

    def spec(self):
        """The ``cluster.ray_launcher.Deployment`` this router was launched with."""
        return self.spec_

    def worker_list(self) -> dict:
        return {"prefill": list(self.published.prefill), "decode": list(self.published.decode)}

    def workers_seen(self, timeout_s: float = 5.0) -> list[dict]:
        """The router's own view (Admin.GetClusterStatus): address, role, healthy, in-flight calls."""
        with GenerationClient(self._local_address(), api_key=self.spec_.cfg.api_key, tls_ca=self._tls_root()) as c:
            st = c.cluster_status(timeout_s)
        return [{"address": w.address, "role": w.role, "healthy": w.healthy,
                 "inflight": int(w.info.get("router_inflight", "0")), "excluded": w.info.get("router_excluded", "")}
                for w in st.workers]

    def serving(self, timeout_s: float = 2.0) -> bool:
        """The router's gRPC health: SERVING once a prefill and a decode worker are in rotation."""
        root = self._tls_root()
        ch = grpc.insecure_channel(self._local_address()) if root is None else \
            grpc.secure_channel(self._local_address(), grpc.ssl_channel_credentials(_read(root)))
        with ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def _tls_root(self) -> str | None:
        """What a client of this router trusts: the CA, or the self-signed certificate (None: no TLS)."""
        return self.spec_.cfg.tls_ca or self.spec_.cfg.tls_cert

    def _local_address(self) -> str:
        host, _, port = self.child.address.rpartition(":")
        return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "::") else self.child.address


class WorkerListPublisher:
    """Asks the namespace's named worker actors where they listen, without ever blocking on one.

    One ``info()`` call per actor is outstanding at a time: an actor that is restarting simply has not
    answered yet (its last known address stays listed and the router's health checks keep it out of
    rotation); one whose call failed (dead) is dropped until it answers again."""

    def __init__(self, namespace: str, interval_s: float) -> None:
        self.namespace, self.interval_s = namespace, interval_s
        self.known: dict[str, dict] = {}
        self._pending: dict[str, ray.ObjectRef] = {}
        self._handles: dict[str, object] = {}

    def poll(self):
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and WORKER_NAME.match(a["name"])}
        for gone in set(self.known) | set(self._pending) | set(self._handles):
            if gone not in names:
                self.known.pop(gone, None), self._pending.pop(gone, None), self._handles.pop(gone, None)
        for name in names:
            if name not in self._pending:
                try:
                    h = self._handles.get(name) or ray.get_actor(name, namespace=self.namespace)
                except ValueError:  # removed between the listing and now
                    continue
                self._handles[name] = h
                self._pending[name] = h.info.remote()
        if self._pending:
            refs = list(self._pending.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.interval_s)
            done = set(ready)
            for name, ref in list(self._pending.items()):
                if ref not in done:
                    continue
                del self._pending[name]
                try:
                    self.known[name] = ray.get(ref)
                except ray.exceptions.RayError:  # died (Ray may restart it; a later call reaches the new one)
                    self.known.pop(name, None)
        listed = [i for _, i in sorted(self.known.items()) if not i["draining"] and i["alive"] and i["address"]]
        return WorkerList(tuple(i["address"] for i in listed if i["role"] == Role.PREFILL),
                          tuple(i["address"] for i in listed if i["role"] == Role.DECODE))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
