"""The OpenAI-compatible HTTP front door of ``pdserve serve``, driven by the real ``openai`` client.

One cluster for the module (router + 1 prefill + 1 decode worker, a tiny random GLM-5 in fp32 with a
word-level tokenizer and a chat template): every prompt is prefilled on the prefill worker and decoded on
the decode worker, so "pages back on both workers" covers the whole path. Answers are compared with the
router's gRPC API (the same request path) and, for chat, with transformers' own chat-template rendering.
"""
import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from router.client import GenerationClient
from serve_helpers import ServeProcess, model_with_tokenizer, pages_all_free
from shared_helpers import wait_until

API_KEY = "openai-key-0123"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n{% else %}"
                 "{{ m['role'] }} {{ m['content'] | trim }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}the{% endif %}")
LONG = 3000
"""max_tokens of a request meant to be still running when the client leaves (the context is 4096)."""


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("openai")
    model = model_with_tokenizer(tiny_dirs["dsa"], str(d / "model"), vocab_size=128)
    with open(f"{model}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                   "unk_token": "[UNK]"}, f)
    sp = ServeProcess(["--model", model, "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", "-1",
                       "--dtype", "float32", "--decode-weights", "model", "--no-speculative", "--num-pages", "400",
                       "--log-format", "json", "--run-dir", str(d / "run")], str(d / "serve.out"),
                      env={"PDSERVE_API_KEY": API_KEY})
    try:
        sp.wait_listening()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", sp.http_url), sp.http_url
        yield sp, model, d / "run"
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[0].http_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(served):
    with GenerationClient(served[0].address, api_key=API_KEY, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(served):
    return served[1].rstrip("/").rsplit("/", 1)[1]


def http_get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def scrape(served) -> dict[str, float]:
    """``/metrics`` as {series (name + labels): value}."""
    status, _, body = http_get(served[0].http_url[:-3] + "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def json_log(path) -> list[dict]:
    """The JSON records of a process log (``--log-format json``; other lines: the ready line, library noise)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def all_back(grpc_client):
    return pages_all_free(grpc_client) and all(w.running == 0 for w in grpc_client.cluster_status().workers)


def test_models_health_version(served, oai, model_name):
    assert [m.id for m in oai.models.list().data] == [model_name]
    base = served[0].http_url[:-3]
    assert http_get(base + "/health")[0] == 200
    status, _, body = http_get(base + "/version")
    assert status == 200 and "version" in json.loads(body)
    assert http_get(base + "/v1/models")[0] == 401  # the API key guards /v1 (not health, version, metrics)


def test_completion_equals_grpc_text_and_token_prompts(oai, grpc_client, model_name):
    prompt = "the quick word of the day is water and the time"
    ref = grpc_client.generate(prompt, max_tokens=12, ignore_eos=True)
    r = oai.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == "length" and c.stop_reason is None
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model_name
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (ref.usage.prompt_tokens, 12,
                                                                       ref.usage.prompt_tokens + 12)
    assert u.prompt_tokens_details.cached_tokens >= 0
    ids = list(range(2, 40))
    ref = grpc_client.generate(token_ids=ids, max_tokens=6, ignore_eos=True)
    r = oai.completions.create(model=model_name, prompt=ids, max_tokens=6, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    again = oai.completions.create(model=model_name, prompt=ids, max_tokens=6, extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefill worker's prefix cache


def test_streaming_completion_with_usage(oai, model_name):
    kw = dict(model=model_name, prompt="one two three four five six seven", max_tokens=10,
              extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_renders_the_template_as_transformers_does(served, oai, grpc_client, model_name):
    from transformers import AutoTokenizer
    messages = [{"role": "system", "content": "you are a word"}, {"role": "user", "content": "  say the time  "}]
    tok = AutoTokenizer.from_pretrained(served[1])
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = grpc_client.generate(rendered, max_tokens=8, ignore_eos=True)
    r = oai.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False).input_ids)
    chunks = list(oai.chat.completions.create(model=model_name, messages=messages, max_tokens=8, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_trimmed_as_vllm_does(oai, model_name, stream):
    prompt = "what is the number of the day"
    full = oai.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                  extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    stop = " ".join(words[3:5])  # a stop string of two tokens, in the middle of the answer
    expected = full[:full.find(stop)]
    kw = dict(model=model_name, prompt=prompt, max_tokens=16, stop=[stop, "never-in-the-vocabulary"],
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(oai.completions.create(stream=True, **kw))
        assert not any(stop in c.choices[0].text for c in chunks)  # never half sent, never sent
        text, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
    else:
        last = oai.completions.create(**kw).choices[0]
        text = last.text
    assert text == expected and last.finish_reason == "stop" and last.stop_reason == stop


def test_logprobs_in_openai_shapes(oai, model_name):
    r = oai.completions.create(model=model_name, prompt="the time of day", max_tokens=5, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(t + " " for t in lp.tokens).strip() == r.choices[0].text.strip()  # word-level: space-joined
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4 and top[tok] == chosen
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen token is the best
    c = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "the"}], max_tokens=4,
                                    logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5) and
               e.bytes == list(e.token.encode()) for e in content)


def test_errors_unknown_model_missing_key_bad_values(served, oai, model_name):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="the")
    assert "no-such-model" in str(e.value) and e.value.body["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[0].http_url, api_key="wrong", max_retries=0).completions.create(
            model=model_name, prompt="the")
    for kw, where in ((dict(n=2), "n > 1"), (dict(temperature=-1.0), "temperature"),
                      (dict(prompt=[1, 2, 100000]), "outside the vocabulary"), (dict(max_tokens=5000), "context")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(**{"model": model_name, "prompt": "the", **kw})
        assert where in e.value.message, (kw, e.value.message)


def test_request_id_is_honoured_and_echoed(oai, model_name):
    raw = oai.completions.with_raw_response.create(model=model_name, prompt="the", max_tokens=2,
                                                   extra_headers={"x-request-id": "my-req-7"})
    assert raw.headers["x-request-id"] == "my-req-7" and raw.parse().id == "cmpl-my-req-7"


def test_deadline_answers_504_and_frees_the_pages(oai, grpc_client, model_name):
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(model=model_name, prompt="the", max_tokens=LONG, extra_body={"ignore_eos": True},
                               extra_headers={"x-request-timeout-s": "0.5"})
    assert e.value.status_code == 504 and "deadline" in e.value.message
    wait_until(lambda: all_back(grpc_client), 30, "pages back after the deadline")


def test_client_that_disconnects_mid_stream_cancels_the_request(served, oai, grpc_client, model_name):
    before = scrape(served)
    stream = oai.completions.create(model=model_name, prompt="the time", max_tokens=LONG, stream=True,
                                    extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "leaver-1"})
    got = [next(stream) for _ in range(3)]
    assert got[0].id == "cmpl-leaver-1"
    stream.close()
    wait_until(lambda: all_back(grpc_client), 30, "pages back on both workers after the client left")
    after = scrape(served)
    key = 'pdserve:requests_total{api="http",status="CANCELLED"}'
    assert after.get(key, 0) - before.get(key, 0) == 1
    access = [r for r in json_log(served[2] / "router.log") if r["logger"] == "router.access"]
    left = [r for r in access if r.get("request_id") == "leaver-1"]
    assert len(left) == 1 and left[0]["status"] == "CANCELLED" and left[0]["api"] == "http", access[-3:]
    assert left[0]["prefill_worker"] == "prefill-0" and left[0]["decode_worker"] == "decode-0"


def test_metrics_count_every_request_and_token(served, oai, grpc_client, model_name):
    before = scrape(served)
    usages = [oai.completions.create(model=model_name, prompt="the day " * (i + 1), max_tokens=3 + i,
                                     extra_body={"ignore_eos": True}).usage for i in range(3)]
    grpc_client.generate("the water", max_tokens=4, ignore_eos=True)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model_name, prompt="the", temperature=-1.0)
    after = scrape(served)

    def moved(series: str) -> float:
        return after.get(series, 0) - before.get(series, 0)
    assert moved('pdserve:requests_total{api="http",status="OK"}') == 3
    assert moved('pdserve:requests_total{api="grpc",status="OK"}') == 1
    assert moved('pdserve:requests_total{api="http",status="INVALID_ARGUMENT"}') == 1
    assert moved('pdserve:request_success_total{finished_reason="length"}') == 4
    assert moved("pdserve:generation_tokens_total") == sum(u.completion_tokens for u in usages) + 4
    assert moved("pdserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages) + 2
    assert moved("pdserve:prompt_tokens_cached_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert moved("pdserve:time_to_first_token_seconds_count") == 4
    assert moved("pdserve:e2e_request_latency_seconds_count") == 4
    assert moved("pdserve:inter_token_latency_seconds_count") >= 1
    assert after["pdserve:num_requests_running"] == 0
    lines = [r["msg"] for r in json_log(served[2] / "router.log") if r["logger"] == "router.access"]
    assert any(re.fullmatch(r"request \S+ api=grpc status=OK finish=length prompt_tokens=2 cached_tokens=\d+ "
                            r"completion_tokens=4 ttft_ms=[\d.]+ router_queue_ms=[\d.]+ e2e_ms=[\d.]+ prefill=prefill-0 decode=decode-0 "
                            r"retries=0 failovers=0", m) for m in lines), lines[-3:]
    # one logging set-up everywhere: the workers log JSON too
    assert any(r["logger"] == "prefill.server" for r in json_log(served[2] / "prefill-0.log"))
    assert any(r["logger"] == "decode.server" for r in json_log(served[2] / "decode-0.log"))


def test_every_worker_serves_metrics_on_the_port_its_status_reports(served, oai, grpc_client, model_name):
    workers = {w.role: w for w in grpc_client.cluster_status().workers}

    def scrape_worker(role: str) -> dict[str, float]:
        w = grpc_client.cluster_status().workers
        port = next(x for x in w if x.role == role).info["metrics_port"]
        status, _, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in body.decode().splitlines()
                                         if line and not line.startswith("#"))}
    pre, dec = scrape_worker("prefill"), scrape_worker("decode")
    prompt = list(range(3, 60))
    usages = [oai.completions.create(model=model_name, prompt=prompt, max_tokens=7,
                                     extra_body={"ignore_eos": True}).usage for _ in range(2)]
    wait_until(lambda: all_back(grpc_client), 30, "requests done")
    pre2, dec2 = scrape_worker("prefill"), scrape_worker("decode")
    p, d = (f'{{worker="{workers[r].worker_id}"}}' for r in ("prefill", "decode"))
    assert pre2["pdserve:prefix_cache_queries_total" + p] - pre["pdserve:prefix_cache_queries_total" + p] == 2 * 57
    assert pre2["pdserve:prefix_cache_hits_total" + p] - pre["pdserve:prefix_cache_hits_total" + p] == \
        sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
    assert pre2["pdserve:kv_transfers_total" + p] - pre["pdserve:kv_transfers_total" + p] == 2
    assert pre2["pdserve:kv_transfer_bytes_total" + p] > pre["pdserve:kv_transfer_bytes_total" + p]
    # the first token of each request is the prefill worker's; the decode worker decodes the other 6
    assert dec2["pdserve:generation_tokens_total" + d] - dec["pdserve:generation_tokens_total" + d] == 2 * 6
    st = {w.role: w for w in grpc_client.cluster_status().workers}["decode"]
    assert dec2["pdserve:kv_pages_free" + d] == st.pages_free == st.pages_total == dec2["pdserve:kv_pages_total" + d]
    assert dec2["pdserve:num_requests_running" + d] == 0 and dec2["pdserve:kv_cache_usage_perc" + d] == 0


def test_bench_openai_backend_reports_vllm_keys(served, model_name, tmp_path):
    from bench.loadgen.config import BenchConfig
    from bench.loadgen.sweep import run_sweep
    cfg = BenchConfig(backend="openai", base_url=served[0].http_url, model=model_name, api_key=API_KEY,
                      workload="random", input_len=24, output_len=6, input_range=(20, 28), output_range=(6, 6),
                      concurrency=(2,), warmup_s=0.0, duration_s=3.0, vocab_size=128, out=str(tmp_path),
                      save_detailed=True, quiet=True).with_defaults()
    result = run_sweep(cfg, progress=False)
    assert result["server"]["model"] == model_name and result["server"]["max_context"] == 4096
    step = result["steps"][0]
    assert step["completed"] == step["num_ok"] > 0 and step["failed"] == 0 and step["length_mismatches"] == 0
    assert step["total_output_tokens"] == 6 * step["completed"]
    assert 20 * step["completed"] <= step["total_input_tokens"] <= 28 * step["completed"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_e2el_ms"):
        assert step[key] > 0, key
    assert step["output_throughput"] == pytest.approx(step["total_output_tokens"] / step["duration"])
    assert len(step["detailed"]) == step["num_measured"] and all(d["output_len"] == 6 for d in step["detailed"])
