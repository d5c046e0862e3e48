"""Every INVALID_ARGUMENT case, checked without a server, plus config and text helpers."""
import argparse
import math

import grpc
import pytest

from protos.pdserve.v1 import generation_pb2
from router.client import make_request
from router.config import RouterConfig, add_config_args, config_from_args
from kvtransfer.protocol import MAX_REQ_ID_LEN
from router.config import MAX_FAILOVERS
from router.request import new_req_id
from router.validate import (DEFAULT_MAX_TOKENS, MAX_ID_SUFFIX_LEN, MAX_REQUEST_ID_LEN, ModelInfo, RequestError,
                             validate)

MODEL = ModelInfo(vocab_size=100, max_context=64, page_size=4, eos_token_ids=(1,), has_tokenizer=False)


def req(ids=(5, 6, 7), **kw):
    return make_request(token_ids=list(ids), **kw)


def with_unknown_field(r):
    raw = r.SerializeToString() + bytes([0xF8, 0x07, 0x01])  # field 127, varint 1
    out = generation_pb2.GenerateRequest()
    out.ParseFromString(raw)
    return out


def with_unknown_sampling_field(r):
    sp = generation_pb2.SamplingParams()
    sp.ParseFromString(r.sampling.SerializeToString() + bytes([0xA0, 0x06, 0x01]))  # field 100
    r.sampling.CopyFrom(sp)
    return r


BAD = {
    "empty token ids": (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds()), "empty prompt"),
    "no prompt at all": (generation_pb2.GenerateRequest(), "empty prompt"),
    "empty text": (generation_pb2.GenerateRequest(text=""), "empty prompt"),
    "text without tokenizer": (make_request(prompt="hello"), "tokenizer"),
    "id outside vocab": (req((5, 100, 7)), "token id 100 outside the vocabulary"),
    "prompt longer than context": (req(range(2, 66)), "longer than the context"),
    "prompt fills the context": (req([5] * 64), "longer than the context"),
    "max_tokens beyond context": (req([5] * 60, max_tokens=5), "beyond the context"),
    "negative temperature": (req(temperature=-0.5), "temperature"),
    "nan temperature": (req(temperature=math.nan), "temperature"),
    "top_p zero": (req(top_p=0.0), "top_p"),
    "top_p above one": (req(top_p=1.5), "top_p"),
    "top_p nan": (req(top_p=math.nan), "top_p"),
    "min_p above one": (req(min_p=1.5), "min_p"),
    "top_k beyond vocab": (req(top_k=101), "top_k"),
    "repetition penalty zero": (req(repetition_penalty=0.0), "repetition_penalty"),
    "frequency penalty nan": (req(frequency_penalty=math.nan), "frequency_penalty"),
    "too many logprobs": (req(logprobs=21), "logprobs"),
    "stop id outside vocab": (req(stop_token_ids=[500]), "stop token id 500"),
    "stop strings without tokenizer": (req(stop=["x"]), "stop strings need a tokenizer"),
    "request id too long": (req(request_id="x" * (MAX_REQUEST_ID_LEN + 1)), "at most 128"),
    "request id with a newline": (req(request_id="a\nb"), "printable ASCII"),
    "request id with a space": (req(request_id="a b"), "printable ASCII"),
    "request id not ascii": (req(request_id="é"), "printable ASCII"),
    "too many stop ids": (req(stop_token_ids=[5] * 1025), "at most 1024 stop_token_ids"),
    "text longer than the context can hold": (make_request(prompt="a" * (64 * 32 + 1)), "at most 2048 UTF-8 bytes"),
    "unknown request field": (with_unknown_field(req()), "does not understand"),
    "unknown sampling field": (with_unknown_sampling_field(req()), "does not understand"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_argument(case):
    r, needle = BAD[case]
    with pytest.raises(RequestError) as e:
        validate(r, MODEL, encode=None if "tokenizer" in case else lambda s: 1 / 0)  # never reaches encode
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.message, e.value.message


def test_valid_request_resolves_defaults_and_encodes_text():
    v = validate(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6])), MODEL)
    assert v.prompt_ids == [5, 6] and v.max_tokens == DEFAULT_MAX_TOKENS == v.sampling.max_tokens
    v = validate(make_request(prompt="ab", max_tokens=62), MODEL, encode=lambda s: [ord(c) - 90 for c in s])
    assert v.prompt_ids == [7, 8] and v.max_tokens == 62
    with pytest.raises(RequestError, match="encodes to no tokens"):
        validate(make_request(prompt=" "), MODEL, encode=lambda s: [])


def test_the_longest_request_id_fits_the_kv_data_plane_with_every_suffix():
    """Issue 25: the router appends suffixes to the client's id; the decode worker refuses ids over 256."""
    req_id = "~" * MAX_REQUEST_ID_LEN
    assert validate(req(request_id=req_id), MODEL).prompt_ids == [5, 6, 7]
    internal = f"{new_req_id(req_id)}.f{MAX_FAILOVERS}.retry1"  # what router.request builds, at its longest
    assert len(internal) == MAX_REQUEST_ID_LEN + MAX_ID_SUFFIX_LEN <= MAX_REQ_ID_LEN


def test_client_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="max_tokens"):
        make_request(token_ids=[1], max_tokens=0)
    with pytest.raises(ValueError, match="exactly one"):
        make_request()
    with pytest.raises(ValueError, match="exactly one"):
        make_request(prompt="a", token_ids=[1])


def test_model_info_from_worker_info():
    m = ModelInfo.from_info({"vocab_size": "128", "max_context": "4096", "page_size": "16",
                             "eos_token_ids": "1,2", "model_dir": "/m", "has_tokenizer": "1"}, "h")
    assert m.eos_token_ids == (1, 2) and m.has_tokenizer and m.model_hash == "h"
    with pytest.raises(ValueError, match="vocab_size"):
        ModelInfo.from_info({"max_context": "1"})


def test_model_info_from_status_reads_the_typed_contract_and_falls_back_to_the_strings():
    model = generation_pb2.ModelInfo(vocab_size=128, max_context=4096, page_size=16, eos_token_ids=[1, 2],
                                     model_dir="/m", has_tokenizer=True)
    legacy = {"vocab_size": "64", "max_context": "512", "page_size": "8", "eos_token_ids": "3"}
    typed = ModelInfo.from_status(generation_pb2.WorkerStatus(model=model, info=legacy, model_hash="h"))
    assert typed == ModelInfo(128, 4096, 16, (1, 2), "/m", True, "h")  # the typed message wins
    old_worker = ModelInfo.from_status(generation_pb2.WorkerStatus(info=legacy))  # a worker before ModelInfo
    assert (old_worker.vocab_size, old_worker.page_size, old_worker.eos_token_ids) == (64, 8, (3,))
    with pytest.raises(ValueError, match="page_size"):
        ModelInfo.from_status(generation_pb2.WorkerStatus(model=generation_pb2.ModelInfo(vocab_size=1)))


def test_config_validation_and_generated_flags():
    with pytest.raises(ValueError, match="routing"):
        RouterConfig(routing="fastest")
    with pytest.raises(ValueError, match="host:port"):
        RouterConfig(prefill=("nohost",))
    with pytest.raises(ValueError, match="max_inflight"):
        RouterConfig(max_inflight=0)
    with pytest.raises(ValueError, match="max_failovers"):
        RouterConfig(max_failovers=MAX_FAILOVERS + 1)
    p = argparse.ArgumentParser()
    add_config_args(p)
    args = p.parse_args(["--prefill", "127.0.0.1:1,127.0.0.1:2", "--decode", "127.0.0.1:3", "--routing",
                         "least_load", "--balance-rel-threshold", "2.5", "--api-key", "k"])
    cfg = config_from_args(args)
    assert cfg.prefill == ("127.0.0.1:1", "127.0.0.1:2") and cfg.decode == ("127.0.0.1:3",)
    assert cfg.routing == "least_load" and cfg.balance_rel_threshold == 2.5 and cfg.api_key == "k"
    assert cfg.port == 50051 and cfg.cluster_secret is None
    assert "longest prefix" in p.format_help()  # help comes from the field docstrings
