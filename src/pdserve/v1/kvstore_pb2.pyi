from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "window_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    window_blocks: int
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., window_blocks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_blocks", "ucx_worker_address", "bytes_per_block", "num_main_blocks")
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_MAIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_hit_blocks: int
    ucx_worker_address: bytes
    bytes_per_block: int
    num_main_blocks: int
    def __init__(self, num_hit_blocks: _Optional[int] = ..., ucx_worker_address: _Optional[bytes] = ..., bytes_per_block: _Optional[int] = ..., num_main_blocks: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "ucx_worker_address", "tag", "window_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ucx_worker_address: bytes
    tag: int
    window_blocks: int
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., ucx_worker_address: _Optional[bytes] = ..., tag: _Optional[int] = ..., window_blocks: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("num_blocks", "bytes_per_block", "checksums", "num_window_blocks", "window_bytes_per_block")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_per_block: int
    checksums: _containers.RepeatedScalarFieldContainer[bytes]
    num_window_blocks: int
    window_bytes_per_block: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., checksums: _Optional[_Iterable[bytes]] = ..., num_window_blocks: _Optional[int] = ..., window_bytes_per_block: _Optional[int] = ...) -> None: ...

class BeginPutRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "first_block", "bytes_per_block", "window_part")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PART_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    bytes_per_block: int
    window_part: bool
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., window_part: _Optional[bool] = ...) -> None: ...

class BeginPutResponse(_message.Message):
    __slots__ = ("put_id", "tag", "ucx_worker_address", "num_accepted", "first_block")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    tag: int
    ucx_worker_address: bytes
    num_accepted: int
    first_block: int
    def __init__(self, put_id: _Optional[int] = ..., tag: _Optional[int] = ..., ucx_worker_address: _Optional[bytes] = ..., num_accepted: _Optional[int] = ..., first_block: _Optional[int] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("put_id", "checksums")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    checksums: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, put_id: _Optional[int] = ..., checksums: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("num_stored",)
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    def __init__(self, num_stored: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "evictions", "bytes_in", "bytes_out", "pinned_blocks", "put_rejected", "corrupt_puts", "open_puts", "staging_bytes", "disk_capacity_bytes", "disk_used_bytes", "disk_blocks", "disk_hits", "disk_writes", "demotions", "promotions", "disk_corrupt")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUT_REJECTED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PUTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_PUTS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    pinned_blocks: int
    put_rejected: int
    corrupt_puts: int
    open_puts: int
    staging_bytes: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_blocks: int
    disk_hits: int
    disk_writes: int
    demotions: int
    promotions: int
    disk_corrupt: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., put_rejected: _Optional[int] = ..., corrupt_puts: _Optional[int] = ..., open_puts: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_writes: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., disk_corrupt: _Optional[int] = ...) -> None: ...

class PurgeWriterRequest(_message.Message):
    __slots__ = ("writer",)
    WRITER_FIELD_NUMBER: _ClassVar[int]
    writer: str
    def __init__(self, writer: _Optional[str] = ...) -> None: ...

class PurgeWriterResponse(_message.Message):
    __slots__ = ("num_blocks", "num_in_use")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_USE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_in_use: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_in_use: _Optional[int] = ...) -> None: ...
