"""The FUSE mount (`l2fs mount`): `operations` (the pyfuse3 file system), `passthrough` (the read-only
kernel-passthrough server) speaking `kernel` (the /dev/fuse wire structs), and `main` (flags, mount loop,
spawn/stop). The names tests and launchers use are re-exported here."""

from l2fs.fuse.main import is_mounted, main, mount_type, parse_args, spawn, stat_is_dir, stop
from l2fs.fuse.operations import L2Operations, errno_of

__all__ = ["L2Operations", "errno_of", "is_mounted", "main", "mount_type", "parse_args", "spawn", "stat_is_dir",
           "stop"]
