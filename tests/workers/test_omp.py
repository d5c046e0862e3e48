"""worker.omp: the serving threads form no OpenMP team, start-up work runs on a thread that ends."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from worker import omp

needs_libgomp = pytest.mark.skipif(not omp._libgomp(), reason="torch's OpenMP runtime here is not libgomp")
needs_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs two CPUs")


@pytest.fixture(autouse=True)
def two_threads():
    """torch's process-wide count at 2 (an earlier test may have left it at 1), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _os_threads() -> set[str]:
    """The process's OS thread ids (a set: threads other tests left ending meanwhile do not count as minus ones)."""
    return set(os.listdir("/proc/self/task"))


def _on_thread(fn):
    """``fn()`` on a new thread; its result (the thread is alive while ``fn`` runs, and then ends)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def _team_threads_started(serial: bool) -> int:
    """OS threads a big parallel op started on a fresh thread (its OpenMP team's helpers), that thread first made
    serial or not."""
    x = torch.ones(1 << 22)

    def op():
        if serial:
            assert omp.serial_here()
        before = _os_threads()
        for _ in range(3):
            x.add_(1.0)
        return len(_os_threads() - before)
    return _on_thread(op)


@needs_libgomp
@needs_cores
def test_a_serial_thread_forms_no_team_and_others_keep_theirs():
    assert _team_threads_started(serial=False) >= 1  # the control: the same op on a plain thread forms a team
    assert _team_threads_started(serial=True) == 0
    assert _on_thread(lambda: (omp.serial_here(), torch.get_num_threads())[1]) == 1
    assert _on_thread(torch.get_num_threads) == torch.get_num_threads() == 2  # other threads keep the count


@needs_libgomp
@needs_cores
def test_serve_serially_covers_the_loop_and_its_default_executor():
    async def main():
        omp.serve_serially()
        here = torch.get_num_threads()
        in_executor = await asyncio.to_thread(torch.get_num_threads)
        return here, in_executor

    assert _on_thread(lambda: asyncio.run(main())) == (1, 1)
    assert torch.get_num_threads() == 2  # the calling thread (pytest's) is untouched


def test_in_own_thread_returns_raises_and_the_thread_has_ended():
    seen = {}

    def work(a, b):
        seen["thread"] = threading.current_thread()
        return a + b

    def fail():
        raise SystemExit("bad flag")

    async def main():
        assert await omp.in_own_thread(work, 2, 3) == 5
        assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
        with pytest.raises(SystemExit, match="bad flag"):
            await omp.in_own_thread(fail)
    asyncio.run(main())
