"""`l2fs mount --passthrough`: a read-write FUSE server that speaks the kernel protocol itself (no libfuse), so
reads and writes of l2fs files go through FUSE passthrough: the kernel reads the block file (or writes a
node-local temp file) directly, and no READ or WRITE request reaches this process.

Why: through pyfuse3/libfuse 3.14 every byte crosses /dev/fuse and Python (0.25-0.65x the native client,
docs/mount.md). Passthrough (Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH) needs the FUSE_PASSTHROUGH init flag
and a backing_id in each OPEN reply, which libfuse 3.14 cannot send. `--read-only` mounts MS_RDONLY (EROFS).

- Writes: an open for writing gets its own unlinked temp file in the private cache directory (the existing
  bytes copied in unless O_TRUNC/new) as its backing file. FLUSH (close), FSYNC and RELEASE publish it with
  `Client.put(if_absent=False)`: the client computes the writer's CRC32C, the master allocates (quotas) and
  issues the size-bound capability for the file's real size, the worker seals it, so the same put-if-absent,
  CRC and seal semantics as every client hold; --max-file-size is checked first (EFBIG, nothing published).
  A FLUSH from a writer that is being killed by a signal (PF_EXITING with a signal exit code, read from
  /proc/<pid>/stat) publishes nothing: a crash mid-write leaves the old version, never a torn one.

- Namespace from `l2fs.client.Client` (Stat/ls); inodes per path, dropped on forget.
- OPEN asks the master for the file's current location (one Stat RPC: close-to-open as in fuse.py). A
  block held by this node's worker is opened O_RDONLY|O_NOFOLLOW and registered as the backing file
  (ioctl FUSE_DEV_IOC_BACKING_OPEN). A block on another node is fetched once over the data plane into a
  node-local cache file (CRC32C checked while it arrives) and that file becomes the backing file; cache
  files are evicted LRU beyond --cache-size once no handle uses them.
- CRC: passthrough reads skip our per-read CRC32C. `--verify open` (default): a local block file is
  CRC-checked in full at its first open on this node, and remembered by (device, inode, size, mtime,
  ctime), so a block rewritten in place is checked again; cache files were checked while fetched.
  `--verify write` trusts the worker's own check when it sealed the block (it recomputes the CRC at
  adopt/write), except for block files modified after the master's commit time (mtime later): those are
  checked in full. A mismatch is EIO (and is reported to the worker), never wrong bytes.
- No passthrough (kernel < 6.9, ioctl refused, or --process-reads): the same server answers READ with
  pread from the same verified files (direct_io).
"""

from __future__ import annotations

import argparse
import errno
import logging
import mmap
import os
import shutil
import signal
import stat as st
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from l2fs.client import Client, L2fsError
from l2fs.common import DEFAULT_MAX_FILE_SIZE, SHARED_POPULATED, Scatter, crc32c_fast, parse_size, pwrite_all
from l2fs.dataplane.client import SpliceUnsupported
from l2fs.fuse import kernel as fp
from l2fs.fuse.main import mount_type, stat_is_dir
from l2fs.fuse.operations import errno_of
from l2fs.options import ClientOptions, add_client_args
from l2fs.proto import l2fs_pb2 as pb

log = logging.getLogger("l2fs.fuse.passthrough")

ROOT = 1
NAME_MAX = 255
MAX_READ = 1 << 20  # the kernel's default max_pages_limit (256 pages)
MAX_WRITE = 1 << 20  # WRITE requests reach us only for opens without passthrough (fallback)
BUF_SIZE = MAX_WRITE + 64 * 1024  # one request: header + a 1 MiB write
PF_EXITING = 0x4  # /proc/<pid>/stat flags: the task is in do_exit
DT_DIR, DT_REG = 4, 8
POOL_BYTES = 128 << 20  # freed fetch buffers kept for reuse
# An OPEN right after the LOOKUP of the same open(2) reuses the lookup's Stat answer when it is this fresh
# (one master round trip per open instead of two); older answers are asked again (close-to-open).
STAT_REUSE = 0.1


class Reply(Exception):
    """An errno for the current request."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Node:
    __slots__ = ("ino", "path", "is_dir", "size", "mtime", "lookups", "opens", "backings", "stat",
                 "stat_at", "writers", "unpublished", "detached")

    def __init__(self, ino: int, path: str, is_dir: bool) -> None:
        self.ino, self.path, self.is_dir = ino, path, is_dir
        self.size, self.mtime = 0, 0.0
        self.lookups = 0
        self.opens = 0  # passthrough opens sharing `backing`
        # backing_ids registered for this inode and still used by an open handle here (the kernel keeps one per
        # inode at a time; more are listed only while a RELEASE is on its way), with what each holds: (block
        # id, size, crc32c) of a published version, ("w", temp fd, 0) of a writer's temp file
        self.backings: dict[int, tuple[str, int, int]] = {}
        self.stat: pb.FileStat | None = None  # the last Stat answer and when it came (see STAT_REUSE)
        self.stat_at = 0.0
        self.writers: list[_Handle] = []  # open-for-write handles; the last one's temp file is the size shown
        self.unpublished = False  # created on this mount and not published yet (visible here only)
        self.detached = False  # unlinked or renamed over while open: never published again


class _Handle:
    __slots__ = ("node", "fd", "passthrough", "cached", "wfd", "created", "append", "discard", "lock")

    def __init__(self, node: _Node, fd: int, passthrough: int, cached: str | None, wfd: int = -1,
                 created: bool = False, append: bool = False) -> None:
        self.node, self.fd, self.cached = node, fd, cached
        self.passthrough = passthrough  # the backing_id this open uses, 0 for none (reads/writes come to us)
        self.wfd = wfd  # writers: the temp file (our own fd, kept for publishing), else -1
        self.created = created  # new or truncated: published at close even if never written
        self.append = append
        self.discard = False  # its writer was killed mid-write: publish nothing
        self.lock = threading.Lock()  # one publish at a time


class Counters:
    """The server's own counters (exported with --metrics-port): a passthrough open must cost no READ."""

    NAMES = ("opens_passthrough", "opens_process", "read_requests", "read_bytes", "cache_fetches",
             "cache_hits", "cache_evictions", "verified_blocks", "crc_errors", "write_requests",
             "write_opens_passthrough", "publishes", "publishes_discarded")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.v = dict.fromkeys(self.NAMES, 0)

    def inc(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.v[name] += n

    def serve(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.core import CounterMetricFamily

        counters = self

        class _Collector:
            def collect(self) -> Any:
                with counters.lock:
                    snap = dict(counters.v)
                for k, val in snap.items():
                    yield CounterMetricFamily(f"l2fs_mount_{k}", f"l2fs passthrough mount: {k}", value=val)

        reg = CollectorRegistry()
        reg.register(_Collector())
        start_http_server(port, addr="127.0.0.1", registry=reg)


def _file_crc(fd: int, size: int) -> int:
    if size == 0:
        return 0
    with mmap.mmap(fd, size, flags=SHARED_POPULATED, prot=mmap.PROT_READ) as m:
        with memoryview(m) as view:
            return crc32c_fast(view)


class BlockCache:
    """Node-local copies of other nodes' blocks, the backing files of cross-node opens. Files are named by
    (block id, crc32c): a new version of a path is a new block, so a cached file is never stale."""

    def __init__(self, client: Client, directory: str, cap: int, counters: Counters) -> None:
        self.client, self.dir, self.cap, self.counters = client, directory, cap, counters
        self.lock = threading.Lock()
        self.files: OrderedDict[str, int] = OrderedDict()  # name -> size, least recently used first
        self.users: dict[str, int] = {}
        self.fetching: dict[str, threading.Lock] = {}
        self.bufs: list[bytearray] = []  # fetch buffers free for reuse (already faulted in), POOL_BYTES at most
        self.splice = True  # fetch by splice until the cache dir's file system refuses it (then buffered)

    def open(self, st_: pb.FileStat, loc: pb.Location, deadline: float) -> tuple[int, str]:
        """(read-only fd, name) of the verified local copy of loc's block; fetched if absent."""
        name = f"{loc.block_id}.{st_.crc32c:08x}"
        with self.lock:
            flock = self.fetching.setdefault(name, threading.Lock())
        with flock:
            with self.lock:
                if name in self.files:
                    self.files.move_to_end(name)
                    self.users[name] = self.users.get(name, 0) + 1
                    self.counters.inc("cache_hits")
                    return os.open(os.path.join(self.dir, name), os.O_RDONLY | os.O_CLOEXEC), name
            try:
                fd = self.fetch(st_, loc, name, deadline)
                with self.lock:
                    self.files[name] = st_.size
                    self.users[name] = self.users.get(name, 0) + 1
            finally:
                with self.lock:
                    self.fetching.pop(name, None)
            self.evict()
            return fd, name

    def fetch(self, st_: pb.FileStat, loc: pb.Location, name: str, deadline: float) -> int:
        """Fetch the block into the cache file: over the data plane spliced straight into the file (the kernel moves
        the bytes; the CRC32C is then computed over the file), else read into a reused buffer and written (see
        _buffered). A short or corrupt block is reported to its worker and gives EIO."""
        size = st_.size
        # no temp name: the directory is this process's own, and a name is used (self.files) once complete
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if size and not self._fetch_into(st_, loc, fd, deadline):
                self.counters.inc("crc_errors")
                raise Reply(errno.EIO)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.counters.inc("cache_fetches")
        return fd

    def _fetch_into(self, st_: pb.FileStat, loc: pb.Location, fd: int, deadline: float) -> bool:
        c = self.client
        if not (c.data_plane and loc.data_address and self.splice):
            return self._buffered(st_, loc, fd, deadline)
        try:  # the very block located (not whatever the path names by now), as Client._read_tcp does
            got, crc = c._data.read_to_file(loc.data_address, loc.block_id, deadline, fd, loc.capability)
        except SpliceUnsupported as e:  # the cache directory's file system: every fetch from now on is buffered
            log.warning("cache dir %s does not take splice (%s): cross-node copies are read through a buffer",
                        self.dir, e)
            self.splice = False
            os.ftruncate(fd, 0)
            return self._buffered(st_, loc, fd, deadline)
        except (OSError, ValueError, L2fsError, Exception) as e:  # noqa: BLE001 - any fault: no bytes
            log.info("fetch of %s from %s failed: %r", st_.path, loc.data_address, e)
            raise Reply(errno.EIO) from None
        # our own file in our own directory: nothing can truncate it under the mapping
        return self._intact(st_, loc, got, crc, _file_crc(fd, got) if got == st_.size else None)

    def _intact(self, st_: pb.FileStat, loc: pb.Location, got: int, crc: int, computed: int | None) -> bool:
        """Whether a data-plane read delivered the committed block (size, the worker's and our CRC32C); if not,
        it is reported to its worker."""
        if got == st_.size and crc == st_.crc32c and computed == crc:
            return True
        log.warning("%s: block %s from %s fails its CRC32C: EIO", st_.path, loc.block_id, loc.address)
        self.client._report_corrupt(loc)
        return False

    def _buffered(self, st_: pb.FileStat, loc: pb.Location, fd: int, deadline: float) -> bool:
        """Read into a reused buffer (already mapped: a fresh mmap of the file cost a page fault per 4 KiB), checked,
        then written to the file in pieces (l2fs.common.fileio says why): the located block over the data plane,
        CRC32C computed while it arrives (where the cache dir refuses splice), or gRPC streaming by path (no data
        plane; the client checks the CRC)."""
        size = st_.size
        buf = self.take(size)
        view = memoryview(buf)[:size]
        try:
            if not self._read_into(st_, loc, view, deadline):
                return False
            pwrite_all(fd, view)
            return True
        finally:
            view.release()
            self.give(buf)

    def _read_into(self, st_: pb.FileStat, loc: pb.Location, view: memoryview, deadline: float) -> bool:
        c = self.client
        if c.data_plane and loc.data_address:
            try:  # the very block located, as in _fetch_into
                got, crc, computed = c._data.read(loc.data_address, loc.block_id, deadline, view, loc.capability)
            except (OSError, ValueError, L2fsError, Exception) as e:  # noqa: BLE001 - any fault: no bytes
                log.info("fetch of %s from %s failed: %r", st_.path, loc.data_address, e)
                raise Reply(errno.EIO) from None
            n = got if isinstance(got, int) else len(got)
            return self._intact(st_, loc, n, crc, crc32c_fast(view[:n]) if computed is None else computed)
        try:  # gRPC streaming of the very block located (by its id), size and CRC checked by the client: by path it
            # would read whatever the path names by now, and file a newer version's bytes under this one's name
            one = st_
            if not st_.locations or st_.locations[0] != loc:
                one = pb.FileStat()
                one.CopyFrom(st_)
                del one.locations[:]
                one.locations.append(loc)
            read = c._read_located(st_.path, one, Scatter([view]), deadline)
        except Exception as e:  # noqa: BLE001 - a refused capability, any fault: no bytes
            log.info("fetch of %s from %s failed: %r", st_.path, loc.address, e)
            raise Reply(errno.EIO) from None
        return read == st_.size

    def take(self, size: int) -> bytearray:
        """A fetch buffer of at least size bytes: a freed one when one fits (a fresh 32 MiB buffer costs
        8,192 page faults, as much as the fetch itself), else a new one."""
        with self.lock:
            fits = [b for b in self.bufs if len(b) >= size]
            if fits:
                b = min(fits, key=len)
                self.bufs.remove(b)
                return b
        return bytearray(max(size, 1))

    def give(self, b: bytearray) -> None:
        with self.lock:
            self.bufs.append(b)
            while sum(len(x) for x in self.bufs) > POOL_BYTES:
                self.bufs.remove(min(self.bufs, key=len))

    def release(self, name: str) -> None:
        with self.lock:
            self.users[name] -= 1
            if not self.users[name]:
                del self.users[name]
        self.evict()

    def evict(self) -> None:
        """Drop least recently used unused copies beyond the byte bound."""
        with self.lock:
            total = sum(self.files.values())
            for name in list(self.files):
                if total <= self.cap:
                    break
                if self.users.get(name):
                    continue
                total -= self.files.pop(name)
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
                self.counters.inc("cache_evictions")


class PassthroughServer:
    """One FUSE connection: reader threads take requests from /dev/fuse and answer them in place."""

    def __init__(self, client: Client, mountpoint: str, *, root: str = "/", cache_dir: str, cache_size: int,
                 passthrough: bool = True, verify: str = "open", timeout: float = 1.0, threads: int = 8,
                 uid: int = 0, gid: int = 0, allow_other: bool = False, read_only: bool = True,
                 max_file_size: int = DEFAULT_MAX_FILE_SIZE, umask: int = 0o022) -> None:
        self.client, self.mountpoint = client, mountpoint
        self.read_only, self.max_file_size = read_only, max_file_size
        self.file_mode = 0o444 if read_only else 0o666 & ~umask
        self.dir_mode = 0o555 if read_only else 0o777 & ~umask
        self.root = root.rstrip("/") or "/"
        self.want_passthrough = passthrough
        self.passthrough = False  # granted by the kernel at INIT and not refused since
        self.verify = verify
        self.timeout = min(timeout, 1.0)
        self.threads = threads
        self.uid, self.gid, self.allow_other = uid, gid, allow_other
        self.counters = Counters()
        self.cache = BlockCache(client, cache_dir, cache_size, self.counters)
        self.lock = threading.Lock()
        self.nodes: dict[int, _Node] = {ROOT: _Node(ROOT, "/", True)}
        self.nodes[ROOT].lookups = 1
        self.by_path: dict[str, _Node] = {"/": self.nodes[ROOT]}
        self.next_ino = ROOT + 1
        self.handles: dict[int, _Handle] = {}
        self.refs: dict[int, int] = {}  # backing_id -> open handles using it
        self.dirs: dict[int, list[tuple[bytes, int, int]]] = {}
        self.next_fh = 1
        self.verified: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.devfd = -1
        self.stopping = threading.Event()
        self.handlers: dict[int, Callable[[_Req], bytes | None]] = {
            fp.INIT: self.op_init, fp.LOOKUP: self.op_lookup, fp.GETATTR: self.op_getattr,
            fp.OPENDIR: self.op_opendir, fp.READDIR: self.op_readdir, fp.RELEASEDIR: self.op_releasedir,
            fp.OPEN: self.op_open, fp.READ: self.op_read, fp.RELEASE: self.op_release,
            fp.STATFS: self.op_statfs, fp.FORGET: self.op_forget, fp.BATCH_FORGET: self.op_batch_forget,
            fp.DESTROY: self.op_destroy, fp.SETATTR: self.op_setattr, fp.CREATE: self.op_create,
            fp.WRITE: self.op_write, fp.FLUSH: self.op_flush, fp.FSYNC: self.op_fsync, fp.MKDIR: self.op_mkdir,
            fp.UNLINK: self.op_unlink, fp.RMDIR: self.op_rmdir, fp.RENAME: self.op_rename,
            fp.RENAME2: self.op_rename2,
        }
        self._statfs: tuple[float, bytes] | None = None

    # ------------------------------------------------------------ lifecycle
    def mount(self) -> None:
        self.devfd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        fsname = f"l2fs:{self.client.masters[0]}{self.root}"
        fp.mount(self.devfd, self.mountpoint, fsname, allow_other=self.allow_other, max_read=MAX_READ,
                 read_only=self.read_only)

    def serve(self) -> None:
        """Run reader threads until the mount goes away (ENODEV) or stop() is called."""
        ts = [threading.Thread(target=self._loop, name=f"fuse-{i}", daemon=True) for i in range(self.threads)]
        for t in ts:
            t.start()
        while not self.stopping.wait(0.5):
            if not any(t.is_alive() for t in ts):
                break
        for t in ts:
            t.join(0.2)  # readers still blocked on /dev/fuse are daemons: they end with us

    def stop(self) -> None:
        """Unmount (lazily: open files keep working until closed); the readers then see ENODEV."""
        if not self.stopping.is_set():
            try:
                fp.umount(self.mountpoint)
            except OSError as e:
                log.info("umount: %s", e)
        self.stopping.set()

    def _loop(self) -> None:
        buf = bytearray(BUF_SIZE)
        while not self.stopping.is_set():
            try:
                n = os.readv(self.devfd, [buf])
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue  # ENOENT: the request was interrupted before we took it
                if e.errno != errno.ENODEV:
                    log.error("read /dev/fuse: %s", e)
                self.stopping.set()
                return
            self._handle(_Req(memoryview(buf)[:n]))

    def _handle(self, req: _Req) -> None:
        fn = self.handlers.get(req.opcode)
        body: bytes | None = b""
        code = 0
        try:
            if fn is None:
                code = errno.ENOSYS
            else:
                body = fn(req)
        except Reply as r:
            code = r.code
        except Exception:  # noqa: BLE001 - one request's bug is its EIO, never a dead mount
            log.exception("opcode %d failed: EIO", req.opcode)
            code = errno.EIO
        if req.opcode in fp.NO_REPLY or (body is None and not code):
            return
        out = b"" if code else (body or b"")
        try:
            os.writev(self.devfd, [fp.OUT_HEADER.pack(fp.OUT_HEADER.size + len(out), -code, req.unique), out])
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # ENOENT: interrupted meanwhile
                log.warning("reply to opcode %d: %s", req.opcode, e)

    # ------------------------------------------------------------ helpers
    def l2(self, path: str) -> str:
        if self.root == "/":
            return path
        return self.root if path == "/" else self.root + path

    def node(self, ino: int) -> _Node:
        with self.lock:
            n = self.nodes.get(ino)
        if n is None:
            raise Reply(errno.ESTALE)
        return n

    def stat_path(self, path: str) -> pb.FileStat:
        """The master's FileStat (size, crc32c, locations) of path, fresh: ENOENT if it does not exist."""
        c, p = self.client, self.l2(path)
        try:  # as Client.stat does, keeping the locations: the path's shard, then a directory elsewhere
            s = c._master("Stat", pb.PathRequest(path=p), shard=c._shard_of(p))
            if not s.exists and len(c._shards) > 1:
                s = c._dir_elsewhere(p) or s
        except Exception as e:  # noqa: BLE001 - every failure reaches the kernel as an errno
            raise Reply(errno_of(e)) from None
        if not s.exists:
            raise Reply(errno.ENOENT)
        return s

    def attr_of(self, n: _Node) -> bytes:
        if n.is_dir:
            return fp.attr(n.ino, 0, st.S_IFDIR | self.dir_mode, n.mtime, self.uid, self.gid, nlink=2)
        size = n.size
        if n.writers:  # this mount holds newer bytes than l2fs: the latest writer's temp file
            try:
                size = os.fstat(n.writers[-1].wfd).st_size
            except OSError:
                pass
        return fp.attr(n.ino, size, st.S_IFREG | self.file_mode, n.mtime, self.uid, self.gid)

    def node_for(self, path: str, s: pb.FileStat) -> _Node:
        with self.lock:
            n = self.by_path.get(path)
            held: list[tuple[str, int, int]] = []  # backings of a version (or of a writer gone since) still open
            if n is not None:
                writing = {w.wfd for w in n.writers}
                held = [k for k in n.backings.values()
                        if not ((k[0] == "w" and k[1] in writing) or (k[0] == "u" and writing))]
            stale = bool(held) and all(k[1:] != (s.size, s.crc32c) for k in held)
            if n is None or n.is_dir != s.is_dir or stale:  # stale: another version is open on the old inode
                n = _Node(self.next_ino, path, s.is_dir)
                self.next_ino += 1
                self.nodes[n.ino] = n
                self.by_path[path] = n
            n.size, n.mtime = (0 if s.is_dir else s.size), s.mtime
            n.stat, n.stat_at = s, time.monotonic()
            return n

    # ------------------------------------------------------------ namespace
    def op_init(self, req: _Req) -> bytes:
        major, minor, readahead, flags, flags2 = fp.INIT_IN.unpack_from(req.body)
        if major != 7:
            raise Reply(errno.EPROTO)
        offered = flags | (flags2 << 32 if flags & fp.INIT_EXT else 0)
        want = fp.ASYNC_READ | fp.BIG_WRITES | fp.PARALLEL_DIROPS | fp.MAX_PAGES | fp.INIT_EXT | fp.ATOMIC_O_TRUNC
        if self.want_passthrough:
            want |= fp.PASSTHROUGH
        got = offered & want
        self.passthrough = bool(got & fp.PASSTHROUGH)
        if self.want_passthrough and not self.passthrough:
            log.warning("kernel %s offers no FUSE passthrough (protocol 7.%d): reads are served by this process",
                        os.uname().release, minor)
        log.info("FUSE protocol 7.%d, passthrough %s", minor, "on" if self.passthrough else "off")
        return fp.INIT_OUT.pack(7, min(minor, 41), readahead, got & 0xFFFFFFFF, 64, 48, MAX_WRITE, 1,
                                MAX_READ // 4096, 0, got >> 32, 1, 0)

    def op_destroy(self, req: _Req) -> bytes:
        self.stopping.set()
        return b""

    def check_writable(self) -> None:
        if self.read_only:
            raise Reply(errno.EROFS)

    def child(self, parent_ino: int, raw: bytes | memoryview) -> str:
        """The mount path of the entry `raw` (a NUL-terminated name) in directory parent_ino."""
        name = bytes(raw).split(b"\0", 1)[0]
        if len(name) > NAME_MAX:
            raise Reply(errno.ENAMETOOLONG)
        parent = self.node(parent_ino)
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise Reply(errno.ENOENT) from None
        if not sname or "/" in sname:
            raise Reply(errno.EINVAL)
        return ("/" + sname) if parent.path == "/" else f"{parent.path}/{sname}"

    def op_lookup(self, req: _Req) -> bytes:
        path = self.child(req.nodeid, req.body)
        with self.lock:
            n = self.by_path.get(path)
        if n is not None and n.unpublished:  # created here, not closed yet: only this mount knows it
            with self.lock:
                n.lookups += 1
            return fp.entry_out(n.ino, self.attr_of(n), self.timeout)
        s = self.stat_path(path)
        n = self.node_for(path, s)
        with self.lock:
            n.lookups += 1
        return fp.entry_out(n.ino, self.attr_of(n), self.timeout)

    def _forget(self, ino: int, count: int) -> None:
        with self.lock:
            n = self.nodes.get(ino)
            if n is None or ino == ROOT:
                return
            n.lookups -= count
            if n.lookups <= 0 and n.opens <= 0:
                del self.nodes[ino]
                if self.by_path.get(n.path) is n:
                    del self.by_path[n.path]

    def op_forget(self, req: _Req) -> None:
        self._forget(req.nodeid, fp.FORGET_IN.unpack_from(req.body)[0])

    def op_batch_forget(self, req: _Req) -> None:
        count, _ = fp.BATCH_FORGET_IN.unpack_from(req.body)
        for i in range(count):
            ino, nl = fp.FORGET_ONE.unpack_from(req.body, fp.BATCH_FORGET_IN.size + i * fp.FORGET_ONE.size)
            self._forget(ino, nl)

    def op_getattr(self, req: _Req) -> bytes:
        n = self.node(req.nodeid)
        if n.ino != ROOT and not (n.unpublished and n.writers):
            s = self.stat_path(n.path)
            if s.is_dir != n.is_dir:
                raise Reply(errno.ESTALE)
            n.size, n.mtime = (0 if s.is_dir else s.size), s.mtime
        return fp.attr_out(self.attr_of(n), self.timeout)

    def op_opendir(self, req: _Req) -> bytes:
        n = self.node(req.nodeid)
        try:
            infos = self.client.ls(self.l2(n.path))
        except Exception as e:  # noqa: BLE001
            raise Reply(errno_of(e)) from None
        entries = [(b".", n.ino, DT_DIR), (b"..", ROOT, DT_DIR)]
        for i in infos:
            name = i.path.rstrip("/").rsplit("/", 1)[-1].encode()
            entries.append((name, 0xFFFFFFFF, DT_DIR if i.is_dir else DT_REG))  # d_ino: unknown until lookup
        pre = n.path.rstrip("/") + "/"
        known = {e[0] for e in entries}
        with self.lock:  # files created here and still open are listed on this mount
            for p, c in self.by_path.items():
                name = p[len(pre):].encode()
                if c.unpublished and p.startswith(pre) and b"/" not in name and name not in known:
                    entries.append((name, c.ino, DT_REG))
            fh = self.next_fh
            self.next_fh += 1
            self.dirs[fh] = entries
        return fp.OPEN_OUT.pack(fh, 0, 0)

    def op_readdir(self, req: _Req) -> bytes:
        fh, off, size, _ = fp.READ_IN.unpack_from(req.body)
        entries = self.dirs.get(fh)
        if entries is None:
            raise Reply(errno.EBADF)
        out = bytearray()
        for i in range(off, len(entries)):
            name, ino, dtype = entries[i]
            d = fp.dirent(ino, i + 1, name, dtype)
            if len(out) + len(d) > size:
                break
            out += d
        return bytes(out)

    def op_releasedir(self, req: _Req) -> bytes:
        fh = fp.RELEASE_IN.unpack_from(req.body)[0]
        with self.lock:
            self.dirs.pop(fh, None)
        return b""

    def op_statfs(self, req: _Req) -> bytes:
        now = time.monotonic()
        if self._statfs is None or now - self._statfs[0] > 5:
            try:
                r = self.client.report()
                cap, used = r.capacity, r.used
            except Exception:  # noqa: BLE001 - df still answers
                cap = used = 0
            blocks, free = cap // 4096, max(0, cap - used) // 4096
            self._statfs = (now, fp.KSTATFS.pack(blocks, free, free, 1 << 20, 1 << 20, 4096, NAME_MAX, 4096, 0))
        return self._statfs[1]

    # ------------------------------------------------------------ files
    def local_block(self, s: pb.FileStat) -> tuple[int, pb.Location] | None:
        """fd of this node's copy of the block, verified (see --verify), or None when this node has none."""
        for loc in s.locations:
            if not self.client._is_local(loc):
                continue
            try:
                fd = os.open(loc.local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # evicted meanwhile, or this process cannot see the worker's disk
            fst = os.fstat(fd)
            if not st.S_ISREG(fst.st_mode) or fst.st_size != s.size or not self.trusted(fd, fst, s):
                os.close(fd)
                log.warning("%s: local block %s is not the committed bytes: EIO", s.path, loc.local_path)
                self.counters.inc("crc_errors")
                self.client._report_corrupt(loc)
                raise Reply(errno.EIO)
            return fd, loc
        return None

    def trusted(self, fd: int, fst: os.stat_result, s: pb.FileStat) -> bool:
        """Whether the block file holds the committed bytes, checking its CRC32C only when needed."""
        key = (fst.st_dev, fst.st_ino, fst.st_size, fst.st_mtime_ns, fst.st_ctime_ns, s.crc32c)
        with self.lock:
            if key in self.verified:
                self.verified.move_to_end(key)
                return True
        if self.verify == "write" and fst.st_mtime_ns <= int(s.mtime * 1e9) + 1_000_000:
            return True  # sealed by the worker after its own CRC check, not written since
        if _file_crc(fd, s.size) != s.crc32c:
            return False
        self.counters.inc("verified_blocks")
        with self.lock:
            self.verified[key] = None
            while len(self.verified) > 65536:
                self.verified.popitem(last=False)
        return True

    def op_open(self, req: _Req) -> bytes:
        flags, _ = fp.OPEN_IN.unpack_from(req.body)
        n = self.node(req.nodeid)
        if n.is_dir:
            raise Reply(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            self.check_writable()
            return self.open_writer(n, flags, truncate=bool(flags & os.O_TRUNC))
        if n.unpublished:  # read a file this mount is still writing: from the writer's temp file
            with self.lock:
                w = n.writers[-1] if n.writers else None
            if w is None:
                raise Reply(errno.ENOENT)
            fd = os.dup(w.wfd)
            backing = self.attach(n, fd, ("u", 0, 0))  # shares the writer's backing file
            if backing:
                os.close(fd)
                return self.new_handle(_Handle(n, -1, backing, None), fp.FOPEN_PASSTHROUGH, backing)
            return self.new_handle(_Handle(n, fd, 0, None), fp.FOPEN_DIRECT_IO, 0)
        s = n.stat
        if s is None or time.monotonic() - n.stat_at > STAT_REUSE:
            s = self.stat_path(n.path)
        n.stat = None  # used once
        if s.is_dir:
            raise Reply(errno.EISDIR)
        if not s.locations:
            raise Reply(errno.ENOENT)  # no live copy: a miss, as in fuse.py
        t0 = time.monotonic()
        deadline = t0 + self.client.timeout
        cached: str | None = None
        local = self.local_block(s)
        if local is not None:
            fd, loc = local
        else:
            loc = s.locations[0]
            fd, cached = self.cache.open(s, loc, deadline)
        n.size, n.mtime = s.size, s.mtime
        key = (loc.block_id, s.size, s.crc32c)
        backing = self.attach(n, fd, key)
        fh = self.add_handle(_Handle(n, -1 if backing else fd, backing, cached))
        log.debug("open %s: %s %s in %.2f ms", n.path, "cached copy" if cached else "local block",
                  "passthrough" if backing else "process reads", (time.monotonic() - t0) * 1e3)
        if backing:
            os.close(fd)  # the kernel holds the file now
            self.counters.inc("opens_passthrough")
            return fp.OPEN_OUT.pack(fh, fp.FOPEN_PASSTHROUGH, backing)
        self.counters.inc("opens_process")
        return fp.OPEN_OUT.pack(fh, fp.FOPEN_DIRECT_IO, 0)

    def add_handle(self, h: _Handle) -> int:
        with self.lock:
            fh = self.next_fh
            self.next_fh += 1
            self.handles[fh] = h
            if h.wfd >= 0:
                h.node.writers.append(h)
        return fh

    def new_handle(self, h: _Handle, open_flags: int, backing: int) -> bytes:
        return fp.OPEN_OUT.pack(self.add_handle(h), open_flags, backing)

    # ------------------------------------------------------------ writes
    def temp_file(self) -> int:
        """A new unlinked file in the private cache directory: a crash of this process leaves nothing."""
        try:
            return os.open(self.cache.dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except (OSError, AttributeError):  # a file system without O_TMPFILE
            fd, name = tempfile.mkstemp(dir=self.cache.dir)
            os.unlink(name)
            return fd

    def open_writer(self, n: _Node, flags: int, *, truncate: bool, created: bool = False) -> bytes:
        """An open for writing: its own temp file, holding the current bytes unless truncate, as the
        backing file (or, when the inode already has another backing file, served by WRITE requests)."""
        wfd = self.temp_file()
        try:
            if not truncate:
                self.copy_in(n, wfd)
            os.utime(wfd, ns=(0, 0))  # mtime 0 = unchanged since open (see dirty())
            fd = os.dup(wfd)  # registered as the backing file, or read/written by WRITE/READ requests
        except BaseException:
            os.close(wfd)
            raise
        h = _Handle(n, fd, 0, None, wfd=wfd, created=truncate or created, append=bool(flags & os.O_APPEND))
        try:
            backing = self.attach(n, fd, ("w", wfd, 0))
        except Reply:
            os.close(fd)
            os.close(wfd)
            raise
        if backing:
            os.close(fd)
            h.fd, h.passthrough = -1, backing
            self.counters.inc("write_opens_passthrough")
            return self.new_handle(h, fp.FOPEN_PASSTHROUGH, backing)
        self.counters.inc("opens_process")
        return self.new_handle(h, fp.FOPEN_DIRECT_IO, 0)

    def copy_in(self, n: _Node, wfd: int) -> None:
        """The file's current bytes into a writer's temp file: another open writer's (this mount's newer
        view), else the published version (ENOENT when it has none: gone, evicted, its worker down)."""
        with self.lock:
            w = n.writers[-1] if n.writers else None
        if w is not None:
            size = os.fstat(w.wfd).st_size
            done = 0
            while done < size:
                k = os.copy_file_range(w.wfd, wfd, size - done, done, done)
                if k <= 0:
                    break
                done += k
            return
        if n.unpublished:
            raise Reply(errno.ENOENT)
        s = self.stat_path(n.path)
        if s.is_dir:
            raise Reply(errno.EISDIR)
        if s.size:
            os.ftruncate(wfd, s.size)
            with mmap.mmap(wfd, s.size) as m, memoryview(m) as view:
                try:
                    got = self.client.get_into(self.l2(n.path), view)
                except ValueError:  # it grew since the Stat
                    got = -1
                except Exception as e:  # noqa: BLE001
                    raise Reply(errno_of(e)) from None
            if got is None:
                raise Reply(errno.ENOENT)
            if got != s.size:
                data = self.client.get(self.l2(n.path))
                if data is None:
                    raise Reply(errno.ENOENT)
                os.ftruncate(wfd, 0)
                os.pwrite(wfd, data, 0)

    @staticmethod
    def killed(pid: int) -> bool:
        """Whether task pid is exiting on a signal (a crash, SIGKILL): the kernel closes its files in do_exit
        after setting PF_EXITING and the exit code, so its FLUSH must not publish a half-written file. A pid
        outside this mount's pid namespace arrives as 0 and cannot be told apart: published as before."""
        if pid <= 0:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            flags, code = int(fields[6]), int(fields[49])
        except (OSError, IndexError, ValueError):
            return False
        return bool(flags & PF_EXITING) and bool(code & 0x7F)

    def dirty(self, h: _Handle) -> bool:
        if h.created:
            return True
        try:
            return os.fstat(h.wfd).st_mtime_ns != 0
        except OSError:
            return False

    def publish(self, h: _Handle) -> None:
        """Publish a writer's temp file at its node's path, atomically (last close wins). EFBIG beyond
        --max-file-size, the client's errno otherwise (nothing published then)."""
        n = h.node
        with h.lock:
            if h.discard or n.detached or not self.dirty(h):
                return
            os.utime(h.wfd, ns=(0, 0))  # a write from now on makes it dirty again
            created, h.created = h.created, False
            size = os.fstat(h.wfd).st_size
            try:
                if size > self.max_file_size:
                    raise Reply(errno.EFBIG)
                self.client.put_file(self.l2(n.path), h.wfd, if_absent=False)
            except Reply:
                h.created = created or h.created
                raise
            except Exception as e:  # noqa: BLE001 - quota, capability, dead worker: the errno, nothing published
                h.created = True
                log.warning("publish of %s failed: %s", n.path, e)
                raise Reply(errno_of(e)) from None
            self.counters.inc("publishes")
            n.unpublished = False
            n.size, n.mtime = size, time.time()
            n.stat = None

    def op_create(self, req: _Req) -> bytes:
        self.check_writable()
        flags, _, _, _ = fp.CREATE_IN.unpack_from(req.body)
        path = self.child(req.nodeid, req.body[fp.CREATE_IN.size:])
        with self.lock:
            n = self.by_path.get(path)
            if n is None or n.is_dir:
                n = _Node(self.next_ino, path, False)
                self.next_ino += 1
                self.nodes[n.ino] = n
                self.by_path[path] = n
            fresh = not n.writers
            if fresh:
                n.unpublished, n.size = True, 0
            n.detached = False
            n.mtime = time.time()
            n.lookups += 1
        try:
            opened = self.open_writer(n, flags, truncate=fresh, created=True)
        except BaseException:
            self._forget(n.ino, 1)
            raise
        return fp.entry_out(n.ino, self.attr_of(n), self.timeout) + opened

    def op_write(self, req: _Req) -> bytes:
        fh, off, size, _, _, _, _ = fp.WRITE_IN.unpack_from(req.body)
        h = self.handles.get(fh)
        if h is None or h.wfd < 0:
            raise Reply(errno.EBADF)
        if h.append:
            off = os.fstat(h.wfd).st_size
        if off + size > self.max_file_size:
            raise Reply(errno.EFBIG)
        data = req.body[fp.WRITE_IN.size:fp.WRITE_IN.size + size]
        done = 0
        while done < size:
            done += os.pwrite(h.wfd, data[done:], off + done)
        self.counters.inc("write_requests")
        return fp.WRITE_OUT.pack(size, 0)

    def op_flush(self, req: _Req) -> bytes:
        fh = fp.FLUSH_IN.unpack_from(req.body)[0]
        h = self.handles.get(fh)
        if h is None or h.wfd < 0:
            return b""
        pid = fp.IN_HEADER.unpack_from(req.raw)[6]
        if self.killed(pid):
            log.warning("%s: its writer (pid %d) was killed mid-write: nothing published", h.node.path, pid)
            h.discard = True
            self.counters.inc("publishes_discarded")
            return b""
        self.publish(h)
        return b""

    def op_fsync(self, req: _Req) -> bytes:
        h = self.handles.get(fp.FSYNC_IN.unpack_from(req.body)[0])
        if h is not None and h.wfd >= 0:
            self.publish(h)
        return b""

    def op_setattr(self, req: _Req) -> bytes:
        f = fp.SETATTR_IN.unpack_from(req.body)
        valid, fh, size = f[0], f[2], f[3]
        n = self.node(req.nodeid)
        if valid & fp.FATTR_SIZE:
            self.check_writable()
            if n.is_dir:
                raise Reply(errno.EISDIR)
            if size > self.max_file_size:
                raise Reply(errno.EFBIG)
            h = self.handles.get(fh) if valid & fp.FATTR_FH else None
            if (h is None or h.wfd < 0) and n.writers:
                h = n.writers[-1]
            if h is not None and h.wfd >= 0:  # ftruncate: that writer's temp file
                os.ftruncate(h.wfd, size)
                h.created = True
            else:  # truncate(path): read, cut, publish, with a temp writer of our own
                self.truncate_path(n, size)
        # mode/owner/times are not stored by l2fs; accepted so that cp -p and touch work
        return fp.attr_out(self.attr_of(n), self.timeout)

    def truncate_path(self, n: _Node, size: int) -> None:
        wfd = self.temp_file()
        try:
            h = _Handle(n, -1, 0, None, wfd=wfd, created=True)
            if size:
                self.copy_in(n, wfd)
            else:
                self.stat_path(n.path)  # ENOENT for a file that is gone
            os.ftruncate(wfd, size)
            self.publish(h)
        finally:
            os.close(wfd)

    def op_mkdir(self, req: _Req) -> bytes:
        self.check_writable()
        path = self.child(req.nodeid, req.body[fp.MKDIR_IN.size:])
        try:
            self.client.mkdir(self.l2(path), parents=False, exist_ok=False)
        except Exception as e:  # noqa: BLE001
            raise Reply(errno_of(e)) from None
        s = self.stat_path(path)
        n = self.node_for(path, s)
        with self.lock:
            n.lookups += 1
        return fp.entry_out(n.ino, self.attr_of(n), self.timeout)

    def detach(self, path: str) -> None:
        """Forget path's inode (unlinked, replaced): its open writers never publish again."""
        with self.lock:
            n = self.by_path.pop(path, None)
            if n is not None:
                n.detached, n.unpublished = True, False

    def op_unlink(self, req: _Req) -> bytes:
        self.check_writable()
        path = self.child(req.nodeid, req.body)
        with self.lock:
            n = self.by_path.get(path)
        try:
            removed = self.client.rm(self.l2(path))
        except Exception as e:  # noqa: BLE001
            raise Reply(errno_of(e)) from None
        if not removed and (n is None or not n.unpublished):
            raise Reply(errno.ENOENT)
        self.detach(path)
        return b""

    def op_rmdir(self, req: _Req) -> bytes:
        self.check_writable()
        path = self.child(req.nodeid, req.body)
        try:
            self.client.rmdir(self.l2(path))
        except Exception as e:  # noqa: BLE001
            raise Reply(errno_of(e)) from None
        self.detach(path)
        return b""

    def op_rename(self, req: _Req) -> bytes:
        newdir = fp.RENAME_IN.unpack_from(req.body)[0]
        return self.rename(req.nodeid, newdir, 0, req.body[fp.RENAME_IN.size:])

    def op_rename2(self, req: _Req) -> bytes:
        newdir, flags, _ = fp.RENAME2_IN.unpack_from(req.body)
        return self.rename(req.nodeid, newdir, flags, req.body[fp.RENAME2_IN.size:])

    def rename(self, olddir: int, newdir: int, flags: int, names: memoryview) -> bytes:
        self.check_writable()
        if flags & fp.RENAME_EXCHANGE or flags & ~(fp.RENAME_EXCHANGE | fp.RENAME_NOREPLACE):
            raise Reply(errno.EINVAL)
        old, new = bytes(names).split(b"\0")[:2]
        src, dst = self.child(olddir, old), self.child(newdir, new)
        if src == dst:
            return b""
        with self.lock:
            sn = self.by_path.get(src)
            w = sn.writers[-1] if sn is not None and sn.writers else None
        if w is not None:
            self.publish(w)  # renaming a file still being written: publish it first
        try:
            self.client.rename(self.l2(src), self.l2(dst), overwrite=not flags & fp.RENAME_NOREPLACE)
        except Exception as e:  # noqa: BLE001
            raise Reply(errno_of(e)) from None
        with self.lock:
            moved = [(p, c) for p, c in self.by_path.items() if p == src or p.startswith(src + "/")]
            for p, _ in moved:
                del self.by_path[p]
            old_dst = self.by_path.pop(dst, None)
            if old_dst is not None and old_dst is not sn:
                old_dst.detached, old_dst.unpublished = True, False
            for p, c in moved:
                c.path = dst + p[len(src):]
                c.stat = None
                self.by_path[c.path] = c
        return b""

    def attach(self, n: _Node, fd: int, key: tuple[str, int, int]) -> int:
        """The backing_id for this open of n (0: serve it from this process).

        The kernel allows one backing file per inode at a time and fails (EIO) any open of an inode that
        still has passthrough opens unless it names that same backing file. Its inode drops the backing file
        at the last close, before our RELEASE arrives (asynchronously), so what this process has recorded
        may already be gone there. Hence: a reader of the recorded version, or of a file this mount is
        writing (n's writer's temp file: this mount's newer bytes), shares the recorded backing_id; anything
        else (every writer, a reader of another version) registers its own file. Where the kernel still
        holds another one, it refuses that open with EIO: never does a writer write through a reader's
        backing file (a worker's sealed block), nor a reader read another version than it asked for. A LOOKUP
        that finds another version gives the path a new inode (node_for), so that conflict lasts at most the
        entry timeout."""
        if not self.passthrough:
            return 0
        with self.lock:
            writing = {w.wfd for w in n.writers}
            for bid, k in reversed(n.backings.items()):
                if key[0] != "w" and (k == key or (k[0] == "w" and k[1] in writing)):
                    self.refs[bid] += 1
                    n.opens += 1
                    return bid
            try:
                bid = fp.backing_open(self.devfd, fd)
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
                    log.warning("FUSE_DEV_IOC_BACKING_OPEN refused (%s): reads are served by this process", e)
                    self.passthrough = False
                else:
                    log.info("no passthrough for %s: %s", n.path, e)
                return 0
            self.refs[bid] = 1
            n.backings[bid] = key
            n.opens += 1
            return bid

    def op_read(self, req: _Req) -> bytes:
        fh, off, size, _ = fp.READ_IN.unpack_from(req.body)
        h = self.handles.get(fh)
        if h is None or h.fd < 0:
            raise Reply(errno.EBADF)
        data = os.pread(h.fd, size, off)
        self.counters.inc("read_requests")
        self.counters.inc("read_bytes", len(data))
        return data

    def op_release(self, req: _Req) -> bytes:
        fh = fp.RELEASE_IN.unpack_from(req.body)[0]
        with self.lock:
            h = self.handles.pop(fh, None)
        if h is None:
            return b""
        n = h.node
        if h.wfd >= 0:
            try:
                self.publish(h)
            except Reply as r:
                log.warning("publish of %s at release failed: errno %d", n.path, r.code)
        close_id = 0
        with self.lock:
            if h.wfd >= 0:
                n.writers.remove(h)
                if n.unpublished and not n.writers:  # never published: it is gone
                    n.unpublished = False
                    if self.by_path.get(n.path) is n:
                        del self.by_path[n.path]
            if h.passthrough:
                n.opens -= 1
                self.refs[h.passthrough] -= 1
                if self.refs[h.passthrough] <= 0:
                    del self.refs[h.passthrough]
                    close_id = h.passthrough
                    n.backings.pop(close_id, None)
            if n.lookups <= 0 and n.opens <= 0 and self.nodes.get(n.ino) is n:
                del self.nodes[n.ino]
                if self.by_path.get(n.path) is n:
                    del self.by_path[n.path]
        if close_id:
            try:
                fp.backing_close(self.devfd, close_id)
            except OSError as e:
                log.warning("FUSE_DEV_IOC_BACKING_CLOSE %d: %s", close_id, e)
        if h.fd >= 0:
            os.close(h.fd)
        if h.wfd >= 0:
            os.close(h.wfd)
        if h.cached:
            self.cache.release(h.cached)
        return b""


class _Req:
    __slots__ = ("opcode", "unique", "nodeid", "body", "raw")

    def __init__(self, raw: memoryview) -> None:
        self.raw = raw
        _, self.opcode, self.unique, self.nodeid, _, _, _, _, _ = fp.IN_HEADER.unpack_from(raw)
        self.body = raw[fp.IN_HEADER.size:]


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="l2fs mount --passthrough",
                                description="l2fs mount whose reads and writes use FUSE passthrough (Linux >= 6.9).")
    p.add_argument("mountpoint")
    p.add_argument("--passthrough", action="store_true", help="(selects this server; always on here)")
    add_client_args(p, timeout=2.0)
    p.add_argument("--root", default="/")
    p.add_argument("--read-only", action="store_true", help="mount read-only (MS_RDONLY: writes get EROFS)")
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE),
                   help="largest file a close may publish (EFBIG beyond, nothing published; default 1G)")
    p.add_argument("--umask", type=lambda v: int(v, 8), default=0o022,
                   help="octal umask applied to 0777 (dirs) and 0666 (files), enforced by the kernel (default 022)")
    p.add_argument("--cache-timeout", type=float, default=1.0, help="kernel entry/attr cache, <= 1 s")
    p.add_argument("--process-reads", action="store_true",
                   help="do not use passthrough: answer READ requests from this process (the fallback path)")
    p.add_argument("--verify", choices=("open", "write"), default="open",
                   help="open: CRC-check each local block file at its first open on this node (default); "
                        "write: trust the worker's check at write unless the file was modified since")
    p.add_argument("--cache-dir", default=None, help="where cross-node blocks are copied, in a private subdirectory removed at exit "
                        "(default: $TMPDIR or /tmp)")
    p.add_argument("--cache-size", default="4G", help="bound on the cross-node copies kept (default 4G)")
    p.add_argument("--threads", type=int, default=8, help="request threads (default 8)")
    p.add_argument("--uid", type=int, default=0)
    p.add_argument("--gid", type=int, default=0)
    p.add_argument("--allow-other", action="store_true")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the server's counters on 127.0.0.1")
    # the pyfuse3 mount's flags that mean nothing here, accepted so that one argument list starts either mount
    p.add_argument("--write-buffer", default=None,
                   help="(not used: the kernel writes the temp files; their bound is the --cache-dir file system)")
    p.add_argument("--read-cache", default=None, help="(not used: no read snapshots, the kernel reads the files)")
    p.add_argument("--page-cache", action="store_true", help="(not used: passthrough reads use the block files' pages)")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)
    if not a.master:
        p.error("--master HOST:PORT (or $L2FS_MASTER) is required")
    if not 0 <= a.cache_timeout <= 1:
        p.error("--cache-timeout must be within 0..1 s")
    try:
        a.cache_size = parse_size(a.cache_size)
        a.max_file_size = parse_size(a.max_file_size)
    except ValueError as e:
        p.error(f"bad size: {e}")
    if a.max_file_size < 1:
        p.error("--max-file-size must be positive")
    if not 0 <= a.umask <= 0o777:
        p.error("--umask must be an octal mode within 000..777")
    kind = mount_type(a.mountpoint)
    if kind and kind.startswith("fuse"):
        p.error(f"{a.mountpoint} already has a {kind} mount; unmount it first: fusermount3 -u {a.mountpoint}")
    if not stat_is_dir(a.mountpoint):
        p.error(f"mountpoint {a.mountpoint!r} is not a directory")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO,
                        format="%(asctime)s l2fs-mount-pt %(levelname)s %(message)s")
    client = Client(a.master, **ClientOptions.from_args(a).client_kwargs())
    root = a.root.rstrip("/") or "/"
    if root != "/" and not a.read_only:  # as the pyfuse3 mount: an endpoint's prefix may not exist yet
        try:
            client.mkdir(root, parents=True, exist_ok=True)
        except L2fsError as e:
            log.warning("could not create --root %s now (%s); it must exist for the mount to work", root, e)
    cache_dir = tempfile.mkdtemp(prefix="l2fs-pt-", dir=a.cache_dir)
    mp = os.path.abspath(a.mountpoint)
    srv = PassthroughServer(client, mp, root=a.root, cache_dir=cache_dir, cache_size=a.cache_size,
                            passthrough=not a.process_reads, verify=a.verify, timeout=a.cache_timeout,
                            threads=a.threads, uid=a.uid, gid=a.gid,
                            allow_other=a.allow_other or bool(a.uid or a.gid), read_only=a.read_only,
                            max_file_size=a.max_file_size, umask=a.umask)
    try:
        srv.mount()
    except OSError as e:
        print(f"l2fs mount: cannot mount {mp}: {e}", file=sys.stderr)
        client.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
        return 1
    if a.metrics_port is not None:
        srv.counters.serve(a.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: srv.stop())
    log.info("mounted l2fs %s%s at %s (node %s, %s, passthrough requested: %s)", a.master, a.root, mp,
             a.node_id or "-", "read-only" if a.read_only else "read-write", not a.process_reads)
    try:
        srv.serve()
    finally:
        srv.stop()
        client.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
        log.info("unmounted %s", mp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
