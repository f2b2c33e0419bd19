"""The Linux FUSE kernel protocol (include/uapi/linux/fuse.h, 7.40+), the subset the passthrough server needs.

Why our own: libfuse 3.14 (Debian 12, wrapped by pyfuse3) cannot set the FUSE_PASSTHROUGH init flag nor put
a backing_id in an OPEN reply (docs/mount.md, Speed step 6), so `l2fs mount --passthrough` speaks the
protocol on /dev/fuse itself. Only structs, constants and the mount(2)/ioctl calls live here; the server is
l2fs/fuse/passthrough.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import struct

# ---------------------------------------------------------------- opcodes
LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
MKDIR, UNLINK, RMDIR, RENAME = 9, 10, 11, 12
OPEN, READ, WRITE, STATFS, RELEASE, FSYNC = 14, 15, 16, 17, 18, 20
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 25, 26, 27, 28, 29
ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET, READDIRPLUS, RENAME2 = 34, 35, 36, 38, 42, 44, 45
NO_REPLY = frozenset({FORGET, BATCH_FORGET})

# ---------------------------------------------------------------- INIT flags (64 bits: flags | flags2 << 32)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3  # OPEN carries O_TRUNC (else the kernel sends OPEN, then SETATTR size 0)
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37  # bit 5 of flags2

# ---------------------------------------------------------------- OPEN reply flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

# ---------------------------------------------------------------- structs (little endian, as the kernel's)
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (then unused[11])
# major minor max_readahead flags max_background congestion_threshold max_write time_gran max_pages
# map_alignment flags2 max_stack_depth request_timeout unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid *_nsec, then ATTR
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy, then ATTR
OPEN_IN = struct.Struct("<II")  # flags open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (then lock_owner flags padding)
RELEASE_IN = struct.Struct("<QII")  # fh flags release_flags (then lock_owner)
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags, then the name
MKDIR_IN = struct.Struct("<II")  # mode umask, then the name
RENAME_IN = struct.Struct("<Q")  # newdir, then oldname NUL newname NUL
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding, then the names
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding, then the data
WRITE_OUT = struct.Struct("<II")  # size padding
FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode unused4 uid gid unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FATTR_SIZE, FATTR_FH = 1 << 3, 1 << 4
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
KSTATFS = struct.Struct("<QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name padded to 8 bytes
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding

MIN_MINOR = 40  # fuse_init_out with flags2 and max_stack_depth; the kernel accepts any minor it knows


def _iow(typ: int, nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (typ << 8) | nr


DEV_IOC_BACKING_OPEN = _iow(229, 1, BACKING_MAP.size)
DEV_IOC_BACKING_CLOSE = _iow(229, 2, 4)


def backing_open(devfd: int, fd: int) -> int:
    """Register fd as a backing file on this FUSE connection; returns its backing_id (OSError: EPERM without
    CAP_SYS_ADMIN, EOPNOTSUPP/ENOTTY on kernels without passthrough, ELOOP when stacked too deep)."""
    return fcntl.ioctl(devfd, DEV_IOC_BACKING_OPEN, bytearray(BACKING_MAP.pack(fd, 0, 0)), True)


def backing_close(devfd: int, backing_id: int) -> None:
    fcntl.ioctl(devfd, DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)


def attr(ino: int, size: int, mode: int, mtime: float, uid: int, gid: int, nlink: int = 1) -> bytes:
    sec = int(mtime)
    nsec = int((mtime - sec) * 1e9)
    return ATTR.pack(ino, size, (size + 511) // 512, sec, sec, sec, nsec, nsec, nsec, mode, nlink, uid, gid,
                     0, 4096, 0)


def _valid(t: float) -> tuple[int, int]:
    return int(t), int((t - int(t)) * 1e9)


def entry_out(ino: int, attr_bytes: bytes, timeout: float) -> bytes:
    s, ns = _valid(timeout)
    return ENTRY_OUT.pack(ino, 0, s, s, ns, ns) + attr_bytes


def attr_out(attr_bytes: bytes, timeout: float) -> bytes:
    s, ns = _valid(timeout)
    return ATTR_OUT.pack(s, ns, 0) + attr_bytes


def dirent(ino: int, off: int, name: bytes, dtype: int) -> bytes:
    raw = DIRENT.pack(ino, off, len(name), dtype) + name
    return raw + b"\0" * (-len(raw) % 8)


# ---------------------------------------------------------------- mount(2) / umount2(2)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
MS_NOSUID, MS_NODEV, MS_RDONLY, MS_NOATIME = 2, 4, 1, 1024
MNT_DETACH = 2


def mount(devfd: int, target: str, fsname: str, *, allow_other: bool, max_read: int, read_only: bool = True) -> None:
    """Mount /dev/fuse (devfd) at target as a `fuse.l2fs` file system (MS_RDONLY unless read_only is False)."""
    data = (f"fd={devfd},rootmode=40000,user_id=0,group_id=0,default_permissions,max_read={max_read}"
            + (",allow_other" if allow_other else ""))
    flags = MS_NOSUID | MS_NODEV | MS_NOATIME | (MS_RDONLY if read_only else 0)
    if _libc.mount(fsname.encode(), target.encode(), b"fuse.l2fs", flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def umount(target: str) -> None:
    """Lazy unmount: the kernel ends the connection and our next /dev/fuse read gets ENODEV."""
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def passthrough_offered(scratch: str) -> bool:
    """Whether this kernel offers FUSE_PASSTHROUGH (Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH), read from the
    INIT request of a throwaway mount at scratch (an empty directory; needs the right to mount FUSE). A probe,
    not a version check: distribution kernels back- or leave out the feature. The INIT is refused (ENOSYS), so
    the throwaway connection serves nothing and is unmounted at once. Raises OSError when no FUSE mount can
    be made at all."""
    devfd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        mount(devfd, scratch, "l2fs-probe", allow_other=False, max_read=4096)
        try:
            raw = os.read(devfd, 1 << 20)  # the kernel queues INIT at mount time
            _, opcode, unique, *_ = IN_HEADER.unpack_from(raw)
            if opcode != INIT:
                raise OSError(0, f"FUSE probe: first request was opcode {opcode}, not INIT")
            _, _, _, flags, flags2 = INIT_IN.unpack_from(raw, IN_HEADER.size)
            offered = flags | (flags2 << 32 if flags & INIT_EXT else 0)
            os.write(devfd, OUT_HEADER.pack(OUT_HEADER.size, -38, unique))  # -ENOSYS: no session
        finally:
            umount(scratch)
    finally:
        os.close(devfd)
    return bool(offered & PASSTHROUGH)
