"""``pdserve serve`` leaves no KV shm segment behind, even when a decode worker is SIGKILLed (issue 25, item 4)."""
import os
import signal

from cluster.local import SHM_DIR, shm_segment_prefix
from kvtransfer.shm import NAME_RE
from serve_helpers import ServeProcess
from shared_helpers import wait_until


def segments(prefix: str = "pdserve-kv-") -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def orphaned(names: set[str]) -> set[str]:
    """The segments among ``names`` whose creating process is gone: a leak. Segments of live processes are
    another test's or program's running workers (tests share /dev/shm), not ours: every process this test
    started has exited by the time it looks."""
    out = set()
    for n in names:
        m = NAME_RE.match(n)
        if m and not os.path.exists(f"/proc/{int(m.group(2), 16)}"):
            out.add(n)
    return out


def test_sigkilled_decode_worker_segment_is_removed_when_it_dies_and_none_survives_serve(tiny_dirs, tmp_path):
    before = segments()
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0", "--run-dir", str(tmp_path / "run")],
                      str(tmp_path / "serve.out"))
    try:
        sp.wait_listening()
        victim = sp.children["decode-0"]
        prefix = shm_segment_prefix(victim)
        assert segments(prefix), f"decode-0 (pid {victim}) made no shm segment:\n{sp.output()[-3000:]}"
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not segments(prefix), timeout_s=20, what="the dead worker's segment removed")
        assert "decode-0" in sp.output().split("listening on")[1]  # the death was reported
    finally:
        rc = sp.stop()
    assert rc == 0, sp.output()[-3000:]
    assert not orphaned(segments() - before), f"left behind: {orphaned(segments() - before)}"
