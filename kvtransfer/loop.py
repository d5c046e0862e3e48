"""An asyncio event loop (uvloop when installed) running in a daemon thread.

The prefill worker's forward pass is synchronous; ``KVSender`` runs its sockets on one of
these so ``send_layer`` only enqueues. A synchronous decode worker can host a
``KVReceiver`` the same way (``LoopThread().run(receiver.start())``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # lazy: uvloop
    except ImportError:  # optional dependency: the stdlib loop works, ~20% slower on the receive path
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Owns one event loop in one thread; ``run`` submits coroutines from any other thread."""

    def __init__(self, name: str = "kvtransfer-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()
        # cancel whatever is left so nothing runs against a closed loop
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    @property
    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (never call this from the loop thread)."""
        if self.in_loop:
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        return self.submit(coro).result(timeout_s)  # type: ignore[arg-type]

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
