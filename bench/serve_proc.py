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
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def serve(flags: list[str], start_timeout_s: float = 300.0) -> Iterator[str]:
    """``pdserve serve --port 0 --http-port 0 FLAGS`` in its own session and a scratch run directory; yields the
    router's address once it listens, SIGTERMs the whole group on exit. Its output is in the error raised
    when it does not start."""
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "serve.out")
        with open(out_path, "wb") as log:
            p = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", "0", "--http-port", "0",
                                  "--run-dir", os.path.join(d, "run"), *flags],
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not (m := re.search(r"listening on (\S+)", open(out_path).read())):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pdserve serve did not start:\n{open(out_path).read()[-3000:]}")
                time.sleep(0.3)
            yield m.group(1)
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(60)
