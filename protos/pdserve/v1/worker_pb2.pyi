from protos.pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "max_new_tokens", "prompt_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    max_new_tokens: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("request_id", "target", "ticket", "resident_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: str
    ticket: bytes
    resident_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[str] = ..., ticket: _Optional[bytes] = ..., resident_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: TransferTicket
    def __init__(self, ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "ticket", "priority", "output_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    ticket: TransferTicket
    priority: int
    output_prefix: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., priority: _Optional[int] = ..., output_prefix: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "cached_tokens", "queue_s", "prefill_s", "transfer_s", "transfer_bytes", "first_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    first_logprob: _generation_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "output_prefix", "sampling", "transfer_timeout_s", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_prefix: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    transfer_timeout_s: float
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_prefix: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., transfer_timeout_s: _Optional[float] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "accept_len", "logprobs", "message")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    accept_len: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    message: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., accept_len: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "evicted", "reset", "host_stored", "host_evicted", "disk_stored", "disk_evicted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    HOST_STORED_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTED_FIELD_NUMBER: _ClassVar[int]
    DISK_STORED_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    host_stored: _containers.RepeatedScalarFieldContainer[int]
    host_evicted: _containers.RepeatedScalarFieldContainer[int]
    disk_stored: _containers.RepeatedScalarFieldContainer[int]
    disk_evicted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ..., host_stored: _Optional[_Iterable[int]] = ..., host_evicted: _Optional[_Iterable[int]] = ..., disk_stored: _Optional[_Iterable[int]] = ..., disk_evicted: _Optional[_Iterable[int]] = ...) -> None: ...
