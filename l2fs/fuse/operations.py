"""`l2fs mount`: a FUSE view of an l2fs cluster, so stock LMCache (`remote_url: fs://localhost:0/<mount>/`)
and any POSIX tool can use L2 with no plugin.

Design (why it looks like this):
- pyfuse3 (libfuse3 low level) on trio. Metadata and data RPCs are blocking `l2fs.Client` calls; they run in
  worker threads (`trio.to_thread`) bounded by a limiter, so one slow RPC never blocks other requests, and
  every call is bounded by the client's deadline, so a dead master gives EIO/ENOENT, never a hang.
- Whole-file semantics, like the l2fs object model: a file opened for reading is fetched once at `open`
  (one `Client.get_into` into a pooled buffer, short-circuited to the local worker's disk when `--node-id`
  matches) and served from that snapshot, shared by every read-only open of the inode, so a reader never
  sees a torn file and N opens cost one copy. Each open-for-write handle has its own buffer,
  published atomically with `Client.put` on `flush` (close) or `fsync` (close-to-open consistency, like
  NFS): concurrent writers of one name never mix, the last close wins, and readers (on any node) see only
  published versions. A file created here and not yet closed is visible (size, listing) on this mount only.
- Cross-node visibility: entry/attr timeouts <= 1 s, no negative entries (ENOENT is never cached), and
  `direct_io` by default so no stale page cache survives a rename done on another node.
- Inodes are per path within this mount (allocated on lookup/readdirplus, dropped on forget).
- Bounded memory: writes and truncates past --max-file-size get EFBIG before allocating, and unfinished
  write buffers across the mount stay under --write-buffer (ENOSPC), so no request can grow the daemon.
- `--page-cache`: l2fs files are immutable once published, so an open whose (size, CRC32C) on the master is
  the version the kernel's pages hold keeps them (FOPEN_KEEP_CACHE) and fetches nothing.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat as st
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from l2fs.client import (
    AlreadyExists,
    Client,
    FileInfo,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from l2fs.common import DEFAULT_MAX_FILE_SIZE, crc32c_fast

log = logging.getLogger("l2fs.fuse")
READ_CACHE = 256 << 20  # bytes of read snapshots held for open read-only handles (l2fs mount --read-cache)

NAME_MAX = 255
T = TypeVar("T")
RENAME_NOREPLACE = getattr(pyfuse3, "RENAME_NOREPLACE", 1)
RENAME_EXCHANGE = getattr(pyfuse3, "RENAME_EXCHANGE", 2)
# How an open may use the kernel page cache, as (direct_io, keep_cache) of the open reply:
DIRECT = (True, False)  # no page cache (direct_io mounts, writers, files not yet published)
BYPASS = (True, True)  # page-cache mount, but handles on another version are open: neither use nor drop pages
FRESH = (False, False)  # page cache, dropping the pages the inode held (another version)
KEEP = (False, True)  # page cache, keeping the pages: they hold this same version


def errno_of(exc: BaseException) -> int:
    """Map an l2fs client exception to the errno the kernel should see."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    named = getattr(exc, "errno", None)  # set by the client from the server's `l2fs-errno` metadata
    if isinstance(named, int) and named:
        return named
    if isinstance(exc, NotFound):
        return errno.ENOENT
    if isinstance(exc, AlreadyExists):
        return errno.EEXIST
    if isinstance(exc, InvalidArgument):  # InvalidPath included; ENAMETOOLONG/EFBIG arrive as .errno above
        return errno.EINVAL
    if isinstance(exc, PermissionDenied):
        return errno.EACCES
    return errno.EIO  # Unavailable (dead master/worker) and anything unexpected


def _join(parent: str, name: str) -> str:
    return "/" + name if parent == "/" else f"{parent}/{name}"


class _Node:
    """One inode this mount has handed to the kernel."""

    __slots__ = ("ino", "path", "is_dir", "size", "mtime", "lookups", "opens", "writers", "unpublished",
                 "detached", "snap", "snap_ident", "readers", "pins", "lock", "kident", "snap_direct")

    def __init__(self, ino: int, path: str, is_dir: bool, size: int = 0, mtime: float = 0.0) -> None:
        self.ino = ino
        self.path = path
        self.is_dir = is_dir
        self.size = size
        self.mtime = mtime
        self.lookups = 0
        self.opens = 0
        self.writers: list[_Handle] = []  # open-for-write handles, most recently written last
        self.unpublished = False  # created on this mount and not yet published
        self.detached = False  # unlinked / renamed over: never publish again
        # The read snapshot shared by every read-only open of this inode (one copy, not one per open), and
        # the (size, crc32c) it holds, computed lazily the first time a second open has to compare it.
        self.snap: memoryview | None = None
        self.snap_ident: tuple[int, int] | None = None
        self.readers = 0  # open read-only handles; the snapshot is dropped when the last one closes
        self.pins = 0  # opens in progress: they will use the snapshot, so it is not dropped under them
        self.lock: trio.Lock | None = None  # serialises snapshot loads of this inode
        # page-cache mode: the (size, crc32c) of the version whose pages the kernel may hold for this inode,
        # so an open of that same version keeps them (FOPEN_KEEP_CACHE) and any other open drops them
        self.kident: tuple[int, int] | None = None
        self.snap_direct = False  # the snapshot's opens bypass the page cache (see snapshot())

    @property
    def local(self) -> bool:
        """This mount holds a newer view of the file's metadata than l2fs (open writers)."""
        return bool(self.writers)

    @property
    def view_size(self) -> int:
        return len(self.writers[-1].buf) if self.writers else self.size


class _Handle:
    __slots__ = ("node", "writable", "append", "data", "buf", "dirty", "lent", "want")

    def __init__(self, node: _Node, *, data: memoryview | None = None, buf: bytearray | None = None,
                 append: bool = False, dirty: bool = False) -> None:
        self.node = node
        self.writable = buf is not None
        self.append = append
        self.data = data  # read snapshot (read-only handles)
        self.buf = buf if buf is not None else bytearray()  # this handle's private write buffer
        self.dirty = dirty  # buf differs from what l2fs holds
        self.lent = False  # buf is being published: copy it before the next change (copy-on-write)
        self.want: tuple[int, int] | None = None  # lazy snapshot: the version the kernel's kept pages hold

    def own_buf(self) -> bytearray:
        """The write buffer, safe to change (a copy if a publish still holds the current one; the caller
        has reserved the copy's bytes, see L2Operations.reserve)."""
        if self.lent:
            self.buf = bytearray(self.buf)
            self.lent = False
        return self.buf


class _BufferPool:
    """Freed read snapshots kept for reuse (bounded bytes). A fresh 32 MiB buffer costs 8,192 page faults
    on first touch, which was a third of a cold open; a reused one is already mapped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.bufs: list[bytearray] = []
        self.held = 0

    def take(self, size: int) -> bytearray:
        for i, b in enumerate(self.bufs):
            if size <= len(b) <= size + (size >> 3) + 4096:  # little waste: KV chunks are mostly one size
                self.held -= len(b)
                return self.bufs.pop(i)
        return bytearray(size)

    def give(self, view: memoryview) -> None:
        """Return a snapshot's buffer, once nothing references it any more."""
        b = view.obj
        try:
            view.release()
        except BufferError:  # still exported somewhere: let it be garbage collected instead
            return
        if isinstance(b, bytearray) and self.held + len(b) <= self.cap:
            self.bufs.append(b)
            self.held += len(b)
        while self.held > self.cap // 2 and len(self.bufs) > 8:  # many sizes: keep the recent ones
            self.held -= len(self.bufs.pop(0))


class L2Operations(pyfuse3.Operations):
    """pyfuse3 operations backed by an `l2fs.Client`."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, client: Client, *, root: str = "/", read_only: bool = False, timeout: float = 1.0,
                 direct_io: bool = True, threads: int = 16, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 write_buffer: int = 2 * DEFAULT_MAX_FILE_SIZE, uid: int | None = None, gid: int | None = None,
                 umask: int = 0o022, read_cache: int = READ_CACHE) -> None:
        super().__init__()
        # Memory bounds: no file grows past max_file_size (EFBIG before anything is allocated), and the
        # bytes buffered for unpublished writes across the whole mount stay under write_buffer (ENOSPC).
        self.max_file_size = max_file_size
        self.write_buffer = write_buffer
        self.buffered = 0
        self.pool = _BufferPool(128 << 20)
        # read snapshots held for open read-only handles: at most read_cache bytes (least recently used
        # evicted first; their handles fetch the same version again when read, see _count_snap)
        self.read_cache = read_cache
        self.snap_bytes = 0
        self.snaps: OrderedDict[int, _Node] = OrderedDict()  # ino -> node holding a counted snapshot
        self.client = client
        self.root = root.rstrip("/") or "/"
        self.read_only = read_only
        self.timeout = min(float(timeout), 1.0)
        self.direct_io = direct_io
        self.limiter = trio.CapacityLimiter(threads)
        # Owner and modes every entry shows (l2fs stores none). The kernel enforces them (default_permissions),
        # so --uid/--gid/--umask decide which non-root users (a vLLM container's) may write.
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        wmask = 0o555 if read_only else 0o777
        self.dir_mode = 0o777 & ~umask & wmask
        self.file_mode = 0o666 & ~umask & wmask
        self.nodes: dict[int, _Node] = {}
        self.by_path: dict[str, _Node] = {}
        self.handles: dict[int, _Handle] = {}
        self.dirs: dict[int, list[tuple[str, FileInfo | _Node]]] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.next_fh = 1
        self._statfs: tuple[float, pyfuse3.StatvfsData] | None = None
        rootnode = _Node(pyfuse3.ROOT_INODE, "/", True, mtime=time.time())
        rootnode.lookups = 1
        self.nodes[rootnode.ino] = rootnode
        self.by_path["/"] = rootnode

    # ---------------------------------------------------------------- helpers
    def l2(self, path: str) -> str:
        """Mount-relative path -> l2fs path (under --root)."""
        if self.root == "/":
            return path
        return self.root if path == "/" else self.root + path

    def mnt(self, l2path: str) -> str:
        """l2fs path -> mount-relative path."""
        if self.root == "/":
            return l2path
        return l2path[len(self.root):] or "/"

    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking client call in a worker thread; client errors become FUSEError."""
        try:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self.limiter)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the kernel as an errno
            code = errno_of(e)
            log.debug("%s%r failed: %r -> errno %d", getattr(fn, "__name__", fn), args[:1], e, code)
            raise pyfuse3.FUSEError(code) from None

    def node(self, ino: int) -> _Node:
        n = self.nodes.get(ino)
        if n is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return n

    def child_path(self, parent_ino: int, name: bytes) -> str:
        if len(name) > NAME_MAX:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        if b"/" in name or b"\0" in name or name in (b"", b".", b".."):
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return _join(self.node(parent_ino).path, sname)

    def check_writable(self) -> None:
        if self.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)

    def reserve(self, h: _Handle | None, new_len: int, *, extra: int = 0) -> None:
        """Account for h's buffer becoming new_len bytes (plus `extra` transient bytes) BEFORE it is
        allocated: EFBIG past the max file size, ENOSPC past the mount's write-buffer cap."""
        if new_len > self.max_file_size:
            raise pyfuse3.FUSEError(errno.EFBIG)
        cur = len(h.buf) if h is not None else 0
        copy = cur if h is not None and h.lent else 0  # own_buf will copy a buffer a publish still holds
        grow = max(0, new_len - cur) + copy + extra
        if grow and self.buffered + grow > self.write_buffer:
            log.warning("write buffers full (%d of %d bytes): ENOSPC", self.buffered, self.write_buffer)
            raise pyfuse3.FUSEError(errno.ENOSPC)
        self.buffered += copy + extra + (new_len - cur)

    def node_for(self, path: str, info: FileInfo) -> _Node:
        """The node for path, created or refreshed from l2fs metadata (lookup count unchanged)."""
        n = self.by_path.get(path)
        if n is not None and n.is_dir != info.is_dir:
            self.detach(n)
            n = None
        if n is None:
            n = _Node(self.next_ino, path, info.is_dir)
            self.next_ino += 1
            self.nodes[n.ino] = n
            self.by_path[path] = n
        if not n.local:
            n.size, n.mtime = info.size, info.mtime
        return n

    def new_local(self, path: str) -> _Node:
        n = self.by_path.get(path)
        if n is None or n.is_dir:
            if n is not None:
                self.detach(n)
            n = _Node(self.next_ino, path, False, mtime=time.time())
            self.next_ino += 1
            self.nodes[n.ino] = n
            self.by_path[path] = n
        return n

    def detach(self, n: _Node) -> None:
        """Forget n's path (unlinked or replaced); the inode lives until the kernel forgets it."""
        if self.by_path.get(n.path) is n:
            del self.by_path[n.path]
        n.detached = True
        self.maybe_drop(n)

    def drop_unpublished(self, n: _Node) -> None:
        """Forget a file that only ever existed on this mount, and make the kernel forget its dentry."""
        path = n.path
        n.unpublished = False
        self.detach(n)
        i = path.rfind("/")
        parent = self.by_path.get(path[:i] or "/")
        if parent is not None:
            pyfuse3.invalidate_entry_async(parent.ino, path[i + 1:].encode(), ignore_enoent=True)

    def maybe_drop(self, n: _Node) -> None:
        if n.lookups <= 0 and n.opens <= 0 and n.ino != pyfuse3.ROOT_INODE:
            self.nodes.pop(n.ino, None)
            if self.by_path.get(n.path) is n:
                del self.by_path[n.path]

    def attrs(self, n: _Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.generation = 0
        a.entry_timeout = self.timeout
        a.attr_timeout = self.timeout
        if n.is_dir:
            a.st_mode = st.S_IFDIR | self.dir_mode
            a.st_nlink = 2
            a.st_size = 0
        else:
            a.st_mode = st.S_IFREG | self.file_mode
            a.st_nlink = 1
            a.st_size = n.view_size
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = 1 << 20
        a.st_blocks = (a.st_size + 511) // 512
        ns = int(n.mtime * 1e9)
        a.st_atime_ns = a.st_ctime_ns = a.st_mtime_ns = ns
        return a

    async def refresh(self, n: _Node) -> None:
        """Re-read n's metadata from l2fs (unless this mount holds its newer content)."""
        if n.local or n.ino == pyfuse3.ROOT_INODE or n.detached:
            return
        info = await self.call(self.client.stat, self.l2(n.path))
        if info is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if info.is_dir != n.is_dir:  # replaced by the other kind elsewhere: this inode is stale
            self.detach(n)
            raise pyfuse3.FUSEError(errno.ENOENT)
        n.size, n.mtime = info.size, info.mtime

    async def publish(self, h: _Handle) -> None:
        """Atomically publish h's buffer at its node's current path (POSIX overwrite: last close wins)."""
        n = h.node
        if not h.dirty or n.detached:
            return
        data = h.buf  # lent without a copy; a write arriving during the RPC copies it first (own_buf)
        h.lent, h.dirty = True, False
        try:
            await self.call(self.client.put, self.l2(n.path), data, if_absent=False)
        except pyfuse3.FUSEError:
            h.dirty = True
            if n.unpublished:  # a new file that could not be published does not exist: drop it now
                self.drop_unpublished(n)
            raise
        finally:
            if h.buf is data:
                h.lent = False
            else:  # a write copied the buffer meanwhile (own_buf): the lent one is freed now
                self.buffered -= len(data)
        n.unpublished = False
        n.size, n.mtime = len(data), time.time()

    # ---------------------------------------------------------------- metadata
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        path = self.child_path(parent_inode, name)
        n = self.by_path.get(path)
        if n is None or not n.unpublished:
            info = await self.call(self.client.stat, self.l2(path))
            if info is None:
                raise pyfuse3.FUSEError(errno.ENOENT)  # not cached by the kernel: no negative entries
            n = self.node_for(path, info)
        n.lookups += 1
        return self.attrs(n)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            n = self.nodes.get(ino)
            if n is not None:
                n.lookups -= count
                self.maybe_drop(n)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        n = self.node(inode)
        await self.refresh(n)
        return self.attrs(n)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        n = self.node(inode)
        if fields.update_size:
            self.check_writable()
            if n.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            size = attr.st_size
            h = self.handles.get(fh) if fh is not None else None
            if h is None and n.writers:
                h = n.writers[-1]
            if h is not None and h.writable:  # ftruncate: changes that handle's buffer
                self.reserve(h, size)
                self._resize(h.own_buf(), size)
                h.dirty = True
            else:  # truncate(path): read-modify-publish, with the file's old and new bytes reserved
                held = size + (0 if size == 0 else n.size)
                self.reserve(None, held)
                try:
                    data = b"" if size == 0 else await self.call(self.client.get, self.l2(n.path))
                    if data is None:
                        raise pyfuse3.FUSEError(errno.ENOENT)
                    buf = bytearray(data)
                    del data
                    self._resize(buf, size)
                    await self.call(self.client.put, self.l2(n.path), buf, if_absent=False)
                finally:
                    self.buffered -= held
                n.size, n.mtime = size, time.time()
        # mode/owner/times are not stored by l2fs; accept them so tools like cp -p and touch work.
        return self.attrs(n)

    @staticmethod
    def _resize(buf: bytearray, size: int) -> None:
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(bytes(size - len(buf)))

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        self.check_writable()
        path = self.child_path(parent_inode, name)
        await self.call(self.client.mkdir, self.l2(path), parents=False, exist_ok=False)
        n = self.node_for(path, FileInfo(path=path, size=0, is_dir=True, mtime=time.time()))
        n.lookups += 1
        return self.attrs(n)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.check_writable()
        path = self.child_path(parent_inode, name)
        await self.call(self.client.rmdir, self.l2(path))
        n = self.by_path.get(path)
        if n is not None:
            self.detach(n)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.check_writable()
        path = self.child_path(parent_inode, name)
        n = self.by_path.get(path)
        removed = await self.call(self.client.rm, self.l2(path))
        if not removed and (n is None or not n.unpublished):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if n is not None:
            self.detach(n)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        self.check_writable()
        if flags & RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        src = self.child_path(parent_inode_old, name_old)
        dst = self.child_path(parent_inode_new, name_new)
        if src == dst:
            return
        sn = self.by_path.get(src)
        if sn is not None and sn.writers and sn.writers[-1].dirty:
            await self.publish(sn.writers[-1])  # renaming a file still being written: publish it first
        await self.call(self.client.rename, self.l2(src), self.l2(dst), overwrite=not flags & RENAME_NOREPLACE)
        dn = self.by_path.get(dst)
        if dn is not None and dn is not sn:
            self.detach(dn)
        if sn is not None:
            self._move(sn, src, dst)

    def _move(self, sn: _Node, src: str, dst: str) -> None:
        moved = [sn] + ([n for p, n in self.by_path.items() if p.startswith(src + "/")] if sn.is_dir else [])
        for n in moved:
            if self.by_path.get(n.path) is n:
                del self.by_path[n.path]
        for n in moved:
            n.path = dst + n.path[len(src):]
            old = self.by_path.get(n.path)
            if old is not None and old is not n:
                self.detach(old)
            self.by_path[n.path] = n

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        now = time.monotonic()
        if self._statfs is not None and now - self._statfs[0] < 2.0:
            return self._statfs[1]
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = NAME_MAX
        try:
            rep = await self.call(self.client.report)
            s.f_blocks = rep.capacity // 4096
            s.f_bfree = s.f_bavail = max(0, rep.capacity - rep.used) // 4096
            s.f_files = max(rep.files * 2, 1 << 20)
            s.f_ffree = s.f_favail = s.f_files - rep.files
        except pyfuse3.FUSEError:
            s.f_blocks = s.f_bfree = s.f_bavail = 0
            s.f_files = s.f_ffree = s.f_favail = 0
        self._statfs = (now, s)
        return s

    # ---------------------------------------------------------------- directories
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        n = self.node(inode)
        if not n.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        infos = await self.call(self.client.ls, self.l2(n.path))
        entries: list[tuple[str, FileInfo | _Node]] = []
        seen: set[str] = set()
        for info in infos:
            name = info.path.rstrip("/").rsplit("/", 1)[-1]
            if name and name not in seen:
                seen.add(name)
                entries.append((name, info))
        # files being written through this mount are visible here before they are published
        prefix = n.path.rstrip("/") + "/"
        for p, cn in list(self.by_path.items()):
            if cn.unpublished and p.startswith(prefix) and "/" not in p[len(prefix):]:
                name = p[len(prefix):]
                if name not in seen:
                    seen.add(name)
                    entries.append((name, cn))
        entries.sort(key=lambda e: e[0])
        fh = self.next_fh
        self.next_fh += 1
        self.dirs[fh] = entries
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self.dirs.get(fh)
        if entries is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(entries)):
            name, item = entries[i]
            n = item if isinstance(item, _Node) else self.node_for(self.mnt(item.path), item)
            if not pyfuse3.readdir_reply(token, name.encode(), self.attrs(n), i + 1):
                self.maybe_drop(n)
                break
            n.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    # ---------------------------------------------------------------- files
    def _new_handle(self, h: _Handle, how: tuple[bool, bool] = DIRECT) -> pyfuse3.FileInfo:
        """how: (direct_io, keep_cache), see DIRECT, BYPASS, FRESH, KEEP."""
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = h
        h.node.opens += 1
        if h.writable:
            h.node.writers.append(h)
        return pyfuse3.FileInfo(fh=fh, direct_io=how[0], keep_cache=how[1])

    def _unpublished_data(self, n: _Node) -> memoryview | None:
        """Content of a file created on this mount and not yet closed (only this mount can see it)."""
        return memoryview(bytes(n.writers[-1].buf)) if n.unpublished and n.writers else None

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        n = self.node(inode)
        if n.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if writable or flags & os.O_TRUNC:
            self.check_writable()
        if flags & os.O_TRUNC:
            return self._new_handle(_Handle(n, buf=bytearray(), append=bool(flags & os.O_APPEND), dirty=True))
        if not writable:
            how = DIRECT
            if n.unpublished:
                view = self._unpublished_data(n)
                if view is None:
                    raise pyfuse3.FUSEError(errno.ENOENT)
            else:
                n.pins += 1
                try:
                    view, how = await self.snapshot(n)
                except BaseException:
                    n.pins -= 1
                    if n.readers + n.pins <= 0:  # the open failed and nothing else uses the snapshot
                        self.drop_snapshot(n)
                    raise
                n.pins -= 1
            h = _Handle(n, data=view)
            if view is None:
                h.want = n.kident
            n.readers += 1
            return self._new_handle(h, how)
        data = await self.call(self.client.get, self.l2(n.path)) if not n.unpublished else None
        if data is None:
            view = self._unpublished_data(n)
            data = bytes(view) if view is not None else None
        if data is None:  # miss: gone, evicted, or its worker is down
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.reserve(None, len(data))
        return self._new_handle(_Handle(n, buf=bytearray(data), append=bool(flags & os.O_APPEND)))

    async def snapshot(self, n: _Node) -> tuple[memoryview | None, tuple[bool, bool]]:
        """The current published content of n, shared by all read-only opens: reused while l2fs still
        holds the same (size, crc32c), fetched once (CRC-verified by the client) when it changed.
        Also says how the kernel may cache it (DIRECT, BYPASS, FRESH or KEEP; with KEEP no snapshot is
        fetched until a read misses the kept pages)."""
        if n.lock is None:
            n.lock = trio.Lock()
        async with n.lock:  # concurrent opens of one inode wait for one fetch instead of making N copies
            ident: tuple[int, int] | None = None
            # The identity costs a Stat RPC; it is worth it when there is something to reuse: a shared
            # snapshot, or (page-cache mode) kernel pages of a version served before.
            if n.snap is not None or not self.direct_io:
                info = await self.call(self.client.stat, self.l2(n.path))
                if info is None or info.is_dir:
                    raise pyfuse3.FUSEError(errno.ENOENT)
                ident = (info.size, info.crc32c)
                if n.snap is not None and n.snap_ident is None:
                    snap = n.snap
                    n.snap_ident = (len(snap), await trio.to_thread.run_sync(crc32c_fast, snap))
                if n.snap is None and n.kident == ident and not n.local and not self.direct_io:
                    return None, KEEP  # the kernel holds this version's pages: fetch only if it asks
            shared_cache = True
            if n.snap is None or n.snap_ident != ident:
                # Handles still open on an older snapshot would fill the inode's page cache with old bytes:
                # while they live, opens of the new version bypass the page cache.
                shared_cache = n.readers == 0
                self._uncount_snap(n)
                n.snap = await self.fetch(n)  # handles on an older snapshot keep their own reference
                self._count_snap(n)
                # the client checked the bytes against the CRC of the version it located, which is the one
                # stat saw or a newer one: a newer one leaves ident unknown (no reuse, no kept pages)
                n.snap_ident = ident if ident is not None and len(n.snap) == ident[0] else None
                if not n.local:
                    n.size = len(n.snap)
            if self.direct_io:
                return n.snap, DIRECT
            if not shared_cache or n.snap_direct or n.local:  # n.local: the size shown is a writer's
                n.snap_direct = True
                n.kident = None  # pages of two versions may end up cached: never keep them later
                return n.snap, BYPASS
            keep = n.kident is not None and n.kident == n.snap_ident
            if n.kident is not None and not keep:  # another version: the kernel's size of n is stale too
                pyfuse3.invalidate_inode(n.ino, attr_only=True)
            n.kident = n.snap_ident
            return n.snap, KEEP if keep else FRESH

    async def fetch(self, n: _Node) -> memoryview:
        """Whole published file into a pooled buffer (sized from the last stat; a grown file falls back)."""
        path = self.l2(n.path)
        if n.size > 0:
            buf = self.pool.take(n.size)

            def get_into() -> int | None:
                try:
                    return self.client.get_into(path, buf)
                except ValueError:  # the buffer is too small: the file grew since the last stat
                    return -1

            got = await self.call(get_into)
            if got is None:
                raise pyfuse3.FUSEError(errno.ENOENT)  # miss: gone, evicted, or its worker is down
            if got >= 0:
                return memoryview(buf)[:got]
        data = await self.call(self.client.get, path)
        if data is None:  # miss: gone, evicted, or its worker is down
            raise pyfuse3.FUSEError(errno.ENOENT)
        return memoryview(data)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self.check_writable()
        path = self.child_path(parent_inode, name)
        n = self.new_local(path)
        n.detached = False
        n.unpublished = True
        n.mtime = time.time()
        n.lookups += 1
        # dirty from the start: even an empty file is published on close
        fi = self._new_handle(_Handle(n, buf=bytearray(), append=bool(flags & os.O_APPEND), dirty=True))
        return fi, self.attrs(n)

    # pyfuse3 replies with any buffer; its stub says bytes, but a memoryview slice saves a copy per read
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        h = self.handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if h.data is None and h.want is not None:
            h.data = await self.lazy_snapshot(h.node, h.want)
        if h.data is not None:
            if h.node.ino in self.snaps:
                self.snaps.move_to_end(h.node.ino)
            return h.data[off:off + size]
        return bytes(h.buf[off:off + size])

    async def lazy_snapshot(self, n: _Node, want: tuple[int, int]) -> memoryview:
        """The snapshot of a handle opened on kept pages, fetched when the kernel lacks one of them. The
        bytes must be the very version those pages hold (size and CRC32C), or the file would be torn: EIO."""
        assert n.lock is not None
        async with n.lock:
            if n.snap is not None and n.snap_ident == want:
                return n.snap
            view = await self.fetch(n)
            if len(view) != want[0] or await trio.to_thread.run_sync(crc32c_fast, view) != want[1]:
                log.warning("%s changed while its kept pages were read: EIO", n.path)
                n.kident = None
                raise pyfuse3.FUSEError(errno.EIO)
            if n.snap is None:
                n.snap, n.snap_ident = view, want
                self._count_snap(n)
            return view

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles.get(fh)
        if h is None or not h.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        if h.append:
            off = len(h.buf)
        self.reserve(h, max(len(h.buf), off + len(buf)))
        b = h.own_buf()
        if off == len(b):
            b += buf
        else:
            if off > len(b):
                b.extend(bytes(off - len(b)))
            b[off:off + len(buf)] = buf
        h.dirty = True
        w = h.node.writers
        if w[-1] is not h:  # most recently written handle defines the size this mount reports
            w.remove(h)
            w.append(h)
        return len(buf)

    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is not None and h.writable:
            await self.publish(h)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        n = h.node
        n.opens -= 1
        if not h.writable:
            n.readers -= 1
            h.data = None
            if n.readers + n.pins <= 0:  # the last reader: free the snapshot (the kernel may keep pages)
                self.drop_snapshot(n)
        else:
            try:
                await self.publish(h)
            except pyfuse3.FUSEError as e:
                log.warning("publish of %s at release failed: errno %d", n.path, e.errno)
            n.writers.remove(h)
            self.buffered -= len(h.buf)
            h.buf = bytearray()
            if n.unpublished and not n.writers:  # never published: it is gone
                self.drop_unpublished(n)
        self.maybe_drop(n)

    def drop_snapshot(self, n: _Node) -> None:
        """Free n's snapshot into the pool: only when no open handle and no open in progress can use it."""
        self._uncount_snap(n)
        if n.snap is not None:
            self.pool.give(n.snap)
        n.snap, n.snap_ident, n.snap_direct = None, None, False

    def _uncount_snap(self, n: _Node) -> None:
        if self.snaps.pop(n.ino, None) is not None and n.snap is not None:
            self.snap_bytes -= len(n.snap)

    def _count_snap(self, n: _Node) -> None:
        """Count n's new snapshot against read_cache, evicting the least recently used others' past it.

        Why: the snapshot of a file stays while any read-only handle of it is open, so opens of 40 files of
        8 MiB that were never closed (any local user of an --allow-other mount) pinned 320 MiB. An evicted
        snapshot's handles keep the version they opened (size, CRC32C) and fetch it again at their next read
        (lazy_snapshot: the same bytes, or EIO if that version is gone); one file larger than read_cache is
        still served, alone."""
        if n.snap is None:
            return
        self.snaps[n.ino] = n
        self.snap_bytes += len(n.snap)
        for ino in list(self.snaps):
            if self.snap_bytes <= self.read_cache:
                break
            if ino != n.ino:
                self._evict_snap(self.snaps[ino])

    def _evict_snap(self, n: _Node) -> None:
        """Drop n's snapshot from memory although handles are open: each is pointed at its version instead."""
        snap = n.snap
        if snap is None:
            return
        ident = n.snap_ident or (len(snap), crc32c_fast(snap))
        for h in self.handles.values():
            if h.node is n and h.data is snap:
                h.data, h.want = None, ident
        self._uncount_snap(n)
        n.snap, n.snap_ident = None, None  # not pooled: the point is to give the memory back

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK and self.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True


def _guard(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """An unexpected exception in one request handler would end pyfuse3's loop, and with it the mount for
    every process (ENOTCONN until someone runs fusermount3 -u): that request gets EIO instead."""
    @functools.wraps(fn)
    async def guarded(self: L2Operations, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("%s failed: EIO", fn.__name__)
            if fn.__name__ == "forget":  # no reply to send
                return None
            raise pyfuse3.FUSEError(errno.EIO) from None
    return guarded


for _op in ("lookup", "forget", "getattr", "setattr", "mkdir", "rmdir", "unlink", "rename", "statfs", "opendir",
            "readdir", "releasedir", "open", "create", "read", "write", "flush", "fsync", "release", "access"):
    setattr(L2Operations, _op, _guard(getattr(L2Operations, _op)))
