from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("ttft_s", "queue_s", "prefill_s", "kv_transfer_s", "kv_transfer_bytes", "accept_len", "prefill_worker", "decode_worker", "retries", "failovers", "router_queue_s", "decode_resident_tokens")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_transfer_bytes: int
    accept_len: float
    prefill_worker: str
    decode_worker: str
    retries: int
    failovers: int
    router_queue_s: float
    decode_resident_tokens: int
    def __init__(self, ttft_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., accept_len: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., retries: _Optional[int] = ..., failovers: _Optional[int] = ..., router_queue_s: _Optional[float] = ..., decode_resident_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "metrics", "logprobs", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    metrics: RequestMetrics
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_address", "healthy", "running", "queued", "pages_total", "pages_free", "pages_cached", "cache_hit_rate", "tokens_per_s", "model_hash", "info", "spec", "model")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    kv_address: str
    healthy: bool
    running: int
    queued: int
    pages_total: int
    pages_free: int
    pages_cached: int
    cache_hit_rate: float
    tokens_per_s: float
    model_hash: str
    info: _containers.ScalarMap[str, str]
    spec: SpecStats
    model: ModelInfo
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., healthy: _Optional[bool] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., pages_cached: _Optional[int] = ..., cache_hit_rate: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., model_hash: _Optional[str] = ..., info: _Optional[_Mapping[str, str]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("vocab_size", "max_context", "page_size", "eos_token_ids", "model_dir", "model_type", "has_tokenizer", "num_mtp_layers", "pid", "host")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_MTP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_context: int
    page_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_dir: str
    model_type: str
    has_tokenizer: bool
    num_mtp_layers: int
    pid: int
    host: str
    def __init__(self, vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., page_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_dir: _Optional[str] = ..., model_type: _Optional[str] = ..., has_tokenizer: _Optional[bool] = ..., num_mtp_layers: _Optional[int] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("config", "verify_steps", "accepted_drafts", "draft_tokens", "accept_len", "accept_rate_per_position", "accept_rate_at_least", "drafted_at_depth", "reached_at_depth", "accepted_at_depth")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_RATE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_RATE_AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REACHED_AT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    config: str
    verify_steps: int
    accepted_drafts: int
    draft_tokens: int
    accept_len: float
    accept_rate_per_position: _containers.RepeatedScalarFieldContainer[float]
    accept_rate_at_least: _containers.RepeatedScalarFieldContainer[float]
    drafted_at_depth: _containers.RepeatedScalarFieldContainer[int]
    reached_at_depth: _containers.RepeatedScalarFieldContainer[int]
    accepted_at_depth: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, config: _Optional[str] = ..., verify_steps: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accept_len: _Optional[float] = ..., accept_rate_per_position: _Optional[_Iterable[float]] = ..., accept_rate_at_least: _Optional[_Iterable[float]] = ..., drafted_at_depth: _Optional[_Iterable[int]] = ..., reached_at_depth: _Optional[_Iterable[int]] = ..., accepted_at_depth: _Optional[_Iterable[int]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "model")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    model: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("kind", "count", "worker_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    count: int
    worker_id: str
    def __init__(self, kind: _Optional[str] = ..., count: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ("worker_id", "address", "armed", "fired")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ARMED_FIELD_NUMBER: _ClassVar[int]
    FIRED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    armed: int
    fired: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., armed: _Optional[int] = ..., fired: _Optional[int] = ...) -> None: ...
