"""``pdserve serve --prefill 0``: an aggregated cluster (router + one decode worker that prefills every prompt
itself, in 32-token chunks here) serving a tiny random GLM-5 (DSA) in fp32, over real gRPC and the OpenAI
HTTP front door. Prompts longer than the chunk take several prefill steps; greedy tokens equal transformers'
``generate`` (the reference the disaggregated end-to-end tests use too), and every page is back after."""
import json
import random
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.client import GenerationClient
from serve_helpers import ServeProcess, hf_greedy, model_with_tokenizer, pages_all_free, tiny_dsa_reference
from shared_helpers import wait_until

CHUNK = 32


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("aggregated")
    model = model_with_tokenizer(tiny_dirs["dsa"], str(d / "model"), vocab_size=128)
    sp = ServeProcess(["--model", model, "--prefill", "0", "--decode", "1", "--port", "0", "--http-port", "-1",
                       "--dtype", "float32", "--decode-weights", "model", "--no-speculative", "--num-pages", "200",
                       "--prefill-chunk", str(CHUNK), "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        yield sp, model
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def client(served):
    with GenerationClient(served[0].address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model():
    return tiny_dsa_reference()


def test_starts_aggregated_with_no_prefill_worker_and_is_healthy(served, client):
    sp = served[0]
    assert "starting 1 decode workers, aggregated" in sp.output()
    assert set(sp.children) == {"decode-0", "router"}
    assert [w.role for w in client.cluster_status().workers] == ["decode"]
    base = sp.http_url[:-3]
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200
    with grpc.insecure_channel(sp.address) as ch:
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"),
                                                  timeout=5)
        assert st.status == health_pb2.HealthCheckResponse.SERVING


def test_long_prompts_over_grpc_and_http_equal_transformers(served, client, hf_model):
    rng = random.Random(7)
    prompt = [rng.randrange(2, 128) for _ in range(3 * CHUNK + 5)]  # 4 prefill steps on the decode worker
    want = hf_greedy(hf_model, prompt, 16)
    out = client.generate(token_ids=prompt, max_tokens=16, ignore_eos=True)
    assert out.token_ids == want and out.finish_reason == "length"
    assert out.metrics.prefill_worker == out.metrics.decode_worker == "decode-0"
    body = json.dumps({"model": served[1], "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(served[0].http_url + "/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        got = json.loads(r.read())
    assert got["choices"][0]["text"] == out.text and got["usage"]["completion_tokens"] == 16
    assert got["usage"]["prompt_tokens"] == len(prompt)
    # concurrent long prompts: chunks of one interleave with the other's decode steps, outputs unchanged
    prompts = [[rng.randrange(2, 128) for _ in range(n)] for n in (2 * CHUNK + 9, 5 * CHUNK)]
    calls = [client.stream(token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts]
    for p, call in zip(prompts, calls):
        assert [t for c in call for t in c.token_ids] == hf_greedy(hf_model, p, 12)
    wait_until(lambda: pages_all_free(client), what="every decode page back")
