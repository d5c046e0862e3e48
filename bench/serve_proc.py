"""``pdserve serve`` as a subprocess for benchmarks: start it, wait for its gRPC address, stop it with its children."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServeEndpoints(NamedTuple):
    """Where a started ``pdserve serve`` listens."""

    grpc: str
    """The router's gRPC address, HOST:PORT."""
    http: str
    """The OpenAI-compatible base URL, ``http://HOST:PORT/v1`` ("" when started without it)."""


@contextlib.contextmanager
def serve(flags: list[str], start_timeout_s: float = 300.0) -> Iterator[str]:
    """``pdserve serve --port 0 --http-port 0 FLAGS`` (see ``serve_endpoints``); yields the router's gRPC
    address."""
    with _serve(flags, start_timeout_s, http=False) as ends:
        yield ends.grpc


@contextlib.contextmanager
def serve_endpoints(flags: list[str], start_timeout_s: float = 300.0) -> Iterator[ServeEndpoints]:
    """``pdserve serve --port 0 --http-port -1 FLAGS`` (the OpenAI front door on any free port); yields both
    addresses once it listens."""
    with _serve(flags, start_timeout_s, http=True) as ends:
        yield ends


@contextlib.contextmanager
def _serve(flags: list[str], start_timeout_s: float, http: bool) -> Iterator[ServeEndpoints]:
    """``pdserve serve`` in its own session and a scratch run directory; yields its addresses (``http`` is ""
    without the front door) once it listens, SIGTERMs the whole group on exit. Its output is in the error
    raised when it does not start."""
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "serve.out")
        with open(out_path, "wb") as log:
            p = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", "0", "--http-port",
                                  "-1" if http else "0", "--run-dir", os.path.join(d, "run"), *flags],
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not ((m := re.search(r"listening on (\S+)", text := _read(out_path)))
                       and (h := re.search(r"OpenAI-compatible HTTP on (\S+)", text) if http else True)):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pdserve serve did not start:\n{_read(out_path)[-3000:]}")
                time.sleep(0.3)
            yield ServeEndpoints(m.group(1), h.group(1) if http else "")
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(60)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
