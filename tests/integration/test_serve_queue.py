"""``pdserve serve`` under a burst far beyond its decode pool: the router's admission queue (``router.admission``)
holds what no decode worker has room for and admits it as pages free, so every request is served (before it,
most were refused at once with RESOURCE_EXHAUSTED), and nothing is left queued or held afterwards.

24 pages of 16 tokens hold about 6 requests of 37 prompt + 24 new tokens (4 pages each at the end); 60 come at
once over gRPC and HTTP. A prompt larger than the whole pool is still refused at once."""
import concurrent.futures
import json
import random
import urllib.error
import urllib.request

import grpc
import pytest

from router.client import GenerationClient
from serve_helpers import ServeProcess, pages_all_free
from shared_helpers import wait_until

NUM_PAGES, PAGE = 24, 16
NUM_REQUESTS = 60


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("queue")
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--prefill", "1", "--decode", "1", "--port", "0", "--http-port",
                       "-1", "--dtype", "float32", "--decode-weights", "model", "--no-speculative", "--num-pages",
                       str(NUM_PAGES), "--page-size", str(PAGE), "--max-queued", "100", "--run-dir", str(d / "run")],
                      str(d / "serve.out"))
    try:
        sp.wait_listening()
        yield sp
    finally:
        sp.stop()


def metric(sp: ServeProcess, name: str) -> float:
    with urllib.request.urlopen(sp.http_url[:-3] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_burst_ten_times_the_decode_pool_is_served_with_no_failure(served):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 100) for _ in range(37)] for _ in range(NUM_REQUESTS)]

    def one(i: int):
        if i % 3 == 2:  # a third through the OpenAI front door
            body = json.dumps({"prompt": prompts[i], "max_tokens": 24, "ignore_eos": True}).encode()
            req = urllib.request.Request(served.http_url + "/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())["usage"]["completion_tokens"], 0.0
        with GenerationClient(served.address, timeout_s=120) as c:
            out = c.generate(token_ids=prompts[i], max_tokens=24, ignore_eos=True)
            return len(out.token_ids), out.metrics.router_queue_s

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        results = list(pool.map(one, range(NUM_REQUESTS)))
    assert [n for n, _ in results] == [24] * NUM_REQUESTS
    assert sum(1 for _, q in results if q > 0) >= 10  # most waited for room
    assert metric(served, "pdserve:requests_rejected_total") == 0
    with GenerationClient(served.address, timeout_s=60) as c:
        wait_until(lambda: pages_all_free(c), what="every decode page back")
        assert metric(served, "pdserve:num_requests_waiting") == 0
        assert metric(served, "pdserve:router_queue_time_seconds_count") >= NUM_REQUESTS
        with pytest.raises(grpc.RpcError) as e:  # never fits: refused at once, not queued
            c.generate(token_ids=[5] * (NUM_PAGES * PAGE + 1), max_tokens=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never be served" in e.value.details()
    assert metric(served, 'pdserve:requests_rejected_total{reason="never_fits"}') == 1
