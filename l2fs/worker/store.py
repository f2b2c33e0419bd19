"""l2fs block store: the worker's data dirs, their SQLite manifests, space accounting and eviction.

Each data dir holds `blocks/<id[:2]>/<id>` files, a `tmp/` folder for in-flight writes and a SQLite
manifest (block id, file path, size, crc32c, sealed, last access, order hint, and the seal MAC the master
delivered once the block was committed: "" until then, and for blocks from before manifest format 2). The manifest is what
lets a restarted master rebuild its namespace: on (re)registration the worker re-reports every sealed
block. CRC32C is computed on write and verified on read; a mismatch deletes the block and the read is a
miss. Both transports (gRPC, raw-TCP data plane) write through `Store.receive` and open blocks through
`Store.open_block`, so the write and damage rules live here once.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import mmap
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import crc32c
import grpc
from prometheus_client import Counter, Gauge

from l2fs.common import DEFAULT_MAX_FILE_SIZE, FRAME, RpcError, pwrite_all
from l2fs.proto import l2fs_pb2 as pb

log = logging.getLogger("l2fs.worker")

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
    seal: str = ""  # the master's seal MAC over (worker, id, size, crc32c, path) once committed ("" = not yet)


TIERS = {"MEM": 0, "SSD": 1, "DISK": 1, "HDD": 2}


def private_dir(root: Path) -> None:
    """Make `root` (a data dir) 0700, also when it was made world-readable before: the manifest lists every
    path (salt directories included) and the blocks are the cache's bytes; same-node clients of other uids
    get block fds over the worker's socket, never the dir."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(root.stat().st_mode) != 0o700:
        os.chmod(root, 0o700)


def private_file(path: Path) -> Path:
    """Create `path` 0600 if missing, else tighten it, and its SQLite WAL and shared-memory files (SQLite
    gives those the database file's mode when it creates them)."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_IMODE(p.stat().st_mode) & 0o077:
                os.chmod(p, 0o600)
    return path


class DataDir:
    """One storage directory with a capacity, a tier rank (0 = fastest) and its own manifest."""

    def __init__(self, root: Path, capacity: int, tier: int = 1) -> None:
        self.root = root
        self.capacity = capacity
        self.tier = tier
        self.used = 0  # sealed + reserved bytes
        self.reserved = 0  # bytes promised to writes not yet sealed (part of `used`)
        private_dir(root)
        (root / "blocks").mkdir(exist_ok=True)
        (root / "tmp").mkdir(exist_ok=True)
        self.db = sqlite3.connect(private_file(root / "manifest.sqlite3"), check_same_thread=False,
                                  isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # Keep the WAL small (it sits outside the block capacity): checkpoint every 1 MiB, truncate to 1 MiB.
        self.db.execute("PRAGMA wal_autocheckpoint=256")
        self.db.execute("PRAGMA journal_size_limit=1048576")
        self.db.execute("""CREATE TABLE IF NOT EXISTS blocks (
            block_id TEXT PRIMARY KEY, path TEXT NOT NULL, size INTEGER NOT NULL, crc32c INTEGER NOT NULL,
            sealed INTEGER NOT NULL, mtime REAL NOT NULL, last_access REAL NOT NULL,
            order_hint INTEGER NOT NULL, seal TEXT NOT NULL DEFAULT '')""")
        # manifest format 2 added the seal column: a format-0/1 manifest gets it, its blocks unsealed
        if "seal" not in {row[1] for row in self.db.execute("PRAGMA table_info(blocks)")}:
            self.db.execute("ALTER TABLE blocks ADD COLUMN seal TEXT NOT NULL DEFAULT ''")

    def block_file(self, bid: str) -> Path:
        return self.root / "blocks" / bid[:2] / bid

    def tmp_file(self, bid: str) -> Path:
        return self.root / "tmp" / f"{bid}.part"


# Files the worker creates: never through a link planted in tmp/ (in plugin mode pods mount the data dir
# read-write), never over an existing file, readable by the worker's user only.
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_MODE = 0o600


def create_exclusive(path: Path) -> IO[bytes]:
    """A new file at `path`, opened for writing; OSError when anything (a file, a symlink) is there."""
    return os.fdopen(os.open(path, CREATE_FLAGS, FILE_MODE), "wb", buffering=0)


def open_regular(path: Path) -> IO[bytes]:
    """`path` opened for reading when it is a regular file itself (not a symlink, FIFO or device);
    OSError otherwise. Checked on the open fd, so a swap after the check cannot redirect it."""
    fd = os.open(path, OPEN_FLAGS | os.O_NONBLOCK)  # O_NONBLOCK: opening a planted FIFO must not hang
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _file_crc(f: IO[bytes], size: int) -> int:
    """CRC32C of an open file's first `size` bytes (-1 if shorter), through one reused buffer. Not mmap:
    a writer truncating the file meanwhile would kill the worker with SIGBUS."""
    buf = bytearray(min(FRAME, max(size, 1)))
    mv = memoryview(buf)
    crc, left = 0, size
    reader = cast(io.BufferedIOBase, f)  # what open() gives for "rb"; IO[bytes] does not declare readinto
    while left:
        n = reader.readinto(mv[:min(left, len(buf))])
        if not n:
            return -1
        crc = crc32c.crc32c(mv[:n], crc, 1)  # GIL released while checksumming
        left -= n
    return crc


def _same_file(path: Path, st: os.stat_result) -> bool:
    """Whether `path` itself (links not followed) is the inode `st` describes."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


class VerifiedFrames:
    """A block file read FRAME by FRAME (at least one frame, possibly empty), checksummed on the way, so a
    reader never holds the whole block. After the last frame, `ok` says whether size and CRC32C matched the
    manifest and nothing followed; a read error ends the frames early (not ok)."""

    def __init__(self, block: Block, f: IO[bytes]) -> None:
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


_INSERT = ("INSERT OR REPLACE INTO blocks (block_id, path, size, crc32c, sealed, mtime, last_access, order_hint, "
           "seal) VALUES (?,?,?,?,1,?,?,?,?)")


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
        # the worker's own copy of each same-node write fd it handed out (open_write_fd): a sealed memfd
        self.memfds: dict[str, int] = {}
        self.removed: list[tuple[str, str]] = []  # (block_id, reason) not yet reported to the master
        self.moved: list[tuple[str, str]] = []  # (block_id, new local path) not yet reported
        self._dirty_access: set[str] = set()
        self._load()

    def _load(self) -> None:
        """Rebuild from the manifests; drop rows whose file is gone and files with no row."""
        for i, d in enumerate(self.dirs):
            for f in (d.root / "tmp").iterdir():
                f.unlink(missing_ok=True)
            rows = d.db.execute("SELECT block_id, path, size, crc32c, sealed, mtime, last_access, order_hint, seal"
                                " FROM blocks").fetchall()
            known = set()
            for bid, path, size, crc, sealed, mtime, la, oh, mac in rows:
                f = d.block_file(bid)
                try:
                    st = os.lstat(f)  # a symlink in blocks/ is damage, never followed
                    whole = stat.S_ISREG(st.st_mode) and st.st_size == size
                except OSError:
                    whole = False
                if not sealed or not whole or bid in self.blocks:
                    # unsealed, missing, damaged, or a second copy left by a demotion cut short
                    d.db.execute("DELETE FROM blocks WHERE block_id=?", (bid,))
                    f.unlink(missing_ok=True)
                    continue
                self.blocks[bid] = Block(bid, i, path, size, crc, mtime, la, oh, mac)
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
                           f"block of {size} bytes exceeds the max file size {self.max_file_size}", "EFBIG")
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

    def reserved_size(self, bid: str) -> int | None:
        """The bytes reserved under `bid` (None: no reservation)."""
        with self.lock:
            r = self.reservations.get(bid)
        return r[1] if r is not None else None

    def open_write_fd(self, bid: str) -> tuple[int, int] | str:
        """(fd for the client, size) of a same-node reservation, else why not. The fd is a memfd of exactly the
        reserved size, sealed so it can neither grow nor shrink: a client writes at most what it reserved.

        Why not the temp file's fd, as before: a client could write any amount into it (256 MiB through a
        1-byte reservation into a 64 MiB worker, none of it counted), and, holding the fd, keep that disk
        space after the reservation expired. A memfd's pages belong to the client that writes them and are
        bounded by the reservation; the worker copies them to disk only at adoption (recomputing the CRC as
        it copies), and keeps nothing of an expired one: its copy of the fd is closed with the reservation."""
        with self.lock:
            r = self.reservations.get(bid)
            if r is None or not r[3]:  # only a short-circuit (ReserveLocal) reservation, never a write in flight
                return f"block {bid} has no short-circuit reservation"
            if bid in self.memfds:
                return f"block {bid}: its write fd was handed out already"
            fd = os.memfd_create(f"l2fs-{bid}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, r[1])
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
                theirs = os.dup(fd)
            except OSError:
                os.close(fd)
                raise
            self.memfds[bid] = fd
            return theirs, r[1]

    def release(self, bid: str) -> None:
        """Give back a reservation of a write that did not complete."""
        with self.lock:
            m = self.memfds.pop(bid, None)
            if m is not None:
                os.close(m)
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
            self.delete(b.block_id, "evicted")
            EVICTIONS.inc()
            EVICTED_BYTES.inc(b.size)

    def _move(self, b: Block, j: int) -> bool:
        """Demote block b into dir j (copy, then switch manifests); False if the copy failed."""
        src_dir, dst_dir = self.dirs[b.dir_idx], self.dirs[j]
        src, dst, tmp = src_dir.block_file(b.block_id), dst_dir.block_file(b.block_id), dst_dir.tmp_file(b.block_id)
        try:
            dst.parent.mkdir(exist_ok=True)
            with open_regular(src) as fin, create_exclusive(tmp) as fout:
                left = b.size
                while left:
                    n = os.sendfile(fout.fileno(), fin.fileno(), None, left)
                    if not n:
                        raise OSError(f"{src} is shorter than {b.size} bytes")
                    left -= n
                st = os.fstat(fout.fileno())
            os.replace(tmp, dst)
            if not _same_file(dst, st):
                raise OSError(f"{tmp} was replaced before it was moved into place")
        except OSError as e:
            log.warning("demoting block %s to %s failed: %s", b.block_id, dst_dir.root, e)
            tmp.unlink(missing_ok=True)
            return False
        dst_dir.db.execute(_INSERT, (b.block_id, b.path, b.size, b.crc32c, b.mtime, b.last_access, b.order_hint,
                                     b.seal))
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

    def seal(self, bid: str, path: str, size: int, crc: int, order_hint: int, src: Path,
             ident: os.stat_result) -> Block:
        """Move a fully written temp file into place and record it in the manifest. `ident` is the fstat of
        the file the worker wrote or checked: if `src` was swapped since (e.g. for a symlink), the renamed
        entry is not that inode, and it is removed and refused instead of published."""
        with self.lock:
            r = self.reservations.pop(bid, None)
            if r is None:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid} has no reservation")
            i, reserved = r[0], r[1]
            d = self.dirs[i]
            dst = d.block_file(bid)
            try:
                dst.parent.mkdir(exist_ok=True)
                os.replace(src, dst)
                placed = _same_file(dst, ident)
            except OSError:
                placed = False
            if not placed:  # give the promised bytes back; what was renamed in (maybe a link) is removed
                dst.unlink(missing_ok=True)
                d.used -= reserved
                d.reserved -= reserved
                self._gauges()
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"block {bid}: temp file missing or replaced before sealing")
            d.used += size - reserved
            d.reserved -= reserved
            now = time.time()
            b = Block(bid, i, path, size, crc, now, now, order_hint)
            self.blocks[bid] = b
            d.db.execute(_INSERT, (bid, path, size, crc, now, now, order_hint, ""))
            self._over_high(i, keep=bid)  # the bytes are here now: make room for them (never by dropping them)
            self._gauges()
        BYTES_WRITTEN.inc(size)
        return b

    def receive(self, bid: str, path: str, size: int, order_hint: int,
                chunks: Iterable[bytes | memoryview]) -> Block:
        """The one write path of both transports: reserve `size` bytes, write `chunks` to a temp file
        while checksumming them, seal; on any failure the reservation is released. `chunks` is consumed
        only after the reservation succeeded, so a transport can acknowledge inside its first step."""
        i = self.reserve(bid, size)
        tmp = self.dirs[i].tmp_file(bid)
        ok = False
        try:
            try:
                f = create_exclusive(tmp)
            except OSError as e:  # something planted at our temp name (a symlink, a file): never write through it
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid}: temp file refused: {e}") from e
            crc, n = 0, 0
            with f:
                for data in chunks:
                    if n + len(data) > size:
                        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"stream carries more than the declared {size} bytes")
                    pwrite_all(f.fileno(), data, n)  # gRPC frames are 4 MiB: written in 1 MiB writes
                    n += len(data)
                    crc = crc32c.crc32c(data, value=crc)
                ident = os.fstat(f.fileno())
            if n != size:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"stream ended after {n} of {size} bytes")
            b = self.seal(bid, path, size, crc, order_hint, tmp, ident)
            ok = True
        finally:
            if not ok:
                self.release(bid)
        return b

    def adopt(self, bid: str, path: str, size: int, crc: int, order_hint: int) -> Block:
        """Seal a short-circuit write: the client wrote the reserved temp file itself. The worker trusts
        nothing about it: the temp name must be a regular file itself (no symlink followed), with one link
        (not a hard link to a file elsewhere), of the declared size, and the worker recomputes its CRC32C;
        a client CRC that does not match the bytes is refused. Any refusal releases the reservation."""
        with self.lock:
            r = self.reservations.get(bid)
            mfd = self.memfds.pop(bid, None) if r is not None else None
        if r is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid} was not reserved")
        if r[1] != size:
            self.release(bid)
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"block {bid}: {size} bytes declared, {r[1]} reserved")
        if mfd is not None:  # written through the fd we handed out
            return self._adopt_memfd(bid, path, size, crc, order_hint, r[0], mfd)
        tmp = self.dirs[r[0]].tmp_file(bid)
        try:
            try:
                f = open_regular(tmp)
            except OSError as e:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"local block file refused (missing, a link or not a regular file): {e}") from e
            with f:
                st = os.fstat(f.fileno())
                if st.st_nlink != 1:
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"local block file has {st.st_nlink} links (a hard link is refused)")
                if st.st_size != size:
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"local block file has {st.st_size} bytes, expected {size}")
                actual = _file_crc(f, size)
            if actual != crc:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"local block file does not match the declared CRC32C {crc:#010x} (recomputed)")
        except RpcError:
            self.release(bid)
            raise
        return self.seal(bid, path, size, crc, order_hint, tmp, st)

    def _adopt_memfd(self, bid: str, path: str, size: int, crc: int, order_hint: int, i: int, mfd: int) -> Block:
        """Seal a same-node write made through our memfd (open_write_fd): sealed against further writes first
        (refused while the client still maps it writable), then copied into a temp file of ours while its
        CRC32C is recomputed; a client CRC that does not match is refused. Any refusal releases the
        reservation. The copy goes to a fresh name of ours (nothing planted at the reservation's temp name is
        ever opened; whatever is there is removed)."""
        planted = self.dirs[i].tmp_file(bid)
        tmp = planted.with_name(f"{bid}.{os.urandom(8).hex()}.copy")
        try:
            try:
                try:
                    fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
                except OSError as e:
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"block {bid}: write fd still mapped writable by the client: {e}") from e
                try:
                    f = create_exclusive(tmp)
                except OSError as e:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"block {bid}: temp file refused: {e}") from e
                with f:
                    # sealed: the pages cannot change any more, so one read-only mapping is both what the CRC
                    # is computed over and what is written (no copy through a Python buffer: at 32 MiB chunks
                    # the framed loop cost ~0.1 s a block and a batch missed the writer's deadline)
                    off = os.fstat(mfd).st_size
                    actual = 0
                    if off == size and size:
                        with mmap.mmap(mfd, size, prot=mmap.PROT_READ) as mm:
                            actual = crc32c.crc32c(mm)
                            pwrite_all(f.fileno(), mm)
                    ident = os.fstat(f.fileno())
            finally:
                os.close(mfd)
            if off != size or actual != crc:
                tmp.unlink(missing_ok=True)
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"local block does not match the declared CRC32C {crc:#010x} (recomputed)")
        except RpcError:
            self.release(bid)
            raise
        planted.unlink(missing_ok=True)  # not ours (a link someone made there): never followed, now gone
        return self.seal(bid, path, size, crc, order_hint, tmp, ident)

    def delete(self, bid: str, reason: str = "deleted") -> bool:
        """Drop a block and its file; any reason but "deleted" (the master asked) is reported to the master."""
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

    def touch(self, bid: str) -> None:
        with self.lock:
            b = self.blocks.get(bid)
            if b is not None:
                b.last_access = time.time()
                self._dirty_access.add(bid)

    def set_path(self, bid: str, path: str, seal: str = "") -> None:
        """A rename reached this worker: the new path and, from a sealing master, the seal for it (the seal
        covers the path, so the old one no longer verifies; "" keeps what is there)."""
        with self.lock:
            b = self.blocks.get(bid)
            if b is not None:
                b.path = path
                if seal:
                    b.seal = seal
                self.dirs[b.dir_idx].db.execute("UPDATE blocks SET path=?, seal=? WHERE block_id=?",
                                                (path, b.seal, bid))

    def seal_blocks(self, seals: Iterable[tuple[str, int, str]]) -> int:
        """Keep the master's seal MACs (block id, committed CRC32C, MAC) in the manifest; returns how many were
        kept. A seal is kept only when the committed CRC is the one this worker computed when it sealed the
        block: a block committed with another CRC (a client that lied) is dropped as corrupt (reported, so the
        master unpublishes it). Unknown ids (deleted or evicted meanwhile) are skipped."""
        kept = 0
        with self.lock:
            updates: dict[int, list[tuple[str, str]]] = {}
            for bid, crc, mac in seals:
                b = self.blocks.get(bid)
                if b is None:
                    continue
                if b.crc32c != crc:
                    log.warning("block %s (%s) was committed with CRC32C %#010x, its bytes have %#010x: dropping it",
                                bid, b.path, crc, b.crc32c)
                    CORRUPT.inc()
                    self.delete(bid, "corrupt")
                    continue
                if b.seal != mac:
                    b.seal = mac
                    updates.setdefault(b.dir_idx, []).append((mac, bid))
                kept += 1
            for i, rows in updates.items():  # one transaction per dir and batch, not one per block
                db = self.dirs[i].db
                db.execute("BEGIN")
                try:
                    db.executemany("UPDATE blocks SET seal=? WHERE block_id=?", rows)
                finally:
                    db.execute("COMMIT")
        return kept

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
            self.delete(bid, "corrupt")
            return True

    def open_block(self, bid: str) -> tuple[Block, Path, IO[bytes]] | None:
        """The block and its current file, opened; None when it is unknown, or found damaged (gone, or not
        the manifest's size: truncated or extended behind our back), then dropped. The one opener for the
        gRPC read, the data-plane read and the re-check: a block can move to a slower tier between lookup
        and open, so a vanished file that was moved is looked up again."""
        for _ in range(3):
            found = self.file_of(bid)
            if found is None:
                return None
            b, path = found
            try:
                f = open_regular(path)  # the caller closes it; a symlink or non-file is damage
            except OSError:
                pass
            else:
                if os.fstat(f.fileno()).st_size == b.size:
                    return b, path, f
                f.close()
            if self.drop_damaged(bid, path):
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
                                   mtime=b.mtime, order_hint=b.order_hint, local_path=self.local_path(b),
                                   seal=b.seal)
                    for b in self.blocks.values()]
