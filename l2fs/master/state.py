"""The master's shared state: metrics, namespace and registry entries, the attributes every part uses."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram

from l2fs.common import (
    ADMINS,
    READERS,
    REMOVERS,
    WORKERS,
    WRITERS,
    BlockKey,
    Credentials,
    capability,
    rpc_handler,
)
from l2fs.common.protocol import MIN_PEER_VERSION, PROTOCOL_VERSION
from l2fs.master.journal import PendingOps
from l2fs.proto import l2fs_pb2_grpc as pbg

log = logging.getLogger("l2fs.master")

# Which roles may call which RPC (checked before the message is read; see TokenInterceptor). Engines' writes
# are further limited to put-if-absent under their prefixes in the handlers.
MASTER_POLICY = {
    **dict.fromkeys(("RegisterWorker", "Heartbeat", "RemoveBlocks", "MoveBlocks"), WORKERS),
    **dict.fromkeys(("Allocate", "AllocateMany", "Commit", "CommitMany", "Mkdir"), WRITERS),
    **dict.fromkeys(("Stat", "StatMany", "PrefixLookup", "List", "Report"), READERS),
    "Rmdir": ADMINS,
    **dict.fromkeys(("Delete", "Rename"), REMOVERS),  # a mount only of files it wrote (the handlers check)
}

RPC_LATENCY = Histogram("l2fs_master_rpc_seconds", "Master RPC latency", ["method"],
                        buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .5, 1, 5))
RPC_ERRORS = Counter("l2fs_master_rpc_errors_total", "Master RPCs that returned an error", ["method", "code"])
LOOKUP_HITS = Counter("l2fs_master_lookup_hits_total", "Stat/prefix-lookup paths found")
LOOKUP_MISSES = Counter("l2fs_master_lookup_misses_total", "Stat/prefix-lookup paths not found")
FILES = Gauge("l2fs_master_files", "Files in the namespace")
WORKERS_ALIVE = Gauge("l2fs_master_workers_alive", "Live workers")
CAPACITY = Gauge("l2fs_master_capacity_bytes", "Capacity of live workers")
USED = Gauge("l2fs_master_used_bytes", "Used bytes on live workers")
COMMITS = Counter("l2fs_master_commits_total", "File commits", ["result"])
_PUBLISHED, _EXISTED = COMMITS.labels("published"), COMMITS.labels("exists")  # labelled once, not per commit
DUPLICATES = Gauge("l2fs_master_duplicate_content_files",
                   "Files (>= 4 KiB) with the same size+crc32c as another file: likely diverging cache keys")
DROPPED = Counter("l2fs_master_dropped_files_total", "Files dropped from the namespace", ["reason"])
QUOTA_REFUSED = Counter("l2fs_master_quota_refusals_total", "Writes refused by a --prefix-quota", ["prefix"])
PREFIX_USED = Gauge("l2fs_master_prefix_used_bytes", "Bytes of files under a --prefix-quota prefix", ["prefix"])
REPORT_REJECTS = Counter("l2fs_master_report_rejects_total",
                         "Reported blocks not published because of what they are (mac: the id is not one a master "
                         "with this --block-key-file minted for that worker and size; seal: the block's seal MAC "
                         "does not verify over the reported worker, id, size and CRC32C, e.g. altered bytes and CRC; "
                         "unsealed: no seal, deleted: committed just before a master restart, or from before "
                         "seals)", ["reason"])
_MAC_REJECT, _SEAL_REJECT, _UNSEALED = (REPORT_REJECTS.labels(r) for r in ("mac", "seal", "unsealed"))
READ_SCOPE_MISSES = Counter("l2fs_master_read_scope_misses_total",
                            "Paths answered as missing (Stat, StatMany, PrefixLookup, List, Delete, Rename) because "
                            "they lie outside the caller's read scope (an engine or mount credential's prefixes "
                            "and read_prefixes): a steady rate means a client configured with a prefix its token "
                            "does not cover", ["credential"])
PENDING = Gauge("l2fs_master_pending_namespace_ops",
                "Deletes/renames acknowledged to clients that their worker has not confirmed yet")


@dataclass(slots=True)
class FileEntry:
    block_id: str
    worker_id: str
    size: int
    crc32c: int
    mtime: float
    order_hint: int
    local_path: str
    writer: str = ""  # name of the credential that committed it ("" = unknown, e.g. reported after a restart)


class Allocation(NamedTuple):
    """An open allocation: where the block goes, until when, and the one commit that may publish it (the
    allocating credential's name, "" without authentication; the normalised path; the size)."""

    worker_id: str
    expiry: float
    writer: str
    path: str
    size: int


@dataclass(slots=True)
class WorkerEntry:
    worker_id: str
    node_id: str
    address: str
    capacity: int
    used: int
    blocks: int
    last_seen: float
    alive: bool = True
    files: set[str] = field(default_factory=set)
    data_address: str = ""
    domain_socket: str = ""  # fd-passing short-circuit socket on the worker's node ("" = none)
    interval: float = 1.0  # the worker's heartbeat interval
    pending: int = 0  # bytes placed here since the last heartbeat: a placement estimate, never reported as used
    owner: str = ""  # name of the credential that registered it (tokens file); "" without authentication
    caps: bool = False  # it holds its data key (protocol >= 3, we have a block key): give clients capabilities
    seals: bool = False  # it keeps seal MACs (protocol >= 4, we have a block key): push it its blocks' seals
    sized: bool = False  # its write capabilities bind the allocated size (protocol >= 5, we have a block key)
    holders: bool = False  # its capabilities name their holder (c2: protocol >= 6, we have a block key)
    seal_sync_after: float = 0.0  # monotonic time before which commits leave its seals to the pusher

    @property
    def free(self) -> int:
        """Room under the 90 % high watermark, counting placements the worker has not reported yet."""
        return int(self.capacity * 0.9) - self.used - self.pending


_rpc = rpc_handler(RPC_LATENCY, RPC_ERRORS)


class MasterBase:
    """The state every part of the master shares (set in MasterService.__init__). One lock (`lock`) guards
    all of it; handlers are short and never do I/O under it."""

    ALLOC_MEMORY = 1 << 18  # open allocations / abandoned block ids remembered (oldest forgotten first)
    protocol_version = PROTOCOL_VERSION  # class attributes so a test can play an older or newer master
    min_peer_version = MIN_PEER_VERSION

    heartbeat_timeout: float
    block_key: BlockKey | None
    minter: capability.Minter | None
    shard: int
    shards: int
    quotas: dict[str, int]
    quota_used: dict[str, int]
    quota_inflight: dict[str, int]
    _alloc_charge: dict[str, tuple[str, int]]
    pending: PendingOps
    _send_locks: dict[str, threading.Lock]
    _push_wake: threading.Event
    seals: dict[str, OrderedDict[str, tuple[int, str]]]
    allocation_ttl: float
    allocations: OrderedDict[str, Allocation]
    abandoned: OrderedDict[str, None]
    max_file_size: int
    lock: threading.RLock
    files: dict[str, FileEntry]
    blocks: dict[str, str]
    children: dict[str, set[str]]
    dir_maker: dict[str, str]
    dirs_by: dict[str, int]
    max_dirs_per_credential: int
    workers: dict[str, WorkerEntry]
    content: dict[tuple[int, int], int]
    duplicates: int
    creds: Credentials
    _token: str | None
    _tls_ca: str | None
    _stubs: dict[str, pbg.WorkerStub]
    _bg: futures.ThreadPoolExecutor
    _stop: threading.Event
