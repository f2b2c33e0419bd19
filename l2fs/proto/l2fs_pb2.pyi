# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Location(_message.Message):
    __slots__ = ("worker_id", "node_id", "address", "block_id", "local_path", "data_address", "domain_socket", "capability")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    address: str
    block_id: str
    local_path: str
    data_address: str
    domain_socket: str
    capability: str
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., block_id: _Optional[str] = ..., local_path: _Optional[str] = ..., data_address: _Optional[str] = ..., domain_socket: _Optional[str] = ..., capability: _Optional[str] = ...) -> None: ...

class FileStat(_message.Message):
    __slots__ = ("path", "exists", "is_dir", "size", "mtime", "crc32c", "order_hint", "locations")
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    IS_DIR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ORDER_HINT_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    path: str
    exists: bool
    is_dir: bool
    size: int
    mtime: float
    crc32c: int
    order_hint: int
    locations: _containers.RepeatedCompositeFieldContainer[Location]
    def __init__(self, path: _Optional[str] = ..., exists: bool = ..., is_dir: bool = ..., size: _Optional[int] = ..., mtime: _Optional[float] = ..., crc32c: _Optional[int] = ..., order_hint: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[Location, _Mapping]]] = ...) -> None: ...

class BlockReport(_message.Message):
    __slots__ = ("block_id", "path", "size", "crc32c", "mtime", "order_hint", "local_path", "seal")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    ORDER_HINT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    path: str
    size: int
    crc32c: int
    mtime: float
    order_hint: int
    local_path: str
    seal: str
    def __init__(self, block_id: _Optional[str] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., mtime: _Optional[float] = ..., order_hint: _Optional[int] = ..., local_path: _Optional[str] = ..., seal: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message", "kind", "errno_name")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ERRNO_NAME_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    kind: str
    errno_name: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., kind: _Optional[str] = ..., errno_name: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "node_id", "address", "capacity", "used", "blocks", "data_address", "protocol_version", "min_protocol_version", "continuation", "domain_socket")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_SOCKET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    address: str
    capacity: int
    used: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockReport]
    data_address: str
    protocol_version: int
    min_protocol_version: int
    continuation: bool
    domain_socket: str
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockReport, _Mapping]]] = ..., data_address: _Optional[str] = ..., protocol_version: _Optional[int] = ..., min_protocol_version: _Optional[int] = ..., continuation: bool = ..., domain_socket: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("delete_blocks", "protocol_version", "data_key")
    DELETE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    delete_blocks: _containers.RepeatedScalarFieldContainer[str]
    protocol_version: int
    data_key: bytes
    def __init__(self, delete_blocks: _Optional[_Iterable[str]] = ..., protocol_version: _Optional[int] = ..., data_key: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "capacity", "used", "blocks", "interval")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    capacity: int
    used: int
    blocks: int
    interval: float
    def __init__(self, worker_id: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., blocks: _Optional[int] = ..., interval: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("reregister",)
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    def __init__(self, reregister: bool = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("worker_id", "block_ids", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class BlocksMoved(_message.Message):
    __slots__ = ("worker_id", "block_ids", "local_paths")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATHS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    local_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[str]] = ..., local_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("path", "size", "node_id", "if_absent", "exclude_workers")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    node_id: str
    if_absent: bool
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., node_id: _Optional[str] = ..., if_absent: bool = ..., exclude_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("exists", "block_id", "worker", "error")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    block_id: str
    worker: Location
    error: ItemError
    def __init__(self, exists: bool = ..., block_id: _Optional[str] = ..., worker: _Optional[_Union[Location, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class AllocateManyRequest(_message.Message):
    __slots__ = ("items", "protocol_version")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AllocateRequest]
    protocol_version: int
    def __init__(self, items: _Optional[_Iterable[_Union[AllocateRequest, _Mapping]]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class AllocateManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AllocateResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[AllocateResponse, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("path", "block_id", "worker_id", "size", "crc32c", "if_absent", "order_hint", "local_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    ORDER_HINT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    block_id: str
    worker_id: str
    size: int
    crc32c: int
    if_absent: bool
    order_hint: int
    local_path: str
    def __init__(self, path: _Optional[str] = ..., block_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., if_absent: bool = ..., order_hint: _Optional[int] = ..., local_path: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("published", "error")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    published: bool
    error: ItemError
    def __init__(self, published: bool = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class CommitManyRequest(_message.Message):
    __slots__ = ("items", "protocol_version")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    protocol_version: int
    def __init__(self, items: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class CommitManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CommitResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[CommitResponse, _Mapping]]] = ...) -> None: ...

class PathRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class PathsRequest(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class StatManyResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.RepeatedCompositeFieldContainer[FileStat]
    def __init__(self, stats: _Optional[_Iterable[_Union[FileStat, _Mapping]]] = ...) -> None: ...

class PrefixLookupResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("path", "start_after", "limit")
    PATH_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    path: str
    start_after: str
    limit: int
    def __init__(self, path: _Optional[str] = ..., start_after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "next_after")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileStat]
    next_after: str
    def __init__(self, entries: _Optional[_Iterable[_Union[FileStat, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class MkdirRequest(_message.Message):
    __slots__ = ("path", "parents", "exist_ok")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    path: str
    parents: bool
    exist_ok: bool
    def __init__(self, path: _Optional[str] = ..., parents: bool = ..., exist_ok: bool = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: bool = ...) -> None: ...

class RenameRequest(_message.Message):
    __slots__ = ("src", "dst", "overwrite")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    overwrite: bool
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., overwrite: bool = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "node_id", "address", "alive", "capacity", "used", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    address: str
    alive: bool
    capacity: int
    used: int
    blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., alive: bool = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("workers", "files", "duplicate_files")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FILES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    files: int
    duplicate_files: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., files: _Optional[int] = ..., duplicate_files: _Optional[int] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("block_id", "path", "size", "order_hint", "data", "capability")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ORDER_HINT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    path: str
    size: int
    order_hint: int
    data: bytes
    capability: str
    def __init__(self, block_id: _Optional[str] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., order_hint: _Optional[int] = ..., data: _Optional[bytes] = ..., capability: _Optional[str] = ...) -> None: ...

class WriteResult(_message.Message):
    __slots__ = ("block_id", "size", "crc32c", "local_path", "error")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    size: int
    crc32c: int
    local_path: str
    error: ItemError
    def __init__(self, block_id: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., local_path: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class WriteResults(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[WriteResult]
    def __init__(self, items: _Optional[_Iterable[_Union[WriteResult, _Mapping]]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("block_id", "capability")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    capability: str
    def __init__(self, block_id: _Optional[str] = ..., capability: _Optional[str] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("size", "crc32c", "data")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    size: int
    crc32c: int
    data: bytes
    def __init__(self, size: _Optional[int] = ..., crc32c: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("block_id", "size", "capability", "path")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    size: int
    capability: str
    path: str
    def __init__(self, block_id: _Optional[str] = ..., size: _Optional[int] = ..., capability: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("tmp_path", "error")
    TMP_PATH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tmp_path: str
    error: ItemError
    def __init__(self, tmp_path: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class ReserveManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReserveRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ReserveRequest, _Mapping]]] = ...) -> None: ...

class ReserveManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReserveResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[ReserveResponse, _Mapping]]] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("block_id", "path", "size", "crc32c", "order_hint", "capability")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ORDER_HINT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    path: str
    size: int
    crc32c: int
    order_hint: int
    capability: str
    def __init__(self, block_id: _Optional[str] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., order_hint: _Optional[int] = ..., capability: _Optional[str] = ...) -> None: ...

class AdoptManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AdoptRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[AdoptRequest, _Mapping]]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("block_ids", "capabilities", "paths")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Iterable[str]] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class SetPathsRequest(_message.Message):
    __slots__ = ("block_ids", "paths", "seals")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    paths: _containers.RepeatedScalarFieldContainer[str]
    seals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., paths: _Optional[_Iterable[str]] = ..., seals: _Optional[_Iterable[str]] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("block_ids", "crc32cs", "seals")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CRC32CS_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    crc32cs: _containers.RepeatedScalarFieldContainer[int]
    seals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., crc32cs: _Optional[_Iterable[int]] = ..., seals: _Optional[_Iterable[str]] = ...) -> None: ...
