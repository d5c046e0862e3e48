"""A decode worker under KV pressure, as real processes over gRPC (prefill + decode workers, KV shipped by
kvtransfer): reservations never end a running request, ``--max-running`` holds at ``Reserve`` (before the
prefill), and every page and reservation is back at the end."""
import threading
import time

import grpc
import pytest

from engine.checkpoint import TINY_GLM5, init_random_model
from procs import Worker
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

SECRET = "test-secret-pressure-0123456789"
MD = (("authorization", f"Bearer {SECRET}"),)
PAGE, NUM_PAGES = 16, 12


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("pressure")
    model_dir = str(d / "model")
    init_random_model({**TINY_GLM5, "index_topk": 64}, model_dir, seed=3)
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    pre = Worker("prefill.server", ["--model", model_dir, "--num-pages", "64", "--page-size", str(PAGE)], env,
                 str(d / "p.log"))
    dec = Worker("decode.server", ["--model", model_dir, "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE),
                                   "--no-speculative", "--max-running", "3"], env, str(d / "d.log"))
    try:
        pa, da = pre.wait_ready(), dec.wait_ready()
        with grpc.insecure_channel(pa) as pch, grpc.insecure_channel(da) as dch:
            yield worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)
    finally:
        pre.stop()
        dec.stop()


def reserve(d, req_id: str, num_tokens: int):
    return d.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=num_tokens), metadata=MD,
                     timeout=10).ticket


def status(d):
    return d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5)


def refused(d, req_id: str, num_tokens: int = 16) -> str:
    with pytest.raises(grpc.RpcError) as e:
        reserve(d, req_id, num_tokens)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    return e.value.details()


def wait_all_back(d) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = status(d)
        if st.pages_free == st.pages_total == NUM_PAGES and st.running == 0 and st.queued == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"decode pages/reservations not back: {status(d)}")


def test_max_running_is_checked_at_reserve_before_any_prefill(workers):
    _, d = workers
    for req_id in ("m1", "m2", "m3"):
        reserve(d, req_id, 20)
    st = status(d)
    assert st.queued == 3  # reservations are load the router sees
    free = st.pages_free
    why = refused(d, "m4")
    assert "max_running=3" in why and "3 reserved" in why
    assert status(d).pages_free == free  # nothing allocated for the refused one
    for req_id in ("m1", "m2", "m3"):
        assert d.Abort(worker_pb2.AbortRequest(request_id=req_id), metadata=MD, timeout=5).found
    wait_all_back(d)


def test_reservations_never_end_the_running_request(workers):
    """The only running request needs a page while reservations of incoming transfers hold all the others:
    it waits (new reservations are refused meanwhile) and finishes once they are gone."""
    p, d = workers
    ids = list(range(7, 37))  # 30 tokens: 2 pages; with 20 new tokens it needs 4
    sp = generation_pb2.SamplingParams(max_tokens=20, ignore_eos=True)
    t = reserve(d, "run", len(ids))
    r = p.Prefill(worker_pb2.PrefillRequest(request_id="run", token_ids=ids, sampling=sp, ticket=t),
                  metadata=MD, timeout=60)
    reserve(d, "incoming", (status(d).pages_free) * PAGE)  # the rest of the pool: 0 pages free
    chunks = []
    stream = d.Decode(worker_pb2.DecodeRequest(request_id="run", prompt_ids=ids, output_prefix=[r.first_token],
                                               sampling=sp, transfer_timeout_s=30), metadata=MD, timeout=60)
    reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while "wait for pages" not in (why := refused(d, "probe")):  # until the running request waits
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    time.sleep(0.3)
    assert not any(c.finish_reason for c in chunks), [(c.finish_reason, c.message) for c in chunks]
    assert d.Abort(worker_pb2.AbortRequest(request_id="incoming"), metadata=MD, timeout=5).found
    reader.join(30)
    assert chunks and chunks[-1].finish_reason == "length", [(c.finish_reason, c.message) for c in chunks]
    assert 1 + sum(len(c.token_ids) for c in chunks) == 20
    wait_all_back(d)
