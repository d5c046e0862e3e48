"""End to end over real gRPC: ``pdserve serve`` (router + 2 prefill + 1 decode worker processes) serving a tiny
random GLM-5 (DSA) checkpoint in fp32, driven through the public API only.

Speculation is left at its default: the checkpoint has no MTP layer and the decode worker must notice.
Prompts under 16 tokens are prefilled on the decode worker (conditional disaggregation), longer ones
on the prefill workers. KV pools hold 200 pages of 16 tokens, less than the 4096-token context.

One cluster for the whole module (startup dominates); the tests that break it (a prefill worker killed,
SIGTERM to the serve process) run last, in file order.
"""
import math
import os
import random
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.pdserve.v1 import generation_pb2
from router.client import GenerationClient, make_request
from serve_helpers import (REPO, ServeProcess, hf_greedy, model_with_tokenizer, pages_all_free, pid_alive, rpc_code,
                           tiny_dsa_reference)
from shared_helpers import wait_until

API_KEY = "e2e-key-0123"
MAX_CONTEXT = 4096
NUM_PAGES = 200


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model = model_with_tokenizer(tiny_dirs["dsa"], str(d / "model"), vocab_size=128)
    # decode runs the checkpoint's own weights: its tokens are compared with transformers' (MXFP4, the default,
    # is served by the bench and demo tests)
    sp = ServeProcess(["--model", model, "--prefill", "2", "--decode", "1", "--port", "0", "--dtype", "float32",
                       "--decode-weights", "model",
                       "--num-pages", str(NUM_PAGES), "--local-prefill-below", "16",
                       "--run-dir", str(d / "run")], str(d / "serve.out"), env={"PDSERVE_API_KEY": API_KEY})
    try:
        sp.wait_listening()
        yield sp, model
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def client(served):
    with GenerationClient(served[0].address, api_key=API_KEY, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model():
    return tiny_dsa_reference()


def test_greedy_tokens_equal_transformers_generate(client, hf_model):
    rng = random.Random(0)
    # 5 tokens: prefilled on the decode worker; 77 (> index_topk 16, DSA sparsity exercised): disaggregated
    for n, where in ((5, "decode-0"), (77, "prefill-")):
        prompt = [rng.randrange(2, 128) for _ in range(n)]
        out = client.generate(token_ids=prompt, max_tokens=20, ignore_eos=True)
        assert out.token_ids == hf_greedy(hf_model, prompt, 20), n
        assert out.finish_reason == "length" and out.metrics.prefill_worker.startswith(where)


def test_streaming_order_usage_and_metrics(client):
    prompt = list(range(3, 40))
    chunks = list(client.stream(token_ids=prompt, max_tokens=12, ignore_eos=True, request_id="order-1"))
    assert len(chunks[0].token_ids) == 1 and not chunks[0].finish_reason  # the first token, alone, at once
    assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    assert all(c.request_id == "order-1" for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    u, m = chunks[-1].usage, chunks[-1].metrics
    assert (u.prompt_tokens, u.completion_tokens) == (len(prompt), len(ids)) == (37, 12)
    assert m.prefill_worker.startswith("prefill-") and m.decode_worker == "decode-0"
    assert m.ttft_s > 0 and m.kv_transfer_bytes > 0 and m.prefill_s > 0
    wait_until(lambda: pages_all_free(client), what="pages back after a finished request")


def test_first_token_that_ends_the_request_frees_the_reservation(client):
    out = client.generate(token_ids=[7, 8, 9], max_tokens=1)
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    first = out.token_ids[0]
    out = client.generate(token_ids=[7, 8, 9], max_tokens=5, stop_token_ids=[first])
    assert out.finish_reason == "stop" and out.token_ids == [first]
    wait_until(lambda: pages_all_free(client), what="reservations freed")


def test_shared_prefix_lands_on_the_worker_holding_it(client, hf_model):
    rng = random.Random(1)
    shared = [rng.randrange(2, 128) for _ in range(64)]  # 4 pages of 16
    first = client.generate(token_ids=shared + [5], max_tokens=4, ignore_eos=True)
    holder = first.metrics.prefill_worker
    assert first.usage.cached_tokens == 0

    def router_knows():
        st = client.cluster_status()
        return {w.worker_id: int(w.info["router_cached_blocks"]) for w in st.workers if w.role == "prefill"}
    wait_until(lambda: router_knows()[holder] >= 4, what="the router to see the cache events")
    for i, tail in enumerate(([9, 10], [11, 12, 13])):
        prompt = shared + tail
        out = client.generate(token_ids=prompt, max_tokens=6, ignore_eos=True)
        assert out.metrics.prefill_worker == holder and out.usage.cached_tokens == 64
        if i == 0:  # KV from the prefix cache decodes like a full prefill
            assert out.token_ids == hf_greedy(hf_model, prompt, 6)


def test_text_prompt_streams_text(client, served):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(served[1], "tokenizer.json"))
    chunks = list(client.stream(prompt="the water of time", max_tokens=8, ignore_eos=True))
    ids = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].usage.prompt_tokens == 4
    assert "".join(c.text for c in chunks) == tok.decode(ids)


def test_stop_strings_end_the_answer(client, served):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(served[1], "tokenizer.json"))
    prompt = list(range(20, 40))
    full = client.generate(token_ids=prompt, max_tokens=12, ignore_eos=True).token_ids
    stop = tok.decode(full[3:5])  # two words: "<w3> <w4>"
    out = client.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.token_ids == full[:len(out.token_ids)] and len(out.token_ids) <= 5
    assert stop in out.text


def test_cancel_mid_stream_frees_pages_on_both_workers(client):
    call = client.stream(token_ids=list(range(10, 50)), max_tokens=3000, ignore_eos=True)
    for i, _ in enumerate(call):
        if i == 3:
            break
    st = client.cluster_status()
    assert any(w.pages_free < w.pages_total for w in st.workers if w.role == "decode")
    call.cancel()
    wait_until(lambda: pages_all_free(client), what="pages freed after cancel")


def test_deadline_exceeded_frees_pages(client):
    code, _ = rpc_code(lambda: client.generate(token_ids=list(range(20, 60)), max_tokens=3000, ignore_eos=True,
                                               timeout_s=1.0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: pages_all_free(client), what="pages freed after the deadline")


BAD = [({"token_ids": []}, "empty prompt"), ({"prompt": ""}, "empty prompt"),
       ({"token_ids": [5, 128]}, "outside the vocabulary"),
       ({"token_ids": [5] * MAX_CONTEXT}, "longer than the context"),
       ({"token_ids": [5] * 4000, "max_tokens": 200}, "beyond the context"),
       ({"token_ids": [5], "temperature": -1.0}, "temperature"),
       ({"token_ids": [5], "temperature": math.nan}, "temperature"),
       ({"token_ids": [5], "top_p": 0.0}, "top_p"), ({"token_ids": [5], "top_p": 1.5}, "top_p"),
       ({"prompt": "time " * 30000}, "at most 131072 UTF-8 bytes"),  # refused before it is tokenized
       ({"token_ids": [5], "stop_token_ids": [6] * 1025}, "at most 1024 stop_token_ids")]


@pytest.mark.parametrize("kw,needle", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_invalid_argument(client, kw, needle):
    code, msg = rpc_code(lambda: client.generate(**kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in msg, msg


def test_a_request_id_too_long_for_the_kv_data_plane_is_refused_and_holds_no_page(client):
    """Issue 25: a 250-character id (259 with the router's suffix) got UNKNOWN from the decode worker's
    Reserve, after its pages were allocated: they never came back."""
    prompt = list(range(20, 60))  # >= 16 tokens: reserved on the decode worker, prefilled by a prefill worker
    code, msg = rpc_code(lambda: client.generate(token_ids=prompt, max_tokens=4, request_id="x" * 250))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 128" in msg, msg
    out = client.generate(token_ids=prompt, max_tokens=4, request_id="y" * 128)
    assert out.finish_reason == "length" and out.request_id == "y" * 128
    wait_until(lambda: pages_all_free(client), timeout_s=10, what="every decode page back")


def test_unknown_fields_and_wire_defaults(served):
    sp = served[0]
    with grpc.insecure_channel(sp.address) as ch:
        raw = ch.unary_stream("/pdserve.v1.Generation/Generate",
                              response_deserializer=generation_pb2.GenerateResponse.FromString)
        md = (("authorization", f"Bearer {API_KEY}"),)
        good = make_request(token_ids=[5, 6], ignore_eos=True).SerializeToString()
        code, msg = rpc_code(lambda: list(raw(good + bytes([0xF8, 0x07, 0x01]), metadata=md, timeout=30)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not understand" in msg
        # max_tokens 0 is "unset" on the wire (proto3): the documented default of 16
        zero = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6]),
                                              sampling=generation_pb2.SamplingParams(ignore_eos=True))
        chunks = list(raw(zero.SerializeToString(), metadata=md, timeout=30))
        assert chunks[-1].usage.completion_tokens == 16


def test_unauthenticated_without_the_api_key(served):
    for key in (None, "wrong-key"):
        with GenerationClient(served[0].address, api_key=key) as c:
            code, msg = rpc_code(lambda: c.generate(token_ids=[5]))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in msg
            assert rpc_code(c.cluster_status)[0] == grpc.StatusCode.UNAUTHENTICATED


def test_the_api_key_is_in_no_command_line(served):
    """Issue 25: the key was in the router's argv, which every user of the machine sees in ps."""
    sp = served[0]
    pids = [sp.proc.pid, *sp.children.values()]
    assert len(pids) == 5  # serve, router, 2 prefill, 1 decode
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert API_KEY.encode() not in f.read(), pid
        with open(f"/proc/{pid}/environ", "rb") as f:  # the router's alone among the children
            has_key = f"PDSERVE_API_KEY={API_KEY}".encode() in f.read().split(b"\0")
        assert has_key == (pid in (sp.proc.pid, sp.children["router"])), pid


def test_health_and_reflection_answer_without_a_key(served):
    with grpc.insecure_channel(served[0].address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "pdserve.v1.Generation", "pdserve.v1.Admin"):
            assert h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Generation")]
        resps = list(stub.ServerReflectionInfo(iter(reqs), timeout=5))
        names = {s.name for s in resps[0].list_services_response.service}
        assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names
        assert resps[1].file_descriptor_response.file_descriptor_proto


def test_cluster_status_lists_every_worker(client):
    st = client.cluster_status()
    assert sorted(w.worker_id for w in st.workers) == ["decode-0", "prefill-0", "prefill-1"]
    assert all(w.healthy and w.pages_total == NUM_PAGES and w.model_hash for w in st.workers)
    assert st.model.endswith("model")
    dec = next(w for w in st.workers if w.role == "decode")
    assert dec.info["speculative"] == "off"  # asked for, but the checkpoint has no MTP layer


def test_prompt_beyond_the_decode_pool_is_resource_exhausted(client):
    code, msg = rpc_code(lambda: client.generate(token_ids=[5] * (NUM_PAGES * 16 + 50), max_tokens=4))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "decode-0" in msg, msg
    wait_until(lambda: pages_all_free(client), what="nothing held")


def test_generate_cli_streams_the_same_tokens(served, client, tmp_path):
    prompt = [11, 12, 13, 14, 15]
    ref = client.generate(token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    base = [sys.executable, "-m", "cli", "generate", "--target", served[0].address]
    args = ["--token-ids", ",".join(map(str, prompt)), "--max-tokens", "8", "--ignore-eos"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    for key_args, extra_env in ((["--api-key-file", str(key_file)], {}), ([], {"PDSERVE_API_KEY": API_KEY}),
                                (["--api-key", API_KEY], {})):
        out = subprocess.run(base + key_args + args, cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={**env, **extra_env})
        assert out.returncode == 0, out.stderr
        assert [int(x) for x in out.stdout.split()] == ref and "[length: 8 tokens" in out.stderr
        assert ("visible to every user" in out.stderr) == ("--api-key" in key_args), out.stderr
    cmd = base + ["--api-key-file", str(key_file)] + args
    bad = subprocess.run(cmd[:-5] + ["--token-ids", "5,999"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_concurrent_streams_match_sequential_answers(served, client):
    """Requests in flight together (batched on the workers, interleaved in the router) answer as when alone."""
    import asyncio
    from router.client import AsyncGenerationClient
    prompts = [[(7 * i + j) % 120 + 2 for j in range(10 + 9 * i)] for i in range(6)]
    alone = [client.generate(token_ids=p, max_tokens=10, ignore_eos=True).token_ids for p in prompts]

    async def together():
        async with AsyncGenerationClient(served[0].address, API_KEY, timeout_s=120) as c:
            return await asyncio.gather(*(c.generate(token_ids=p, max_tokens=10, ignore_eos=True) for p in prompts))
    outs = asyncio.run(together())
    assert [o.token_ids for o in outs] == alone
    assert {"prefill-0", "prefill-1"} <= {o.metrics.prefill_worker for o in outs}  # cold prompts spread
    wait_until(lambda: pages_all_free(client), what="pages back")


def test_prefill_worker_killed_before_the_first_token_is_retried(served, client):
    sp = served[0]
    rng = random.Random(2)
    prompt = [rng.randrange(2, 128) for _ in range(1600)]  # ~3 s of prefill on this CPU
    result = {}
    t = threading.Thread(target=lambda: result.update(out=client.generate(token_ids=prompt, max_tokens=4)))
    t.start()

    def busy_prefill():
        st = client.cluster_status(timeout_s=5)
        return next((w.worker_id for w in st.workers if w.role == "prefill" and w.info["router_inflight"] == "1"),
                    None)
    victim = wait_until(busy_prefill, timeout_s=10, interval_s=0.02, what="the prefill to start")
    os.kill(sp.children[victim], signal.SIGKILL)
    t.join(60)
    out = result["out"]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.metrics.retries == 1 and out.metrics.prefill_worker != victim
    st = client.cluster_status()
    assert [w.healthy for w in st.workers if w.worker_id == victim] == [False]
    # the rest of the cluster keeps serving
    assert client.generate(token_ids=[5, 6, 7], max_tokens=3).finish_reason in ("length", "stop")
    # the KV stream was cut mid-transfer (layers ship as they are computed): the decode worker's
    # reservation for the lost attempt is freed, and the surviving prefill worker holds nothing
    wait_until(lambda: pages_all_free(client, skip=victim), what="pages back after the killed transfer")


def test_sigterm_to_serve_stops_every_child(served):
    sp = served[0]
    pids = dict(sp.children)
    assert set(pids) == {"prefill-0", "prefill-1", "decode-0", "router"}
    os.kill(sp.proc.pid, signal.SIGTERM)  # the process group leader only
    assert sp.proc.wait(40) == 0
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout_s=20, what="children gone")
    assert "pdserve: stopped" in sp.output()
