"""Fixtures for the kvtransfer tests: one long-lived simulated prefill worker process."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

import kvt_workers


class PrefillClient:
    """Drives a ``kvt_workers.prefill_worker`` process: ``run(**cmd)`` -> its report."""

    def __init__(self, shared: bool = False) -> None:
        self.ctx = mp.get_context("spawn")
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=kvt_workers.prefill_worker, args=(child,), daemon=True)
        if shared:  # the session's worker: tests/conftest.py's leak check lets it outlive the module that started it
            os.environ["PDSERVE_TEST_SHARED_PROCESS"] = "1"
        try:
            self.proc.start()
        finally:
            os.environ.pop("PDSERVE_TEST_SHARED_PROCESS", None)
        if not self.conn.poll(120) or self.conn.recv() != "ready":  # imports done: timings start now
            raise AssertionError("prefill worker did not start")

    def submit(self, **cmd) -> None:
        self.conn.send(cmd)

    def result(self, timeout_s: float = 60.0) -> dict:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"prefill worker gave no answer within {timeout_s}s")
        out = self.conn.recv()
        if out["status"] == "crash":
            raise AssertionError(f"prefill worker crashed:\n{out['traceback']}")
        return out

    def run(self, timeout_s: float = 60.0, **cmd) -> dict:
        self.submit(**cmd)
        return self.result(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture(scope="session")
def prefill():
    client = PrefillClient(shared=True)
    yield client
    client.close()


@pytest.fixture
def spawn_prefill():
    """A fresh prefill worker process for tests that kill it."""
    clients = []

    def make() -> PrefillClient:
        clients.append(PrefillClient())
        return clients[-1]

    yield make
    for c in clients:
        c.kill()
