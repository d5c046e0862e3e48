import logging
import os
import sys

import psutil
import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random transformers checkpoints saved to disk: {'dsa': dir, 'gqa': dir}."""
    from tiny import make_hf_model
    out = {}
    for kind in ("dsa", "gqa"):
        d = tmp_path_factory.mktemp(f"tiny_{kind}")
        make_hf_model(kind).save_pretrained(d)
        out[kind] = str(d)
    return out


@pytest.fixture(scope="session")
def tiny_glm5_dir(tmp_path_factory):
    """A tiny random GLM-5 checkpoint (``TINY_GLM5`` with index_topk 64, seed 1): the scheduler tests' model,
    loaded by each in the dtype it needs."""
    from engine.checkpoint import TINY_GLM5, init_random_model  # as tiny_dirs: the engine only for tests using it
    d = str(tmp_path_factory.mktemp("tiny_glm5"))
    init_random_model({**TINY_GLM5, "index_topk": 64}, d, seed=1)
    return d


# -- no process outlives its test module ---------------------------------------------------------------------------
# A child left running (a server a test forgot to stop, a rank whose parent died) holds ports, shm segments and
# CPU: on a 2-core CI machine one leak slows every later module, up to Ray's head raylet missing its 30 s start-up
# window. Each module's new descendants must have exited at its end; the long-lived pools that are meant to
# outlive a module (inductor's compile workers, multiprocessing's resource tracker, the session's Ray cluster and
# everything under it) are exempt, and so is a process a session-scoped fixture started with SHARED_ENV=1 in its
# environment (it lives for the whole session by design, and is stopped by that fixture's teardown).
SHARED_ENV = "PDSERVE_TEST_SHARED_PROCESS"
LONG_LIVED = ("torch/_inductor/compile_worker", "multiprocessing.resource_tracker", "multiprocessing.forkserver", "/ray/", "raylet", "gcs_server", "ray::")


@pytest.fixture
def fresh_dynamo():
    """torch._dynamo as a decode worker's process has it: nothing compiled yet. One pytest process runs every
    module's models through the same compiled functions (``mla_decode_stack``, ``gqa_decode_layer``), whose cache
    entries and automatic-dynamic decisions outlive the test that made them: an earlier test's static graph could
    serve a warm-up shape that a fresh worker compiles dynamic, and the 64-entry recompile limit was reached
    across modules (CI, serial: 4 graphs after warm-up, then FailOnRecompileLimitHit). A test of what a worker
    compiles starts from a reset."""
    import torch._dynamo
    torch._dynamo.reset()
    yield


def _long_lived(p: psutil.Process) -> bool:
    try:
        if p.environ().get(SHARED_ENV) == "1":
            return True
        chain = [p, *p.parents()]
        return any(any(k in " ".join(q.cmdline()) for k in LONG_LIVED) for q in chain)
    except psutil.Error:
        return True  # gone meanwhile


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # the long-lived ones are left out before the wait (waiting on a compile worker cost the module 10 s)
    new = [p for p in me.children(recursive=True) if p.pid not in before and not _long_lived(p)]
    _, alive = psutil.wait_procs(new, timeout=10)
    leaked = [p for p in alive if _alive(p) and not _long_lived(p)]
    if not leaked:
        return
    names = []
    for p in leaked:
        try:
            names.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            pass
    pytest.fail("processes outlived their test module (killed now):\n" + "\n".join(names), pytrace=False)


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N`` (pytest-xdist, ``--dist loadgroup``, what ``make test`` runs): a module's tests run
    on one worker, so its module-scoped servers and models are built once; every test on the session's Ray
    cluster runs on one worker, so only one cluster starts; tests/kvtransfer runs on one worker (its session's
    simulated prefill worker, and Mooncake's transfer engines, which bind fixed local ports). A test marked
    ``own_xdist_group`` (one that compiles for minutes) is a group of its own: the two workers share the load."""
    for item in items:
        module = item.nodeid.split("::")[0]
        if item.get_closest_marker("own_xdist_group"):  # minutes alone: it may run beside its module's others
            group = item.nodeid
        elif "ray_cluster" in getattr(item, "fixturenames", ()):
            group = "ray_cluster"
        elif module.startswith("tests/kvtransfer/"):
            group = "kvtransfer"
        else:
            group = module
        item.add_marker(pytest.mark.xdist_group(group))
