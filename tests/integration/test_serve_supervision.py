"""``pdserve serve`` supervises its workers: a SIGKILLed worker is restarted on its old address, its shm
segment is removed, the router takes it back into rotation within 30 s and no request fails after that."""
import os
import signal
import time

from serve_helpers import ServeProcess, pages_all_free
from shared_helpers import wait_until

from cluster.local import shm_segment_prefix
from router.client import GenerationClient


def worker(client, role: str):
    return next(w for w in client.cluster_status().workers if w.role == role)


def shm_segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(shm_segment_prefix(pid))]


def test_a_sigkilled_worker_is_back_in_rotation_within_30s_and_serves(tiny_dirs, tmp_path):
    sp = ServeProcess(["--model", tiny_dirs["dsa"], "--port", "0", "--dtype", "float32", "--decode-weights", "model",
                       "--no-speculative", "--num-pages", "512", "--run-dir", str(tmp_path / "run")],
                      str(tmp_path / "serve.out"))
    try:
        sp.wait_listening()
        with GenerationClient(sp.address, timeout_s=60) as client:
            assert client.generate(token_ids=[3, 5, 7], max_tokens=8, ignore_eos=True).finish_reason == "length"
            for role in ("decode", "prefill"):
                old = worker(client, role)
                pid, address = int(old.info["pid"]), old.address
                if role == "decode":
                    assert shm_segments(pid), "the decode pool is in shared memory"
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                back = wait_until(lambda role=role, pid=pid: (w := worker(client, role)).healthy and
                                  int(w.info["pid"]) != pid and w,
                                  timeout_s=30, interval_s=0.2, what=f"{role} worker back in rotation")
                took = time.monotonic() - t0
                assert back.address == address and took < 30
                assert not shm_segments(pid), "the dead worker's shm segment was removed"
                for i in range(6):  # no request lost once it is back
                    out = client.generate(token_ids=[3, 5, 7 + i], max_tokens=8, ignore_eos=True)
                    assert out.finish_reason == "length" and len(out.token_ids) == 8
                wait_until(lambda: pages_all_free(client), what="every page back")
            out = wait_until(lambda: "decode-0 is back" in (o := sp.output()) and "prefill-0 is back" in o and o,
                             what="both logged back")
            for role in ("decode", "prefill"):
                assert f"pdserve: {role}-0 (pid" in out and "exited with code -9" in out
                assert f"pdserve: {role}-0: restarting in 1s (restart 1 of 5)" in out
                assert f"pdserve: {role}-0: restarted as pid" in out and f"pdserve: {role}-0 is back (pid" in out
    finally:
        assert sp.stop() == 0
