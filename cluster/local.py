# over 400 lines: the local launcher: child processes, ports, supervision and decode-weight resolution.
"""A whole pdserve cluster on this machine: N prefill + M decode worker processes and a router process.

    cluster = LocalCluster(LocalClusterConfig(model=DIR, prefill=1, decode=1, router=RouterConfig(port=0)))
    cluster.start()          # raises ClusterStartError naming the worker that failed, with its log tail
    cluster.router_address   # where clients connect
    cluster.stop()           # SIGTERM everything (router first), SIGKILL what is left after the grace period

Every child writes its log to ``run_dir/<name>.log``. The internal plane gets a cluster secret (the
caller's ``PDSERVE_CLUSTER_SECRET`` or a random one) through the children's environment, never argv; the
API key reaches the router the same way (``PDSERVE_API_KEY``), and no other child.
Children stay in the launcher's process group (Ctrl-C reaches them all) and are asked by the kernel to
exit if the launcher dies without cleaning up (``PR_SET_PDEATHSIG``), so no worker outlives it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from cluster.spec import ClusterSpec, WorkerSlot
from common.env import API_KEY, CLUSTER_SECRET, child_environ
from common.reasons import Role
from protos import rpc

READY_PREFIX = "PDSERVE_READY"
SHM_DIR = "/dev/shm"
logger = logging.getLogger(__name__)


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_segment_prefix(pid: int) -> str:
    """What the names of the KV shm segments created by worker ``pid`` start with: the format of
    ``kvtransfer.shm.segment_prefix``, spelled here so the launcher does not import torch (a test keeps
    them equal). Our children share our pid namespace."""
    return f"pdserve-kv-{_pid_ns():x}-{pid:x}-"


def remove_shm_segments(pid: int) -> list[str]:
    """Unlink the shm segments of worker ``pid``, which has exited (SIGKILL skips its own cleanup: a decode
    worker's pool is hundreds of MB of /dev/shm). Call only after the process was reaped."""
    prefix, removed = shm_segment_prefix(pid), []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class ClusterStartError(RuntimeError):
    """A child failed to start; the message names it and carries its log tail."""


@dataclass(frozen=True, slots=True)
class LocalClusterConfig(ClusterSpec):
    """``pdserve serve``: the cluster (``ClusterSpec``) and what only a cluster on this machine has."""

    run_dir: str | None = None
    """Where the logs go (None: a new temporary directory; alias --log-dir)."""
    stop_margin_s: float = 15.0
    """Beyond ``grace_s``: how long a child may take to exit after its drain before it is killed."""

    def __post_init__(self) -> None:
        ClusterSpec.__post_init__(self)  # (zero-argument super() fails in a slots dataclass)
        if self.stop_margin_s <= 0:
            raise ValueError(f"stop_margin_s must be > 0, got {self.stop_margin_s}")

    @property
    def stop_grace_s(self) -> float:
        """How long a child gets after SIGTERM before SIGKILL."""
        return self.grace_s + self.stop_margin_s


class Child:
    """One child process with its log file; ``address`` is parsed from its ``PDSERVE_READY`` line."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=_die_with_parent)
        self.address: str | None = None
        self.http_address: str | None = None
        """The router's OpenAI-compatible HTTP address (``http HOST:PORT`` on its ready line), if it serves one."""
        self.cleaned = False
        """Its shm segments were removed after it exited."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll_ready(self) -> bool:
        """True once the child printed its ready line; raises ClusterStartError if it exited."""
        if self.address is not None:
            return True
        with open(self.log_path, "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    words = line.split()
                    self.address = words[2]
                    if words[3:4] == ["http"]:
                        self.http_address = words[4]
                    return True
        if self.proc.poll() is not None:
            raise ClusterStartError(f"{self.name} (pid {self.pid}) exited with code {self.proc.returncode} before "
                                    f"becoming ready; log {self.log_path}:\n{self.log_tail()}")
        return False

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - num_bytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def clean_up_after_exit(self) -> None:
        """Once it has exited: remove what it could not (its shm segments, if it was killed). Idempotent."""
        if self.cleaned or self.proc.poll() is None:
            return
        self.cleaned = True
        removed = remove_shm_segments(self.pid)
        if removed:
            logger.warning("%s (pid %d) exited leaving shm segment(s) %s: removed", self.name, self.pid,
                           ", ".join(removed))

    def close(self) -> None:
        self._log.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalCluster:
    def __init__(self, cfg: LocalClusterConfig) -> None:
        self.cfg = cfg
        self.model = cfg.model or _default_model()
        # heavy: torch (engine.quant quantizes the experts); `pdserve --help` and bench import this module
        from cluster.weights import resolve_decode_weights
        self.decode_weights = resolve_decode_weights(self.model, cfg.decode_weights)
        self.run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="pdserve-run-")
        """Logs; a temporary one (no ``run_dir`` given) is removed by a clean ``stop``."""
        self._temp_run_dir = cfg.run_dir is None
        os.makedirs(self.run_dir, exist_ok=True)
        """The checkpoint decode workers load (None: ``self.model``)."""
        self.secret = rpc.cluster_secret() or secrets.token_hex(16)
        # the API key is the router's alone (workers never see it); like the secret, never in argv
        self.env = child_environ(drop=(API_KEY,), **{CLUSTER_SECRET: self.secret, "PYTHONUNBUFFERED": "1"})
        self.workers: list[Child] = []
        self.router: Child | None = None

    @property
    def router_address(self) -> str:
        return self.router.address if self.router is not None and self.router.address else ""

    @property
    def http_address(self) -> str:
        """The router's OpenAI-compatible HTTP HOST:PORT ("" when off or not started)."""
        return self.router.http_address or "" if self.router is not None else ""

    @property
    def children(self) -> list[Child]:
        return self.workers + ([self.router] if self.router is not None else [])

    @property
    def spec(self) -> ClusterSpec:
        """The config as the children are started from it (``ClusterSpec.resolved``)."""
        return self.cfg.resolved(self.model, self.decode_weights)

    def _worker_cmd(self, role: str, i: int) -> list[str]:
        c = self.cfg
        num_ranks = c.prefill * c.prefill_tp + c.decode * c.decode_tp
        cores = os.cpu_count() or 1
        share = max(1, cores // num_ranks)  # this worker's share of the cores
        # every worker's steps take its whole share: reserving a core for the serving path (as vLLM's CPU guide
        # does for its API server) measured slower once one OpenMP team per process was the rule (worker.omp;
        # docs/performance.md)
        threads = c.threads_per_worker or share
        # a decode worker's own prefill forwards take its whole share of the cores (decode steps: --threads-per-worker)
        slot = WorkerSlot(f"{role}-{i}", threads, prefill_threads=max(threads, share),
                          mem_fraction=c.mem_fraction / (c.prefill + c.decode) if c.mem_fraction else None)
        return [sys.executable, "-m", f"{role}.server", "--host", "127.0.0.1", *self.spec.worker_argv(role, slot)]

    def start(self) -> None:
        """Start every worker, wait until all are ready, then start the router and wait for it too."""
        c = self.cfg
        try:
            for role, n in ((Role.PREFILL, c.prefill), (Role.DECODE, c.decode)):
                for i in range(n):
                    name = f"{role}-{i}"
                    self.workers.append(Child(name, self._worker_cmd(role, i), self.env,
                                              os.path.join(self.run_dir, f"{name}.log")))
            self._wait_ready(self.workers, c.startup_timeout_s)
            router_env = {**self.env, **({API_KEY: c.api_key} if c.api_key else {})}
            self.router = Child("router", self._router_cmd(), router_env, os.path.join(self.run_dir, "router.log"))
            self._wait_ready([self.router], c.startup_timeout_s)
        except BaseException:
            self.stop(keep_logs=True)  # the error names a log in run_dir
            raise

    def _router_cmd(self) -> list[str]:
        pre = ",".join(w.address for w in self.workers if w.name.startswith(Role.PREFILL))
        dec = ",".join(w.address for w in self.workers if w.name.startswith(Role.DECODE))
        workers = ([] if self.cfg.aggregated else ["--prefill", pre]) + ["--decode", dec]
        return [sys.executable, "-m", "router", *self.spec.router_argv(), *workers]

    @staticmethod
    def _wait_ready(children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            pending = [ch for ch in pending if not ch.poll_ready()]
            if pending and time.monotonic() > deadline:
                ch = pending[0]
                raise ClusterStartError(f"{ch.name} (pid {ch.pid}) not ready within {timeout_s:.0f}s; "
                                        f"log {ch.log_path}:\n{ch.log_tail()}")
            if pending:
                time.sleep(0.1)

    def restart_worker(self, i: int, n: int) -> Child:
        """Start worker ``i`` (which exited) again with its command on its old port, so the router, which
        knows it by address, takes it back once its health poll answers; its log goes to NAME.restartN.log."""
        old = self.workers[i]
        cmd = list(old.cmd)
        if old.address:
            cmd[cmd.index("--port") + 1] = old.address.rsplit(":", 1)[1]
        new = Child(old.name, cmd, self.env, os.path.join(self.run_dir, f"{old.name}.restart{n}.log"))
        old.close()
        self.workers[i] = new
        return new

    def dead_children(self) -> list[Child]:
        """Children that exited (their leftover shm segments are removed here, as soon as they are seen)."""
        dead = [ch for ch in self.children if ch.proc.poll() is not None]
        for ch in dead:
            ch.clean_up_after_exit()
        return dead

    def stop(self, keep_logs: bool = False) -> None:
        """SIGTERM the router, then the workers; SIGKILL whatever outlives the grace period; remove a
        temporary run directory unless ``keep_logs``. Idempotent."""
        if self.router is not None:
            self.router.terminate()
            _wait_all([self.router], self.cfg.stop_grace_s)
        for w in self.workers:
            w.terminate()
        _wait_all(self.children, self.cfg.stop_grace_s)
        for ch in self.children:
            if ch.proc.poll() is None:
                logger.warning("%s (pid %d) did not exit within %.0fs of SIGTERM: killing it", ch.name, ch.pid,
                               self.cfg.stop_grace_s)
                ch.proc.kill()
                ch.proc.wait(5)
            ch.clean_up_after_exit()
            ch.close()
        if self._temp_run_dir and not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(keep_logs=exc_type is not None)


def _wait_all(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for ch in children:
        try:
            ch.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _default_model() -> str:
    from engine.defaults import default_model_dir  # lazy: engine (the launcher's CLI and `pdserve bench` never import it)
    return default_model_dir()
