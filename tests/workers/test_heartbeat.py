"""``Heartbeat``: a worker reports itself unhealthy when its scheduler thread is dead or stalled with work."""
import threading
import time

import pytest

from worker.heartbeat import Heartbeat


def test_heartbeat_flags_a_dead_thread_and_a_stall_with_work_only():
    hb = Heartbeat(stall_after_s=0.05)
    alive = threading.Thread(target=time.sleep, args=(1,), daemon=True)
    alive.start()
    assert hb.problem(alive, busy=True) == ""
    time.sleep(0.1)
    assert hb.problem(alive, busy=False) == "", "idle is not stalled"
    assert "no scheduler step finished" in hb.problem(alive, busy=True)
    hb.beat()
    assert hb.problem(alive, busy=True) == ""
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    assert hb.problem(dead, busy=False) == "scheduler thread is not running"
    with pytest.raises(ValueError):
        Heartbeat(0)


def test_a_stuck_decode_scheduler_reports_itself(monkeypatch):
    """The scheduler's own view: a step that never returns makes health_problem() say so once the
    stall limit passes; stop() ends the report."""
    from decode.scheduler import DecodeScheduler
    gate = threading.Event()
    sched = DecodeScheduler.__new__(DecodeScheduler)
    sched._cv, sched._running, sched._pending_prefill, sched._stop = threading.Condition(), ["task"], [], False
    sched.heartbeat = Heartbeat(stall_after_s=0.1)
    monkeypatch.setattr(DecodeScheduler, "step", lambda self: gate.wait(10))
    sched.start()
    try:
        assert sched.health_problem() == ""
        time.sleep(0.3)
        assert "no scheduler step finished" in sched.health_problem()
    finally:
        with sched._cv:
            sched._stop = True
        gate.set()
        sched._thread.join(5)
    assert sched.health_problem() == ""
