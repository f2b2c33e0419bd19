"""l2fs client: the one way every other part of kvtier (connector, mount, fsspec, router, benches) reaches L2.

CONTRACT STUB written before the implementation so that other components can be coded against it.
The l2fs implementer replaces the bodies; the names, arguments and return conventions below are the
contract (extend, don't break).

Conventions:
- Paths are absolute POSIX-style strings inside the l2fs namespace ("/kv/model/abc.data"). Invalid paths
  ("..", NUL, empty components, > limits) raise `InvalidPath` (a ValueError).
- Reads are fail-as-miss: a missing file, a dead/unreachable worker, a checksum mismatch or a deadline
  overrun returns None (never raises, never blocks past `timeout`).
- Metadata calls on an unreachable master raise `Unavailable` after `timeout` (callers on the cache path
  catch `L2fsError` and treat it as a miss).
- `put` is put-if-absent by default: publishing an existing path is a successful no-op that returns False.
  A file becomes visible only when complete (atomic publish).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class L2fsError(Exception):
    """Base class of l2fs client errors."""


class InvalidPath(L2fsError, ValueError):
    """The path is not a valid l2fs path."""


class NotFound(L2fsError, FileNotFoundError):
    """The path does not exist (metadata operations only; reads return None instead)."""


class AlreadyExists(L2fsError, FileExistsError):
    """Target exists and the operation does not overwrite."""


class Unavailable(L2fsError, ConnectionError):
    """Master (or every candidate worker) unreachable within the deadline."""


class PermissionDenied(L2fsError, PermissionError):
    """Authentication/authorization failed (bad or missing token)."""


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


class Client:
    """Synchronous client. Thread-safe; share one per process.

    master: "host:port" (or comma-separated list); default from $L2FS_MASTER.
    node_id: this process's node, for local-first placement and short-circuit I/O; default $L2FS_NODE_ID.
    token: bearer token for clusters started with --token; default $L2FS_TOKEN.
    tls_ca: CA bundle path to enable TLS; default $L2FS_TLS_CA.
    timeout: per-call deadline in seconds (reads fail as a miss after it).
    short_circuit: read/write local blocks directly on disk when the worker is on this node.
    """

    def __init__(
        self,
        master: str | None = None,
        *,
        node_id: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout: float = 2.0,
        short_circuit: bool = True,
    ) -> None:
        raise NotImplementedError

    # --- data ---
    def put(self, path: str, data: bytes | bytearray | memoryview, *, if_absent: bool = True,
            order_hint: int | None = None) -> bool:
        """Store and atomically publish. Returns True if this call published it, False if it already
        existed (if_absent) . order_hint = position of this object in a prefix chain (0 = first chunk);
        eviction prefers dropping the deepest chunks first."""
        raise NotImplementedError

    def get(self, path: str) -> bytes | None:
        """Whole file or None (miss)."""
        raise NotImplementedError

    def get_into(self, path: str, buf: memoryview | bytearray) -> int | None:
        """Read the file into buf (must be large enough); returns bytes read or None (miss)."""
        raise NotImplementedError

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]], *, if_absent: bool = True,
                 order_hints: Sequence[int] | None = None) -> list[bool]:
        raise NotImplementedError

    def get_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """Parallel fetches; one None per miss."""
        raise NotImplementedError

    # --- metadata ---
    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def stat(self, path: str) -> FileInfo | None:
        raise NotImplementedError

    def stat_many(self, paths: Sequence[str]) -> list[FileInfo | None]:
        """One RPC."""
        raise NotImplementedError

    def prefix_lookup(self, paths: Sequence[str]) -> int:
        """How many leading paths exist (one RPC). Does not pin or renew anything."""
        raise NotImplementedError

    def ls(self, path: str = "/") -> list[FileInfo]:
        raise NotImplementedError

    def mkdir(self, path: str, *, parents: bool = True, exist_ok: bool = True) -> None:
        raise NotImplementedError

    def rmdir(self, path: str) -> None:
        raise NotImplementedError

    def rm(self, path: str) -> bool:
        """True if something was removed."""
        raise NotImplementedError

    def rename(self, src: str, dst: str, *, overwrite: bool = True) -> None:
        """Atomic; overwrite=True replaces dst (POSIX rename semantics)."""
        raise NotImplementedError

    def report(self) -> ClusterReport:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio twin of Client with the same methods as coroutines (same arguments and conventions)."""
