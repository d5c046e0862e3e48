"""Property-based fuzzing of the public API over real gRPC (router + in-process fake workers).

Whatever a client sends -- any field values, NaN/Inf floats, huge lengths, duplicate request ids,
unknown fields, or raw bytes that are not a GenerateRequest at all -- the router answers with a
finished stream or a status code, never a crash or a hang; afterwards no decode page is still
reserved and a well-formed request is served.
"""
import asyncio

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.pdserve.v1 import generation_pb2
from router_fakes import MAX_CONTEXT, VOCAB, FakeCluster

U32 = st.integers(0, 2**32 - 1)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(-2, 2, width=32))
EXPECTED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FINISH = {"stop", "length"}


def parses(raw: bytes) -> bool:
    try:
        generation_pb2.GenerateRequest.FromString(raw)
        return True
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        return False


def mostly(draw, sane, wild):
    """A sane value 7 times in 8, else a wild one: most requests are valid, every field gets abused."""
    return draw(wild if draw(st.integers(0, 7)) == 0 else sane)


@st.composite
def requests(draw) -> generation_pb2.GenerateRequest:
    sp = generation_pb2.SamplingParams(
        max_tokens=mostly(draw, st.integers(0, 8), st.one_of(st.integers(MAX_CONTEXT - 8, MAX_CONTEXT + 8), U32)),
        top_k=mostly(draw, st.integers(0, 5), U32), min_p=mostly(draw, st.floats(0, 1, width=32), FLOATS),
        stop_token_ids=mostly(draw, st.lists(st.integers(2, VOCAB - 1), max_size=2), st.lists(U32, max_size=3)),
        ignore_eos=draw(st.booleans()), logprobs=mostly(draw, st.integers(0, 5), U32),
        frequency_penalty=mostly(draw, st.floats(-1, 1, width=32), FLOATS),
        presence_penalty=mostly(draw, st.floats(-1, 1, width=32), FLOATS))
    sane = {"temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.0625, 1, width=32),
            "repetition_penalty": st.floats(0.5, 2, width=32)}
    for name, ok in sane.items():
        if draw(st.booleans()):
            setattr(sp, name, mostly(draw, ok, FLOATS))
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.integers(0, 7)) == 0:
        sp.stop.extend(draw(st.lists(st.text(max_size=4), max_size=2)))
    req = generation_pb2.GenerateRequest(sampling=sp, priority=mostly(draw, st.integers(0, 3), U32),
                                         request_id=draw(st.sampled_from(["", "", "dup", "x" * 300, "é\x00"])))
    kind = mostly(draw, st.just("ids"), st.sampled_from(["text", "none"]))
    if kind == "ids":
        ids = mostly(draw, st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=64),
                     st.lists(st.one_of(st.integers(2, VOCAB - 1), U32), max_size=MAX_CONTEXT + 4))
        req.token_ids.ids.extend(ids)
    elif kind == "text":
        req.text = draw(st.text(max_size=16))
    return req


def test_any_generate_request_gets_a_stream_or_a_status():
    loop = asyncio.new_event_loop()
    fc = FakeCluster(1, 1)
    loop.run_until_complete(fc.__aenter__())

    async def open_channel() -> grpc.aio.Channel:  # bound to this loop
        return grpc.aio.insecure_channel(fc.router.address)

    channel = loop.run_until_complete(open_channel())
    generate = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)

    async def call(raw: bytes) -> tuple[grpc.StatusCode | None, list]:
        try:
            return None, [r async for r in generate(raw, timeout=20)]
        except grpc.aio.AioRpcError as e:
            return e.code(), [e.details()]

    seen: dict = {}

    def check(raw: bytes, well_formed: bool) -> None:
        code, out = loop.run_until_complete(asyncio.wait_for(call(raw), 30))
        seen[code] = seen.get(code, 0) + 1
        if code is None:
            assert out and out[-1].finish_reason in FINISH, out[-1:]
        elif well_formed:
            assert code in EXPECTED_ERRORS, (code, out)
            assert out[0], "an error without a message"
        else:  # not a GenerateRequest at all
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed GenerateRequest" in out[0], (code, out)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests(), st.binary(max_size=8))
    def fuzz_fields(req: generation_pb2.GenerateRequest, junk: bytes) -> None:
        raw = req.SerializeToString()
        check(raw, True)
        if junk:  # unknown or garbled trailing fields
            check(raw + junk, parses(raw + junk))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=64))
    def fuzz_bytes(raw: bytes) -> None:
        check(raw, parses(raw))

    try:
        fuzz_fields()
        fuzz_bytes()
        # the generator reaches both outcomes (a fuzzer that only ever sees errors proves little)
        print("fuzz outcomes:", seen)
        assert seen.get(None, 0) >= 5 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 5, seen
        # nothing leaked, and the router still serves a good request
        loop.run_until_complete(fc.wait_for(lambda: not fc.decodes[0].reserved, 5.0, "reservations freed"))
        good = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                                              sampling=generation_pb2.SamplingParams(max_tokens=4))
        code, out = loop.run_until_complete(call(good.SerializeToString()))
        assert code is None and sum(len(r.token_ids) for r in out) == 4
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(fc.__aexit__(None, None, None))
        loop.close()
