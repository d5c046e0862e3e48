"""worker.scheduler_thread: the step thread both schedulers run on (real threads, bounded waits)."""
import threading

from worker.scheduler_thread import SchedulerThread


class Counter(SchedulerThread):
    thread_name = "test-scheduler"

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.pending, self.steps, self.errors, self.fail_at = 0, 0, 0, fail_at
        self.idle = threading.Event()

    def has_work(self) -> bool:
        if not self.pending:
            self.idle.set()
        return self.pending > 0

    def step(self) -> bool:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("a bug in one step")
        with self._cv:
            self.pending -= 1
        return True

    def on_step_error(self) -> None:
        self.errors += 1
        self.pending -= 1

    def submit(self, n: int) -> None:
        with self._cv:
            self.idle.clear()
            self.pending += n
            self._cv.notify()


def test_steps_until_idle_survives_a_failing_step_and_stops():
    s = Counter(fail_at=2)
    assert s.health_problem() == ""  # not started: nothing to report
    s.start()
    s.submit(5)
    assert s.idle.wait(10)
    assert (s.steps, s.errors, s.pending) == (5, 1, 0)  # the failing step ended its batch, the thread went on
    assert s.health_problem() == ""
    s.stop_thread(timeout_s=10)
    assert not s._thread.is_alive()


def test_a_dead_thread_is_reported():
    s = Counter()
    s.start()
    s.stop_thread(timeout_s=10)
    s._stop = False  # as if the thread had died on its own
    assert s.health_problem() == "scheduler thread is not running"
