"""Real prefill and decode worker processes driven over their internal gRPC services (as the router does),
with the KV shipped through kvtransfer on loopback."""
import time

import grpc
import pytest

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from procs import Worker
from worker.convert import model_info_strings, sampling_from_proto
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

SECRET = "test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("w")
    model_dir = str(d / "model")
    init_random_model({**TINY_GLM5, "index_topk": 64}, model_dir, seed=3)
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    common = ["--model", model_dir, "--num-pages", "256", "--page-size", "16", "--dtype", "float32"]
    pre = Worker("prefill.server", common + ["--chunk-size", "32", "--max-batch-tokens", "64"], env, str(d / "p.log"))
    dec = Worker("decode.server", common + ["--no-speculative"], env, str(d / "d.log"))
    try:
        pa, da = pre.wait_ready(), dec.wait_ready()
        yield model_dir, pa, da
    finally:
        pre.stop()
        dec.stop()


MD = (("authorization", f"Bearer {SECRET}"),)


def generate(pa, da, req_id, ids, sampling):
    with grpc.insecure_channel(pa) as pch, grpc.insecure_channel(da) as dch:
        p, d = worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)
        t = d.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=len(ids)), metadata=MD, timeout=10).ticket
        r = p.Prefill(worker_pb2.PrefillRequest(request_id=req_id, token_ids=ids, sampling=sampling, ticket=t),
                      metadata=MD, timeout=60)
        out = [r.first_token]
        reason = ""
        for chunk in d.Decode(worker_pb2.DecodeRequest(request_id=req_id, prompt_ids=ids, output_prefix=[r.first_token],
                                                       sampling=sampling), metadata=MD, timeout=60):
            out += list(chunk.token_ids)
            reason = chunk.finish_reason
        return r, out, reason


def status(addr, stub_cls):
    with grpc.insecure_channel(addr) as ch:
        return stub_cls(ch).GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5)


def test_pd_over_real_workers_matches_in_process_engine(cluster):
    model_dir, pa, da = cluster
    sp = generation_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
    ids = list(range(7, 120))
    r, out, reason = generate(pa, da, "req-1", ids, sp)
    model, cfg = load_model(model_dir, "float32", "cpu")
    # same chunking as the worker: on a random model the logit margins are tiny, so a different
    # chunking's last-bit differences can flip a later greedy token
    ref = Engine(model, cfg, page_size=16, chunk_size=32).generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert out == ref.token_ids and reason == "length"
    assert r.transfer_bytes > 0
    # same prompt again: served from the prefix cache, same tokens
    r2, out2, _ = generate(pa, da, "req-2", ids, sp)
    assert r2.cached_tokens == 112 and out2 == out  # 7 full pages of 113 tokens
    ds = status(da, worker_pb2_grpc.DecodeWorkerStub)
    assert ds.pages_free == ds.pages_total  # every decode page back
    ps = status(pa, worker_pb2_grpc.PrefillWorkerStub)
    assert ps.info["pages_owned_by_requests"] == "0" and ps.pages_cached > 0
    # both froze their start-up heap (modules, model, tables) out of the garbage collector's full passes
    assert int(ps.info["gc_frozen_objects"]) > 20000 and int(ds.info["gc_frozen_objects"]) > 20000
    # the model contract travels typed, and as the same strings for routers that predate it
    for st in (ps, ds):
        assert (st.model.vocab_size, st.model.max_context, st.model.page_size) == \
            (cfg.vocab_size, cfg.max_position_embeddings, 16)
        assert list(st.model.eos_token_ids) == list(cfg.eos_token_ids) and st.model.num_mtp_layers == cfg.num_mtp_layers
        assert model_info_strings(st.model).items() <= dict(st.info).items()


def test_internal_services_require_the_cluster_secret(cluster):
    _, pa, da = cluster
    with grpc.insecure_channel(da) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.DecodeWorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.DecodeWorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=5,
                                                           metadata=(("authorization", "Bearer wrong"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bad_input_gets_status_codes(cluster):
    _, pa, da = cluster
    with grpc.insecure_channel(pa) as ch:
        p = worker_pb2_grpc.PrefillWorkerStub(ch)
        for req, code in [
            (worker_pb2.PrefillRequest(request_id="e1"), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.PrefillRequest(request_id="e2", token_ids=[1, 99999]), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.PrefillRequest(request_id="e3", token_ids=[1, 2],
                                       sampling=generation_pb2.SamplingParams(top_p=1.5)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.PrefillRequest(request_id="e4", token_ids=[1, 2],
                                       ticket=worker_pb2.TransferTicket(ticket=b"\x93garbage")),
             grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                p.Prefill(req, metadata=MD, timeout=10)
            assert e.value.code() == code, (req, e.value.details())
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            d.Reserve(worker_pb2.ReserveRequest(request_id="big", num_tokens=10_000_000), metadata=MD, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:  # decode without a transfer: clear error, no hang
            list(d.Decode(worker_pb2.DecodeRequest(request_id="nope", output_prefix=[3]), metadata=MD, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_abort_after_reserve_frees_decode_pages(cluster):
    _, pa, da = cluster
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        before = d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free
        d.Reserve(worker_pb2.ReserveRequest(request_id="ab", num_tokens=100), metadata=MD, timeout=5)
        mid = d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free
        assert mid == before - 7
        assert d.Abort(worker_pb2.AbortRequest(request_id="ab"), metadata=MD, timeout=5).found
        for _ in range(50):
            if d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free == before:
                break
            time.sleep(0.05)
        assert d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free == before


def test_a_refused_reservation_leaves_the_decode_pool_untouched(cluster):
    """Issue 25: a 257-character id was refused after its pages were allocated (UNKNOWN, pages gone for good)."""
    _, _, da = cluster
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        free = lambda: d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free  # noqa: E731
        before = free()
        d.Reserve(worker_pb2.ReserveRequest(request_id="dup", num_tokens=100), metadata=MD, timeout=5)
        for req_id, needle in (("x" * 257, "1..256 characters"), ("", "1..256 characters"), ("dup", "already holds")):
            with pytest.raises(grpc.RpcError) as e:
                d.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=100), metadata=MD, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value
            assert free() == before - 7
        assert d.Abort(worker_pb2.AbortRequest(request_id="dup"), metadata=MD, timeout=5).found
        deadline = time.monotonic() + 5
        while free() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert free() == before


def test_stop_token_ids_are_a_capped_set():
    """Issue 25: 10M stop ids were scanned linearly for every new token; now a set, at most 1024 of them."""
    sp = sampling_from_proto(generation_pb2.SamplingParams(stop_token_ids=[5, 5, 6]))
    assert sp.stop_token_ids == frozenset({5, 6}) and isinstance(sp.stop_token_ids, frozenset)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"):
        sampling_from_proto(generation_pb2.SamplingParams(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)))


def test_too_many_stop_token_ids_are_refused_by_the_decode_worker(cluster):
    _, _, da = cluster
    sp = generation_pb2.SamplingParams(max_tokens=2, stop_token_ids=[7] * (MAX_STOP_TOKEN_IDS + 1))
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(d.Decode(worker_pb2.DecodeRequest(request_id="stops", prompt_ids=[5, 6], sampling=sp,
                                                   local_prefill=True), metadata=MD, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in e.value.details()
        st = d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5)
        assert st.pages_free == st.pages_total


def test_local_prefill_on_the_decode_worker(cluster):
    """Conditional disaggregation: a short prompt prefilled by the decode worker itself equals the PD path."""
    _, pa, da = cluster
    sp = generation_pb2.SamplingParams(max_tokens=10, ignore_eos=True)
    ids = list(range(30, 50))
    _, ref, _ = generate(pa, da, "pd-short", ids, sp)
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        out = []
        for chunk in d.Decode(worker_pb2.DecodeRequest(request_id="local", prompt_ids=ids, sampling=sp,
                                                       local_prefill=True), metadata=MD, timeout=60):
            out += list(chunk.token_ids)
        assert out == ref and chunk.finish_reason == "length"
        st = d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5)
        assert st.pages_free == st.pages_total


def test_a_local_prefill_past_max_running_is_refused_like_a_reservation(cluster):
    """max_running counts reservations, running requests and local prefills: with 64 (the default) reserved, a
    local prefill (aggregated mode's only path) gets RESOURCE_EXHAUSTED saying so before anything is allocated,
    and is taken again once they are gone."""
    _, _, da = cluster
    sp = generation_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
    local = worker_pb2.DecodeRequest(request_id="over", prompt_ids=list(range(30, 50)), sampling=sp,
                                     local_prefill=True)
    with grpc.insecure_channel(da) as ch:
        d = worker_pb2_grpc.DecodeWorkerStub(ch)
        total = d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_total
        for i in range(64):
            d.Reserve(worker_pb2.ReserveRequest(request_id=f"hold{i}", num_tokens=1), metadata=MD, timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(d.Decode(local, metadata=MD, timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_running=64 requests" in e.value.details()
        assert d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free == total - 64
        for i in range(64):
            d.Abort(worker_pb2.AbortRequest(request_id=f"hold{i}"), metadata=MD, timeout=5)
        out = [t for c in d.Decode(local, metadata=MD, timeout=60) for t in c.token_ids]
        assert len(out) == 3
        deadline = time.monotonic() + 5
        while d.GetStatus(worker_pb2.StatusRequest(), metadata=MD, timeout=5).pages_free != total:
            assert time.monotonic() < deadline
            time.sleep(0.05)
