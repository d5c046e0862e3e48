"""``pdserve serve`` when start-up fails or is interrupted: a clear error naming the worker, and no process left."""
import json
import os
import shutil
import signal

from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

from engine.checkpoint import TINY_GLM5, init_random_model
from serve_helpers import ServeProcess, children_of, pid_alive
from shared_helpers import wait_until


def group_is_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_startup_failure_names_the_worker_and_leaves_nothing_behind(tmp_path):
    """A failure only a worker can see (config.json's vocabulary disagrees with the weights' shapes: the
    command's own checks read headers, not shapes) names the worker and its log tail."""
    model = tmp_path / "model"
    init_random_model(TINY_GLM5, str(tmp_path / "src"))
    shutil.copytree(tmp_path / "src", model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    sp = ServeProcess(["--model", str(model), "--port", "0", "--run-dir", str(tmp_path / "run"),
                       "--decode-weights", "model", "--startup-timeout", "120"], str(tmp_path / "serve.out"))
    assert sp.proc.wait(150) == 1
    out = sp.output()
    assert "pdserve: error:" in out and "exited with code" in out
    assert any(f"{name} (pid" in out for name in ("prefill-0", "decode-0"))
    assert "shape mismatch for checkpoint tensor" in out.split("pdserve: error:")[1]  # the log tail says why
    assert group_is_empty(sp.proc.pid)
    sp.stop()


def test_ctrl_c_during_startup_stops_every_worker(tiny_dirs, tmp_path):
    run = tmp_path / "run"
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0", "--prefill", "2", "--run-dir", str(run)],
                      str(tmp_path / "serve.out"))
    pids = wait_until(lambda: len(children_of(sp.proc.pid)) == 3 and children_of(sp.proc.pid),
                      timeout_s=60, what="3 workers spawned")  # after the command's own checks
    os.killpg(sp.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert sp.proc.wait(60) == 0
    assert "SIGINT: shutting down" in sp.output()
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=30, what="workers gone")
    assert group_is_empty(sp.proc.pid)
    sp.stop()


def test_a_clean_stop_leaves_no_temporary_run_directory(tiny_dirs, tmp_path):
    """Without --run-dir the logs go to a temporary directory, removed when serve stops cleanly."""
    # TMPDIR moves the run directory; inductor's cache (also under the temporary directory by default) stays
    # where the other tests warmed it, or the workers' warm-up compiles every graph cold (~90 s)
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0"], str(tmp_path / "serve.out"),
                      env={"TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()})
    sp.wait_listening()
    assert [n for n in os.listdir(tmp_path) if n.startswith("pdserve-run-")]
    assert sp.stop() == 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("pdserve-run-")]
