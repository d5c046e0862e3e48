"""Helpers of the Ray launcher tests (``conftest.ray_cluster`` and the tests that use it)."""
import glob
import os

import psutil

LOOPBACK = "127.0.0.1"
NS = "pdserve-test"
"""The namespace the session's driver joins (each test module may launch in its own)."""


def ray_pids(c) -> set[int]:
    """Every process the test cluster (a ``ray.cluster_utils.Cluster``) started (raylets, GCS, ...)."""
    return {i.process.pid for node in c.list_all_nodes() for infos in node.all_processes.values() for i in infos
            if i.process is not None}


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


RAY_LOGS = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")


def ray_start_report() -> str:
    """What a failed Ray start-up leaves to read: the machine's load, its busiest processes and the tails of the
    newest session's raylet / GCS logs."""
    def cpu_s(p) -> float:
        t = p.info["cpu_times"]
        return t.user + t.system if t else 0.0
    procs = sorted(psutil.process_iter(["pid", "cpu_times", "cmdline"]), key=cpu_s, reverse=True)
    lines = [f"load average {os.getloadavg()}", "processes by CPU time:"]
    lines += [f"  {p.info['pid']} {cpu_s(p):.0f}s {' '.join(p.info['cmdline'] or [])[:160]}" for p in procs[:8]]
    for name in RAY_LOGS:
        for path in sorted(glob.glob(f"/tmp/ray/session_latest/logs/{name}"))[-1:]:
            with open(path, errors="replace") as f:
                lines += [f"--- {path} (tail)", *f.read().splitlines()[-15:]]
    return "\n".join(lines)


def start_cluster(head_args: dict, node_args: list[dict], attempts: int = 2):
    """A ``ray.cluster_utils.Cluster``: the head, then ``node_args``' raylets, all registered.

    Ray gives a raylet a fixed 30 s to register with the GCS (``ray._private.node``); on a loaded 2-core machine
    a start-up can miss it. A failed attempt's processes are killed, its logs and the machine's load are kept in
    the error, and the start is tried once more; a second failure raises with both reports."""
    from ray.cluster_utils import Cluster  # lazy: ray (an optional extra for the tests that skip without it)
    reports = []
    for attempt in range(attempts):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**head_args)
            for a in node_args:
                c.add_node(wait=False, **a)
            c.wait_for_nodes()
            return c
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a node that missed its start
            reports.append(f"attempt {attempt + 1}: {type(e).__name__}: {e}\n{ray_start_report()}")
            try:
                c.shutdown()
            except Exception:  # noqa: BLE001 - best effort: what it could not stop is killed below
                pass
            new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            for p in new:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(new, timeout=10)
    raise RuntimeError("the test Ray cluster did not start:\n" + "\n".join(reports))
