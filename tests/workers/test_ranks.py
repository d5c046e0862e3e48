"""A rank group in this test process (rank 0) with one real follower process (gloo on 127.0.0.1), on a tiny
random GLM-5 checkpoint split two ways: no rank hangs forever in a collective.

- a follower that stops answering (SIGSTOP) makes rank 0's next model call raise ``RankFailure`` within the
  collective timeout, the group reports the problem, and the follower, resumed, leaves its dead group and exits;
- a rank 0 that goes silent (no command, no heartbeat) ends its follower after the collective timeout.
"""
import os
import signal
import time

import pytest
import torch

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.load import load_model
from engine.fingerprint import model_hash
from engine.offline import Engine
from engine.sampling import SamplingParams
from worker.model_proxy import ModelProxy
from worker.ranks import FollowerArgs, RankConfig, RankFailure, RankGroup

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_random_model(TINY_GLM5, str(tmp_path_factory.mktemp("ranks") / "tiny"))


def start(model_dir: str, heartbeat_s: float = 1.0) -> tuple[RankGroup, Engine]:
    group = RankGroup(RankConfig(tp_size=2, timeout_s=TIMEOUT_S, heartbeat_s=heartbeat_s), torch.device("cpu"))
    group.start(FollowerArgs(model_dir, "float32", "cpu", threads=1, log_level="WARNING"))
    model, cfg = load_model(model_dir, "float32", "cpu", parallel=group.parallel)
    group.wait_ready(model_hash(model_dir), cfg)
    return group, Engine(ModelProxy(model, group), cfg, num_pages=32)


def exited_within(proc, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()


def test_a_hung_follower_fails_the_call_within_the_timeout_and_then_exits(model_dir):
    group, eng = start(model_dir)
    [follower] = group._procs
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        assert len(eng.generate([[3, 5, 7]], params)[0].token_ids) == 4
        os.kill(follower.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailure):
            eng.generate([[3, 5, 9]], params)
        assert time.monotonic() - t0 < TIMEOUT_S + 10, "rank 0 waited past the collective timeout"
        assert "rank group" in group.problem()
        with pytest.raises(RankFailure):  # a failed group refuses at once
            eng.generate([[4]], params)
        os.kill(follower.pid, signal.SIGCONT)
        assert exited_within(follower, TIMEOUT_S + 20) not in (None, 0), "the follower left its dead group"
    finally:
        if follower.poll() is None:
            os.kill(follower.pid, signal.SIGCONT)
        group.close()
    assert follower.poll() is not None


def test_a_silent_rank_0_ends_its_follower_after_the_timeout(model_dir):
    group, _ = start(model_dir, heartbeat_s=1.0)
    [follower] = group._procs
    try:
        group._stop.set()  # rank 0 hangs: no command and no heartbeat any more
        group._monitor.join()
        code = exited_within(follower, TIMEOUT_S + 20)
        assert code not in (None, 0), "the follower gave up on a silent rank 0"
    finally:
        group.close()
