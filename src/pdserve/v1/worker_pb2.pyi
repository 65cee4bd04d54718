from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ticket(_message.Message):
    __slots__ = ("ticket_id", "decode_instance_id", "ucx_worker_address", "tag_base", "lease_expiry_unix_s", "num_blocks", "kv_fingerprint", "nonce")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ticket_id: int
    decode_instance_id: str
    ucx_worker_address: bytes
    tag_base: int
    lease_expiry_unix_s: float
    num_blocks: int
    kv_fingerprint: str
    nonce: bytes
    def __init__(self, ticket_id: _Optional[int] = ..., decode_instance_id: _Optional[str] = ..., ucx_worker_address: _Optional[bytes] = ..., tag_base: _Optional[int] = ..., lease_expiry_unix_s: _Optional[float] = ..., num_blocks: _Optional[int] = ..., kv_fingerprint: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "ticket", "use_kvstore")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    USE_KVSTORE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    ticket: Ticket
    use_kvstore: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ..., use_kvstore: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "stages")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    stages: _common_pb2.StageCosts
    def __init__(self, first_token_id: _Optional[int] = ..., stages: _Optional[_Union[_common_pb2.StageCosts, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "write_back", "num_predicted_tokens", "lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    write_back: bool
    num_predicted_tokens: int
    lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., write_back: _Optional[bool] = ..., num_predicted_tokens: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "use_kvstore", "write_back")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_KVSTORE_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    use_kvstore: bool
    write_back: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., use_kvstore: _Optional[bool] = ..., write_back: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stages", "ticket")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stages: _common_pb2.StageCosts
    ticket: Ticket
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stages: _Optional[_Union[_common_pb2.StageCosts, _Mapping]] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

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

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("remaining",)
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    remaining: int
    def __init__(self, remaining: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("instance_id", "role", "state", "model_fingerprint", "kv_fingerprint", "block_size", "num_layers", "bytes_per_block", "load", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    state: str
    model_fingerprint: str
    kv_fingerprint: str
    block_size: int
    num_layers: int
    bytes_per_block: int
    load: _common_pb2.WorkerLoad
    counters: _containers.ScalarMap[str, float]
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., state: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StreamsRequest(_message.Message):
    __slots__ = ("open", "close", "credit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[StreamOpen]
    close: _containers.RepeatedScalarFieldContainer[int]
    credit: int
    def __init__(self, open: _Optional[_Iterable[_Union[StreamOpen, _Mapping]]] = ..., close: _Optional[_Iterable[int]] = ..., credit: _Optional[int] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("stream_id", "decode", "generate")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    decode: DecodeRequest
    generate: WorkerGenerateRequest
    def __init__(self, stream_id: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., generate: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ...) -> None: ...

class StreamsEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("stream_id", "token_ids", "finish_reason", "stages", "ticket", "status_code", "status_message", "ended")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stages: _common_pb2.StageCosts
    ticket: Ticket
    status_code: int
    status_message: str
    ended: bool
    def __init__(self, stream_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stages: _Optional[_Union[_common_pb2.StageCosts, _Mapping]] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., ended: _Optional[bool] = ...) -> None: ...
