"""One OpenMP team per worker process: its scheduler thread's.

torch's CPU kernels run on OpenMP (libgomp in torch's wheels). Every thread that runs a parallel region keeps a
team of its own (its pool of helper threads) until the thread exits. Once the threads of the process's live teams
outnumber the CPUs it may use, libgomp lets a waiting team thread spin only ~100 iterations instead of ~300,000
(about 3 ms; ``gomp_throttled_spin_count_var`` in libgomp's env.c): each parallel region then ends with its
helpers asleep on a futex, and the next one waits for them to wake. A worker's scheduler thread steps on N threads;
on a machine with N CPUs one more team anywhere in the process (the event loop's, after it loaded the model, ran
the warm-up or copied a big tensor) throttles every region of every step.

Measured (``bench.omp_threads``: the peers' glm4_moe, bf16, compiled decode step, batch 1, 2 threads on 2 CPUs;
``docs/performance.md``): 1,951 us per step on the thread that had loaded the model; 6,305 us on another thread
while the loading thread lived; 2,040 us on another thread once the loading thread had ended.

So a worker loads, compiles and warms up on a thread of its own that then exits (``in_own_thread``), and the
threads that serve (the event loop's, the default executor's) run torch ops on one thread (``serial_here``),
never forming a team. The scheduler thread's team is the only one left.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import os
import threading
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


@functools.cache
def _libgomp() -> tuple[ctypes.CDLL, ...]:
    """The libgomp copies loaded in this process (torch's wheel ships its own), from ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return ()
    libs = []
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libgomp")):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError as e:
            logger.debug("cannot open %s: %s", path, e)
    return tuple(libs)


def serial_here() -> bool:
    """Run the calling thread's torch ops on one thread from now on (OpenMP's per-thread ``nthreads`` ICV); other
    threads keep theirs, and threads started later take torch's process-wide count as before. Returns False where
    torch's OpenMP is not libgomp (nothing changed)."""
    import torch  # lazy: the router imports worker modules and must not load torch

    torch.get_num_threads()  # torch's per-thread lazy init first: it would set this thread back to the global count
    libs = _libgomp()
    for lib in libs:
        lib.omp_set_num_threads(1)
    return bool(libs)


def serve_serially() -> None:
    """The serving threads stay out of OpenMP teams: the calling thread (the event loop's) and the loop's default
    executor (``asyncio.to_thread``) run torch ops on one thread. Call on the worker's event loop."""
    if not serial_here():
        logger.debug("torch's OpenMP runtime is not libgomp: the event loop keeps torch's thread count")
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(thread_name_prefix="worker-io", initializer=serial_here))


async def in_own_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a new thread, awaited; the thread has ended (and its OpenMP team with it) when this
    returns. Its exception is raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine, raised there
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=target, name=f"worker-{getattr(fn, '__name__', 'startup')}", daemon=True)
    thread.start()
    result = await done
    thread.join()  # it has returned: it ends now
    return result
