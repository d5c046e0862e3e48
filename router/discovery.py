"""Live worker discovery: the router follows a worker list that changes while it serves.

``python -m router.discovery --discovery file:PATH [router flags]`` runs the ordinary router with no static
workers; PATH holds ``{"prefill": ["host:port", ...], "decode": ["host:port", ...]}`` and is re-read
whenever it changes (writers replace it atomically: write a temporary file, then rename). A worker that
appears is added to the registry (it enters the rotation on its first good health poll); one that
disappears is drained: out of the rotation at once, forgotten when this router's calls to it have ended.

The Ray launcher (``cluster/ray_actors.py``) writes this file from the named worker actors it finds in
its namespace, so workers that Ray restarts on a new port, or that ``pdserve scale`` adds or removes, are
followed without restarting the router. The router itself never talks to Ray.

The router sends the cluster secret to every address the list names, so whoever can write the list can
collect the secret. The list therefore lives in a private directory (``ensure_private_dir``: a real
directory, owned by us, not writable by group or others), is written through a randomly named temporary
file created with ``O_EXCL`` and renamed over the target (a symlink there is replaced, never followed),
and the router ignores a list whose file or directory fails the same checks.

Prints ``PDSERVE_READY router HOST:PORT`` once listening, like ``python -m router``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import NamedTuple

from common import flags, logs
from common.reasons import Role
from protos import rpc
from router.config import RouterConfig, add_config_args, config_from_args
from router.server import RouterServer
from worker.process import run

logger = logging.getLogger("router.discovery")
ROLES = tuple(Role)


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    discovery: str = ""
    """Where the worker list comes from: file:PATH (JSON {"prefill": [...], "decode": [...]})."""
    discovery_interval_s: float = 0.5
    """How often the source is checked for changes."""
    drain_timeout_s: float = 600.0
    """A removed worker is forgotten when the router's calls to it end, or after this long."""

    def __post_init__(self) -> None:
        if not self.discovery.startswith("file:") or len(self.discovery) <= len("file:"):
            raise ValueError(f"discovery must be file:PATH, got {self.discovery!r}")
        if not self.discovery_interval_s > 0 or not self.drain_timeout_s > 0:
            raise ValueError(f"discovery_interval_s and drain_timeout_s must be > 0, got "
                             f"{self.discovery_interval_s} and {self.drain_timeout_s}")

    @property
    def path(self) -> str:
        return self.discovery[len("file:"):]


class WorkerList(NamedTuple):
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> "WorkerList":
        """Raises ValueError on anything but {"prefill": [host:port...], "decode": [host:port...]}."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        out = []
        for role in ROLES:
            addrs = obj.get(role, [])
            if not isinstance(addrs, list) or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit()
                                                      and a.rpartition(":")[0] for a in addrs):
                raise ValueError(f"{role!r} must be a list of host:port strings, got {addrs!r}")
            out.append(tuple(dict.fromkeys(addrs)))
        return cls(*out)

    def dump(self) -> str:
        return json.dumps({"prefill": list(self.prefill), "decode": list(self.decode)}, sort_keys=True)


def check_private(path: str, is_dir: bool, st: os.stat_result | None = None) -> None:
    """Raise ``PermissionError`` unless ``path`` (or the open file whose ``st`` is given) is a real
    file/directory (not a symlink), owned by this user, and writable by nobody else."""
    st = st or os.lstat(path)
    kind = "directory" if is_dir else "file"
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        raise PermissionError(f"{path} is not a plain {kind} (a symlink?): refusing it")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()}): refusing it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"refusing it")


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (and its missing parents) with mode 0700, or check an existing one with
    ``check_private``: a directory somebody else created first (e.g. under /tmp) is refused, not used."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        ensure_private_dir(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private(path, is_dir=True)
    return path


def write_worker_list(path: str, workers: WorkerList) -> None:
    """Replace ``path`` atomically (a reader never sees half a file) inside a private directory: a fresh
    temporary file (random name, ``O_EXCL``, mode 0600) renamed over it."""
    directory = ensure_private_dir(os.path.dirname(os.path.abspath(path)))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".workers-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(workers.dump())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_worker_list(path: str) -> WorkerList:
    """The list at ``path``; ``PermissionError`` if it or its directory is not private, ``ValueError`` if
    malformed."""
    check_private(os.path.dirname(os.path.abspath(path)), is_dir=True)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        check_private(path, is_dir=False, st=os.fstat(fd))  # the file we opened, not whatever is there now
        return WorkerList.parse(f.read())


class FileDiscovery:
    """Keeps ``registry``'s membership equal to the list in a file (see the module docstring)."""

    def __init__(self, cfg: DiscoveryConfig, registry) -> None:
        self.cfg, self.registry = cfg, registry
        self._seen: tuple[int, int, int] | None = None
        self.applied: WorkerList | None = None
        """The list last applied (None: the file was never read)."""

    def apply(self, workers: WorkerList) -> None:
        """Add the listed workers the registry lacks; drain the ones it has that are not listed."""
        reg = self.registry
        for role, addrs in zip(ROLES, workers):
            for a in addrs:
                reg.add_worker(role, a)
            want = {f"{role}/{a}" for a in addrs}
            for key, w in list(reg.workers.items()):
                if w.role == role and key not in want:
                    reg.remove_worker(key, self.cfg.drain_timeout_s)
        self.applied = workers

    def check(self) -> bool:
        """Re-read the file if it changed; True when a new list was applied."""
        try:
            st = os.stat(self.cfg.path)
        except FileNotFoundError:
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            workers = read_worker_list(self.cfg.path)
        except (OSError, ValueError) as e:
            logger.warning("worker list %s ignored: %s", self.cfg.path, e)
            return False
        if workers != self.applied:
            logger.info("worker list changed: %d prefill, %d decode", len(workers.prefill), len(workers.decode))
            self.apply(workers)
        return True

    async def run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.cfg.discovery_interval_s)


async def amain(cfg: RouterConfig, dcfg: DiscoveryConfig) -> None:
    srv = RouterServer(cfg)
    try:
        await srv.start()
    except OSError as e:
        raise SystemExit(f"router: error: {e}") from None
    disc = FileDiscovery(dcfg, srv.core.registry)
    disc.check()
    task = asyncio.get_running_loop().create_task(disc.run(), name="discovery")
    http = f" http {srv.http.address}" if srv.http is not None else ""
    print(f"PDSERVE_READY router {srv.address}{http}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received: shutting down")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await srv.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m router.discovery", description="pdserve router with live discovery")
    add_config_args(p, skip=("prefill", "decode"))
    add_config_args(p, cls=DiscoveryConfig)
    flags.add_api_key_file_arg(p)
    logs.add_log_args(p)
    p.set_defaults(http_port=flags.DEFAULT_HTTP_PORT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup_logging(args.log_level, args.log_format)
    try:
        cfg = config_from_args(args, api_key=rpc.api_key_from_args(args))
        dcfg = config_from_args(args, cls=DiscoveryConfig)
    except (ValueError, OSError) as e:
        print(f"router: error: {e}", file=sys.stderr)
        return 2
    run(amain(cfg, dcfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
