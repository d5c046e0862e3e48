"""Real worker processes size their KV pool from memory (--mem-fraction) and refuse one that cannot fit
before loading the model or allocating anything."""
import os
import signal
import subprocess
import sys
import tempfile
import threading

import grpc
import pytest
from procs import Worker

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.config import ModelConfig
from engine.headers import checkpoint_tensors, weights_bytes
from engine.kvcache import KVLayout
from engine.memory import ACTIVATION_RESERVE_BYTES, host_memory
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

SECRET = "test-secret-0123456789abcdef"
POOL_BYTES = 64 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_random_model(TINY_GLM5, str(tmp_path_factory.mktemp("mem") / "model"), seed=1)


def test_a_pool_sized_by_mem_fraction_fits_and_is_reported(model_dir, tmp_path):
    total = host_memory().total_bytes
    wbytes = weights_bytes(checkpoint_tensors(model_dir), 4)
    frac = (wbytes + ACTIVATION_RESERVE_BYTES + POOL_BYTES) / total
    page_bytes = KVLayout.for_model(ModelConfig.from_model_dir(model_dir), 16, "float32").bytes_per_page()
    w = Worker("prefill.server", ["--model", model_dir, "--mem-fraction", repr(frac), "--dtype", "auto"],
               {"PDSERVE_CLUSTER_SECRET": SECRET}, str(tmp_path / "p.log"))
    try:
        addr = w.wait_ready()
        with grpc.insecure_channel(addr) as ch:
            st = worker_pb2_grpc.PrefillWorkerStub(ch).GetStatus(
                worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {SECRET}"),), timeout=5)
        expect = (int(frac * total) - wbytes - ACTIVATION_RESERVE_BYTES) // page_bytes
        assert abs(st.pages_total - expect) <= 1 and st.pages_total == st.pages_free
        assert st.info["dtype"] == "float32"  # a float32 checkpoint stays float32 under auto
        assert abs(int(st.info["kv_pool_bytes"]) - POOL_BYTES) <= 2 * page_bytes
        with open(w.log_path) as f:
            log = f.read()
        assert "dtype auto -> float32: the checkpoint is float32" in log
        assert f"KV pool: {st.pages_total} pages of 16 tokens" in log
        # the prefix cache's host tier is on by default: twice the pool (a quarter of the host's memory at most)
        host_pages = int(st.info["host_cache_capacity_pages"])
        assert 0 < host_pages <= 2 * st.pages_total and st.info["host_cache_pages"] == "0"
        assert f"host prefix cache: {host_pages} pages, auto: 2 x the KV pool" in log
    finally:
        w.stop()


MEASURE = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""
"""Runs the command as the child of a fresh, small Python process and writes the child's peak RSS (KiB) to a
file. Measured from the test process itself, the peak would be wrong: the kernel keeps a process's peak RSS
across exec, and a child forked (or vforked) from pytest starts with pytest's own resident size, over 2 GiB late
in a full run (CI failed on 2.09 GiB for a worker that allocated nothing)."""


def run_measured(cmd: list[str], env: dict, timeout_s: float) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``cmd`` to its end; its output and its own peak RSS in KiB (``MEASURE``: a small parent reaps it with
    ``os.wait4``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r") as rss:
        p = subprocess.Popen([sys.executable, "-c", MEASURE, rss.name, *cmd], stdout=out, stderr=err, text=True,
                             env=env, start_new_session=True)
        timer = threading.Timer(timeout_s, lambda: os.killpg(p.pid, signal.SIGKILL))
        timer.start()
        try:
            p.wait()
        finally:
            timer.cancel()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read()), int(rss.read() or 0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pool_that_cannot_fit_is_refused_before_any_allocation(model_dir, role):
    out, maxrss_kib = run_measured([sys.executable, "-m", f"{role}.server", "--model", model_dir, "--num-pages",
                                    "100000000", "--log-level", "INFO"],
                                   env={**os.environ, "PDSERVE_CLUSTER_SECRET": SECRET}, timeout_s=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pdserve {role} worker: error: KV pool of 100000000 pages (") and \
        "does not fit:" in last and "available on cpu, weights ~0.00 GiB" in last, last
    assert "Traceback" not in out.stderr and "loaded " not in out.stderr  # refused before the model was loaded
    # nothing near the pool's size was ever touched (this worker's own peak RSS in KiB, ``run_measured``)
    assert 0 < maxrss_kib < 2 << 20
