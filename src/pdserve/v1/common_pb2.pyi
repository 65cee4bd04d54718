from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_COLOCATED: Role

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "stop", "output_offset")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    output_offset: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., output_offset: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_waiting", "num_running", "free_blocks", "total_blocks", "tokens_in_flight", "num_reserved", "step_ms_ewma", "max_num_seqs")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_EWMA_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    free_blocks: int
    total_blocks: int
    tokens_in_flight: int
    num_reserved: int
    step_ms_ewma: float
    max_num_seqs: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., num_reserved: _Optional[int] = ..., step_ms_ewma: _Optional[float] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class StageCosts(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "transfer_ms", "transfer_bytes", "decode_ms", "cached_tokens", "kvstore_tokens", "reserve_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    transfer_bytes: int
    decode_ms: float
    cached_tokens: int
    kvstore_tokens: int
    reserve_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., decode_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., kvstore_tokens: _Optional[int] = ..., reserve_ms: _Optional[float] = ...) -> None: ...
