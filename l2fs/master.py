"""l2fs master: in-memory namespace (dirs, files -> block -> worker), worker registry, placement.

No Raft: the namespace is soft state. Workers persist a manifest of their sealed blocks and re-report it
on (re)registration, so a restarted master rebuilds the namespace from block reports. KV data is
recomputable, so anything lost in that window only costs cache misses. What must not come back from those
reports (deleted files, old names of renamed files, overwritten blocks) waits in `l2fs.journal.PendingOps`
(on disk with `--journal`) until the worker has confirmed it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import threading
import time
import uuid
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from l2fs import capability
from l2fs.batch import MIN_PEER_VERSION, PROTOCOL_VERSION, each, peer_version, version_mismatch
from l2fs.common import (
    ADMINS,
    BLOCK_ID,
    DEFAULT_MAX_FILE_SIZE,
    READERS,
    REMOVERS,
    WORKERS,
    WRITERS,
    BlockKey,
    BlockKeyError,
    Credential,
    Credentials,
    PathError,
    RpcError,
    TokensFileError,
    auth_metadata,
    check_block_id,
    grpc_server,
    load_block_key,
    make_channel,
    norm_path,
    parent_of,
    parse_shard,
    parse_size,
    rpc_handler,
    shard_of,
    start_metrics_server,
    valid_address,
    wait_for_stop_signal,
    write_port_file,
)
from l2fs.journal import JournalError, PendingOps
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

log = logging.getLogger("l2fs.master")

# what `kvtier tokens generate --mount` gives a mount token (kvtier.contract's KV/MP/META prefixes; l2fs imports
# nothing of kvtier): the default --mount-prefixes of ServiceAccount-reviewed mounts
MOUNT_PREFIXES = "/kvtier/kv,/kvtier/mp,/kvtier/meta"
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
    seal_sync_after: float = 0.0  # monotonic time before which commits leave its seals to the pusher

    @property
    def free(self) -> int:
        """Room under the 90 % high watermark, counting placements the worker has not reported yet."""
        return int(self.capacity * 0.9) - self.used - self.pending


_rpc = rpc_handler(RPC_LATENCY, RPC_ERRORS)


class MasterService(pbg.MasterServicer):
    """Namespace + registry. One lock guards all state; handlers are short and never do I/O under it."""

    ALLOC_MEMORY = 1 << 18  # open allocations / abandoned block ids remembered (oldest forgotten first)
    protocol_version = PROTOCOL_VERSION  # class attributes so a test can play an older or newer master
    min_peer_version = MIN_PEER_VERSION

    def __init__(self, *, heartbeat_timeout: float = 10.0, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 token: str | None = None, tls_ca: str | None = None, allocation_ttl: float = 600.0,
                 journal: str | None = None, prefix_quotas: dict[str, int] | None = None,
                 creds: Credentials | None = None, shard: tuple[int, int] = (0, 1),
                 block_key: BlockKey | None = None, capability_ttl: float = capability.DEFAULT_TTL) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        # With a key, block ids are minted as their own MAC over (worker id, size) (BlockKey): a commit or a
        # block report whose id does not verify was never allocated by a master of this cluster. Without one,
        # uuid4 ids and no check (any worker-role caller can publish blocks it made up).
        self.block_key = block_key
        # ... and the data plane takes per-block capabilities instead of the token (l2fs/capability.py): each
        # protocol->=3 worker gets its data key K_w at registration, clients a capability per location
        self.minter = capability.Minter(block_key.key, capability_ttl) if block_key is not None else None
        # Path-hash sharding: this master owns the files whose path hashes to shard[0] of shard[1] (shard_of);
        # directories live on every shard that has something under them.
        self.shard, self.shards = shard
        # Per-prefix byte quotas (tenant isolation): a prefix at its quota gets write misses instead of
        # evicting everyone else's blocks. Counted on published files; checked at Allocate and Commit.
        self.quotas = {norm_path(k): v for k, v in (prefix_quotas or {}).items()}
        self.quota_used = dict.fromkeys(self.quotas, 0)
        # bytes allocated under a quota prefix and not committed yet: a batch of puts must not write (and make
        # the worker evict for) more than the quota before its first commit is checked
        self.quota_inflight = dict.fromkeys(self.quotas, 0)
        self._alloc_charge: dict[str, tuple[str, int]] = {}  # block id -> (path, size) charged in flight
        # Deletes/renames a worker has not confirmed: applied to its block reports, pushed until it acks.
        self.pending = PendingOps(journal)
        self._send_locks: dict[str, threading.Lock] = {}  # one push at a time per worker: acks stay ordered
        self._push_wake = threading.Event()
        # Seal MACs of committed blocks not delivered to their worker yet: worker id -> block id -> (crc32c,
        # MAC), pushed (SealBlocks) by the pusher thread. Also what a worker's re-registration is checked
        # against while its seals are on their way. Bounded per worker (a protocol-3 worker never takes them).
        self.seals: dict[str, OrderedDict[str, tuple[int, str]]] = {}
        self.allocation_ttl = allocation_ttl
        # Blocks allocated but not committed yet (block id -> (worker id, expiry)), and those given up on: an
        # expired allocation, or one whose worker re-registered before the commit. An abandoned block is never
        # published (a put that never returned must not surface after a worker restart) and is deleted.
        self.allocations: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.abandoned: OrderedDict[str, None] = OrderedDict()
        self.max_file_size = max_file_size
        self.lock = threading.RLock()
        self.files: dict[str, FileEntry] = {}
        self.blocks: dict[str, str] = {}  # block_id -> path
        self.children: dict[str, set[str]] = {"/": set()}  # dir -> child names (files and dirs)
        self.workers: dict[str, WorkerEntry] = {}
        self.content: dict[tuple[int, int], int] = {}  # (size, crc32c) -> files with it (>= 4 KiB)
        self.duplicates = 0
        # who may write where (checked in the handlers, where the path is known); `token` is what the master
        # sends when it calls workers
        self.creds = creds if creds is not None else Credentials(token)
        self._token = self.creds.outbound_token(token)
        self._tls_ca = tls_ca
        self._stubs: dict[str, pbg.WorkerStub] = {}
        self._bg = futures.ThreadPoolExecutor(8, thread_name_prefix="l2fs-master-bg")
        self._stop = threading.Event()
        threading.Thread(target=self._sweeper, name="l2fs-sweeper", daemon=True).start()
        threading.Thread(target=self._pusher, name="l2fs-pending", daemon=True).start()
        PENDING.set(len(self.pending))

    # ---------- helpers (call with lock held unless noted) ----------

    def _owns(self, path: str) -> bool:
        return self.shards <= 1 or shard_of(path, self.shards) == self.shard

    def _own(self, path: str) -> None:
        """FAILED_PRECONDITION (kind "shard") for a file path that hashes to another shard: a client or
        worker with a wrong master list must fail loudly, not split the namespace silently."""
        if not self._owns(path):
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{path} belongs to l2fs shard {shard_of(path, self.shards)} of {self.shards}, this "
                           f"master is shard {self.shard}/{self.shards}: the caller's master list does not "
                           f"match the cluster's shards", kind="shard")

    def _own_or_dir(self, path: str) -> None:
        """Lookups of another shard's path are refused unless it is a directory here (directories exist on
        every shard that holds something under them, so a sharded client asks all shards for them)."""
        if not self._owns(path) and path not in self.children:
            self._own(path)

    def _ensure_dirs(self, path: str) -> None:
        """Create path and its missing parents as directories."""
        missing = []
        p = path
        while p not in self.children:
            if p in self.files:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{p} is a file, not a directory", "ENOTDIR")
            missing.append(p)
            p = parent_of(p)
        for d in reversed(missing):
            self.children[d] = set()
            self.children[parent_of(d)].add(d.rsplit("/", 1)[1])

    def _add_file(self, path: str, entry: FileEntry) -> None:
        if path in self.children:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a directory", "EISDIR")
        self._ensure_dirs(parent_of(path))
        self.files[path] = entry
        self.blocks[entry.block_id] = path
        self.children[parent_of(path)].add(path.rsplit("/", 1)[1])
        w = self.workers.get(entry.worker_id)
        if w is not None:
            w.files.add(path)
        self._count_content(entry, +1)
        self._charge(path, entry.size)
        FILES.set(len(self.files))

    def _drop_file(self, path: str) -> FileEntry | None:
        e = self.files.pop(path, None)
        if e is None:
            return None
        self.blocks.pop(e.block_id, None)
        kids = self.children.get(parent_of(path))
        if kids is not None:
            kids.discard(path.rsplit("/", 1)[1])
        w = self.workers.get(e.worker_id)
        if w is not None:
            w.files.discard(path)
        self._count_content(e, -1)
        self._charge(path, -e.size)
        FILES.set(len(self.files))
        return e

    def _count_content(self, e: FileEntry, delta: int) -> None:
        """Key-divergence detector: track files whose bytes (size + crc32c) equal another file's."""
        if e.size < 4096:
            return
        key = (e.size, e.crc32c)
        n = self.content.get(key, 0)
        if delta > 0:
            self.duplicates += n > 0
            self.content[key] = n + 1
        else:
            self.duplicates -= n > 1
            if n <= 1:
                self.content.pop(key, None)
            else:
                self.content[key] = n - 1
        DUPLICATES.set(self.duplicates)

    def _quotas_of(self, path: str) -> list[str]:
        return [q for q in self.quotas if path == q or path.startswith(q.rstrip("/") + "/")]

    def _charge(self, path: str, size: int) -> None:
        for q in self._quotas_of(path):
            self.quota_used[q] += size
            PREFIX_USED.labels(q).set(self.quota_used[q])

    def _uncharge_allocation(self, bid: str) -> None:
        """An allocation under a quota prefix was committed, refused or given up: its bytes are no longer
        in flight."""
        charged = self._alloc_charge.pop(bid, None)
        if charged is not None:
            for q in self._quotas_of(charged[0]):
                self.quota_inflight[q] -= charged[1]

    def _check_quota(self, moves: list[tuple[str | None, str | None, int]]) -> None:
        """Refuse (RESOURCE_EXHAUSTED, EDQUOT) when (old path | None, new path | None, bytes) moves would take
        a prefix that grows past its quota; a prefix may always shrink."""
        if not self.quotas:
            return
        delta: dict[str, int] = {}
        for old, new, size in moves:
            for q in self._quotas_of(old) if old else ():
                delta[q] = delta.get(q, 0) - size
            for q in self._quotas_of(new) if new else ():
                delta[q] = delta.get(q, 0) + size
        for q, d in delta.items():
            if d > 0 and self.quota_used[q] + self.quota_inflight[q] + d > self.quotas[q]:
                QUOTA_REFUSED.labels(q).inc()
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"prefix {q} is at its quota ({self.quota_used[q]} of {self.quotas[q]} bytes used, "
                               f"{d} more asked): a write miss", "EDQUOT")

    def _cap(self, w: WorkerEntry, op: str, bid: str, path: str = "") -> str:
        """The capability a client shows `w` for `op` on `bid` ("" when `w` takes tokens)."""
        return self.minter.mint(w.worker_id, op, bid, path) if self.minter is not None and w.caps else ""

    def _location(self, e: FileEntry, caps: bool = True) -> pb.Location:
        w = self.workers[e.worker_id]
        return pb.Location(worker_id=w.worker_id, node_id=w.node_id, address=w.address,
                           block_id=e.block_id, local_path=e.local_path, data_address=w.data_address,
                           domain_socket=w.domain_socket,
                           capability=self._cap(w, capability.READ, e.block_id) if caps else "")

    def _stat(self, path: str, caps: bool = True) -> pb.FileStat:
        """`caps`: mint read capabilities into the locations (lookups before a read; a List need not)."""
        e = self.files.get(path)
        if e is not None:
            return pb.FileStat(path=path, exists=True, size=e.size, mtime=e.mtime, crc32c=e.crc32c,
                               order_hint=e.order_hint, locations=[self._location(e, caps)])
        if path in self.children:
            return pb.FileStat(path=path, exists=True, is_dir=True)
        return pb.FileStat(path=path, exists=False)

    def _drop_worker_files(self, w: WorkerEntry, reason: str) -> None:
        for path in list(w.files):
            self._drop_file(path)
            DROPPED.labels(reason).inc()
        w.files.clear()

    def _update_gauges(self) -> None:
        alive = [w for w in self.workers.values() if w.alive]
        WORKERS_ALIVE.set(len(alive))
        CAPACITY.set(sum(w.capacity for w in alive))
        USED.set(sum(w.used for w in alive))

    def _worker_stub(self, address: str) -> pbg.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = pbg.WorkerStub(make_channel(address, self._tls_ca))
            self._stubs[address] = stub
        return stub

    def _worker_md(self, worker_id: str, method: str, request: Any) -> tuple[tuple[str, str], ...] | None:
        """Metadata of a maintenance call to a worker: our token and, with a block key, the call's MAC under
        that worker's data key (capability.master_call_mac: another worker's token does not make one)."""
        md = tuple(auth_metadata(self._token) or ())
        if self.minter is not None:
            md += self.minter.call_metadata(worker_id, method, request)
        return md or None

    def _tell_worker(self, worker_id: str, call: str, request: Any) -> None:
        """Master -> worker RPC in the background, best effort: a dead worker re-reports later."""
        with self.lock:
            w = self.workers.get(worker_id)
            address = w.address if w is not None else None
        if address is None:
            return

        def send() -> None:
            # in the background, retry with growing deadlines: a loaded worker that misses one 1 s
            # deadline would otherwise keep a losing writer's orphan block until it restarts
            attempts = 3
            md = self._worker_md(worker_id, call, request)
            for i in range(attempts):
                try:
                    getattr(self._worker_stub(address), call)(request, timeout=1.0 * (2 ** i), metadata=md)
                    return
                except grpc.RpcError as e:
                    if i + 1 == attempts or e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                             grpc.StatusCode.UNAVAILABLE):
                        log.warning("worker %s %s failed: %s", worker_id, call, e.code())
                        return
                    if self._stop.wait(0.2 * (2 ** i)):
                        return

        self._bg.submit(send)

    def _remember(self, memory: OrderedDict[str, Any], bid: str, value: Any) -> None:
        """Add to a bounded block-id memory (allocations, abandoned): the oldest entry goes first."""
        memory[bid] = value
        if len(memory) > self.ALLOC_MEMORY:
            old, _ = memory.popitem(last=False)
            if memory is self.allocations:
                self._uncharge_allocation(old)

    def _abandon(self, bid: str) -> None:
        self._remember(self.abandoned, bid, None)

    def _expire_allocations(self, now: float) -> dict[str, list[str]]:
        """Abandon allocations older than allocation_ttl (lock held); returns worker -> block ids to delete."""
        out: dict[str, list[str]] = {}
        while self.allocations:
            bid, (wid, expiry) = next(iter(self.allocations.items()))
            if expiry > now:
                break
            self.allocations.popitem(last=False)
            self._uncharge_allocation(bid)
            self._abandon(bid)
            out.setdefault(wid, []).append(bid)
        return out

    def _sweeper(self) -> None:
        """Marks a worker dead within heartbeat_timeout of its failure and drops its locations at once.

        The failure happened up to one heartbeat interval after the last heartbeat, so a worker is dead
        once it has been silent for timeout - interval (but at least two intervals)."""
        period = max(0.02, min(0.1, self.heartbeat_timeout / 20))
        last = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            paused, last = now - last > period + 1.0, now
            with self.lock:
                if paused:  # the master itself stalled (SIGSTOP, swap): silence was ours, not theirs
                    for w in self.workers.values():
                        w.last_seen = max(w.last_seen, now - w.interval)
                for w in self.workers.values():
                    limit = max(self.heartbeat_timeout - w.interval - period, 2 * w.interval)
                    if w.alive and now - w.last_seen > limit:
                        w.alive = False
                        self._drop_worker_files(w, "worker_dead")
                        log.warning("worker %s (%s) dead: no heartbeat for %.1fs", w.worker_id, w.address,
                                    now - w.last_seen)
                self._update_gauges()
                expired = self._expire_allocations(now)
            for wid, ids in expired.items():  # their writers gave up long ago: free whatever got sealed
                log.info("abandoning %d uncommitted block(s) on worker %s", len(ids), wid)
                self._tell_worker(wid, "DeleteBlocks", pb.BlockIds(block_ids=ids))

    def close(self) -> None:
        self._stop.set()
        self._push_wake.set()
        self._bg.shutdown(wait=False, cancel_futures=True)
        self.pending.close()

    # ---------- pending namespace changes ----------

    PUSH_BATCH = 10_000  # changes per DeleteBlocks/SetPaths call

    def _record(self, changes: list[tuple[str, str, str | None]]) -> None:
        """Make (worker, block, new path | None = delete) changes durable before they are acknowledged."""
        try:
            self.pending.record(changes)
        except JournalError as e:
            log.error("%s", e)
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{e}: the operation was not applied") from e
        PENDING.set(len(self.pending))

    def _push(self, wid: str, timeout: float = 1.0, lock_wait: float = 0.25) -> bool:
        """Send one worker its pending changes (deletes, then new paths) and forget what it acknowledged.
        False when it is not live, is unreachable, or another push to it is under way (that one, or the
        pusher's next round, carries our change: a client call never waits for more than one attempt)."""
        with self.lock:
            w = self.workers.get(wid)
            if w is None or not w.alive:
                return False
            address = w.address
            send_lock = self._send_locks.setdefault(wid, threading.Lock())
        if not send_lock.acquire(timeout=lock_wait):
            return False
        try:
            ops = self.pending.batch(wid, self.PUSH_BATCH)  # read under the send lock: the newest state
            if not ops:
                return True
            deletes = [b for b, p in ops.items() if p is None]
            moves = [(b, p) for b, p in ops.items() if p is not None]
            stub = self._worker_stub(address)
            try:
                if deletes:
                    req = pb.BlockIds(block_ids=deletes)
                    stub.DeleteBlocks(req, timeout=timeout, metadata=self._worker_md(wid, "DeleteBlocks", req))
                if moves:
                    mreq = pb.SetPathsRequest(block_ids=[b for b, _ in moves], paths=[p for _, p in moves],
                                              seals=self._reseal(wid, moves))
                    stub.SetPaths(mreq, timeout=timeout, metadata=self._worker_md(wid, "SetPaths", mreq))
            except grpc.RpcError as e:
                log.warning("worker %s: %d pending namespace change(s) not confirmed yet (%s)", wid, len(ops),
                            e.code())
                return False
            self.pending.acked(wid, ops)
            PENDING.set(len(self.pending))
            return True
        finally:
            send_lock.release()

    # ---------- seal MACs ----------

    SEAL_MEMORY = 1 << 16  # undelivered seals remembered per worker (oldest forgotten: that block is unsealed)
    SEAL_WAIT = 1.0  # seconds a commit waits for its seals to reach the worker before the pusher takes over

    @property
    def sealing(self) -> bool:
        """Whether this master seals commits and publishes only sealed reports (a block key, protocol >= 4)."""
        return self.block_key is not None and self.protocol_version >= 4

    def _seal(self, wid: str, bid: str, size: int, crc: int, path: str, sealed: list[tuple[str, str]]) -> None:
        """Queue the seal of a block just published (lock held); `sealed` collects what to deliver now."""
        if self.block_key is None or not self.sealing:
            return
        sealed.append((wid, bid))
        q = self.seals.setdefault(wid, OrderedDict())
        q[bid] = (crc, capability.seal_mac(self.block_key.key, wid, bid, size, crc, path))
        if len(q) > self.SEAL_MEMORY:
            q.popitem(last=False)

    def _reseal(self, wid: str, moves: list[tuple[str, str]]) -> list[str]:
        """Seals for renamed blocks at their new paths (sent with SetPaths, so the worker's manifest keeps a seal
        that verifies over the path it reports); "" where this master does not seal or the path no longer
        holds that block (a newer change of it follows)."""
        if self.block_key is None or not self.sealing:
            return []
        out = []
        with self.lock:
            for bid, path in moves:
                e = self.files.get(path)
                out.append(capability.seal_mac(self.block_key.key, wid, bid, e.size, e.crc32c, path)
                           if e is not None and e.block_id == bid and e.worker_id == wid else "")
        return out

    def _seal_of(self, wid: str, b: pb.BlockReport) -> str:
        """The seal to check a report against: the worker's own, else one still on its way to it (lock held)."""
        if b.seal:
            return b.seal
        q = self.seals.get(wid)
        got = q.get(b.block_id) if q is not None else None
        return got[1] if got is not None else ""

    def _deliver_now(self, sealed: list[tuple[str, str]]) -> None:
        """Deliver the seals a Commit/CommitMany just minted before it answers (one call per worker), so an
        acknowledged put survives a master restart that follows at once; a worker that does not answer within
        SEAL_WAIT gets them from the pusher (the put is acknowledged anyway: only a master restart before that
        delivery costs the block, as a miss). A worker that missed that deadline gets its seals only from the
        pusher for the next 10 s: a hung (or hostile) worker must not hold the master's handler threads."""
        by_worker: dict[str, list[str]] = {}
        for wid, bid in sealed:
            by_worker.setdefault(wid, []).append(bid)
        for wid, bids in by_worker.items():
            now = time.monotonic()
            with self.lock:
                w = self.workers.get(wid)
                q = self.seals.get(wid)
                batch = [(b, q[b]) for b in bids if q is not None and b in q]
                leave = w is not None and w.seal_sync_after > now  # it missed a deadline lately
            if not batch:
                continue
            if w is None or leave:
                self._push_wake.set()  # the pusher delivers them
                continue
            if not self._send_seals(wid, batch, self.SEAL_WAIT):
                with self.lock:
                    w.seal_sync_after = time.monotonic() + 10.0
                self._push_wake.set()

    def _push_seals(self, wid: str, timeout: float = 2.0) -> bool:
        """Deliver one batch of `wid`'s undelivered seals; True when something was delivered (the caller goes on)."""
        with self.lock:
            q = self.seals.get(wid)
            if not q:
                self.seals.pop(wid, None)
                return False
            batch = list(q.items())[:self.PUSH_BATCH]
        return self._send_seals(wid, batch, timeout)

    def _send_seals(self, wid: str, batch: list[tuple[str, tuple[int, str]]], timeout: float) -> bool:
        """One SealBlocks call; the seals it delivered are forgotten. False when `wid` is not live, takes no
        seals or did not answer."""
        with self.lock:
            w = self.workers.get(wid)
            if w is None or not w.alive or not w.seals:
                return False
            address = w.address
        try:
            sreq = pb.SealRequest(block_ids=[b for b, _ in batch], crc32cs=[v[0] for _, v in batch],
                                  seals=[v[1] for _, v in batch])
            self._worker_stub(address).SealBlocks(sreq, timeout=timeout,
                                                  metadata=self._worker_md(wid, "SealBlocks", sreq))
        except grpc.RpcError as e:
            log.warning("worker %s: %d seal(s) not delivered yet (%s)", wid, len(batch), e.code())
            return False
        with self.lock:
            q = self.seals.get(wid, OrderedDict())
            for bid, v in batch:
                if q.get(bid) == v:
                    del q[bid]
            if not q:
                self.seals.pop(wid, None)
        return True

    def _pusher(self) -> None:
        """Retries every pending change until its worker confirms it, and delivers seals (woken by
        registrations and commits)."""
        while not self._stop.is_set():
            self._push_wake.wait(1.0)
            self._push_wake.clear()
            for wid in list(self.seals):
                for _ in range(100):
                    if self._stop.is_set() or not self._push_seals(wid):
                        break
            for wid in self.pending.workers():
                if self._stop.is_set():
                    return
                for _ in range(100):  # more than one batch; bounded, a failing journal must not spin
                    if not self._push(wid, timeout=2.0, lock_wait=2.0) or wid not in self.pending.workers():
                        break

    # ---------- worker-facing ----------

    def _check_owner(self, context: Any, worker_id: str, claim: bool = False, node_id: str | None = None) -> str:
        """A worker id belongs to the credential that registered it: another worker-role token may not
        heartbeat, report for or (while it is alive) re-register it. Returns the caller's credential name.
        That ownership lives in master memory (after a master restart the first registration claims the id);
        a credential with a "node" in the tokens file is also bound statically to its node's worker ids
        (Credential.may_be_worker), which no restart forgets."""
        cred = self.creds.caller(context)
        if cred is None:
            return ""
        if not cred.may_be_worker(worker_id, node_id):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"credential {cred.name!r} is bound to node {cred.node!r}: it may not act as worker "
                           f"{worker_id!r}" + (f" of node {node_id!r}" if node_id is not None else ""))
        with self.lock:
            w = self.workers.get(worker_id)
            if w is not None and w.owner and w.owner != cred.name and (w.alive or not claim):
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"worker {worker_id!r} is registered by another credential than {cred.name!r}")
        return cred.name

    @_rpc
    def RegisterWorker(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:  # noqa: N802
        if not request.worker_id or not request.address:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        if len(request.worker_id) > 256 or any(ord(ch) < 33 for ch in request.worker_id):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "worker_id must be 1-256 printable characters")
        if not valid_address(request.address):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker address must be host:port, got {request.address[:100]!r}")
        if request.data_address and not valid_address(request.data_address):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker data_address must be host:port, got {request.data_address[:100]!r}")
        sock = request.domain_socket
        if sock and (not sock.startswith("/") or len(sock.encode()) > 107 or any(ord(ch) < 32 for ch in sock)):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker domain_socket must be an absolute path under 108 bytes, got {sock[:100]!r}")
        why = version_mismatch("master", f"worker {request.worker_id}", request.protocol_version,
                               request.min_protocol_version, mine=self.protocol_version,
                               my_min=self.min_peer_version)
        if why:
            log.error("refusing registration: %s", why)
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, why)
        reject: list[str] = []
        foreign = unverified = bad_seal = unsealed = 0
        remote_deletes: list[tuple[str, str, str | None]] = []
        with self.lock:
            owner = self._check_owner(context, request.worker_id, claim=True,  # under the lock: no race
                                      node_id=request.node_id or request.worker_id)
            old = self.workers.get(request.worker_id)
            if request.continuation:  # more reports of the registration this worker just made
                if old is None or not old.alive or old.address != request.address:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"worker {request.worker_id}: report continues no live registration; "
                                   f"register again")
                w = old
                w.last_seen = time.monotonic()
                w.blocks += len(request.blocks)
            else:
                if old is not None:  # a re-registration replaces the old one cleanly
                    self._drop_worker_files(old, "reregistered")
                w = WorkerEntry(request.worker_id, request.node_id or request.worker_id, request.address,
                                request.capacity, request.used, len(request.blocks), time.monotonic(),
                                data_address=request.data_address, owner=owner,
                                domain_socket=request.domain_socket,
                                caps=self.minter is not None and self.protocol_version >= 3
                                and peer_version(request.protocol_version) >= 3,
                                seals=self.sealing and peer_version(request.protocol_version) >= 4)
                self.workers[request.worker_id] = w
            data_key = self.minter.key_for(w.worker_id) if self.minter is not None and w.caps else b""
            for b in request.blocks:
                if not BLOCK_ID.match(b.block_id):
                    continue  # not a block any worker of ours could hold: nothing to publish or delete
                if self.block_key is not None and not self.block_key.verify(b.block_id, w.worker_id, b.size):
                    # never allocated to this worker for this size (made up, another worker's, resized, or from
                    # before the key): not published, but not deleted either, so a master with a wrong key
                    # cannot wipe a cluster's cache; the worker evicts it as cold in time
                    unverified += 1
                    continue
                self._uncharge_allocation(b.block_id)
                if b.block_id in self.abandoned or self.allocations.pop(b.block_id, None) is not None:
                    self._abandon(b.block_id)  # sealed, never committed: its put did not return success
                    reject.append(b.block_id)
                    continue
                has_op, new_path = self.pending.lookup(w.worker_id, b.block_id)
                if has_op and new_path is None:  # deleted or overwritten while the worker was away
                    reject.append(b.block_id)
                    continue
                if self.block_key is not None and self.sealing:
                    mac = self._seal_of(w.worker_id, b)
                    if not mac:  # never sealed: committed just before a master restart, or cached before seals;
                        unsealed += 1  # its id verified, so it is this worker's own allocation: safe to delete
                        reject.append(b.block_id)
                        continue
                    if not capability.seal_ok(self.block_key.key, mac, w.worker_id, b.block_id, b.size, b.crc32c,
                                              b.path):
                        bad_seal += 1  # altered (bytes and CRC), or a seal of another key: neither published
                        continue  # nor deleted, as for an id that does not verify
                try:
                    path = norm_path(new_path if has_op and new_path is not None else b.path)  # renamed meanwhile
                except PathError:
                    reject.append(b.block_id)
                    continue
                if not self._owns(path):  # another shard's block (a worker with a wrong master list): neither
                    foreign += 1  # ours to publish nor to delete
                    continue
                cur = self.files.get(path)
                if cur is not None and cur.block_id != b.block_id:
                    if cur.mtime >= b.mtime:  # keep the newer copy of a path
                        reject.append(b.block_id)
                        continue
                    self._drop_file(path)
                    remote_deletes.append((cur.worker_id, cur.block_id, None))
                try:
                    self._add_file(path, FileEntry(b.block_id, w.worker_id, b.size, b.crc32c, b.mtime,
                                                   b.order_hint, b.local_path))
                except RpcError:  # path clashes with a directory: that block cannot be published
                    reject.append(b.block_id)
            self._update_gauges()
        # a displaced older copy on another worker must not come back with that worker's next report either
        self._record(remote_deletes)
        self._push_wake.set()  # this worker (and those) get their pending changes now
        log.info("registered worker %s node=%s at %s: %d blocks (%d rejected)", request.worker_id,
                 request.node_id, request.address, len(request.blocks), len(reject))
        if unverified:
            _MAC_REJECT.inc(unverified)
            log.warning("worker %s reported %d block(s) whose id does not verify for it and their size (not "
                        "allocated by a master with this block key: forged, another worker's, resized, or written "
                        "before the key was set): not published", request.worker_id, unverified)
        if bad_seal:
            _SEAL_REJECT.inc(bad_seal)
            log.warning("worker %s reported %d block(s) whose seal does not verify over the reported size and CRC32C "
                        "(altered on the worker, or sealed by a master with another key): not published",
                        request.worker_id, bad_seal)
        if unsealed:
            _UNSEALED.inc(unsealed)
            log.info("worker %s reported %d unsealed block(s) (committed just before a master restart, or from before "
                     "seals): not published, deleted", request.worker_id, unsealed)
        if foreign:
            log.warning("worker %s reported %d block(s) of other shards (this master is shard %d/%d): is its "
                        "master list the cluster's?", request.worker_id, foreign, self.shard, self.shards)
        return pb.RegisterResponse(delete_blocks=reject, protocol_version=self.protocol_version, data_key=data_key)

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:  # noqa: N802
        self._check_owner(context, request.worker_id)
        with self.lock:
            w = self.workers.get(request.worker_id)
            if w is None or not w.alive:
                return pb.HeartbeatResponse(reregister=True)
            w.last_seen = time.monotonic()
            w.capacity, w.used, w.blocks = request.capacity, request.used, request.blocks
            w.pending = 0  # the worker's own figure now includes what landed
            if request.interval > 0:
                w.interval = min(request.interval, self.heartbeat_timeout / 2)
        return pb.HeartbeatResponse(reregister=False)

    @_rpc
    def RemoveBlocks(self, request: pb.BlocksRemoved, context: Any) -> pb.Empty:  # noqa: N802
        self._check_owner(context, request.worker_id)
        with self.lock:
            for bid in request.block_ids:
                path = self.blocks.get(bid)
                if path is not None and self.files[path].worker_id == request.worker_id:
                    self._drop_file(path)
                    DROPPED.labels(request.reason or "removed").inc()
        return pb.Empty()

    @_rpc
    def MoveBlocks(self, request: pb.BlocksMoved, context: Any) -> pb.Empty:  # noqa: N802
        if len(request.block_ids) != len(request.local_paths):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and local_paths differ in length")
        self._check_owner(context, request.worker_id)
        with self.lock:
            for bid, lp in zip(request.block_ids, request.local_paths, strict=True):
                path = self.blocks.get(bid)
                if path is not None and self.files[path].worker_id == request.worker_id:
                    self.files[path].local_path = lp
        return pb.Empty()

    # ---------- client-facing ----------

    @_rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:  # noqa: N802
        self.creds.check_write(context, [(request.path, request.if_absent)])
        return self._allocate(request)

    @_rpc
    def AllocateMany(self, request: pb.AllocateManyRequest, context: Any) -> pb.AllocateManyResponse:  # noqa: N802
        """Allocate for a whole put batch under one lock hold; a failed item gets its error, the rest go on."""
        # a batch with one path outside the caller's scope is refused whole
        self.creds.check_write(context, [(r.path, r.if_absent) for r in request.items])
        with self.lock:
            items = each(list(request.items), self._allocate, lambda err: pb.AllocateResponse(error=err))
        return pb.AllocateManyResponse(items=items)

    def _allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        path = norm_path(request.path)
        self._own(path)
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot write to '/'")
        if request.size > self.max_file_size:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"file of {request.size} bytes exceeds the max file size {self.max_file_size}", "EFBIG")
        with self.lock:
            if request.if_absent and path in self.files:
                return pb.AllocateResponse(exists=True)
            if path in self.children:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a directory", "EISDIR")
            cur = self.files.get(path)
            self._check_quota([(path if cur is not None else None, None, cur.size if cur else 0),
                               (None, path, request.size)])
            w = self._place(request.size, request.node_id, set(request.exclude_workers))
            w.pending += request.size  # until the next heartbeat: spreads concurrent writers
            # the exact size asked for: the client writes (and the worker seals) exactly that many bytes
            bid = self.block_key.mint(w.worker_id, request.size) if self.block_key else uuid.uuid4().hex
            self._remember(self.allocations, bid, (w.worker_id, time.monotonic() + self.allocation_ttl))
            charged = self._quotas_of(path) if self.quotas else []
            if charged:
                self._alloc_charge[bid] = (path, request.size)
                for q in charged:
                    self.quota_inflight[q] += request.size
            return pb.AllocateResponse(block_id=bid, worker=pb.Location(
                worker_id=w.worker_id, node_id=w.node_id, address=w.address, data_address=w.data_address,
                domain_socket=w.domain_socket, capability=self._cap(w, capability.WRITE, bid, path)))

    def _place(self, size: int, node_id: str, exclude: set[str]) -> WorkerEntry:
        """Local-first if the local worker has free room, else the most free; eviction makes room last."""
        alive = [w for w in self.workers.values()
                 if w.alive and w.capacity >= size and w.worker_id not in exclude]
        if not alive:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no live worker can hold {size} bytes", "ENOSPC")
        local = [w for w in alive if node_id and w.node_id == node_id]
        for w in local:
            if w.free >= size:
                return w
        roomy = [w for w in alive if w.free >= size]
        if roomy:
            return max(roomy, key=lambda w: w.free)
        if local:
            return local[0]
        return max(alive, key=lambda w: w.free)

    @_rpc
    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:  # noqa: N802
        self.creds.check_write(context, [(request.path, request.if_absent)])
        orphans: list[tuple[str, str]] = []
        sealed: list[tuple[str, str]] = []
        try:
            return self._commit(request, orphans, sealed, self.creds.caller(context))
        finally:
            self._deliver_now(sealed)
            self._delete_orphans(orphans)

    @_rpc
    def CommitMany(self, request: pb.CommitManyRequest, context: Any) -> pb.CommitManyResponse:  # noqa: N802
        """Publish a whole put batch under one lock hold; each item is its own atomic, put-if-absent commit."""
        self.creds.check_write(context, [(r.path, r.if_absent) for r in request.items])
        orphans: list[tuple[str, str]] = []
        sealed: list[tuple[str, str]] = []
        with self.lock:
            cred = self.creds.caller(context)
            items = each(list(request.items), lambda r: self._commit(r, orphans, sealed, cred),
                         lambda err: pb.CommitResponse(error=err))
        self._deliver_now(sealed)
        self._delete_orphans(orphans)
        return pb.CommitManyResponse(items=items)

    def _delete_orphans(self, orphans: list[tuple[str, str]]) -> None:
        """Blocks that lost a put-if-absent race or were replaced: pending deletes (so a re-report never
        publishes them again), pushed in the background."""
        if not orphans:
            return
        try:
            self._record([(wid, bid, None) for wid, bid in orphans])
        except RpcError:  # the commit itself is done; the orphan is only kept until its worker re-registers
            return
        self._push_wake.set()

    def _commit(self, request: pb.CommitRequest, orphans: list[tuple[str, str]],
                sealed: list[tuple[str, str]], cred: Credential | None = None) -> pb.CommitResponse:
        path = norm_path(request.path)
        self._own(path)
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot write to '/'")
        check_block_id(request.block_id)
        orphan: tuple[str, str] | None = None
        with self.lock:
            w = self.workers.get(request.worker_id)
            if w is None or not w.alive:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"worker {request.worker_id!r} is not alive")
            # the client names the worker and the size: believed only when the id is their MAC
            if self.block_key is not None and not self.block_key.verify(request.block_id, request.worker_id,
                                                                        request.size):
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"block {request.block_id} was not allocated on worker {request.worker_id!r} for "
                               f"{request.size} bytes (its id's MAC does not verify): not published", "EACCES")
            cur = self.files.get(path)
            if cur is not None and cur.block_id == request.block_id:
                return pb.CommitResponse(published=True)  # a retried commit of our own block
            if request.block_id in self.abandoned:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"block {request.block_id} was abandoned before its commit (allocation older than "
                               f"{self.allocation_ttl:.0f} s, or its worker restarted): write it again")
            self.allocations.pop(request.block_id, None)
            self._uncharge_allocation(request.block_id)
            if cur is not None and request.if_absent:
                orphan = (request.worker_id, request.block_id)  # lost the race: drop our copy
                published = False
            elif cur is not None and cred is not None and not cred.may_replace(cur.writer):
                self._abandon(request.block_id)
                orphans.append((request.worker_id, request.block_id))
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"token {cred.name!r} may not overwrite {path}: another credential wrote it", "EACCES")
            else:
                try:  # authoritative: concurrent allocations each fitted alone
                    self._check_quota([(path if cur is not None else None, None, cur.size if cur else 0),
                                       (None, path, request.size)])
                except RpcError:
                    self._abandon(request.block_id)
                    orphans.append((request.worker_id, request.block_id))
                    raise
                if cur is not None:
                    self._drop_file(path)
                    orphan = (cur.worker_id, cur.block_id)
                self._add_file(path, FileEntry(request.block_id, w.worker_id, request.size, request.crc32c,
                                               time.time(), request.order_hint, request.local_path,
                                               cred.name if cred is not None else ""))
                self._seal(w.worker_id, request.block_id, request.size, request.crc32c, path, sealed)
                published = True
        (_PUBLISHED if published else _EXISTED).inc()
        if orphan is not None:
            orphans.append(orphan)
        return pb.CommitResponse(published=published)

    @_rpc
    def Stat(self, request: pb.PathRequest, context: Any) -> pb.FileStat:  # noqa: N802
        path = norm_path(request.path)
        with self.lock:
            self._own_or_dir(path)
            st = self._stat(path)
        (LOOKUP_HITS if st.exists else LOOKUP_MISSES).inc()
        return st

    @_rpc
    def StatMany(self, request: pb.PathsRequest, context: Any) -> pb.StatManyResponse:  # noqa: N802
        paths = [norm_path(p) for p in request.paths]
        with self.lock:
            for p in paths if self.shards > 1 else ():
                self._own_or_dir(p)
            stats = [self._stat(p) for p in paths]
        hits = sum(s.exists for s in stats)
        LOOKUP_HITS.inc(hits)
        LOOKUP_MISSES.inc(len(stats) - hits)
        return pb.StatManyResponse(stats=stats)

    @_rpc
    def PrefixLookup(self, request: pb.PathsRequest, context: Any) -> pb.PrefixLookupResponse:  # noqa: N802
        paths = [norm_path(p) for p in request.paths]
        for p in paths if self.shards > 1 else ():
            self._own(p)
        n = 0
        with self.lock:
            for p in paths:
                if p not in self.files:
                    break
                n += 1
        LOOKUP_HITS.inc(n)
        if n < len(paths):
            LOOKUP_MISSES.inc()
        return pb.PrefixLookupResponse(count=n)

    @_rpc
    def List(self, request: pb.PathRequest, context: Any) -> pb.ListResponse:  # noqa: N802
        path = norm_path(request.path)
        with self.lock:
            if path in self.files:
                return pb.ListResponse(entries=[self._stat(path, caps=False)])
            kids = self.children.get(path)
            if kids is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{path}: no such file or directory")
            base = "" if path == "/" else path
            entries = [self._stat(f"{base}/{name}", caps=False) for name in sorted(kids)]
        return pb.ListResponse(entries=entries)

    @_rpc
    def Mkdir(self, request: pb.MkdirRequest, context: Any) -> pb.Empty:  # noqa: N802
        path = norm_path(request.path)
        self.creds.check_write(context, [(path, True)], mkdir=True)
        with self.lock:
            if path in self.files:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{path} exists and is a file")
            if path in self.children:
                if not request.exist_ok:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{path} already exists")
                return pb.Empty()
            if not request.parents and parent_of(path) not in self.children:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"parent of {path} does not exist")
            self._ensure_dirs(path)
        return pb.Empty()

    @_rpc
    def Rmdir(self, request: pb.PathRequest, context: Any) -> pb.Empty:  # noqa: N802
        path = norm_path(request.path)
        with self.lock:
            self._rmdir(path)
        return pb.Empty()

    def _rmdir(self, path: str) -> None:
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot remove '/'")
        kids = self.children.get(path)
        if kids is None:
            if path in self.files:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a file, not a directory", "ENOTDIR")
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"{path}: no such directory")
        if kids:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path}: directory not empty", "ENOTEMPTY")
        del self.children[path]
        self.children[parent_of(path)].discard(path.rsplit("/", 1)[1])

    @_rpc
    def Delete(self, request: pb.PathRequest, context: Any) -> pb.DeleteResponse:  # noqa: N802
        path = norm_path(request.path)
        cred = self.creds.caller(context)
        with self.lock:
            if path in self.children:
                self._may_replace(cred, path, "")
                self._rmdir(path)
                return pb.DeleteResponse(removed=True)
            self._own(path)
            e = self.files.get(path)
            if e is None:
                return pb.DeleteResponse(removed=False)
            self._may_replace(cred, path, e.writer)
            self._record([(e.worker_id, e.block_id, None)])  # durable before the namespace changes
            self._drop_file(path)
        self._push(e.worker_id)  # one attempt now; the pusher retries until the worker confirms
        return pb.DeleteResponse(removed=True)

    @staticmethod
    def _may_replace(cred: Credential | None, path: str, writer: str) -> None:
        if cred is not None and not cred.may_replace(writer):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"token {cred.name!r} may not delete or rename {path}: not a file it wrote", "EACCES")

    @_rpc
    def Rename(self, request: pb.RenameRequest, context: Any) -> pb.Empty:  # noqa: N802
        src, dst = norm_path(request.src), norm_path(request.dst)
        if src == "/" or dst == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot rename '/'")
        if src == dst:
            with self.lock:
                if src not in self.files and src not in self.children:
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"{src}: no such file or directory")
            return pb.Empty()
        if dst.startswith(src + "/"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot move {src} inside itself", "EINVAL")
        if self.shards > 1:  # a rename may not move a file to another shard's master (copy + delete instead)
            with self.lock:
                if src in self.children:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"cannot rename directory {src} in a sharded l2fs: its files would change "
                                   f"shards (copy and delete them instead)", "EXDEV")
            self._own(src)
            if not self._owns(dst):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"cannot rename {src} to {dst}: they belong to different l2fs shards "
                               f"(copy and delete instead)", "EXDEV")
        changes: list[tuple[str, str, str | None]] = []  # (worker, block, new path | None = deleted)
        cred = self.creds.caller(context)
        with self.lock:
            if cred is not None and "admin" not in cred.roles:  # a mount: its own file, to a free path of its own
                self._may_replace(cred, src, self.files[src].writer if src in self.files else "")
                if dst in self.files or dst in self.children or not cred.may_write(dst, True):
                    raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"token {cred.name!r} may not rename onto {dst}", "EACCES")
            if src in self.files:
                if dst in self.children:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst} is a directory", "EISDIR")
                if dst in self.files and not request.overwrite:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{dst} already exists")
                self._ensure_dirs(parent_of(dst))
                e, old = self.files[src], self.files.get(dst)
                self._check_quota([(src, dst, e.size)] + ([(dst, None, old.size)] if old is not None else []))
                if old is not None:
                    changes.append((old.worker_id, old.block_id, None))
                changes.append((e.worker_id, e.block_id, dst))
                self._record(changes)  # durable before the namespace changes
                self._drop_file(dst)
                self._drop_file(src)
                self._add_file(dst, e)
            elif src in self.children:
                if dst in self.files:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst} is a file", "ENOTDIR")
                if dst in self.children:
                    if self.children[dst]:
                        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst}: directory not empty", "ENOTEMPTY")
                    if not request.overwrite:
                        raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{dst} already exists")
                    self._rmdir(dst)
                self._ensure_dirs(parent_of(dst))
                prefix = src + "/"
                subdirs = sorted(d for d in self.children if d == src or d.startswith(prefix))
                subfiles = [p for p in self.files if p.startswith(prefix)]
                self._check_quota([(p, dst + p[len(src):], self.files[p].size) for p in subfiles])
                changes = [(self.files[p].worker_id, self.files[p].block_id, dst + p[len(src):]) for p in subfiles]
                self._record(changes)
                entries = [(p, self._drop_file(p)) for p in subfiles]
                for d in reversed(subdirs):
                    kids = self.children.pop(d)
                    kids.clear()
                    self.children.get(parent_of(d), set()).discard(d.rsplit("/", 1)[1])
                for d in subdirs:
                    self._ensure_dirs(dst + d[len(src):])
                for p, moved in entries:
                    assert moved is not None
                    self._add_file(dst + p[len(src):], moved)
            else:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{src}: no such file or directory")
        for wid in dict.fromkeys(w for w, _, _ in changes):  # one attempt now; the pusher retries
            self._push(wid)
        return pb.Empty()

    @_rpc
    def Report(self, request: pb.Empty, context: Any) -> pb.ReportResponse:  # noqa: N802
        with self.lock:
            ws = [pb.WorkerStatus(worker_id=w.worker_id, node_id=w.node_id, address=w.address, alive=w.alive,
                                  capacity=w.capacity, used=w.used, blocks=w.blocks)
                  for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
            return pb.ReportResponse(workers=ws, files=len(self.files), duplicate_files=self.duplicates)

    def health(self) -> dict:
        with self.lock:
            alive = sum(w.alive for w in self.workers.values())
            return {"ok": True, "role": "master", "workers_alive": alive, "files": len(self.files),
                    "pending_namespace_ops": len(self.pending), "shard": f"{self.shard}/{self.shards}"}


def serve(host: str, port: int, service: MasterService, *, token: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, threads: int = 32) -> tuple[grpc.Server, int]:
    """Start the master gRPC server; returns it and the bound port. The service's credentials (a tokens
    file) take precedence over `token`."""
    creds = service.creds if service.creds.enabled else Credentials(token)
    server, bound, _ = grpc_server(host, port, lambda s: pbg.add_MasterServicer_to_server(service, s),
                                   name="l2fs-master", creds=creds, policy=MASTER_POLICY,
                                   tls_cert=tls_cert, tls_key=tls_key, threads=threads)
    server.start()
    return server, bound


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2fs master", description="Run the l2fs metadata master.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8995, help="gRPC port (0 = pick a free one)")
    p.add_argument("--port-file", help="write {'port':..., 'metrics_port':...} JSON here once bound")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP /metrics and /healthz port (0 = pick a free one; default: off)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat before a worker is dead (default 10)")
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE), help="e.g. 1G (default)")
    p.add_argument("--allocation-ttl", type=float, default=600.0,
                   help="seconds a put may take from Allocate to Commit; older uncommitted blocks are deleted "
                        "and never published (default 600)")
    p.add_argument("--journal", default=None,
                   help="SQLite file (on a volume) where deletes and renames wait until their worker confirms "
                        "them, so they survive a master restart; without it they wait in memory")
    p.add_argument("--prefix-quota", action="append", default=[], metavar="PREFIX=SIZE",
                   help="at most SIZE bytes of files under PREFIX (e.g. /kvtier/kv/a=10GiB; repeatable): writes "
                        "beyond it are refused (RESOURCE_EXHAUSTED, a failed put) instead of evicting others")
    p.add_argument("--token", default=None,
                   help="require this bearer token (also $L2FS_TOKEN). Alone it is one shared secret with admin + "
                        "worker rights for every holder (insecure between pods); with --tokens-file it is only "
                        "the token the master calls workers with")
    p.add_argument("--tokens-file", default=os.environ.get("L2FS_TOKENS_FILE"),
                   help="JSON list of {name, token, role: worker|engine|router|admin, prefixes}: scoped tokens "
                        "(also $L2FS_TOKENS_FILE); see docs/l2fs.md")
    p.add_argument("--worker-identity", choices=("tokens", "k8s"), default=os.environ.get("L2FS_WORKER_IDENTITY")
                   or "tokens", help="how workers prove who they are: worker-role entries of the tokens file "
                   "(default), or k8s: a projected ServiceAccount token checked with a TokenReview, bound to the "
                   "node the review names (l2fs/identity.py; also $L2FS_WORKER_IDENTITY)")
    p.add_argument("--worker-sa", default=os.environ.get("L2FS_WORKER_SA") or "kvtier:l2fs-worker",
                   metavar="NAMESPACE:NAME", help="with --worker-identity k8s: the workers' ServiceAccount")
    p.add_argument("--worker-audience", default=os.environ.get("L2FS_WORKER_AUDIENCE") or "l2fs",
                   help="with --worker-identity k8s: the audience the workers' tokens must carry (default l2fs)")
    p.add_argument("--mount-sa", default=os.environ.get("L2FS_MOUNT_SA") or None, metavar="NAMESPACE:NAME",
                   help="the FUSE mounts' ServiceAccount (also $L2FS_MOUNT_SA): a mount pod's projected token "
                        "(--worker-audience), checked with a TokenReview, becomes the mount credential "
                        "mount@<node>, so a mount replaces or deletes only files written through its own node's "
                        "mount. Default: none (mounts use tokens-file entries)")
    p.add_argument("--mount-prefixes", default=os.environ.get("L2FS_MOUNT_PREFIXES") or MOUNT_PREFIXES,
                   metavar="P1,P2", help=f"with --mount-sa: the prefixes the mounts may write under (default "
                                         f"{MOUNT_PREFIXES}, what `kvtier tokens generate --mount` gives)")
    p.add_argument("--kubeconfig", default=None,
                   help="with --worker-identity k8s or --mount-sa: API server config (default $KUBECONFIG, else "
                        "in-cluster)")
    p.add_argument("--block-key-file", default=os.environ.get("L2FS_BLOCK_KEY_FILE") or None,
                   help="file of >= 32 random bytes shared by every master (also $L2FS_BLOCK_KEY_FILE): block ids "
                        "become a MAC over (worker id, size), and commits or worker reports of ids it does not "
                        "verify are not published. Without it: uuid4 ids, no check. Turning it on unpublishes "
                        "blocks written before (docs/l2fs.md)")
    p.add_argument("--capability-ttl", type=float, default=capability.DEFAULT_TTL, metavar="SECONDS",
                   help="with --block-key-file: seconds a block capability the master hands a client stays valid "
                        f"(workers allow their --capability-skew more; default {capability.DEFAULT_TTL:g})")
    p.add_argument("--shard", default="0/1", metavar="INDEX/COUNT",
                   help="this master's shard of a path-hash sharded namespace (e.g. 0/2; default 0/1 = the whole "
                        "namespace). Paths that hash to another shard are refused (FAILED_PRECONDITION)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca", help="CA to verify workers when the master calls them over TLS")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shard = parse_shard(args.shard)
    except ValueError as e:
        parser.error(f"--shard: {e}")
    quotas: dict[str, int] = {}
    for spec in args.prefix_quota:
        prefix, _, size = spec.rpartition("=")
        try:
            quotas[norm_path(prefix)] = parse_size(size.removesuffix("iB").removesuffix("B") if size else "")
        except (ValueError, PathError) as e:
            parser.error(f"--prefix-quota {spec!r}: expected PREFIX=SIZE like /kvtier/kv/a=10GiB ({e})")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = args.token or os.environ.get("L2FS_TOKEN") or None
    try:
        identity = None
        if args.worker_identity == "k8s" or args.mount_sa:
            from l2fs.identity import K8sIdentity

            prefixes = tuple(norm_path(p.strip()) for p in args.mount_prefixes.split(",") if p.strip())
            identity = K8sIdentity(args.worker_sa if args.worker_identity == "k8s" else None, args.worker_audience,
                                   args.kubeconfig, mount_sa=args.mount_sa, mount_prefixes=prefixes)
        creds = Credentials(token, args.tokens_file, identity)
    except (TokensFileError, ValueError, PathError) as e:
        print(f"l2fs master: {e}", file=sys.stderr)
        return 2
    if args.capability_ttl <= 0:
        parser.error("--capability-ttl must be > 0 seconds")
    try:
        block_key = BlockKey(load_block_key(args.block_key_file)) if args.block_key_file else None
    except BlockKeyError as e:
        print(f"l2fs master: {e}", file=sys.stderr)
        return 2
    try:
        service = MasterService(heartbeat_timeout=args.heartbeat_timeout,
                                max_file_size=parse_size(args.max_file_size), token=token, tls_ca=args.tls_ca,
                                allocation_ttl=args.allocation_ttl, journal=args.journal, prefix_quotas=quotas,
                                creds=creds, shard=shard, block_key=block_key,
                                capability_ttl=args.capability_ttl)
    except (JournalError, OSError, sqlite3.Error) as e:
        print(f"l2fs master: cannot open the journal: {e}", file=sys.stderr)
        return 2
    server, port = serve(args.host, args.port, service, token=token, tls_cert=args.tls_cert,
                         tls_key=args.tls_key)
    metrics_port = None
    if args.metrics_port is not None:
        metrics_port = start_metrics_server(args.host, args.metrics_port, service.health).server_address[1]
    write_port_file(args.port_file, port=port, metrics_port=metrics_port)
    print(f"l2fs master listening on {args.host}:{port}"
          + (f" (metrics on http://{args.host}:{metrics_port}/metrics)" if metrics_port else ""), flush=True)
    wait_for_stop_signal()
    service.close()
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
