"""The reason enums are the strings that cross the wire: peers and clients see what they saw before."""
from common.reasons import AbortReason, FinishReason, Role
from protos.pdserve.v1 import generation_pb2


def test_reasons_are_the_wire_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert [r.value for r in Role] == ["prefill", "decode"]
    assert [r.value for r in AbortReason] == ["cancelled", "shutdown", "deadline exceeded", "cancelled by the client",
                                              "stream closed by the client", "aborted by the router", "internal error"]
    # members go into proto string fields as they are and compare equal to what a peer sends
    r = generation_pb2.GenerateResponse(finish_reason=FinishReason.LENGTH)
    st = generation_pb2.WorkerStatus(role=Role.DECODE)
    assert generation_pb2.GenerateResponse.FromString(r.SerializeToString()).finish_reason == "length"
    assert generation_pb2.WorkerStatus.FromString(st.SerializeToString()).role == Role.DECODE
    assert f"{AbortReason.DEADLINE}" == "deadline exceeded"  # messages format the value, not the member name
