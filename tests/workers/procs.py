"""Start real worker processes for tests and stop them (no orphans)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class Worker:
    def __init__(self, module: str, args: list[str], env: dict | None = None, log_path: str | None = None) -> None:
        self.log_path = log_path
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.address = None

    def wait_ready(self, timeout_s: float = 90) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_tail()}")
            for line in open(self.log_path).read().splitlines():
                if line.startswith("PDSERVE_READY"):
                    self.address = line.split()[2]
                    with grpc.insecure_channel(self.address) as ch:
                        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                        assert r.status == health_pb2.HealthCheckResponse.SERVING
                    return self.address
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready in {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return open(self.log_path).read()[-n:] if self.log_path else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
