"""The FUSE mount (`l2fs mount`): `operations` (the pyfuse3 file system), `passthrough` (the read-only
kernel-passthrough server) speaking `kernel` (the /dev/fuse wire structs), and `main` (flags, mount loop,
spawn/stop). The names tests and launchers use are re-exported here."""

try:  # the mount's dependencies are an extra: the rest of kvtier (workstation CLI included) runs without them
    import pyfuse3  # noqa: F401
    import trio  # noqa: F401
except ImportError as e:
    raise ImportError(f"l2fs mount needs the 'mount' extra ({e.name} is not installed): pip install 'kvtier[mount]' "
                      "(Linux: pyfuse3 builds against libfuse3; apt-get install libfuse3-dev pkg-config)",
                      name=e.name) from e

from l2fs.fuse.main import is_mounted, main, mount_type, parse_args, spawn, stat_is_dir, stop
from l2fs.fuse.operations import L2Operations, errno_of

__all__ = ["L2Operations", "errno_of", "is_mounted", "main", "mount_type", "parse_args", "spawn", "stat_is_dir",
           "stop"]
