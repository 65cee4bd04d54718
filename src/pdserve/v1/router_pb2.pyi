from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "e2e_ms", "stages", "prefill_instance", "decode_instance")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    e2e_ms: float
    stages: _common_pb2.StageCosts
    prefill_instance: str
    decode_instance: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., stages: _Optional[_Union[_common_pb2.StageCosts, _Mapping]] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "server_ms", "finish_reason", "usage", "resume_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    server_ms: float
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    resume_token: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., server_ms: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request", "received_token_ids", "resume_token", "received_text")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TEXT_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    received_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token: str
    received_text: str
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., received_token_ids: _Optional[_Iterable[int]] = ..., resume_token: _Optional[str] = ..., received_text: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "address", "role", "state", "load", "heartbeat_age_s", "model_fingerprint", "dtype")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    role: _common_pb2.Role
    state: str
    load: _common_pb2.WorkerLoad
    heartbeat_age_s: float
    model_fingerprint: str
    dtype: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., state: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., heartbeat_age_s: _Optional[float] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("instances", "requests_total", "requests_running", "prompt_tokens_total", "cached_tokens_total", "model", "kvstore_address", "vocab_size", "context_length", "block_size", "dtype", "predictor", "predictor_kendall_tau", "predictor_observed", "queue_waiting", "checkpoint_dtype", "routers", "router_id", "shared_store")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_KENDALL_TAU_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAITING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_STORE_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    requests_total: int
    requests_running: int
    prompt_tokens_total: int
    cached_tokens_total: int
    model: str
    kvstore_address: str
    vocab_size: int
    context_length: int
    block_size: int
    dtype: str
    predictor: str
    predictor_kendall_tau: float
    predictor_observed: int
    queue_waiting: int
    checkpoint_dtype: str
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    router_id: str
    shared_store: str
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., requests_total: _Optional[int] = ..., requests_running: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., model: _Optional[str] = ..., kvstore_address: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., predictor: _Optional[str] = ..., predictor_kendall_tau: _Optional[float] = ..., predictor_observed: _Optional[int] = ..., queue_waiting: _Optional[int] = ..., checkpoint_dtype: _Optional[str] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., router_id: _Optional[str] = ..., shared_store: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("router_id", "address", "http_address", "workers", "is_self")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IS_SELF_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    address: str
    http_address: str
    workers: int
    is_self: bool
    def __init__(self, router_id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., workers: _Optional[int] = ..., is_self: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance_id", "address", "role", "model_fingerprint", "block_size", "load", "dtype")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    role: _common_pb2.Role
    model_fingerprint: str
    block_size: int
    load: _common_pb2.WorkerLoad
    dtype: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., dtype: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "kvstore_address", "router")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    kvstore_address: str
    router: PeerRouter
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., kvstore_address: _Optional[str] = ..., router: _Optional[_Union[PeerRouter, _Mapping]] = ...) -> None: ...

class PeerRouter(_message.Message):
    __slots__ = ("router_id", "address", "http_address")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    address: str
    http_address: str
    def __init__(self, router_id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "role", "state", "load", "routers")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    state: str
    load: _common_pb2.WorkerLoad
    routers: _containers.RepeatedCompositeFieldContainer[PeerRouter]
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., state: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., routers: _Optional[_Iterable[_Union[PeerRouter, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "router")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    known: bool
    router: PeerRouter
    def __init__(self, known: _Optional[bool] = ..., router: _Optional[_Union[PeerRouter, _Mapping]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
