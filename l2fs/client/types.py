"""What client calls return (FileInfo, WorkerInfo, ClusterReport) and the client's own records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from l2fs.client.errors import L2fsError
from l2fs.proto import l2fs_pb2 as pb


@dataclass(slots=True)
class FileInfo:
    path: str
    size: int
    is_dir: bool = False
    mtime: float = 0.0
    crc32c: int = 0
    nodes: list[str] = field(default_factory=list)  # node ids holding the file's blocks


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    node_id: str
    address: str
    alive: bool
    capacity: int
    used: int
    blocks: int


@dataclass(slots=True)
class ClusterReport:
    workers: list[WorkerInfo]
    files: int
    capacity: int
    used: int
    duplicate_files: int = 0  # same bytes under another name: a sign of diverging cache keys


def _info(st: pb.FileStat) -> FileInfo:
    return FileInfo(path=st.path, size=st.size, is_dir=st.is_dir, mtime=st.mtime, crc32c=st.crc32c,
                    nodes=[loc.node_id for loc in st.locations])


@dataclass(slots=True)
class _Shard:
    """One shard of the namespace: its failover masters (one is current) and when lookups may ask it again."""

    addrs: list[str]
    stubs: list[Any]
    current: int = 0
    down_until: float = 0.0  # after a failed lookup, skip this shard's master for a moment (fail fast)


@dataclass(slots=True)
class _Put:
    """One item of a put batch as it goes through allocate, write and commit rounds."""

    path: str
    mv: memoryview
    hint: int
    result: bool | L2fsError | None = None  # set once the item is finished
    bid: str = ""
    loc: pb.Location = field(default_factory=pb.Location)
    written: pb.WriteResult | None = None
    exclude: list[str] = field(default_factory=list)  # workers that were unreachable for this item
    error: L2fsError | None = None  # why the last round has to be retried
    tries: int = 0
    crc: int | None = None  # CRC32C of mv as this client sends it: what the commit publishes
