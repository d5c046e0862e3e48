"""The router's OpenAI-compatible HTTP front door against in-process fake workers (real HTTP, real gRPC), and
its pure parts: the answer text as vLLM shapes it (stop strings, stop tokens) and chat templates rendered as
transformers renders them. The whole path with real workers: tests/integration/test_openai_serve.py."""
import functools
import json
import socket

import aiohttp
import grpc
import openai
import pytest

from protos.pdserve.v1 import generation_pb2
from router.chat import ChatTemplate, ChatTemplateError
from router.openai_protocol import HTTP_STATUS, Answer, OutputText, parse_completion
from router.text import TextCodec
from router_fakes import FakeCluster, expected_tokens, run_bounded, write_tokenizer


run = functools.partial(run_bounded, timeout_s=30.0)


# -- the answer's text -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return TextCodec.from_model_dir(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def feed(out: OutputText, chunks: list[tuple[list[int], str]]) -> list[str]:
    return [out.add(ids, finish) for ids, finish in chunks]


def test_stop_string_is_cut_and_never_half_sent(codec):
    ids = codec.encode("the quick brown fox jumps over the lazy dog")
    text = codec.decode(ids)
    sp = generation_pb2.SamplingParams(stop=["fox jumps", "zzz"])
    # the worker stops on the token that completes the stop string; chunks of one token each
    end = next(i for i in range(1, len(ids) + 1) if "fox jumps" in codec.decode(ids[:i]))
    out = OutputText(codec, sp, eos_token_ids=(1,))
    sent = feed(out, [([t], "") for t in ids[:end - 1]] + [([ids[end - 1]], "stop")])
    assert "".join(sent) == text[:text.find("fox jumps")] == out.text
    assert not any("fox" in s for s in sent) and out.stop_reason == "fox jumps"


def test_stop_and_eos_token_text_left_out(codec):
    ids = codec.encode("hello world text")
    sp = generation_pb2.SamplingParams(stop_token_ids=[ids[-1]])
    out = OutputText(codec, sp, eos_token_ids=())
    assert "".join(feed(out, [(ids[:1], ""), (ids[1:], "stop")])) == codec.decode(ids[:-1])
    assert out.stop_reason == ids[-1]
    eos = OutputText(codec, generation_pb2.SamplingParams(), eos_token_ids=(ids[-1],))
    assert "".join(feed(eos, [(ids, "stop")])) == codec.decode(ids[:-1]) and eos.stop_reason is None
    kept = OutputText(codec, generation_pb2.SamplingParams(ignore_eos=True), eos_token_ids=(ids[-1],))
    assert "".join(feed(kept, [(ids, "length")])) == codec.decode(ids)


def test_a_token_whose_text_is_held_back_still_gets_its_chunk(codec):
    """A token whose text cannot go out yet (here: held back while it may start a stop string) streams a chunk with
    empty text, as vLLM's server does (a client's TTFT and inter-token times are the tokens'); the text follows."""
    ids = codec.encode("hello world")
    oreq = parse_completion({"model": "m", "prompt": [5, 6], "stream": True, "stop": ["hello world and more"]})
    answer = Answer(oreq, "r1", "m", 0, codec, ())
    chunks = [answer.chunk(generation_pb2.GenerateResponse(token_ids=[t])) for t in ids]
    assert all(c is not None for c in chunks) and all(c["choices"][0]["text"] == "" for c in chunks)
    last = answer.chunk(generation_pb2.GenerateResponse(finish_reason="length"))
    assert last["choices"][0]["text"] == codec.decode(ids) and last["choices"][0]["finish_reason"] == "length"
    assert answer.chunk(generation_pb2.GenerateResponse()) is None  # nothing a client would see


# -- chat templates ----------------------------------------------------------------------------------------
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ('user', 'assistant', 'system') %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ {'k': 'é'} | tojson }}{% endif %}")


def test_chat_template_renders_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer
    write_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "bos_token": "<s>",
         "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True, "lstrip": False,
                       "rstrip": False, "normalized": False, "single_word": False}}))
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "héllo\nwörld"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ChatTemplate.from_model_dir(str(tmp_path))
    for gen in (True, False):
        assert ours.render(msgs, add_generation_prompt=gen) == tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ours.render([{"role": "tool", "content": "x"}])


def test_the_default_model_ships_a_chat_template():
    from engine.defaults import default_model_dir
    t = ChatTemplate.from_model_dir(default_model_dir())
    assert t is not None and t.render([{"role": "user", "content": "sort a list"}]).endswith("# assistant:\n")


# -- over HTTP, fake workers -------------------------------------------------------------------------------
def http_cluster(tmp_path, **kw) -> FakeCluster:
    return FakeCluster(1, 1, model=write_tokenizer(str(tmp_path)), http_port=-1, api_key="k", **kw)


def client(fc: FakeCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{fc.router.http.address}/v1", api_key="k", max_retries=0)


def test_completion_tokens_match_the_fake_model_and_errors_map_to_http(tmp_path):
    async def go():
        async with http_cluster(tmp_path) as fc:
            c = client(fc)
            r = await c.completions.create(model=tmp_path.name, prompt=[5, 6, 7], max_tokens=5)
            assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
            assert r.choices[0].text == fc.router.core.codec.decode(expected_tokens([5, 6, 7], 5))
            fc.decodes[0].reserved = {"squatter": 64}  # no room: it waits in the admission queue to its deadline
            with pytest.raises(openai.APIStatusError, match="admission queue") as e:
                await c.completions.create(model=tmp_path.name, prompt=[5, 6, 7], max_tokens=5,
                                           extra_headers={"x-request-timeout-s": "0.3"})
            assert e.value.status_code == 504 and int(e.value.response.headers["Retry-After"]) >= 1
            fc.decodes[0].reserved = {}
            with pytest.raises(openai.BadRequestError, match="printable ASCII"):
                await c.completions.create(model=tmp_path.name, prompt=[5], extra_headers={"x-request-id": "a b"})
            async with aiohttp.ClientSession() as s:
                base = f"http://{fc.router.http.address}"
                async with s.post(base + "/v1/completions", data=b"{not json", headers={"Authorization": "Bearer k"}
                                  ) as resp:
                    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
                async with s.get(base + "/health") as resp:
                    assert resp.status == 200
                for w in fc.prefills:
                    await w.stop(0)
                await fc.wait_for(lambda: not fc.registry.serving(), what="prefill worker out of rotation")
                async with s.get(base + "/health") as resp:
                    assert resp.status == 503
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model=tmp_path.name, prompt=[5, 6])
            assert e.value.status_code == HTTP_STATUS[grpc.StatusCode.UNAVAILABLE] == 503
    run(go())


def test_disconnect_mid_stream_aborts_on_both_workers(tmp_path):
    async def go():
        async with http_cluster(tmp_path) as fc:
            fc.decodes[0].b.delay_s = 0.05
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{fc.router.http.address}/v1/completions",
                                  json={"prompt": [5, 6, 7], "max_tokens": 200, "stream": True},
                                  headers={"Authorization": "Bearer k", "x-request-id": "gone"}) as resp:
                    assert resp.status == 200 and resp.headers["x-request-id"] == "gone"
                    await resp.content.readline()  # the first event: the request is running
            d, p = fc.decodes[0], fc.prefills[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total and d.streams == 0, what="decode freed")
            await fc.wait_for(lambda: any(a.startswith("gone.") for a in d.aborts), what="decode abort")
            await fc.wait_for(lambda: any(a.startswith("gone.") for a in p.aborts), what="prefill abort")
            assert fc.router.core.inflight == 0
    run(go())


def test_error_after_the_stream_started_is_an_event_then_done(tmp_path):
    async def go():
        async with http_cluster(tmp_path) as fc:
            fc.decodes[0].b.delay_s = 0.2
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{fc.router.http.address}/v1/completions",
                                  json={"prompt": [5, 6, 7], "max_tokens": 100, "stream": True},
                                  headers={"Authorization": "Bearer k", "x-request-timeout-s": "0.5"}) as resp:
                    events = [line for line in (await resp.read()).decode().split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: "):])["error"]
            assert err["code"] == 504 and "deadline" in err["message"]
            assert json.loads(events[0][len("data: "):])["choices"][0]["text"]  # tokens came first
    run(go())


def test_a_busy_http_port_is_a_clear_error_and_leaves_nothing_bound(tmp_path):
    async def go():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            fc = FakeCluster(1, 1, http_port=busy.getsockname()[1])
            with pytest.raises(OSError, match="--http-port 0 turns it off, -1 picks a free port"):
                await fc.__aenter__()
            assert fc.router.server is not None and fc.router.http is None
            for w in fc.decodes + fc.prefills:
                await w.stop(0)
    run(go())
