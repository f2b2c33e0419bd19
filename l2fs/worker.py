"""l2fs worker: stores blocks as files on local data dirs, serves them over gRPC, evicts when full.

Each data dir holds `blocks/<id[:2]>/<id>` files, a `tmp/` folder for in-flight writes and a SQLite
manifest (block id, file path, size, crc32c, sealed, last access, order hint). The manifest is what
lets a restarted master rebuild its namespace: on (re)registration the worker re-reports every sealed
block. CRC32C is computed on write and verified on every read; a mismatch deletes the block and the
read is a miss.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import socket
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import grpc
from prometheus_client import Counter, Gauge, Histogram

from l2fs.common import (
    DEFAULT_MAX_FILE_SIZE,
    FRAME,
    GRPC_OPTIONS,
    RpcError,
    TokenInterceptor,
    auth_metadata,
    make_channel,
    norm_path,
    parse_size,
    rpc_handler,
    server_credentials,
    start_metrics_server,
    wait_for_stop_signal,
    write_port_file,
)
from l2fs.dataplane import DATA_IDLE_TIMEOUT, DATA_MAX_CONNS, DataServer
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

log = logging.getLogger("l2fs.worker")

RPC_LATENCY = Histogram("l2fs_worker_rpc_seconds", "Worker RPC latency", ["method"],
                        buckets=(.0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5))
READ_HITS = Counter("l2fs_worker_read_hits_total", "Block reads served (gRPC) or touched (short-circuit)")
READ_MISSES = Counter("l2fs_worker_read_misses_total", "Block reads of unknown or corrupt blocks")
BYTES_READ = Counter("l2fs_worker_bytes_read_total", "Bytes served over gRPC")
BYTES_WRITTEN = Counter("l2fs_worker_bytes_written_total", "Bytes sealed (gRPC and short-circuit)")
EVICTIONS = Counter("l2fs_worker_evictions_total", "Blocks evicted to stay under the watermark")
DEMOTIONS = Counter("l2fs_worker_demotions_total", "Blocks moved to a slower tier instead of evicted")
EVICTED_BYTES = Counter("l2fs_worker_evicted_bytes_total", "Bytes evicted")
RESERVE_REJECTS = Counter("l2fs_worker_reserve_rejects_total",
                          "Writes refused because too many bytes were promised to unfinished writes")
RESERVED_FRACTION = 0.25  # unsealed bytes a data dir admits, as a fraction of its capacity
RESERVATION_TTL = 30.0  # seconds an unadopted short-circuit reservation is held
CORRUPT = Counter("l2fs_worker_corrupt_blocks_total", "Blocks dropped after a checksum mismatch")
CAPACITY = Gauge("l2fs_worker_capacity_bytes", "Capacity over all data dirs")
USED = Gauge("l2fs_worker_used_bytes", "Used bytes over all data dirs (sealed + reserved)")
BLOCKS = Gauge("l2fs_worker_blocks", "Sealed blocks held")

BLOCK_ID = re.compile(r"^[0-9a-f]{32}$")


def _check_block_id(bid: str) -> str:
    if not BLOCK_ID.match(bid or ""):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block id {bid[:80]!r}")
    return bid


@dataclass(slots=True)
class Block:
    block_id: str
    dir_idx: int
    path: str
    size: int
    crc32c: int
    mtime: float
    last_access: float
    order_hint: int


TIERS = {"MEM": 0, "SSD": 1, "DISK": 1, "HDD": 2}


class DataDir:
    """One storage directory with a capacity, a tier rank (0 = fastest) and its own manifest."""

    def __init__(self, root: Path, capacity: int, tier: int = 1) -> None:
        self.root = root
        self.capacity = capacity
        self.tier = tier
        self.used = 0  # sealed + reserved bytes
        self.reserved = 0  # bytes promised to writes not yet sealed (part of `used`)
        (root / "blocks").mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(root / "manifest.sqlite3", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # Keep the WAL small (it sits outside the block capacity): checkpoint every 1 MiB, truncate to 1 MiB.
        self.db.execute("PRAGMA wal_autocheckpoint=256")
        self.db.execute("PRAGMA journal_size_limit=1048576")
        self.db.execute("""CREATE TABLE IF NOT EXISTS blocks (
            block_id TEXT PRIMARY KEY, path TEXT NOT NULL, size INTEGER NOT NULL, crc32c INTEGER NOT NULL,
            sealed INTEGER NOT NULL, mtime REAL NOT NULL, last_access REAL NOT NULL,
            order_hint INTEGER NOT NULL)""")

    def block_file(self, bid: str) -> Path:
        return self.root / "blocks" / bid[:2] / bid

    def tmp_file(self, bid: str) -> Path:
        return self.root / "tmp" / f"{bid}.part"


class VerifiedFrames:
    """A block file read FRAME by FRAME (at least one frame, possibly empty), checksummed on the way, so a
    reader never holds the whole block. After the last frame, `ok` says whether size and CRC32C matched the
    manifest and nothing followed; a read error ends the frames early (not ok)."""

    def __init__(self, block: Block, f: Any) -> None:
        self.block, self.f, self.ok = block, f, False

    def __iter__(self) -> Iterator[bytes]:
        size, off, crc = self.block.size, 0, 0
        try:
            while True:
                data = self.f.read(min(FRAME, size - off))
                crc = crc32c.crc32c(data, value=crc)
                off += len(data)
                yield data
                if not data or off >= size:
                    break  # the end, or shorter than the manifest says
            self.ok = off == size and not self.f.read(1) and crc == self.block.crc32c
        except OSError:
            self.ok = False


class Store:
    """Blocks over all data dirs; one lock; eviction (LRU by read, deepest order hint first)."""

    def __init__(self, dirs: list[tuple[Path, int]] | list[tuple[Path, int, int]], *, high: float = 0.9,
                 low: float = 0.8, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 evict_granularity: float = 1.0, max_reserved: float = RESERVED_FRACTION,
                 reservation_ttl: float = RESERVATION_TTL) -> None:
        self.lock = threading.RLock()
        self.dirs = [DataDir(*d) for d in dirs]
        self.high, self.low = high, low
        self.max_file_size = max_file_size
        self.evict_granularity = evict_granularity
        self.max_reserved = max_reserved
        self.reservation_ttl = reservation_ttl
        self.blocks: dict[str, Block] = {}
        # bid -> (dir, size, since, expires): short-circuit reservations expire, streamed ones are
        # released by the thread that receives the bytes
        self.reservations: dict[str, tuple[int, int, float, bool]] = {}
        self.removed: list[tuple[str, str]] = []  # (block_id, reason) not yet reported to the master
        self.moved: list[tuple[str, str]] = []  # (block_id, new local path) not yet reported
        self._dirty_access: set[str] = set()
        self._load()

    def _load(self) -> None:
        """Rebuild from the manifests; drop rows whose file is gone and files with no row."""
        for i, d in enumerate(self.dirs):
            for f in (d.root / "tmp").iterdir():
                f.unlink(missing_ok=True)
            rows = d.db.execute("SELECT block_id, path, size, crc32c, sealed, mtime, last_access, order_hint"
                                " FROM blocks").fetchall()
            known = set()
            for bid, path, size, crc, sealed, mtime, la, oh in rows:
                f = d.block_file(bid)
                if not sealed or not f.exists() or f.stat().st_size != size or bid in self.blocks:
                    # unsealed, missing, damaged, or a second copy left by a demotion cut short
                    d.db.execute("DELETE FROM blocks WHERE block_id=?", (bid,))
                    f.unlink(missing_ok=True)
                    continue
                self.blocks[bid] = Block(bid, i, path, size, crc, mtime, la, oh)
                d.used += size
                known.add(bid)
            for sub in (d.root / "blocks").iterdir():
                for f in sub.iterdir():
                    if f.name not in known:
                        f.unlink(missing_ok=True)
        self._gauges()

    def _gauges(self) -> None:
        CAPACITY.set(sum(d.capacity for d in self.dirs))
        USED.set(sum(d.used for d in self.dirs))
        BLOCKS.set(len(self.blocks))

    @property
    def capacity(self) -> int:
        return sum(d.capacity for d in self.dirs)

    @property
    def used(self) -> int:
        return sum(d.used for d in self.dirs)

    def local_path(self, b: Block) -> str:
        return str(self.dirs[b.dir_idx].block_file(b.block_id))

    # ---------- space ----------

    def reserve(self, bid: str, size: int, *, expires: bool = False) -> int:
        """Pick a dir and promise `size` bytes to a write; returns the dir index.

        Why no eviction here: a promise is not data, and evicting for it let any client flush the cache
        with empty reservations. Live blocks are evicted when bytes are sealed (`seal`); here only when the
        dir would otherwise go past its capacity (a single reservation larger than the headroom above the
        high watermark). Unsealed bytes per dir are capped at `max_reserved` x capacity (one reservation is
        always admitted, so a single large write works): beyond it RESOURCE_EXHAUSTED, a write miss."""
        if size < 0 or size > self.max_file_size:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"block of {size} bytes exceeds the max file size {self.max_file_size}")
        with self.lock:
            if bid in self.blocks or bid in self.reservations:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"block {bid} already exists")
            fits = [i for i, d in enumerate(self.dirs) if d.capacity * self.low >= size]
            if not fits:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"block of {size} bytes is larger than {self.low:.0%} of every data dir")
            free = [j for j in fits if self.dirs[j].reserved == 0
                    or self.dirs[j].reserved + size <= self.dirs[j].capacity * self.max_reserved]
            if not free:
                RESERVE_REJECTS.inc()
                pending = sum(self.dirs[j].reserved for j in fits)
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many bytes promised to unfinished writes ({pending} reserved; each data dir "
                               f"admits {self.max_reserved:.0%} of its capacity): retry after they complete")
            # new data goes to the fastest tier; its coldest blocks move down (or out) when it is sealed
            fastest = min(self.dirs[j].tier for j in free)
            i = max((j for j in free if self.dirs[j].tier == fastest),
                    key=lambda j: self.dirs[j].capacity - self.dirs[j].used)
            d = self.dirs[i]
            if d.used + size > d.capacity:  # the bytes would not fit at all: make room now
                self._evict(i, d.capacity - size)
            d.used += size
            d.reserved += size
            self.reservations[bid] = (i, size, time.monotonic(), expires)
            self._gauges()
            return i

    def release(self, bid: str) -> None:
        """Give back a reservation of a write that did not complete."""
        with self.lock:
            r = self.reservations.pop(bid, None)
            if r is not None:
                self.dirs[r[0]].used -= r[1]
                self.dirs[r[0]].reserved -= r[1]
                self.dirs[r[0]].tmp_file(bid).unlink(missing_ok=True)
                self._gauges()

    def _evict(self, i: int, target: float, keep: str | None = None) -> None:
        """Free dir i down to `target` used bytes (sealed + reserved): coldest read first, deepest chain position first. A victim
        moves to a slower tier when there is one (which makes room the same way), else it is deleted."""
        d = self.dirs[i]
        g = self.evict_granularity
        victims = sorted((b for b in self.blocks.values() if b.dir_idx == i and b.block_id != keep),
                         key=lambda b: (int(b.last_access / g), -b.order_hint, b.last_access))
        for b in victims:
            if d.used <= target:
                break
            slower = [j for j, dj in enumerate(self.dirs) if dj.tier > d.tier and dj.capacity * self.low >= b.size]
            if slower:
                j = min(slower, key=lambda j: (self.dirs[j].tier, self.dirs[j].used - self.dirs[j].capacity))
                dj = self.dirs[j]
                if dj.used - dj.reserved + b.size > dj.capacity * self.high:
                    self._evict(j, dj.capacity * self.low - b.size + dj.reserved)
                if self._move(b, j):
                    continue
            self._delete(b.block_id, "evicted")
            EVICTIONS.inc()
            EVICTED_BYTES.inc(b.size)

    def _move(self, b: Block, j: int) -> bool:
        """Demote block b into dir j (copy, then switch manifests); False if the copy failed."""
        src_dir, dst_dir = self.dirs[b.dir_idx], self.dirs[j]
        src, dst, tmp = src_dir.block_file(b.block_id), dst_dir.block_file(b.block_id), dst_dir.tmp_file(b.block_id)
        try:
            dst.parent.mkdir(exist_ok=True)
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        except OSError as e:
            log.warning("demoting block %s to %s failed: %s", b.block_id, dst_dir.root, e)
            tmp.unlink(missing_ok=True)
            return False
        dst_dir.db.execute("INSERT OR REPLACE INTO blocks VALUES (?,?,?,?,1,?,?,?)",
                           (b.block_id, b.path, b.size, b.crc32c, b.mtime, b.last_access, b.order_hint))
        src_dir.db.execute("DELETE FROM blocks WHERE block_id=?", (b.block_id,))
        src.unlink(missing_ok=True)
        src_dir.used -= b.size
        dst_dir.used += b.size
        b.dir_idx = j
        self.moved.append((b.block_id, str(dst)))
        DEMOTIONS.inc()
        self._gauges()
        return True

    def _over_high(self, i: int, keep: str | None = None) -> None:
        """Sealed bytes of dir i above the high watermark: evict them down to the low one (promised bytes
        do not count, so pending reservations never push live blocks out)."""
        d = self.dirs[i]
        if d.used - d.reserved > d.capacity * self.high:
            self._evict(i, d.capacity * self.low + d.reserved, keep)

    def maybe_evict(self) -> None:
        """Background check: bring any dir above the high watermark down to the low one, and drop
        short-circuit reservations whose writer went away."""
        with self.lock:
            for i in range(len(self.dirs)):
                self._over_high(i)
            now = time.monotonic()
            for bid, (_, _, since, expires) in list(self.reservations.items()):
                if expires and now - since > self.reservation_ttl:
                    self.release(bid)

    # ---------- blocks ----------

    def seal(self, bid: str, path: str, size: int, crc: int, order_hint: int, src: Path) -> Block:
        """Move a fully written temp file into place and record it in the manifest."""
        with self.lock:
            r = self.reservations.pop(bid, None)
            if r is None:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid} has no reservation")
            i, reserved = r[0], r[1]
            d = self.dirs[i]
            dst = d.block_file(bid)
            dst.parent.mkdir(exist_ok=True)
            os.replace(src, dst)
            d.used += size - reserved
            d.reserved -= reserved
            now = time.time()
            b = Block(bid, i, path, size, crc, now, now, order_hint)
            self.blocks[bid] = b
            d.db.execute("INSERT OR REPLACE INTO blocks VALUES (?,?,?,?,1,?,?,?)",
                         (bid, path, size, crc, now, now, order_hint))
            self._over_high(i, keep=bid)  # the bytes are here now: make room for them (never by dropping them)
            self._gauges()
        BYTES_WRITTEN.inc(size)
        return b

    def _delete(self, bid: str, reason: str) -> bool:
        with self.lock:
            b = self.blocks.pop(bid, None)
            if b is None:
                return False
            d = self.dirs[b.dir_idx]
            d.block_file(bid).unlink(missing_ok=True)
            d.used -= b.size
            d.db.execute("DELETE FROM blocks WHERE block_id=?", (bid,))
            self._dirty_access.discard(bid)
            if reason != "deleted":
                self.removed.append((bid, reason))
            self._gauges()
            return True

    def delete(self, bid: str, reason: str = "deleted") -> bool:
        return self._delete(bid, reason)

    def touch(self, bid: str) -> None:
        with self.lock:
            b = self.blocks.get(bid)
            if b is not None:
                b.last_access = time.time()
                self._dirty_access.add(bid)

    def set_path(self, bid: str, path: str) -> None:
        with self.lock:
            b = self.blocks.get(bid)
            if b is not None:
                b.path = path
                self.dirs[b.dir_idx].db.execute("UPDATE blocks SET path=? WHERE block_id=?", (path, bid))

    def flush_access(self) -> None:
        """Persist read times in batches (a read must not cost a SQLite write)."""
        with self.lock:
            for bid in self._dirty_access:
                b = self.blocks.get(bid)
                if b is not None:
                    self.dirs[b.dir_idx].db.execute("UPDATE blocks SET last_access=? WHERE block_id=?",
                                                    (b.last_access, bid))
            self._dirty_access.clear()

    def file_of(self, bid: str) -> tuple[Block, Path] | None:
        """The block and its current file (it can move to a slower tier at any time)."""
        with self.lock:
            b = self.blocks.get(bid)
            return (b, self.dirs[b.dir_idx].block_file(bid)) if b is not None else None

    def drop_damaged(self, bid: str, path: Path) -> bool:
        """Drop a block found damaged at `path`; False if it has moved meanwhile (the caller retries)."""
        with self.lock:
            b = self.blocks.get(bid)
            if b is None:
                return True
            if self.dirs[b.dir_idx].block_file(bid) != path:
                return False
            log.warning("block %s (%s) failed verification: dropping it", bid, b.path)
            CORRUPT.inc()
            self._delete(bid, "corrupt")
            return True

    def open_block(self, bid: str) -> tuple[Block, Path, Any] | None:
        """The block and its current file, opened; None when it is unknown, or gone behind our back (then
        dropped). It can move to a slower tier between lookup and open: look again."""
        for _ in range(3):
            found = self.file_of(bid)
            if found is None:
                return None
            try:
                return found[0], found[1], open(found[1], "rb", buffering=0)  # noqa: SIM115 - caller closes
            except OSError:
                if self.drop_damaged(bid, found[1]):
                    return None
        return None

    def verify(self, bid: str) -> bool:
        """Re-check a block's checksum, one frame in memory at a time; drops it when bad."""
        for _ in range(3):
            opened = self.open_block(bid)
            if opened is None:
                return False
            b, path, f = opened
            with f:
                frames = VerifiedFrames(b, f)
                for _ in frames:
                    pass
            if frames.ok:
                self.touch(bid)
                return True
            if self.drop_damaged(bid, path):
                return False
        return False

    def reports(self) -> list[pb.BlockReport]:
        with self.lock:
            return [pb.BlockReport(block_id=b.block_id, path=b.path, size=b.size, crc32c=b.crc32c,
                                   mtime=b.mtime, order_hint=b.order_hint, local_path=self.local_path(b))
                    for b in self.blocks.values()]


_rpc = rpc_handler(RPC_LATENCY)


class WorkerService(pbg.WorkerServicer):
    def __init__(self, store: Store, on_removed: Callable[[], None]) -> None:
        self.store = store
        self._on_removed = on_removed

    @_rpc
    def WriteBlock(self, request_iterator: Iterator[pb.WriteChunk], context: Any) -> pb.WriteResult:  # noqa: N802
        it = iter(request_iterator)
        first = next(it, None)
        if first is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "empty write stream")
        bid = _check_block_id(first.block_id)
        path = norm_path(first.path)
        size = first.size
        i = self.store.reserve(bid, size)
        tmp = self.store.dirs[i].tmp_file(bid)
        ok = False
        try:
            crc, n = 0, 0
            with open(tmp, "wb", buffering=0) as f:
                msg: pb.WriteChunk | None = first
                while msg is not None:
                    data = msg.data
                    if data:
                        n += len(data)
                        if n > size:
                            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"stream carries more than the declared {size} bytes")
                        f.write(data)
                        crc = crc32c.crc32c(data, value=crc)
                    msg = next(it, None)
            if n != size:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"stream ended after {n} of {size} bytes")
            b = self.store.seal(bid, path, size, crc, first.order_hint, tmp)
            ok = True
        finally:
            if not ok:
                self.store.release(bid)
            self._on_removed()
        return pb.WriteResult(block_id=bid, size=size, crc32c=crc, local_path=self.store.local_path(b))

    def ReadBlock(self, request: pb.ReadRequest, context: Any) -> Iterator[pb.ReadChunk]:  # noqa: N802
        t0 = time.perf_counter()
        try:
            bid = _check_block_id(request.block_id)
        except RpcError as e:
            context.abort(e.code, str(e))
        # Stream frame by frame (memory per read = one frame, not the whole block), checksumming as we go; a
        # mismatch found at the end aborts the stream (the client discards what it got) and drops the block.
        opened = self.store.open_block(bid)
        if opened is None:
            READ_MISSES.inc()
            self._on_removed()
            context.abort(grpc.StatusCode.NOT_FOUND, f"block {bid} not found (missing or failed checksum)")
        b, path, f = opened
        with f:
            frames = VerifiedFrames(b, f)
            for i, data in enumerate(frames):
                yield pb.ReadChunk(size=b.size, crc32c=b.crc32c, data=data) if i == 0 else pb.ReadChunk(data=data)
        if not frames.ok:
            READ_MISSES.inc()
            self.store.drop_damaged(bid, path)
            self._on_removed()
            context.abort(grpc.StatusCode.DATA_LOSS, f"block {bid} failed verification while streaming")
        self.store.touch(bid)
        READ_HITS.inc()
        BYTES_READ.inc(b.size)
        RPC_LATENCY.labels("ReadBlock").observe(time.perf_counter() - t0)

    @_rpc
    def ReserveLocal(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:  # noqa: N802
        bid = _check_block_id(request.block_id)
        i = self.store.reserve(bid, request.size, expires=True)
        self._on_removed()
        return pb.ReserveResponse(tmp_path=str(self.store.dirs[i].tmp_file(bid)))

    @_rpc
    def AdoptLocal(self, request: pb.AdoptRequest, context: Any) -> pb.WriteResult:  # noqa: N802
        bid = _check_block_id(request.block_id)
        path = norm_path(request.path)
        with self.store.lock:
            r = self.store.reservations.get(bid)
        if r is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid} was not reserved")
        tmp = self.store.dirs[r[0]].tmp_file(bid)
        try:
            actual = tmp.stat().st_size
        except OSError:
            actual = -1
        if actual != request.size:
            self.store.release(bid)
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"local block file has {actual} bytes, expected {request.size}")
        b = self.store.seal(bid, path, request.size, request.crc32c, request.order_hint, tmp)
        self._on_removed()  # sealing may have evicted: tell the master now
        return pb.WriteResult(block_id=bid, size=b.size, crc32c=b.crc32c, local_path=self.store.local_path(b))

    @_rpc
    def Touch(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        for bid in request.block_ids:
            self.store.touch(bid)
            READ_HITS.inc()
        return pb.Empty()

    @_rpc
    def ReportCorrupt(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        for bid in request.block_ids:
            _check_block_id(bid)
            self.store.verify(bid)  # re-checked here: a client alone cannot get data deleted
        self._on_removed()
        return pb.Empty()

    @_rpc
    def DeleteBlocks(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        for bid in request.block_ids:
            self.store.delete(_check_block_id(bid))
        return pb.Empty()

    @_rpc
    def SetPaths(self, request: pb.SetPathsRequest, context: Any) -> pb.Empty:  # noqa: N802
        if len(request.block_ids) != len(request.paths):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and paths differ in length")
        for bid, path in zip(request.block_ids, request.paths, strict=True):
            self.store.set_path(_check_block_id(bid), norm_path(path))
        return pb.Empty()


class Worker:
    """Server + the heartbeat/registration loop that keeps the master's view current."""

    def __init__(self, store: Store, *, master: str, node_id: str, worker_id: str, host: str, port: int,
                 advertise: str | None, heartbeat_interval: float, token: str | None, tls_cert: str | None,
                 tls_key: str | None, tls_ca: str | None, threads: int = 32, data_port: int | None = 0,
                 data_max_conns: int = DATA_MAX_CONNS, data_idle_timeout: float = DATA_IDLE_TIMEOUT) -> None:
        self.store = store
        self.node_id, self.worker_id = node_id, worker_id
        self.heartbeat_interval = heartbeat_interval
        self._token = token
        self._wake = threading.Event()
        self._stop = threading.Event()
        interceptors = [TokenInterceptor(token)] if token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(threads, thread_name_prefix="l2fs-worker"),
                                  interceptors=interceptors, options=GRPC_OPTIONS)
        pbg.add_WorkerServicer_to_server(WorkerService(store, self._wake.set), self.server)
        creds = server_credentials(tls_cert, tls_key)
        addr = f"{host}:{port}"
        self.port = self.server.add_secure_port(addr, creds) if creds else self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"could not bind {addr}")
        if not advertise and host in ("0.0.0.0", "::", ""):
            advertise = f"{_host_ip()}:{self.port}"
        self.address = advertise or f"{host}:{self.port}"
        self.data: DataServer | None = None
        if data_port is not None and not creds:  # raw TCP is plaintext: TLS clusters use gRPC only
            self.data = DataServer(store, host, data_port, token, self._wake.set, max_conns=data_max_conns,
                                   idle_timeout=data_idle_timeout)
        adv_host = self.address.rpartition(":")[0]
        self.data_address = f"{adv_host}:{self.data.port}" if self.data else ""
        self.master = pbg.MasterStub(make_channel(master, tls_ca))
        self.registered = False

    def start(self) -> None:
        self.server.start()
        if self.data is not None:
            self.data.start()
        threading.Thread(target=self._loop, name="l2fs-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.data is not None:
            self.data.stop()
        self.server.stop(grace=1).wait()

    def _register(self) -> None:
        reports = self.store.reports()
        resp = self.master.RegisterWorker(pb.RegisterRequest(
            worker_id=self.worker_id, node_id=self.node_id, address=self.address,
            capacity=self.store.capacity, used=self.store.used, blocks=reports, data_address=self.data_address),
            timeout=30, metadata=auth_metadata(self._token))
        for bid in resp.delete_blocks:
            self.store.delete(bid)
        with self.store.lock:
            self.store.removed.clear()  # the full report supersedes pending removals and moves
            self.store.moved.clear()
        self.registered = True
        log.info("registered with master as %s (%d blocks reported)", self.worker_id, len(reports))

    def _report_removed(self) -> None:
        with self.store.lock:
            pending, self.store.removed = self.store.removed, []
        by_reason: dict[str, list[str]] = {}
        for bid, reason in pending:
            by_reason.setdefault(reason, []).append(bid)
        for reason, ids in by_reason.items():
            try:
                self.master.RemoveBlocks(pb.BlocksRemoved(worker_id=self.worker_id, block_ids=ids,
                                                          reason=reason),
                                         timeout=5, metadata=auth_metadata(self._token))
            except grpc.RpcError:
                with self.store.lock:
                    self.store.removed.extend((b, reason) for b in ids)
                raise

    def _report_moved(self) -> None:
        with self.store.lock:
            pending, self.store.moved = self.store.moved, []
        try:
            self.master.MoveBlocks(pb.BlocksMoved(worker_id=self.worker_id, block_ids=[b for b, _ in pending],
                                                  local_paths=[p for _, p in pending]),
                                   timeout=5, metadata=auth_metadata(self._token))
        except grpc.RpcError:
            with self.store.lock:
                self.store.moved[:0] = pending
            raise

    def _loop(self) -> None:
        """Heartbeat every interval; re-register when the master asks (it restarted or dropped us)."""
        next_hb = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                if self.store.removed:
                    self._report_removed()
                if self.store.moved:
                    self._report_moved()
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self.heartbeat_interval
                    self.store.maybe_evict()
                    self.store.flush_access()
                    resp = self.master.Heartbeat(pb.HeartbeatRequest(
                        worker_id=self.worker_id, capacity=self.store.capacity, used=self.store.used,
                        blocks=len(self.store.blocks), interval=self.heartbeat_interval),
                        timeout=5, metadata=auth_metadata(self._token))
                    if resp.reregister:
                        self.registered = False
                        continue
            except grpc.RpcError as e:
                log.warning("master unreachable (%s); retrying", e.code())
                self.registered = self.registered and e.code() != grpc.StatusCode.UNAVAILABLE
                self._stop.wait(min(1.0, self.heartbeat_interval))
                continue
            self._wake.wait(max(0.0, next_hb - time.monotonic()))
            self._wake.clear()


def _host_ip() -> str:
    """This node's address as others see it (for workers bound to 0.0.0.0 without --advertise)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def parse_data_dir(spec: str) -> tuple[Path, int, int]:
    """'[TIER]PATH[:CAPACITY]' -> (path, bytes, tier rank). TIER is MEM, SSD (default), DISK or HDD, as in
    Curvine; capacity defaults to the filesystem's free space."""
    tier = TIERS["SSD"]
    m = re.match(r"^\[([A-Za-z]+)\](.*)$", spec)
    if m:
        if m.group(1).upper() not in TIERS:
            raise ValueError(f"unknown tier [{m.group(1)}] in {spec!r} (use MEM, SSD, DISK or HDD)")
        tier, spec = TIERS[m.group(1).upper()], m.group(2)
    path, _, cap = spec.rpartition(":") if re.search(r":\d+(\.\d+)?[kmgtKMGT]?i?[bB]?$", spec) else (spec, "", "")
    p = Path(path).resolve()
    p.mkdir(parents=True, exist_ok=True)
    if cap:
        return p, parse_size(cap), tier
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize, tier


def _worker_id(first_dir: Path, node_id: str) -> str:
    """Stable across restarts: stored in the first data dir the first time."""
    f = first_dir / "worker_id"
    if f.exists():
        return f.read_text().strip()
    wid = f"{node_id}-{uuid.uuid4().hex[:8]}"
    f.write_text(wid)
    return wid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2fs worker", description="Run an l2fs block-storing worker.")
    p.add_argument("--master", default=os.environ.get("L2FS_MASTER"), help="master host:port ($L2FS_MASTER)")
    p.add_argument("--data-dir", action="append", required=True, metavar="[TIER]PATH[:CAPACITY]",
                   help="storage dir, repeatable; capacity like 10G or 512M (default: free space); optional "
                        "tier [MEM]/[SSD]/[HDD]: new blocks go to the fastest tier, cold ones move down")
    p.add_argument("--node-id", default=os.environ.get("L2FS_NODE_ID") or socket.gethostname())
    p.add_argument("--worker-id", default=None, help="default: stored in the first data dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8997, help="gRPC port (0 = pick a free one)")
    p.add_argument("--advertise", default=None, help="host:port the master gives clients (default host:port)")
    p.add_argument("--data-port", type=int, default=0,
                   help="raw-TCP data plane port (0 = pick a free one; -1 = off, gRPC streaming only)")
    p.add_argument("--port-file")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--high-watermark", type=float, default=0.9)
    p.add_argument("--low-watermark", type=float, default=0.8)
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE))
    p.add_argument("--max-reserved", type=float, default=RESERVED_FRACTION,
                   help="fraction of a data dir's capacity that unfinished writes may reserve; one write is "
                        "always admitted, more beyond it get RESOURCE_EXHAUSTED")
    p.add_argument("--reservation-ttl", type=float, default=RESERVATION_TTL,
                   help="seconds an unadopted short-circuit reservation is held")
    p.add_argument("--data-max-conns", type=int, default=DATA_MAX_CONNS,
                   help="concurrent data-plane connections; more are refused with a message")
    p.add_argument("--data-idle-timeout", type=float, default=DATA_IDLE_TIMEOUT,
                   help="seconds an idle data-plane connection is kept")
    p.add_argument("--token", default=None, help="require this bearer token (also $L2FS_TOKEN)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca", help="CA to verify the master's TLS certificate")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.master:
        print("l2fs worker: --master or $L2FS_MASTER is required", file=sys.stderr)
        return 2
    if not 0 < args.low_watermark <= args.high_watermark <= 1:
        print("l2fs worker: need 0 < low watermark <= high watermark <= 1", file=sys.stderr)
        return 2
    dirs = [parse_data_dir(s) for s in args.data_dir]
    token = args.token or os.environ.get("L2FS_TOKEN") or None
    if not 0 < args.max_reserved <= 1 or args.reservation_ttl <= 0:
        print("l2fs worker: need 0 < --max-reserved <= 1 and --reservation-ttl > 0", file=sys.stderr)
        return 2
    if args.data_max_conns < 1 or args.data_idle_timeout <= 0:
        print("l2fs worker: need --data-max-conns >= 1 and --data-idle-timeout > 0", file=sys.stderr)
        return 2
    store = Store(dirs, high=args.high_watermark, low=args.low_watermark,
                  max_file_size=parse_size(args.max_file_size), max_reserved=args.max_reserved,
                  reservation_ttl=args.reservation_ttl)
    worker = Worker(store, master=args.master, node_id=args.node_id,
                    worker_id=args.worker_id or _worker_id(dirs[0][0], args.node_id), host=args.host,
                    port=args.port, advertise=args.advertise, heartbeat_interval=args.heartbeat_interval,
                    token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                    data_port=None if args.data_port < 0 else args.data_port,
                    data_max_conns=args.data_max_conns, data_idle_timeout=args.data_idle_timeout)
    worker.start()
    metrics_port = None
    if args.metrics_port is not None:
        def health() -> dict:
            return {"ok": True, "ready": worker.registered, "role": "worker", "worker_id": worker.worker_id,
                    "node_id": worker.node_id, "registered": worker.registered, "capacity": store.capacity, "used": store.used,
                    "blocks": len(store.blocks)}
        metrics_port = start_metrics_server(args.host, args.metrics_port, health).server_address[1]
    write_port_file(args.port_file, port=worker.port, metrics_port=metrics_port, worker_id=worker.worker_id,
                    data_address=worker.data_address)
    print(f"l2fs worker {worker.worker_id} (node {args.node_id}) listening on {worker.address}, "
          f"(data plane {worker.data_address or 'off'}), {len(store.blocks)} blocks, {store.used}/{store.capacity} bytes used"
          + (f" (metrics on http://{args.host}:{metrics_port}/metrics)" if metrics_port else ""), flush=True)
    wait_for_stop_signal()
    worker.stop()
    store.flush_access()
    return 0


if __name__ == "__main__":
    sys.exit(main())
