"""``pdserve serve`` when start-up fails or is interrupted: a clear error naming the worker, and no process left."""
import os
import signal

from serve_helpers import ServeProcess, children_of, pid_alive, wait_until


def group_is_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_startup_failure_names_the_worker_and_leaves_nothing_behind(tmp_path):
    sp = ServeProcess(["--model", str(tmp_path / "no-such-model"), "--port", "0", "--run-dir", str(tmp_path / "run"),
                       "--startup-timeout", "120"], str(tmp_path / "serve.out"))
    assert sp.proc.wait(150) == 1
    out = sp.output()
    assert "pdserve: error:" in out and "exited with code" in out
    assert any(f"{name} (pid" in out for name in ("prefill-0", "decode-0"))
    assert "no-such-model" in out.split("pdserve: error:")[1]  # the log tail says why
    assert group_is_empty(sp.proc.pid)
    sp.stop()


def test_ctrl_c_during_startup_stops_every_worker(tiny_dirs, tmp_path):
    run = tmp_path / "run"
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0", "--prefill", "2", "--run-dir", str(run)],
                      str(tmp_path / "serve.out"))
    pids = wait_until(lambda: len(children_of(sp.proc.pid)) == 3 and children_of(sp.proc.pid),
                      what="3 workers spawned")
    os.killpg(sp.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert sp.proc.wait(60) == 0
    assert "SIGINT: shutting down" in sp.output()
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=30, what="workers gone")
    assert group_is_empty(sp.proc.pid)
    sp.stop()
